//! A turn's pacing, in one place: where it asks the pacer and where it
//! settles with it, and which of the routes each takes.
//!
//! The pacer is asked (the run store's side of each script hop is named):
//! 1. at submit, for a run's first call (`crate::turn::first_ask`, carried as `Turn::ask`);
//! 2. by the fetch that leases a turn carrying an ask, in its own script
//!    (`runs/fetch.lua`, `Routes::fetch_asks`): a run's first turn, a parked
//!    turn at its line's timer or its safety deadline, a turn the line
//!    released (its ask starts it: the pacer's `send`). Cleared, the turn is
//!    started; owed a moment, it is leased with a pause; owed longer, it stays
//!    parked;
//! 3. at the turn's start, by a turn its fetch did not clear (`Runner::pace_at_start`);
//! 4. before the call, when the body built outgrows what was cleared, or
//!    nothing was (`Runner::pace_call`);
//! 5. for the next turn, as the turn commits (`Runner::ask_for_next`): in
//!    the commit's own script where the pacer lets a script ask it
//!    (`runs/store.lua` `commit`), after the call's settle — unless turns
//!    are due and untaken, when its fetch asks (step 2: no reservation held
//!    by a turn waiting for a slot); else here before it, while the budget
//!    is scarce.
//!
//! A call's reservation is settled (one of):
//! - in the commit's script, before the next turn's ask, where the pacer
//!   lets a script settle with it and the tools answer within
//!   `SETTLE_IN_COMMIT`;
//! - in the process's next batch of pacer calls (`Runner::settle_soon`):
//!   a pacer no script reaches, tools slower than that, or a turn that ends
//!   before its commit (`SettleGuard` on drop);
//! - at once, after a failed call (`Runner::settle_now`) or a cancel, or
//!   for a clearance given back unused (`Runner::give_back`).
//!
//! Owed time up to the in-place wait is waited here; anything longer parks
//! the turn in the queue, where the pacer releases it when the budget can
//! take it (a wait cut short is not a wait saved).
//! Nothing outside this file matches on the `Pacer`'s variants.

use std::time::Duration;

use serde_json::{json, Value};
use shared::pacer::{AcquireOp, CallOutcome, Decision, Estimate, Op, OwedReason, Pacer, SharedPacer};
use shared::queue::Lease;
use shared::runs::{
    BudgetWait, CommitPacing, Committed, Fence, Next, PacedAsk, RunSpec, StoreError, Turn, TurnContext, TurnJob,
    WaitReason,
};
use shared::telemetry::metric;

use crate::routes::{Route, Routes};
use crate::turn::{Runner, TurnError};

/// A turn the pacer cleared when the turn before it committed calls without
/// asking again if it was leased within this of its due time; one that waited
/// longer in the queue (every slot busy) asks again, which a reservation still
/// held answers at once (clear) and a lapsed one decides afresh.
pub const CLEARED_FRESH_MS: i64 = 10_000;

/// A turn cleared for tokens no more than this share below what its worker
/// counts when it builds the call calls on that clearance. One cleared for
/// less (a first turn's ask is the API's count, in the style of the provider
/// the API knows of; a body built otherwise here) gives its reservation back
/// and asks for what it sends.
pub const CLEARED_SLACK: f64 = 0.10;

/// How long a call's settle waits for its turn's tools before it goes on its
/// own rather than with the commit (as long as the shared pacer's batch loop
/// lets a settle wait for company).
pub(crate) const SETTLE_IN_COMMIT: Duration = Duration::from_millis(20);

/// When a process last heard a route's pacer owe a call time: a scarce
/// budget. While it is, a turn asks the pacer for the next one as it commits
/// (its first wait then costs no round of its own); while the budget has room
/// it does not, as that ask would only add a round trip before every commit.
#[derive(Debug, Clone, Default)]
pub struct OwedLately(std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl OwedLately {
    /// How long a budget counts as scarce after the pacer last owed a call time.
    pub const SCARCE_FOR: Duration = Duration::from_secs(30);

    /// The pacer owed a call time just now, for `reason`. (A cold budget's
    /// probe holds calls for its headers: that says nothing of the budget.)
    pub fn note(&self, reason: OwedReason) {
        if reason != OwedReason::Probe {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        }
    }

    /// Whether it did within [`Self::SCARCE_FOR`].
    pub fn scarce(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|at| at.elapsed() < Self::SCARCE_FOR)
    }
}

