//! The run store's side of a turn's pacing route: the ask a turn carries
//! (`PacedAsk`, made at submit by `FirstAsk` for a run's first turn), the
//! pacers the worker's fetch asks in its own script (`FetchAsks`: a turn
//! carrying an ask is asked for before it is leased — `fetch.lua` `hold`:
//! cleared, it is started; owed a moment, leased with a pause; owed longer, it
//! waits in the queue again, its run `waiting`), and the ops a commit makes in
//! its own script (`CommitPacing`: the call's settle, the next turn's ask —
//! `store.lua` `commit`) or the wait it puts the next turn in (`BudgetWait`).
//! The worker's side of the same route is `worker/src/pacing.rs`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::spec::RunSpec;
use super::state::WaitReason;

/// What a turn owed budget asks the pacer again when it comes back: carried
/// in its payload, so it asks before it starts, and a turn still owed is
/// requeued without its run's record or history being read again (a wait
/// round then costs the ask and the requeue, not a whole start). The run
/// cannot change while its turn waits, so neither can what the turn asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PacedAsk {
    /// The model (the pacer keeps one state per budget and model).
    pub model: String,
    /// The run's provider (`PACELINE_PROVIDERS`), whose pacer it asks; none: the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Work or companion.
    pub mode: crate::pacer::Mode,
    /// The run's tenant (its line and share).
    pub tenant: String,
    /// The call's estimated tokens (input and output reservation).
    pub tokens: u64,
    /// Requests (1).
    pub requests: u64,
    /// The output tokens reserved.
    pub output: u64,
}

impl PacedAsk {
    /// The ask of a call of run `spec` (of `tenant`) estimated at `est`.
    pub fn new(spec: &RunSpec, tenant: &str, est: crate::pacer::Estimate) -> Self {
        Self {
            model: spec.model.clone(),
            provider: spec.provider.clone(),
            mode: spec.mode,
            tenant: tenant.to_owned(),
            tokens: est.tokens,
            requests: est.requests,
            output: est.output,
        }
    }
}

/// How a run's first turn gets its ask at submit: the tokens its first call
/// will send, counted as a worker counts them. With it the first turn is
/// queued as every later one is, carrying its ask: the fetch that leases it
/// asks the pacer first, and under a scarce budget it waits in the queue from
/// the start, parked in its budget's line (never started before it is clear). The binary
/// gives the worker's counter (`worker::turn::first_ask`): the API crate
/// counts no tokens itself. A worker whose own count is larger asks again
/// (turn.rs `CLEARED_SLACK`).
#[derive(Clone)]
pub struct FirstAsk(std::sync::Arc<AskOf>);

/// `f(spec, tenant)`: the ask of a run's first turn (see [`FirstAsk`]).
type AskOf = dyn Fn(&RunSpec, &str) -> PacedAsk + Send + Sync;

impl FirstAsk {
    /// The estimator `f(spec, tenant)`.
    pub fn new(f: impl Fn(&RunSpec, &str) -> PacedAsk + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }

    /// The ask of run `spec`'s first turn, of `tenant` (counted off the
    /// runtime's threads: a long input takes a while, [`crate::cpu_bound`]).
    pub fn ask(&self, spec: &RunSpec, tenant: &str) -> PacedAsk {
        crate::cpu_bound(|| (self.0)(spec, tenant))
    }
}

impl std::fmt::Debug for FirstAsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FirstAsk")
    }
}

/// The shared pacers a worker's fetch asks itself
/// ([`super::RunStore::fetch_script_asking`]), as `runs/fetch.lua` reads them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FetchAsks {
    /// Per provider name, its pacer's [`crate::pacer::SharedPacer::script_route`].
    pub routes: std::collections::BTreeMap<String, Value>,
    /// The provider of an ask that names none (the first).
    pub first: String,
    /// Tenants' weights (`PACELINE_TENANT_WEIGHTS`; others 1).
    pub weights: std::collections::BTreeMap<String, f64>,
    /// Tenants' caps (`PACELINE_TENANT_CAPS`; others 0: none).
    pub caps: std::collections::BTreeMap<String, f64>,
    /// The worker's in-place wait, ms (`PACELINE_IN_PLACE_WAIT_MS`; 0: none): a
    /// turn owed no longer is leased (not started) with that pause
    /// ([`super::Turn::pause_ms`]) and waits in its worker, as the worker's own ask
    /// would have it — not requeued for a few ms (a round of the queue).
    pub in_place_ms: u64,
    /// Providers whose worker paces nothing (`--pacer off`): a turn of theirs
    /// that carries an ask (a run's first, from its submit) is started as any
    /// turn, there being no ask to make.
    pub unpaced: Vec<String>,
}

/// A wait a commit puts its next turn in (see [`super::Next::Paced`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetWait {
    /// How long, ms.
    pub ms: u64,
    /// Why (budget or fair share).
    pub reason: WaitReason,
    /// The `turn.paced` event's data.
    pub data: Value,
}

/// The pacer ops a commit makes in its own script (store.lua `commit`): the
/// settle of the turn's call, made whatever the fence says (the call
/// happened), and the next turn's ask (a [`super::Next::Paced`] turn's, not made
/// yet), made only when the commit lands: cleared, the next turn is queued
/// cleared; owed, it waits from this commit on. One script, one round trip:
/// not a pacer call of the worker's before the commit.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitPacing {
    /// The pacer's keys and knobs: [`crate::pacer::SharedPacer::commit_route`].
    pub route: Value,
    /// The call's settle op.
    pub settle: Option<crate::pacer::Op>,
    /// The next turn's acquire op.
    pub ask: Option<crate::pacer::Op>,
}
