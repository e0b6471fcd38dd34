//! The pacer: when do we wait, and for how long? — where its state lives.
//!
//! The policy itself is the `pacer` crate (pure functions over plain data,
//! no I/O, no clock; re-exported here under the same names). This module holds
//! what runs it: [`store`] the shared pacer (state in Redis, changed only by
//! the atomic script of `lua/`, the model written again file for file), [`local`]
//! the per-process baseline, [`history`] the dashboard's counts. `sim` (feature
//! `sim`, tests only) is the policy's simulator.

#[cfg(feature = "sim")]
pub use pacer::sim;
pub use pacer::{backoff, bucket, classify, durations, fair, headers, model, refund};

pub mod history;
pub mod local;
pub mod store;

pub use history::History;
pub use local::LocalPacer;
pub use pacer::{
    next_retry, server_delay, Ask, CallOutcome, Decision, DelaySource, Estimate, FailedCall, FailureKind, GiveUp,
    HeaderSnapshot, Mode, Observation, OwedReason, PacerState, PacingConfig, RetryDecision, RetryPolicy, Transport,
    Who,
};
pub use store::{lua_function, BudgetShape, BudgetSnapshot, Pacer, PacerError, PacerKind, SharedPacer, TenantShare};
