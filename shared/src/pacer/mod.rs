//! The pacer: when do we wait, and for how long?
//!
//! Two layers (docs/pacing.md has the reasoning):
//! - proactive: before every call a worker asks the pacer to reserve the call's
//!   estimated tokens; the answer is "clear" or "owed N ms". Owed time is paid in
//!   full — a wait cut short is not a wait saved.
//! - reactive: when a call fails anyway, [`classify()`] says whether it is a rate
//!   limit, a transient error or a terminal one, and [`backoff`] says how long
//!   to wait before the next attempt.
//!
//! The policy is pure functions over plain data ([`durations`], [`headers`],
//! [`classify`](mod@classify), [`backoff`], and the proactive model: [`bucket`] one provider
//! bucket, [`fair`] the line's order, [`model`] acquire and settle); the shared
//! state lives in Redis and is changed only by the atomic script in
//! `scripts.lua` ([`store`]); [`local`] is the per-process baseline; [`sim`]
//! is the simulator the property tests drive the model with.

pub mod backoff;
pub mod bucket;
pub mod classify;
pub mod durations;
pub mod fair;
pub mod headers;
pub mod history;
pub mod local;
pub mod model;
pub mod refund;
pub mod sim;
pub mod store;

pub use backoff::{next_retry, server_delay, DelaySource, GiveUp, RetryDecision, RetryPolicy};
pub use bucket::Observation;
pub use classify::{classify, FailedCall, FailureKind, Transport};
pub use headers::HeaderSnapshot;
pub use history::History;
pub use local::LocalPacer;
pub use model::{Ask, CallOutcome, Decision, Estimate, Mode, OwedReason, PacerState, PacingConfig, Who};
pub use store::{lua_function, BudgetShape, BudgetSnapshot, Pacer, PacerError, PacerKind, SharedPacer, TenantShare};

#[cfg(test)]
mod tests {
    /// Architecture invariant: the pure policy never reads a clock or does
    /// I/O; callers pass `now_ms` (and a random draw) in. Each pure module's
    /// code, outside its tests, names no clock, no randomness source of its
    /// own, no file, socket, environment, Redis or HTTP.
    #[test]
    fn the_pure_policy_reads_no_clock_and_does_no_io() {
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
            "std::net",
            "std::env",
            "std::io",
            "tokio",
            "redis",
            "reqwest",
            "Clock", // the trait or a clock of its own; `Millis` is plain data
        ];
        for (name, text) in modules {
            let code = text.split("#[cfg(test)]").next().unwrap();
            for (n, line) in code.lines().enumerate() {
                let line = line.split("//").next().unwrap();
                for word in forbidden {
                    assert!(!line.contains(word), "pacer/{name}:{}: `{word}` in the pure policy", n + 1);
                }
            }
        }
    }
}