/// How a route's pacer may be asked.
enum Kind<'p> {
    /// Shared, and a script may ask it itself (the fetch, the commit).
    Scripted(&'p SharedPacer),
    /// Shared on an injected clock (tests), or per-process: asked by the worker alone.
    Direct,
    /// No proactive pacing.
    Off,
}

fn kind(pacer: &Pacer) -> Kind<'_> {
    match pacer {
        Pacer::Shared(p) if p.scriptable() => Kind::Scripted(p),
        Pacer::Shared(_) | Pacer::Local(_) => Kind::Direct,
        Pacer::Off => Kind::Off,
    }
}

impl Routes {
    /// The worker's fetch asked a pacer and it owed a turn time: each budget
    /// the fetch asks counts as scarce (the fetch does not say which owed).
    pub fn note_fetch_owed(&self) {
        for r in self.iter() {
            if matches!(kind(&r.pacer), Kind::Scripted(_)) {
                r.owed.note(OwedReason::Budget);
            }
        }
    }

    /// What the fetch needs to ask the shared pacers itself
    /// (`RunStore::fetch_script_asking`): the routes whose pacer is shared,
    /// and those that pace nothing. `None` when none is either.
    /// `in_place` is the worker's in-place wait ([`shared::runs::FetchAsks::in_place_ms`]).
    pub fn fetch_asks(
        &self,
        tenants: &shared::config::TenantPolicy,
        in_place: Duration,
    ) -> Option<shared::runs::FetchAsks> {
        let routes: std::collections::BTreeMap<String, Value> = self
            .iter()
            .filter_map(|r| match kind(&r.pacer) {
                Kind::Scripted(p) => p.script_route().map(|route| (r.name.clone(), route)),
                _ => None,
            })
            .collect();
        let unpaced: Vec<String> =
            self.iter().filter(|r| matches!(kind(&r.pacer), Kind::Off)).map(|r| r.name.clone()).collect();
        if routes.is_empty() && unpaced.is_empty() {
            return None;
        }
        Some(shared::runs::FetchAsks {
            routes,
            unpaced,
            first: self.iter().next().map(|r| r.name.clone()).unwrap_or_default(),
            weights: tenants.weights().map(|(t, w)| (t.to_owned(), w)).collect(),
            caps: tenants.caps().map(|(t, c)| (t.to_owned(), c)).collect(),
            in_place_ms: in_place.as_millis() as u64,
        })
    }
}

/// What the pacer said of a call, once owed time short enough to wait in place was waited.
pub(crate) enum Paced {
    /// Send now; the reservation is held.
    Clear,
    /// Owed more than the in-place wait: requeue for this long.
    Owed {
        /// Milliseconds until its queue entry is due (parked: the line releases it before).
        ms: u64,
        /// Why.
        reason: OwedReason,
        /// Milliseconds until it is expected clear (what its run shows).
        eta_ms: u64,
    },
}

/// A turn's call as the pacer stands with it before it is built.
pub(crate) enum Clearance {
    /// Not asked yet: the call asks once its body is built.
    Unasked,
    /// Cleared for this many tokens under the turn's reservation (held until
    /// its settle).
    Cleared(u64),
}

/// Where a turn's start leaves its pacing ([`Runner::pace_at_start`]).
pub(crate) enum AtStart {
    /// Go on to start the turn.
    Go(Clearance),
    /// It waits in the queue again (for budget), not started.
    Requeued(Fence),
}

/// A call's settle the commit's script is to make (or that is sent alone if
/// it does not).
#[derive(Clone, Copy)]
pub(crate) struct Settle<'a> {
    spec: &'a RunSpec,
    reservation: &'a str,
    outcome: &'a CallOutcome,
}

/// Sends its settle on its own when dropped still holding it (a turn that
/// ended before its commit: cancelled, fenced, an error; or a commit that
/// failed on Redis trouble, which may not have landed).
pub(crate) struct SettleGuard<'r, 'a> {
    runner: &'r Runner,
    settle: Option<Settle<'a>>,
}

