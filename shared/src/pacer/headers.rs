//! Reading a response's rate-limit headers into one snapshot.
