//! The pacer's policy: when do we wait, and for how long?
//!
//! Two layers (docs/pacing.md has the reasoning):
//! - proactive: before every call a worker asks the pacer to reserve the call's
//!   estimated tokens; the answer is "clear" or "owed N ms". Owed time is paid in
//!   full — a wait cut short is not a wait saved.
//! - reactive: when a call fails anyway, [`classify()`] says whether it is a rate
//!   limit, a transient error or a terminal one, and [`backoff`] says how long
//!   to wait before the next attempt.
//!
//! Everything here is pure functions over plain data ([`durations`], [`headers`],
//! [`classify`](mod@classify), [`backoff`], and the proactive model: [`bucket`]
//! one provider bucket, [`fair`] the line's order, [`refund`] what the provider
//! gives back, [`model`] acquire and settle). This crate does no I/O and reads
//! no clock: its `Cargo.toml` lists no Redis, runtime or HTTP client, and every
//! function that needs the time takes `now_ms`. Where the state lives (Redis,
//! the process) is the `shared` crate's business (`shared::pacer`); the same
//! model runs there atomically as Lua (`shared/src/pacer/lua/`, file for file).
//! `sim` (feature `sim`, and this crate's own tests) is the discrete-event
//! simulator the property tests drive the model with.

pub mod acquire;
pub mod backoff;
pub mod bucket;
pub mod classify;
pub mod durations;
pub mod fair;
pub mod headers;
pub mod model;
pub mod refund;
pub mod release;
pub mod settle;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod state;

pub use backoff::{next_retry, server_delay, DelaySource, GiveUp, RetryDecision, RetryPolicy};
pub use bucket::Observation;
pub use classify::{classify, context_excess, FailedCall, FailureKind, Transport};
pub use headers::HeaderSnapshot;
pub use model::{Ask, CallOutcome, Decision, Estimate, Mode, OwedReason, PacerState, PacingConfig, Who};

/// Milliseconds since the Unix epoch, on whichever clock the caller reads
/// (the Redis server's, for shared state).
pub type Millis = i64;

#[cfg(test)]
mod tests {
    /// Architecture invariant: the policy reads no clock and draws no random
    /// number of its own (callers pass `now_ms` and a draw in); that it does
    /// no I/O is this crate's `Cargo.toml` (no Redis, runtime or HTTP client).
    /// Each module's code, outside its tests, names no clock or randomness source.
    #[test]
    fn the_policy_reads_no_clock() {
        let modules = [
            ("durations.rs", include_str!("durations.rs")),
            ("headers.rs", include_str!("headers.rs")),
            ("classify.rs", include_str!("classify.rs")),
            ("backoff.rs", include_str!("backoff.rs")),
            ("bucket.rs", include_str!("bucket.rs")),
            ("refund.rs", include_str!("refund.rs")),
            ("fair.rs", include_str!("fair.rs")),
            ("model.rs", include_str!("model.rs")),
        ];
        let forbidden = [
            "SystemTime",
            "Instant::",
            "::now(",
            "now_utc",
            "thread_rng",
            "rand::rng(",
            "rand::random",
            "std::fs",
            "std::env",
        ];
        for (name, text) in modules {
            let code = text.split("#[cfg(test)]").next().unwrap();
            for (n, line) in code.lines().enumerate() {
                let line = line.split("//").next().unwrap();
                for word in forbidden {
                    assert!(!line.contains(word), "pacer/src/{name}:{}: `{word}` in the policy", n + 1);
                }
            }
        }
    }
}