impl<'a> SettleGuard<'_, 'a> {
    /// The settle the commit's script is to make, if it still holds one.
    pub(crate) fn pending(&self) -> Option<Settle<'a>> {
        self.settle
    }

    /// The settle was made by a commit's script that answered (fenced or
    /// not, the script settles) unless the script says its pacer ops failed;
    /// those, and an error, leave it to be sent alone — twice at worst, if
    /// the commit landed: the pacer then observes the same headers again and
    /// finds no reservation to charge.
    pub(crate) fn made_by(&mut self, committed: &Result<Committed, StoreError>) {
        if committed.as_ref().is_ok_and(|c| !c.unsettled) {
            self.settle = None;
        }
    }

    /// Sends it now, on its own (its tools are slow, or the turn ends here).
    pub(crate) fn send_alone(&mut self) {
        if let Some(s) = self.settle.take() {
            self.runner.settle_soon(s.spec, s.reservation, s.outcome);
        }
    }
}

impl Drop for SettleGuard<'_, '_> {
    fn drop(&mut self) {
        self.send_alone();
    }
}

impl Runner {
    /// A guard that holds no settle (a commit with no call's settle to make).
    pub(crate) fn no_settle(&self) -> SettleGuard<'_, 'static> {
        SettleGuard { runner: self, settle: None }
    }

    /// Step 3: a turn that carries an ask its fetch did not clear (back from
    /// a budget wait, a run's first turn) asks before it starts — after the
    /// pause its fetch owed it, if any — and one still owed is requeued
    /// without starting: its record and history are not read, its tokens not
    /// counted, again. One the pacer cleared when the turn before it
    /// committed, or its fetch cleared, calls without asking, unless it
    /// waited in the queue so long that its reservation may have lapsed
    /// ([`CLEARED_FRESH_MS`]).
    pub(crate) async fn pace_at_start(&self, turn: &Turn, lease: &Lease) -> Result<AtStart, TurnError> {
        let Some(ask) = &turn.ask else { return Ok(AtStart::Go(Clearance::Unasked)) };
        let Some(route) = self.routes.get(ask.provider.as_deref()) else {
            return Ok(AtStart::Go(Clearance::Unasked));
        };
        if turn.cleared && lease.lateness_ms() <= CLEARED_FRESH_MS {
            return Ok(AtStart::Go(Clearance::Cleared(ask.tokens)));
        }
        // Owed a moment when its fetch asked: it waits that here (not a round
        // of the queue), then asks.
        if let Some(ms) = turn.pause_ms {
            tokio::time::sleep(Duration::from_millis(ms).min(self.config.in_place_wait)).await;
        }
        let est = Estimate { tokens: ask.tokens, requests: ask.requests, output: ask.output };
        let reservation = reservation_id(lease, turn.job);
        match self.pace(route, &ask.model, &reservation, est, ask.mode, &ask.tenant).await? {
            Paced::Clear => Ok(AtStart::Go(Clearance::Cleared(ask.tokens))),
            Paced::Owed { ms, reason, eta_ms } => {
                let waited = self.budget_wait(lease, turn.job, ms, eta_ms, reason, ask.clone(), turn.cached_until_ms);
                Ok(AtStart::Requeued(waited.await?))
            }
        }
    }

    /// A turn cleared at its start that does not run (cancelled, finished,
    /// stale): its reservation goes back unused.
    pub(crate) async fn give_back(&self, turn: &Turn, lease: &Lease) {
        let Some(ask) = &turn.ask else { return };
        if let Some(route) = self.routes.get(ask.provider.as_deref()) {
            let reservation = reservation_id(lease, turn.job);
            if let Err(error) = route.pacer.settle(&ask.model, &reservation, &CallOutcome::default()).await {
                tracing::warn!(message = "could not settle the pacer", %error, reservation);
            }
        }
    }

