//! The proactive model of the provider's token bucket: owed time from a snapshot.
