//! The pacer: when do we wait, and for how long?
//!
//! Two layers (see `../shared/seeds` design note, and SPEC §4):
//! - proactive: before every call a worker asks the pacer to reserve the call's
//!   estimated tokens; the answer is "clear" or "owed N ms". Owed time is paid in
//!   full — a wait cut short is not a wait saved.
//! - reactive: when a call fails anyway, [`classify`] says whether it is a rate
//!   limit, a transient error or a terminal one, and [`backoff`] says how long
//!   to wait before the next attempt.
//!
//! The policy is pure functions over plain data ([`durations`], [`headers`],
//! [`classify`], [`backoff`], [`bucket`]); the shared state lives in Redis and is
//! changed only by the atomic scripts in `scripts.lua` ([`shared`]).

pub mod backoff;
pub mod bucket;
pub mod classify;
pub mod durations;
pub mod headers;
pub mod sim;
pub mod store;

pub use backoff::{next_retry, server_delay, DelaySource, GiveUp, RetryDecision, RetryPolicy};
pub use bucket::{Decision, Estimate, Mode, Observation, OwedReason, PacingConfig, TenantLine, Who};
pub use classify::{classify, FailedCall, FailureKind, Transport};
pub use headers::{HeaderSnapshot, LimitSnapshot};
pub use store::{BudgetSnapshot, CallOutcome, TenantShare, LocalPacer, Pacer, PacerError, PacerKind, SharedPacer};