    /// Step 4: the call of `ctx`'s turn, built and estimated at `est`, asks
    /// the pacer unless it was cleared for enough tokens already
    /// ([`CLEARED_SLACK`]; one cleared for too few gives that back and asks
    /// for what it sends). `None`: send it; `Some(fence)`: it was requeued for
    /// the time it owes.
    // The call's parts as the turn holds them; a struct for them would be built here only.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn pace_call(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        route: &Route,
        est: Estimate,
        cleared: &Clearance,
        cached_until_ms: Option<u64>,
    ) -> Result<Option<Fence>, TurnError> {
        let spec = &ctx.spec;
        let reservation = reservation_id(lease, job);
        let short = match cleared {
            Clearance::Cleared(tokens) => est.tokens as f64 > *tokens as f64 * (1.0 + CLEARED_SLACK),
            Clearance::Unasked => false,
        };
        if short {
            self.settle_now(spec, &reservation, &CallOutcome::default()).await;
        }
        if matches!(cleared, Clearance::Cleared(_)) && !short {
            return Ok(None);
        }
        match self.pace(route, &spec.model, &reservation, est, spec.mode, &ctx.tenant).await? {
            Paced::Clear => Ok(None),
            Paced::Owed { ms, reason, eta_ms } => {
                let ask = PacedAsk::new(spec, &ctx.tenant, est);
                Ok(Some(self.budget_wait(lease, job, ms, eta_ms, reason, ask, cached_until_ms).await?))
            }
        }
    }

    /// Asks the pacer until it clears the call or owes more than the in-place wait.
    async fn pace(
        &self,
        route: &Route,
        model: &str,
        reservation: &str,
        est: Estimate,
        mode: shared::pacer::Mode,
        tenant: &str,
    ) -> Result<Paced, TurnError> {
        let who = self.tenants.who(tenant);
        loop {
            match route.pacer.acquire(model, reservation, est, mode, &who).await? {
                Decision::Clear => return Ok(Paced::Clear),
                Decision::Owed { ms, reason, .. } if Duration::from_millis(ms) <= self.config.in_place_wait => {
                    route.owed.note(reason);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Decision::Owed { ms, reason, eta_ms } => {
                    route.owed.note(reason);
                    return Ok(Paced::Owed { ms, reason, eta_ms });
                }
            }
        }
    }

    /// Requeues the turn, parked: due in `ms` (its line releases it sooner,
    /// or it comes back then to ask), carrying `ask` to make again and how
    /// long the prompt cache of the turn before holds; the run shows
    /// `eta_ms`. A budget wait is not a failure: the attempt stays.
    // The parked turn's parts as its callers hold them.
    #[allow(clippy::too_many_arguments)]
    async fn budget_wait(
        &self,
        lease: &Lease,
        job: TurnJob,
        ms: u64,
        eta_ms: u64,
        reason: OwedReason,
        ask: PacedAsk,
        cached_until_ms: Option<u64>,
    ) -> Result<Fence, TurnError> {
        let (data, wait_reason) = budget_wait_record(job, eta_ms, reason);
        let next = Turn { job, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms };
        let event = shared::runs::state::event::TURN_PACED;
        Ok(self.store.wait_parked(lease, job, next, ms, eta_ms, wait_reason, event, &data).await?)
    }

    /// Step 5: the ask of the turn after `job`, made as it commits when its
    /// budget is scarce (this process heard it owe a call time lately:
    /// [`OwedLately`]): `new_items` (the model's output and the tool results)
    /// end the history the next call sends, so its ask is known now. Cleared,
    /// the next turn is queued with its reservation held; owed, it waits in
    /// the queue from this commit on — no delivery, start or requeue of its
    /// own for that first wait. With room in a shared budget the ask is
    /// carried, not made: the fetch that leases the turn makes it (in its own
    /// script, no round trip of the worker's), and a turn owed by then waits
    /// in the queue unstarted. Without a shared pacer (the fetch asks none),
    /// or when the pacer cannot be reached, the next turn asks when it starts
    /// (`Next::Continue`). Where the pacer lets a script ask it, a scarce
    /// budget's ask is made by the commit's own script (the acquire op
    /// returned: one round trip, not a pacer call before the commit); the
    /// turn is then `Next::Paced` with the ask not made yet, and the commit's
    /// answer says how it went.
    pub(crate) async fn ask_for_next(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        new_items: &[Value],
    ) -> (Next, Option<Op>) {
        let spec = &ctx.spec;
        let Some(route) = self.routes.get(spec.provider.as_deref()) else { return (Next::Continue, None) };
        let scarce = route.owed.scarce();
        let scripted = match kind(&route.pacer) {
            Kind::Off => return (Next::Continue, None),
            Kind::Direct if !scarce => return (Next::Continue, None),
            Kind::Scripted(p) => Some(p),
            Kind::Direct => None,
        };
        let next = TurnJob { turn: job.turn + 1, attempt: 1 };
        let mut transcript = ctx.transcript.clone();
        transcript
            .extend(new_items.iter().map(|item| shared::runs::TranscriptEntry { turn: next.turn, item: item.clone() }));
        let (_, est) = self.prepare_call(route, spec, &transcript, None, true);
        let ask = PacedAsk::new(spec, &ctx.tenant, est);
        // The call just answered wrote the prompt cache the next one is
        // expected to read (`request/cache.rs`): for so long.
        let cached_until_ms = Some(crate::turn::now_ms() + crate::request::CACHE_HOLDS_MS);
        let unasked = Next::Paced {
            turn: Turn { job: next, ask: Some(ask.clone()), cleared: false, pause_ms: None, cached_until_ms },
            wait: None,
        };
        if !scarce {
            return (unasked, None);
        }
        let reservation = reservation_id(lease, next);
        if let Some(p) = scripted {
            let who = self.tenants.who(&ctx.tenant);
            let op = Op::Acquire(AcquireOp::new(&reservation, est, spec.mode, &who, p.jitter_u()));
            return (unasked, Some(op));
        }
        let next = match self.pace(route, &spec.model, &reservation, est, spec.mode, &ctx.tenant).await {
            Ok(Paced::Clear) => Next::Paced {
                turn: Turn { job: next, ask: Some(ask), cleared: true, pause_ms: None, cached_until_ms },
                wait: None,
            },
            Ok(Paced::Owed { ms, reason, eta_ms }) => {
                let (data, reason) = budget_wait_record(next, eta_ms, reason);
                let wait = Some(BudgetWait { ms, reason, data });
                Next::Paced {
                    turn: Turn { job: next, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms },
                    wait,
                }
            }
            Err(error) => {
                tracing::warn!(message = "could not ask the pacer for the next turn; it asks when it starts", %error,
                    run.id = %lease.id);
                Next::Continue
            }
        };
        (next, None)
    }

    /// The settle of an answered call (`reservation`, reporting `outcome`):
    /// left to the commit's script where the run's pacer lets a script settle
    /// with it (the commit asks for the next turn there, after the settle: a
    /// run's next turn never waits behind its own call's answer — at a cold
    /// start, for the probe that call was — and the state is read and written
    /// once for both) — the guard sends it alone if the commit does not make
    /// it; otherwise sent now to the batch loop, which sends a busy process's
    /// many together (one read and write of the state for all).
    pub(crate) fn settle_answered<'a>(
        &self,
        spec: &'a RunSpec,
        reservation: &'a str,
        outcome: &'a CallOutcome,
    ) -> SettleGuard<'_, 'a> {
        let in_commit =
            self.settling_route(spec, outcome).is_some_and(|route| matches!(kind(&route.pacer), Kind::Scripted(_)));
        let settle = Settle { spec, reservation, outcome };
        if in_commit {
            SettleGuard { runner: self, settle: Some(settle) }
        } else {
            self.settle_soon(spec, reservation, outcome);
            SettleGuard { runner: self, settle: None }
        }
    }

    /// The pacer ops the commit's script makes: the call's `settle` (the
    /// guard's, if it holds one) and the next turn's `ask` (an acquire op),
    /// over the route of `spec`'s pacer.
    pub(crate) fn commit_pacing(
        &self,
        spec: &RunSpec,
        settle: &SettleGuard<'_, '_>,
        ask: Option<Op>,
    ) -> Option<CommitPacing> {
        let settle = settle.pending();
        if settle.is_none() && ask.is_none() {
            return None;
        }
        let route = self.routes.get(spec.provider.as_deref())?;
        let Kind::Scripted(p) = kind(&route.pacer) else { return None };
        Some(CommitPacing {
            route: p.commit_route(&spec.model)?,
            settle: settle.map(|s| SharedPacer::settle_op(s.reservation, s.outcome)),
            ask,
        })
    }

    /// What a commit's answer says of the pacer: an ask its script made that
    /// owed the next turn time counts as a budget wait (its record and event
    /// were written by the script); a commit fenced off after its turn was
    /// cleared for the next call gives that reservation back.
    pub(crate) async fn after_commit(
        &self,
        lease: &Lease,
        spec: &RunSpec,
        next: &Next,
        committed: &Result<Committed, StoreError>,
    ) {
        if let Ok(Committed { asked: Some(Decision::Owed { eta_ms: ms, reason, .. }), .. }) = committed {
            if let Some(route) = self.routes.get(spec.provider.as_deref()) {
                route.owed.note(*reason);
            }
            count_budget_wait(*ms);
        }
        // (Not on Redis trouble: the commit may have landed, and its turn holds the reservation.)
        let not_queued =
            matches!(committed, Ok(Committed { fence: Fence::Stop(_), .. } | Committed { ended: true, .. }));
        if not_queued {
            if let Next::Paced { turn: turn @ Turn { cleared: true, .. }, .. } = next {
                // Cleared for a turn that was not queued: the reservation goes back unused.
                self.give_back(turn, lease).await;
            }
        }
    }

    /// Settles `reservation` now with `outcome` (a failed call, an aborted
    /// one, a clearance too small). A pacer that cannot be written is logged,
    /// not fatal: the call happened, and its turn must still be committed.
    pub(crate) async fn settle_now(&self, spec: &RunSpec, reservation: &str, outcome: &CallOutcome) {
        let Some(route) = self.settling_route(spec, outcome) else { return };
        if let Err(error) = route.pacer.settle(&spec.model, reservation, outcome).await {
            tracing::warn!(message = "could not settle the pacer", %error, reservation);
        }
    }

    /// Settles as [`Self::settle_now`] does, with the pacer's next call of
    /// this process if one follows within a few ms ([`Pacer::settle_soon`]);
    /// queued before it returns.
    pub(crate) fn settle_soon(&self, spec: &RunSpec, reservation: &str, outcome: &CallOutcome) {
        let Some(route) = self.settling_route(spec, outcome) else { return };
        let settled = route.pacer.settle_soon(&spec.model, reservation, outcome);
        let reservation = reservation.to_owned();
        tokio::spawn(async move {
            if let Err(error) = settled.await {
                tracing::warn!(message = "could not settle the pacer", %error, reservation);
            }
        });
    }

    /// The route a settle of `spec`'s call goes to, the remaining tokens its
    /// headers named put on the gauge.
    fn settling_route(&self, spec: &RunSpec, outcome: &CallOutcome) -> Option<&Route> {
        let route: &Route = self.routes.get(spec.provider.as_deref())?;
        if let Some(remaining) = outcome.tokens.remaining {
            metrics::gauge!(metric::PACER_REMAINING_TOKENS, "budget" => route.budget.clone(), "model" => shared::telemetry::model_label(&spec.model))
                .set(remaining as f64);
        }
        Some(route)
    }
}

