//! The pacer: when do we wait, and for how long? — where its state lives.
//!
//! The policy itself is the `pacer` crate (pure functions over plain data,
//! no I/O, no clock; re-exported here under the same names). This module holds
//! what runs it, and where its state lives ([`Pacer`]): in Redis for every
//! worker ([`shared_pacer`], changed only by the atomic script of `lua/`, the
//! model written again file for file, [`script`]; its ops [`ops`]), in the
//! process ([`local`], a baseline like a single-process client), or nowhere
//! (`off`, reactive backoff only) — the benchmark compares the three;
//! [`snapshot`] what the workers see of a budget, [`history`] the dashboard's
//! counts. `sim` (feature `sim`, tests only) is the policy's simulator.

#[cfg(feature = "sim")]
pub use pacer::sim;
pub use pacer::{backoff, bucket, classify, durations, fair, headers, model, refund};

pub mod history;
pub mod local;
pub mod ops;
pub mod script;
pub mod shared_pacer;
pub mod snapshot;

pub use history::History;
pub use local::LocalPacer;
pub use ops::{AcquireOp, Op, SettleOp};
pub use pacer::{
    context_excess, next_retry, server_delay, Ask, CallOutcome, Decision, DelaySource, Estimate, FailedCall,
    FailureKind, GiveUp, HeaderSnapshot, Mode, Observation, OwedReason, PacerState, PacingConfig, RetryDecision,
    RetryPolicy, Transport, Who,
};
pub use shared_pacer::{lua_function, PacerHost, SharedPacer};
pub use snapshot::{BudgetShape, BudgetSnapshot, TenantShare};

use serde::Serialize;

/// Which pacer a worker uses (`PACELINE_PACER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PacerKind {
    /// One state in Redis for every worker (the product).
    Shared,
    /// State kept in each process (a baseline).
    Local,
    /// No proactive pacing (a baseline).
    Off,
}

/// An error of the pacer's store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PacerError {
    /// Redis did not answer or refused.
    #[error("pacer state in Redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The script answered something this code does not understand.
    #[error("pacer script answered {0:?}")]
    Protocol(String),
}

/// The pacer a worker asks before every call.
#[derive(Debug, Clone)]
pub enum Pacer {
    /// Shared state in Redis.
    Shared(SharedPacer),
    /// Per-process state.
    Local(LocalPacer),
    /// No proactive pacing.
    Off,
}

impl Pacer {
    /// The same pacer, a shared one's ops run in `host`'s script (see
    /// [`SharedPacer::with_host`]); the others have no line to release.
    pub fn with_host(self, host: PacerHost) -> Self {
        match self {
            Self::Shared(p) => Self::Shared(p.with_host(host)),
            other => other,
        }
    }

    /// Asks to reserve `est` for the call of reservation `id` on `model`, for
    /// `who` (its tenant's line decides the order of work turns when the
    /// budget is scarce).
    pub async fn acquire(
        &self,
        model: &str,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
    ) -> Result<Decision, PacerError> {
        match self {
            Self::Shared(p) => p.acquire(model, id, est, mode, who).await,
            Self::Local(p) => Ok(p.acquire(model, id, est, mode, who)),
            Self::Off => Ok(Decision::Clear),
        }
    }

    /// Settles reservation `id` with what the call reported (headers, usage, 429).
    /// Under `off` this does nothing: that baseline keeps no state at all.
    pub async fn settle(&self, model: &str, id: &str, outcome: &CallOutcome) -> Result<(), PacerError> {
        match self {
            Self::Shared(p) => p.settle(model, id, outcome).await,
            Self::Local(p) => {
                p.settle(model, id, outcome);
                Ok(())
            }
            Self::Off => Ok(()),
        }
    }

    /// Settles as [`Pacer::settle`] does, but the shared pacer sends it with
    /// the next call this process makes for the model (the ask for the run's
    /// next turn, usually) if one follows within a few ms: one script call for
    /// both. The settle is queued before this returns, so a call made after it
    /// is decided after it; the future says how it went.
    pub fn settle_soon(
        &self,
        model: &str,
        id: &str,
        outcome: &CallOutcome,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), PacerError>> + Send + 'static>> {
        match self {
            Self::Shared(p) => Box::pin(p.settle_soon(model, id, outcome)),
            Self::Local(p) => {
                p.settle(model, id, outcome);
                Box::pin(std::future::ready(Ok(())))
            }
            Self::Off => Box::pin(std::future::ready(Ok(()))),
        }
    }

    /// Every budget and model this pacer knows.
    pub async fn snapshot(&self) -> Result<Vec<BudgetSnapshot>, PacerError> {
        match self {
            Self::Shared(p) => p.snapshot().await,
            Self::Local(p) => Ok(p.snapshot()),
            Self::Off => Ok(vec![]),
        }
    }
}
