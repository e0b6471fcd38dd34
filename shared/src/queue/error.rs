//! What the queue's callers match on.

/// What the queue's callers match on.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The caller's lease is not the live one: the turn was redelivered, its lease
    /// expired, or it is gone. Nothing was changed.
    #[error("lease of {id} at epoch {epoch} is stale ({why}); nothing changed")]
    Fenced {
        /// The turn.
        id: String,
        /// The caller's epoch.
        epoch: u64,
        /// `gone`, `not_leased` or `stale`.
        why: String,
    },
    /// Redis failed or is unreachable; the caller may retry.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A payload did not (de)serialize.
    #[error("payload: {0}")]
    Payload(#[from] serde_json::Error),
    /// Redis answered something this code does not understand.
    #[error("unexpected reply from a queue script: {0}")]
    Protocol(String),
}