/// A budget wait of `job` for `ms`: its `turn.paced` data and the run's wait
/// reason; counted in the metrics here.
fn budget_wait_record(job: TurnJob, ms: u64, reason: OwedReason) -> (Value, WaitReason) {
    count_budget_wait(ms);
    let (reason_name, wait_reason) = match reason {
        OwedReason::Budget => ("budget", WaitReason::Budget),
        OwedReason::RateLimited => ("window_closed", WaitReason::Budget),
        OwedReason::Probe => ("probe", WaitReason::Budget),
        OwedReason::FairShare => ("fair_share", WaitReason::FairShare),
    };
    (json!({"turn": job.turn, "owed_ms": ms, "reason": reason_name}), wait_reason)
}

/// Counts a budget wait of `ms` in the metrics.
fn count_budget_wait(ms: u64) {
    crate::traces::budget_wait(ms, "budget");
    metrics::counter!(metric::BUDGET_WAITS).increment(1);
    metrics::histogram!(metric::REQUEUE_DELAY, "reason" => "budget").record(ms as f64 / 1000.0);
}

/// The pacer's reservation id of a call attempt: `run:turn:attempt`.
pub(crate) fn reservation_id(lease: &Lease, job: TurnJob) -> String {
    format!("{}:{}:{}", lease.id, job.turn, job.attempt)
}
