//! One turn of a run, end to end: start it (fenced), build what the model is
//! sent, ask the pacer, call the provider, note its headers into the pacer, run
//! the tool calls it asked for, and commit — or requeue the turn for exactly
//! the time it owes.
//!
//! A turn never sleeps through a rate-limit window: owed time up to the short
//! in-place wait is waited here, anything longer is a requeue that frees the
//! worker slot. A wait cut short is not a wait saved — the turn comes back when
//! its time is paid, not before.

use crate::cancels::Cancel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::context::{clip_tool_output, context_entries};
use rand::SeedableRng;
use serde_json::{json, Value};
use shared::pacer::{
    next_retry, server_delay, CallOutcome, Estimate, FailureKind, GiveUp, Mode, RetryDecision, RetryPolicy,
};
use shared::providers::ProviderTable;
use shared::queue::Lease;
use shared::runs::state::event;
use shared::runs::{
    ApiStyle, ContextOverflow, ErrorKind, Fence, FirstAsk, ModelOutput, Next, PacedAsk, Phase, RunStore, Started,
    StoreError, TranscriptEntry, Turn, TurnContext, TurnJob, Usage, WaitReason,
};

use crate::pacing::{reservation_id, AtStart, Clearance, SettleGuard, SETTLE_IN_COMMIT};
use crate::provider::{CallFailure, CallSuccess, StreamEvent, ToolCall};
use crate::request::{answer_tool, build_body, TurnParams};
use crate::routes::{Route, Routes};
use shared::telemetry::metric;

/// Text deltas arriving within this of each other are one `turn.output_text.delta` event.
const DELTA_BATCH: Duration = Duration::from_millis(50);

/// Tool calls that answer within this of the model's output are committed
/// with it in one script; slower ones see the output committed first, while
/// they run, so a crash during them does not call the model again. (A crash
/// inside this window does: the price of one script less for quick tools.)
const OUTPUT_GRACE: Duration = Duration::from_millis(100);

/// The knobs of running turns.
#[derive(Debug, Clone)]
pub struct TurnConfig {
    /// History depth sent to the model, in turns (`PACELINE_MAX_HISTORY`).
    pub max_history: usize,
    /// Owed time up to this is waited in place; more is a requeue.
    pub in_place_wait: Duration,
    /// The reactive ladder.
    pub retry: RetryPolicy,
}

impl Default for TurnConfig {
    fn default() -> Self {
        Self {
            max_history: crate::context::DEFAULT_MAX_HISTORY,
            in_place_wait: Duration::from_millis(shared::config::DEFAULT_IN_PLACE_WAIT_MS),
            retry: RetryPolicy::default(),
        }
    }
}

/// Everything a turn needs, shared by every turn of a worker process.
#[derive(Debug, Clone)]
pub struct Runner {
    /// Runs: record, transcript, events, fenced commits.
    pub store: RunStore,
    /// The providers, each with its client and its pacer (shared, local or off).
    pub routes: Routes,
    /// Calls tool endpoints: the allow-list (checked again here: the API
    /// checked at submit), the signing secret, no redirects.
    pub tools: crate::tools::ToolClient,
    /// Knobs.
    pub config: Arc<TurnConfig>,
    /// Tenants' weights and caps (fair admission).
    pub tenants: Arc<shared::config::TenantPolicy>,
    /// The turns a cancel can reach (`cancels.rs`).
    pub cancels: crate::cancels::Cancels,
    /// Tenants' day caps and their ledger (`PACELINE_TENANT_BUDGETS`), when any is set.
    pub spend: Option<Arc<Spend>>,
    /// What this process's calls used and cost, per tenant, model and day,
    /// until its next write (`GET /v1/usage`).
    pub usage: Arc<shared::runs::usage::UsageBook>,
    /// Bench only: the list each delivery is logged to
    /// (`WorkerConfig::bench_deliveries_key`).
    pub bench_deliveries_key: Option<String>,
}

/// Tenants' day caps and the ledger that keeps them (`shared::runs::spend`).
#[derive(Debug)]
pub struct Spend {
    /// The ledger on Redis.
    pub ledger: shared::runs::spend::SpendLedger,
    /// The caps.
    pub budgets: shared::runs::spend::TenantBudgets,
}

/// What a call booked of its tenant's day cap: settled with its real cost.
struct SpendHold {
    ledger: Arc<Spend>,
    day: u64,
    price: shared::models::Price,
    estimate: f64,
}

/// A turn that could not finish for a reason outside the run (Redis trouble):
/// the queue retries it.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The run store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The pacer's state could not be read or written.
    #[error(transparent)]
    Pacer(#[from] shared::pacer::PacerError),
}

/// How a turn ended for this worker (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnOutcome {
    /// Committed; the next turn is queued.
    Continued,
    /// Committed; the run is completed.
    Completed,
    /// The run failed.
    Failed,
    /// Requeued to wait (budget, 429, retry).
    Requeued,
    /// Nothing written: cancelled, finished, stale or already committed.
    Stopped,
}

impl TurnOutcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Continued => "continued",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Requeued => "requeued",
            Self::Stopped => "stopped",
        }
    }
}

fn settled(lease: &Lease, fence: Fence, ok: TurnOutcome) -> TurnOutcome {
    // Whatever the script did (written, or finished/stale), the queue item is
    // no longer this handler's to complete.
    lease.mark_settled();
    match fence {
        Fence::Ok => ok,
        Fence::Stop(why) => {
            tracing::info!(message = "turn stopped", run.id = %lease.id, why = %why);
            TurnOutcome::Stopped
        }
    }
}

impl Runner {
    /// Runs turn `job` of the run `lease.id`.
    pub async fn run_turn(&self, job: TurnJob, lease: &Lease) -> Result<TurnOutcome, TurnError> {
        self.run_turn_asking(Turn { job, ask: None, cleared: false, pause_ms: None, cached_until_ms: None }, lease)
            .await
    }

    /// Runs `turn`; one back from a budget wait (`ask`) asks the pacer first,
    /// and one still owed is requeued without starting: its record and
    /// history are not read, its tokens not counted, again. One the pacer
    /// cleared when the turn before it committed (`cleared`) calls without
    /// asking, unless it waited in the queue so long that its reservation may
    /// have lapsed (`pacing.rs`, `CLEARED_FRESH_MS`).
    pub async fn run_turn_asking(&self, turn: Turn, lease: &Lease) -> Result<TurnOutcome, TurnError> {
        let job = turn.job;
        let started = Instant::now();
        let cleared = match self.pace_at_start(&turn, lease).await? {
            AtStart::Go(cleared) => cleared,
            AtStart::Requeued(fence) => return Ok(settled(lease, fence, TurnOutcome::Requeued)),
        };
        // The fetch started it (unless it had to ask first), or it starts now.
        let start = match self.store.started(lease) {
            Some(start) => start?,
            None => self.store.start_turn_with_history(lease, job, self.config.max_history).await?,
        };
        let mut ctx = match start {
            Started::Run(ctx) => ctx,
            Started::Stop(why) => {
                tracing::info!(message = "turn not started", run.id = %lease.id, why = %why);
                if let Clearance::Cleared(_) = cleared {
                    // Cleared, and not sent: the reservation goes back unused.
                    self.give_back(&turn, lease).await;
                }
                lease.mark_settled();
                return Ok(TurnOutcome::Stopped);
            }
        };
        // From here a cancel of the run reaches this turn (cancels.rs).
        let cancel = self.cancels.watch_lease(&lease.id, Some(lease.clone()));
        if !ctx.spec.mcp_servers.is_empty() {
            let listed = tokio::select! {
                listed = self.mcp_tools(lease, &ctx) => listed?,
                () = cancel.wait() => Err("the run was cancelled".to_owned()),
            };
            match listed {
                Ok(tools) => ctx.spec.tools.extend(tools),
                Err(why) => {
                    if let Clearance::Cleared(_) = cleared {
                        self.give_back(&turn, lease).await;
                    }
                    if cancel.is_cancelled() {
                        return self.cancelled(lease, &ctx).await;
                    }
                    return self.tools_unavailable(lease, job, why).await;
                }
            }
        }
        let span = crate::traces::turn_span(&lease.id, job.turn, job.attempt, ctx.trace.as_deref());
        let outcome = tracing::Instrument::instrument(
            async {
                if ctx.phase == Phase::Tools {
                    // The model's output is committed; its tool calls were interrupted.
                    let calls = pending_tool_calls(&ctx.transcript, job.turn + 1);
                    // Announced again: the delivery that recorded them may not have got that far.
                    let announced = tool_call_events(lease, job, &calls);
                    if let Err(error) = self.store.emit_all(&lease.id, event::TURN_TOOL_CALL, &announced).await {
                        tracing::warn!(message = "could not write the tool calls' events", %error, run.id = %lease.id);
                    }
                    self.run_tools_and_commit(lease, job, &ctx, &calls, &cancel, None, None).await
                } else {
                    self.call_model(lease, job, &ctx, &cancel, &cleared, turn.cached_until_ms).await
                }
            },
            span,
        )
        .await?;
        metrics::counter!(metric::TURNS, "outcome" => outcome.as_str()).increment(1);
        metrics::histogram!(metric::TURN_LATENCY).record(started.elapsed().as_secs_f64());
        Ok(outcome)
    }

    /// The tools of the run's MCP servers (`tools/mcp.rs`): as its first
    /// turn listed them, or listed now and kept for every later turn (the
    /// first worker to keep a list decides it). `Err` inside: a server could
    /// not be listed.
    async fn mcp_tools(&self, lease: &Lease, ctx: &TurnContext) -> Result<Result<Vec<Value>, String>, TurnError> {
        let unreadable = |e: serde_json::Error| format!("the run's kept MCP tool list is unreadable: {e}");
        if let Some(kept) = &ctx.mcp_tools {
            return Ok(serde_json::from_str(kept).map_err(unreadable));
        }
        let room = shared::runs::spec::MAX_TOOLS.saturating_sub(ctx.spec.tools.len());
        let listed = match self.tools.mcp().discover(&lease.id, &ctx.tenant, &ctx.spec.mcp_servers, room).await {
            Ok(listed) => listed,
            Err(why) => return Ok(Err(why)),
        };
        Ok(match self.store.keep_mcp_tools(lease, &Value::Array(listed).to_string()).await? {
            Some(kept) => serde_json::from_str(&kept).map_err(unreadable),
            // The run is gone, or this lease stale: the turn's next write finds it so and stops.
            None => Ok(vec![]),
        })
    }

    /// The run's MCP tools could not be listed: the turn is tried again
    /// later, on the retry ladder of a provider's transient errors, and the
    /// run fails with `tools_unavailable` when the ladder is spent.
    async fn tools_unavailable(&self, lease: &Lease, job: TurnJob, why: String) -> Result<TurnOutcome, TurnError> {
        let mut rng = rand::rngs::StdRng::from_os_rng();
        match next_retry(&self.config.retry, job.attempt, FailureKind::Transient, None, &mut rng) {
            RetryDecision::Retry { delay_ms, .. } => {
                tracing::info!(message = "MCP tools unavailable; requeued", run.id = %lease.id, turn.index = job.turn,
                    attempt = job.attempt, delay_ms, error = %why);
                let next = TurnJob { turn: job.turn, attempt: job.attempt + 1 };
                let data = json!({"turn": job.turn, "attempt": job.attempt, "delay_ms": delay_ms, "reason": why});
                let fence =
                    self.store.wait(lease, job, next, delay_ms, WaitReason::Retry, event::TURN_RETRY, &data).await?;
                Ok(settled(lease, fence, TurnOutcome::Requeued))
            }
            RetryDecision::GiveUp(_) => {
                let message = format!("{why} (after {} attempts)", job.attempt);
                tracing::warn!(message = "MCP tools unavailable; the run fails", run.id = %lease.id, error = %message);
                let fence =
                    self.store.fail(lease, job, ErrorKind::ToolsUnavailable, &message, Usage::default()).await?;
                Ok(settled(lease, fence, TurnOutcome::Failed))
            }
        }
    }

    /// The body of a call of `spec` over `transcript` (bounded to the history
    /// depth, fitted to the model's window and to `fits` tokens of input when
    /// given), its answer tool, and what the pacer is asked to reserve for it:
    /// its input as counted here (the pacer charges it at its learned input
    /// ratio) and the output reservation.
    pub(crate) fn prepare_call(
        &self,
        route: &Route,
        spec: &shared::runs::RunSpec,
        transcript: &[TranscriptEntry],
        fits: Option<u64>,
        cache_fresh: bool,
    ) -> (Built, Estimate) {
        let learned = match (route.windows.get(&spec.model), fits) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let build =
            || call_body(route.provider.api_style(), spec, transcript, self.config.max_history, learned, cache_fresh);
        // A short body is built in place: stepping off the runtime's thread
        // costs more than building it (a thread hand-off, and the allocator's
        // pages of another thread).
        let built = if call_text_len(spec, transcript) > IN_PLACE_TEXT { shared::cpu_bound(build) } else { build() };
        let est = call_estimate(spec, built.input);
        (built, est)
    }

    /// Builds the call, asks the pacer unless it was cleared for enough
    /// tokens already (`pacing.rs`, `pace_call`), calls the provider and goes
    /// on with its answer.
    async fn call_model(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        cancel: &Cancel,
        cleared: &Clearance,
        cached_until_ms: Option<u64>,
    ) -> Result<TurnOutcome, TurnError> {
        let spec = &ctx.spec;
        // A turn that waited past the prompt cache of the turn before counts its input in full.
        let cache_fresh = cached_until_ms.is_none_or(|until| now_ms() < until);
        let Some(route) = self.routes.get(spec.provider.as_deref()) else {
            // The API knew the name (it checks PACELINE_PROVIDERS at submit);
            // this worker does not: its configuration differs from the API's.
            let message = format!(
                "this worker has no provider named {:?} (its PACELINE_PROVIDERS: {})",
                spec.provider.as_deref().unwrap_or_default(),
                self.routes.names().join(", ")
            );
            let fence = self.store.fail(lease, job, ErrorKind::ProviderError, &message, Usage::default()).await?;
            return Ok(settled(lease, fence, TurnOutcome::Failed));
        };
        // A companion turn delivered again (its worker died, or lost its
        // lease, mid-answer) whose text already reached its listeners fails
        // rather than say it twice.
        if spec.mode == Mode::Companion && lease.deliveries > 1 && self.store.streamed_text(&lease.id, job.turn).await?
        {
            let message = "the turn was delivered again after it had streamed text (its worker stopped mid-answer)";
            let fence = self.store.fail(lease, job, ErrorKind::PartialOutput, message, Usage::default()).await?;
            return Ok(settled(lease, fence, TurnOutcome::Failed));
        }
        let (built, est) = self.prepare_call(route, spec, &ctx.transcript, None, cache_fresh);
        // One reservation id per call attempt: a budget wait keeps it (so the
        // turn finds its booking when it comes back), a retry gets a new one.
        let reservation = reservation_id(lease, job);
        let unsent = match built.overflow.clone() {
            Some(message) => Some((ErrorKind::ContextOverflow, message)),
            None => self.over_cost_cap(lease, ctx, &built).await?.map(|message| (ErrorKind::BudgetExceeded, message)),
        };
        if let Some((kind, message)) = unsent {
            // Never sent: a reservation the commit's ask may have made goes back.
            self.settle_now(spec, &reservation, &CallOutcome::default()).await;
            let fence = self.store.fail(lease, job, kind, &message, Usage::default()).await?;
            return Ok(settled(lease, fence, TurnOutcome::Failed));
        }
        let hold = match self.reserve_spend(ctx, &reservation, &built).await? {
            Ok(hold) => hold,
            Err((wait_ms, why)) => {
                // The tenant's cap for the day is reached: the run waits for the next day.
                self.settle_now(spec, &reservation, &CallOutcome::default()).await;
                let data = json!({"turn": job.turn, "reason": "spend_cap", "owed_ms": wait_ms, "why": why});
                tracing::info!(message = "the tenant's spend cap for the day is reached; the run waits for the next day",
                    run.id = %lease.id, tenant = %ctx.tenant, wait_ms);
                let fence =
                    self.store.wait(lease, job, job, wait_ms, WaitReason::SpendCap, event::TURN_PACED, &data).await?;
                return Ok(settled(lease, fence, TurnOutcome::Requeued));
            }
        };
        if let Some(fence) = self.pace_call(lease, job, ctx, route, est, cleared, cached_until_ms).await? {
            if let Some(hold) = hold {
                hold.settle(&ctx.tenant, &reservation, 0.0).await;
            }
            return Ok(settled(lease, fence, TurnOutcome::Requeued));
        }
        let full_input = built.full_input;
        let provider_name = if route.provider.api_style() == ApiStyle::Anthropic { "anthropic" } else { "openai" };
        let traced = crate::traces::call_span(provider_name, &spec.model, spec.max_output_tokens);
        let (mut result, mut tail) = tracing::Instrument::instrument(
            self.send(route, lease, job, cancel, built.body, built.answer_tool.as_deref()),
            traced.clone(),
        )
        .await;
        crate::traces::record_answer(&traced, &result);
        drop(traced);
        // A provider's context-length error: the window it names (a tenth
        // under what it refused when it names none) is learned, and the call
        // trimmed to it is sent once more, under the same reservation (the
        // shorter call needs less) — the one 400 that is retried, once.
        if let Some(Err(failure)) = &result {
            if failure.kind == FailureKind::ContextOverflow && spec.context_overflow != ContextOverflow::Fail {
                // What the error taught, or, when it taught nothing new, a
                // tenth off this call.
                let learned = route.windows.learn(&spec.model, full_input, &failure.message);
                let fits = learned.filter(|&f| f < full_input).unwrap_or(full_input / 10 * 9);
                let (again, _) = self.prepare_call(route, spec, &ctx.transcript, Some(fits), cache_fresh);
                metrics::counter!(metric::PROVIDER_CALLS, "status" => "400").increment(1);
                tracing::info!(message = "the provider said the input overflows its context window; trimmed and sent again",
                    run.id = %lease.id, turn.index = job.turn, input = full_input, fits = ?fits, error = %failure.message);
                if again.overflow.is_none() {
                    let traced = crate::traces::call_span(provider_name, &spec.model, spec.max_output_tokens);
                    (result, tail) = tracing::Instrument::instrument(
                        self.send(route, lease, job, cancel, again.body, again.answer_tool.as_deref()),
                        traced.clone(),
                    )
                    .await;
                    crate::traces::record_answer(&traced, &result);
                }
            }
        }
        if let Some(Ok(success)) = &result {
            if let Some(u) = success.usage {
                self.usage.add(&ctx.tenant, &spec.model, now_ms(), &u.tokens);
                count_usage(&spec.model, &u.tokens);
            }
        }
        if let Some(hold) = hold {
            // What the call cost: its usage at the price; a refused call
            // nothing; an aborted one is not known, so its estimate.
            let cost = match &result {
                Some(Ok(success)) => success.usage.map_or(hold.estimate, |u| hold.price.cost_usd(&u.tokens)),
                Some(Err(_)) => 0.0,
                None => hold.estimate,
            };
            hold.settle(&ctx.tenant, &reservation, cost).await;
        }
        let Some(result) = result else {
            // What the provider counted of an aborted call is not known: the
            // reservation settles as a call without usage.
            self.settle_now(spec, &reservation, &CallOutcome::default()).await;
            return self.cancelled(lease, ctx).await;
        };
        match result {
            Ok(success) => self.on_success(lease, job, ctx, &reservation, success, tail, cancel).await,
            Err(failure) => self.on_failure(lease, job, ctx, &reservation, failure).await,
        }
    }

    /// Why the call `built` must not be sent under the run's `max_cost_usd`:
    /// what the run has cost so far (its record) and the call's estimated
    /// cost would cross it ([`call_cost_estimate`], high on purpose). A run whose
    /// model this worker has no price for is not sent either: its cap could
    /// not be kept. `None` for a run without a cap.
    async fn over_cost_cap(
        &self,
        lease: &Lease,
        ctx: &TurnContext,
        built: &Built,
    ) -> Result<Option<String>, TurnError> {
        let spec = &ctx.spec;
        let Some(cap) = spec.max_cost_usd else { return Ok(None) };
        let Some(price) = shared::models::price(&spec.model) else {
            return Ok(Some(format!(
                "no price is known for model {:?} on this worker (PACELINE_PRICES): its max_cost_usd cannot be kept",
                spec.model
            )));
        };
        let spent = self.store.get(&ctx.tenant, &lease.id).await?.and_then(|run| run.cost_usd).unwrap_or(0.0);
        let estimate = call_cost_estimate(&price, built, spec.max_output_tokens);
        Ok((spent + estimate > cap).then(|| {
            format!(
                "the next call (up to ${estimate:.4}) would take the run past its max_cost_usd of ${cap} (spent ${spent:.4}); not sent"
            )
        }))
    }

    /// Books the call `built`'s estimated cost ([`call_cost_estimate`]) of its
    /// tenant's cap for the day (`PACELINE_TENANT_BUDGETS`). `Ok(None)`: the
    /// tenant has no cap; `Err((ms, why))`: the cap is reached (or the model
    /// has no price, so it cannot be kept) — the run waits `ms`, until the
    /// next day.
    async fn reserve_spend(
        &self,
        ctx: &TurnContext,
        reservation: &str,
        built: &Built,
    ) -> Result<Result<Option<SpendHold>, (u64, String)>, TurnError> {
        use shared::runs::spend::Reserved;
        let Some(spend) = &self.spend else { return Ok(Ok(None)) };
        let Some(cap) = spend.budgets.cap(&ctx.tenant) else { return Ok(Ok(None)) };
        let now_ms = now_ms();
        let Some(price) = shared::models::price(&ctx.spec.model) else {
            let why = format!(
                "no price is known for model {:?}: tenant {}'s day cap cannot be kept",
                ctx.spec.model, ctx.tenant
            );
            return Ok(Err((spend.ledger_day_left_ms(now_ms), why)));
        };
        let estimate = call_cost_estimate(&price, built, ctx.spec.max_output_tokens);
        let answer =
            spend.ledger.reserve(&ctx.tenant, reservation, estimate, cap, now_ms).await.map_err(StoreError::from)?;
        Ok(match answer {
            Reserved::Held { day } => Ok(Some(SpendHold { ledger: spend.clone(), day, price, estimate })),
            Reserved::OverCap { next_day_ms, spent } => Err((
                next_day_ms.saturating_sub(now_ms).max(1),
                format!("tenant {} spent ${:.4} of its ${cap} today", ctx.tenant, spent as f64 / 1e6),
            )),
        })
    }

    /// Sends one call and streams its text deltas to the run's events as they
    /// arrive, in order, without making the provider's stream wait on Redis.
    /// Deltas that arrive within 50 ms of each other go out as one event: a
    /// listener sees the text as it comes, Redis sees a few writes per turn,
    /// not one per token. The last batch, still gathering when the answer
    /// ended, is handed back with an answer (its event data: the commit writes
    /// it, before `turn.completed`, in the entry it writes anyway — one `XADD`
    /// a turn less), else emitted here. `None`: the run was cancelled, and the
    /// call dropped mid-way.
    async fn send(
        &self,
        route: &Route,
        lease: &Lease,
        job: TurnJob,
        cancel: &Cancel,
        body: Value,
        answer_tool: Option<&str>,
    ) -> (Option<Result<CallSuccess, CallFailure>>, Option<Value>) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let store = self.store.clone();
        let run_id = lease.id.clone();
        let turn = job.turn;
        let epoch = lease.epoch;
        let delta = move |text: String| json!({"turn": turn, "epoch": epoch, "delta": text});
        let forward = tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut text = first;
                let flush_at = tokio::time::Instant::now() + DELTA_BATCH;
                loop {
                    match tokio::time::timeout_at(flush_at, rx.recv()).await {
                        Ok(Some(more)) => text.push_str(&more),
                        // The answer ended while this batch gathered: the caller's.
                        Ok(None) => return Some(delta(text)),
                        Err(_) => break,
                    }
                }
                if let Err(error) = store.emit(&run_id, event::TURN_OUTPUT_TEXT_DELTA, &delta(text)).await {
                    tracing::warn!(message = "could not emit a text delta", %error, run.id = %run_id);
                }
            }
            None
        });
        let mut on_event = move |ev: StreamEvent| {
            if let StreamEvent::TextDelta(delta) = ev {
                let _ = tx.send(delta);
            }
        };
        let call = route.provider.call_answering(body, answer_tool, &mut on_event);
        let result = tokio::select! {
            r = call => Some(r),
            () = cancel.wait() => None,
        };
        drop(on_event);
        let tail = forward.await.ok().flatten();
        match (&result, tail) {
            (Some(Ok(_)), tail) => (result, tail),
            (_, Some(data)) => {
                if let Err(error) = self.store.emit(&lease.id, event::TURN_OUTPUT_TEXT_DELTA, &data).await {
                    tracing::warn!(message = "could not emit a text delta", %error, run.id = %lease.id);
                }
                (result, None)
            }
            (_, None) => (result, None),
        }
    }

    /// `tail`: the answer's last text delta not emitted yet ([`Self::send`]),
    /// written by the script that commits the output.
    #[allow(clippy::too_many_arguments)]
    async fn on_success(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        reservation: &str,
        success: CallSuccess,
        tail: Option<Value>,
        cancel: &Cancel,
    ) -> Result<TurnOutcome, TurnError> {
        metrics::counter!(metric::PROVIDER_CALLS, "status" => success.status.to_string()).increment(1);
        let usage =
            success.usage.map(|u| Usage { total_tokens: u.tokens.input_tokens + u.tokens.output_tokens, ..u.tokens });
        // The pacer settles with what the provider's limit counted (Anthropic
        // does not count cache reads), not what the run is told it read.
        let charged = success.usage.map(|u| u.charged_input_tokens);
        let outcome = CallOutcome {
            used_tokens: charged.zip(usage).map(|(input, u)| input + u.output_tokens),
            input_tokens: charged,
            rate_limited_ms: None,
            tokens: success.headers.tokens,
            requests: success.headers.requests,
            input: success.headers.input_tokens,
            output: success.headers.output_tokens,
            headers_age_ms: success.headers_received.elapsed().as_millis() as u64,
        };
        // Made by the commit's own script where the pacer lets a script ask it
        // (with the next turn's ask, when the tools answer at once); else sent
        // with the next ask of this process, or alone after a few ms.
        let mut settle = self.settle_answered(&ctx.spec, reservation, &outcome);
        let usage = usage.unwrap_or_default();
        let ends = if success.tool_calls.is_empty() {
            Some((Next::Complete(success.output_text.clone()), TurnOutcome::Completed))
        } else if job.turn + 1 >= ctx.spec.max_turns {
            // The model wants another turn and there is none left.
            let next = Next::Fail {
                kind: ErrorKind::MaxTurns,
                message: format!("the run reached max_turns ({}) with tool calls pending", ctx.spec.max_turns),
            };
            Some((next, TurnOutcome::Failed))
        } else {
            None
        };
        // The last text delta first, then the tool calls, announced by whichever
        // script commits the output.
        let mut announced: Vec<(&str, Value)> = tail.map(|d| (event::TURN_OUTPUT_TEXT_DELTA, d)).into_iter().collect();
        if let Some((next, outcome)) = ends {
            let pacing = self.commit_pacing(&ctx.spec, &settle, None);
            let committed = self
                .store
                .commit_with_output(lease, job, None, &success.output, usage, &next, &announced, pacing.as_ref())
                .await;
            settle.made_by(&committed);
            return Ok(settled(lease, committed?.fence, outcome));
        }
        announced
            .extend(tool_call_events(lease, job, &success.tool_calls).into_iter().map(|e| (event::TURN_TOOL_CALL, e)));
        let output = ModelOutput { items: &success.output, usage, events: &announced };
        self.run_tools_and_commit(lease, job, ctx, &success.tool_calls, cancel, Some(output), Some(settle)).await
    }

    /// Runs the tool calls and commits their results. `output`, the model's
    /// output when it is not committed yet, is committed before the tools
    /// finish if they take longer than [`OUTPUT_GRACE`] (a crash while they
    /// run then re-calls no model), else with their results, in one script.
    /// `settle`, the call's settle for the commit's script to make, is sent
    /// on its own if the tools take longer than `SETTLE_IN_COMMIT`: the
    /// pacer hears of the call's headers and usage without waiting for them.
    #[allow(clippy::too_many_arguments)]
    async fn run_tools_and_commit(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        calls: &[ToolCall],
        cancel: &Cancel,
        output: Option<ModelOutput<'_>>,
        settle: Option<SettleGuard<'_, '_>>,
    ) -> Result<TurnOutcome, TurnError> {
        // Whatever happens next, a settle not made by a commit is sent on its
        // own (by the guard, when it is dropped).
        let mut settle = settle.unwrap_or_else(|| self.no_settle());
        if cancel.is_cancelled() {
            return self.cancelled(lease, ctx).await;
        }
        let endpoint = ctx.spec.tool_endpoint.as_deref().unwrap_or_default();
        let declared = declared_tools(&ctx.spec.tools);
        let tools = self.tools.run(endpoint, &ctx.spec.mcp_servers, &ctx.tenant, &lease.id, &declared, calls);
        let record = async {
            match &output {
                Some(o) => {
                    tokio::time::sleep(OUTPUT_GRACE).await;
                    self.store.record_output_with_events(lease, job, o.items, o.usage, o.events).await
                }
                None => std::future::pending().await,
            }
        };
        // An output step still under way when the tools answer is given up
        // on (dropped with this box): the commit finds whether it landed (the
        // turn's phase) and writes the output once.
        let mut record = Box::pin(record);
        tokio::pin!(tools);
        let mut recording = output.is_some();
        // A cancel drops the tool calls still running; none starts after it.
        let linger = tokio::time::sleep(SETTLE_IN_COMMIT);
        tokio::pin!(linger);
        let results = loop {
            tokio::select! {
                r = &mut tools => break r,
                () = &mut linger, if settle.pending().is_some() => settle.send_alone(),
                fence = &mut record, if recording => {
                    recording = false;
                    if let Fence::Stop(why) = fence? {
                        return Ok(settled(lease, Fence::Stop(why), TurnOutcome::Stopped));
                    }
                }
                () = cancel.wait() => return self.cancelled(lease, ctx).await,
            }
        };
        drop(record);
        let mut items = Vec::with_capacity(results.len());
        let mut reported = Vec::with_capacity(results.len());
        for r in &results {
            // The transcript keeps the clipped text: what the API shows is what
            // the model was allowed to read — one constant, not two.
            let clipped = clip_tool_output(&r.name, &r.output);
            reported.push((
                event::TURN_TOOL_RESULT,
                json!({"turn": job.turn, "epoch": lease.epoch, "call_id": r.call_id, "name": r.name,
                       "clipped": clipped.clipped, "error": r.error, "chars": clipped.total}),
            ));
            items.push(json!({"type": "function_call_output", "call_id": r.call_id, "output": clipped.text}));
        }
        // The next turn asks the pacer now: its history ends with this turn's
        // output (unless the transcript read at the start holds it already:
        // a redelivery in the tools phase) and these results.
        let new_items: Vec<Value> = output.iter().flat_map(|o| o.items.iter()).chain(&items).cloned().collect();
        let (next, ask) = self.ask_for_next(lease, job, ctx, &new_items).await;
        let pacing = self.commit_pacing(&ctx.spec, &settle, ask);
        // The results are written by the commit itself: once, and only if it lands.
        let committed = self
            .store
            .commit_with_output(
                lease,
                job,
                output.as_ref(),
                &items,
                Usage::default(),
                &next,
                &reported,
                pacing.as_ref(),
            )
            .await;
        settle.made_by(&committed);
        self.after_commit(lease, &ctx.spec, &next, &committed).await;
        let fence = committed.map(|c| c.fence);
        Ok(settled(lease, fence?, TurnOutcome::Continued))
    }

    async fn on_failure(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        reservation: &str,
        failure: CallFailure,
    ) -> Result<TurnOutcome, TurnError> {
        let status = failure.status.map(|s| s.to_string()).unwrap_or_else(|| "none".into());
        metrics::counter!(metric::PROVIDER_CALLS, "status" => status).increment(1);
        let delay = server_delay(&failure.headers, &failure.message);
        let rate_limited = failure.kind == FailureKind::RateLimited;
        if rate_limited {
            metrics::counter!(metric::RATE_LIMITED).increment(1);
        }
        // The pacer hears of every answer, 2xx or not; a 429 closes the window
        // for every worker, for the server's delay (or until its reset).
        let outcome = CallOutcome {
            used_tokens: None,
            input_tokens: None,
            rate_limited_ms: rate_limited.then(|| delay.map(|(ms, _)| ms).unwrap_or(1_000)),
            tokens: failure.headers.tokens,
            requests: failure.headers.requests,
            input: failure.headers.input_tokens,
            output: failure.headers.output_tokens,
            headers_age_ms: failure.headers_received.map(|t| t.elapsed().as_millis() as u64).unwrap_or(0),
        };
        self.settle_now(&ctx.spec, reservation, &outcome).await;

        if ctx.spec.mode == Mode::Companion && failure.streamed_text {
            // Re-sending would say the same words twice to a live listener.
            let message = format!("the call failed after it had streamed text: {}", failure.message);
            let fence = self.store.fail(lease, job, ErrorKind::PartialOutput, &message, Usage::default()).await?;
            return Ok(settled(lease, fence, TurnOutcome::Failed));
        }
        let mut rng = rand::rngs::StdRng::from_os_rng();
        match next_retry(&self.config.retry, job.attempt, failure.kind, delay, &mut rng) {
            RetryDecision::Retry { delay_ms, source } => {
                let next = TurnJob { turn: job.turn, attempt: job.attempt + 1 };
                let (reason, kind, data) = if rate_limited {
                    let data = json!({"turn": job.turn, "attempt": job.attempt, "retry_after_ms": delay_ms,
                                      "source": source.as_str()});
                    (WaitReason::RateLimited, event::TURN_RATE_LIMITED, data)
                } else {
                    let data = json!({"turn": job.turn, "attempt": job.attempt, "delay_ms": delay_ms,
                                      "reason": failure.message});
                    (WaitReason::Retry, event::TURN_RETRY, data)
                };
                let label = if rate_limited { "rate_limited" } else { "retry" };
                metrics::histogram!(metric::REQUEUE_DELAY, "reason" => label).record(delay_ms as f64 / 1000.0);
                tracing::info!(message = "call failed; requeued", run.id = %lease.id, turn.index = job.turn,
                    attempt = job.attempt, delay_ms, kind = ?failure.kind, source = ?source);
                let fence = self.store.wait(lease, job, next, delay_ms, reason, kind, &data).await?;
                Ok(settled(lease, fence, TurnOutcome::Requeued))
            }
            RetryDecision::GiveUp(give_up) => {
                let message = match give_up {
                    GiveUp::RetryAfterTooLong { delay_ms } => {
                        format!("{} (the provider asked to wait {delay_ms} ms: a quota, not a window)", failure.message)
                    }
                    GiveUp::AttemptsExhausted => {
                        format!("{} (after {} attempts)", failure.message, self.config.retry.max_attempts)
                    }
                    GiveUp::NotRetryable(_) => failure.message.clone(),
                };
                tracing::warn!(message = "call failed; the run fails", run.id = %lease.id, turn.index = job.turn,
                    attempt = job.attempt, kind = ?failure.kind, error = %message);
                let fence =
                    self.store.fail(lease, job, ErrorKind::from(failure.kind), &message, Usage::default()).await?;
                Ok(settled(lease, fence, TurnOutcome::Failed))
            }
        }
    }

    /// The run was cancelled while this turn ran: the turn ends here. The
    /// cancel script ended the run; the queue's record of the turn goes when
    /// the handler returns (the backend completes an unsettled lease). A wake
    /// for a run that is not cancelled (it cannot be: a cancel is final) is
    /// handed back to the queue as an error, to run again.
    async fn cancelled(&self, lease: &Lease, ctx: &TurnContext) -> Result<TurnOutcome, TurnError> {
        if lease.is_lost() {
            // Another delivery owns the turn now: write nothing, settle nothing.
            tracing::warn!(message = "turn stopped: its lease was taken back; it runs again elsewhere", run.id = %lease.id);
            lease.mark_settled();
            return Ok(TurnOutcome::Stopped);
        }
        let run = self.store.get(&ctx.tenant, &lease.id).await?;
        if run.is_some_and(|r| r.status != shared::runs::RunStatus::Cancelled) {
            return Err(TurnError::Store(StoreError::Protocol(
                "woken by a cancel of a run that is not cancelled".into(),
            )));
        }
        tracing::info!(message = "turn stopped by a cancel", run.id = %lease.id);
        Ok(TurnOutcome::Stopped)
    }
}

/// A call built for a turn.
pub(crate) struct Built {
    /// The body.
    pub body: Value,
    /// The name of its answer tool, if the style needs one.
    pub answer_tool: Option<String>,
    /// Its input tokens as counted here: on Anthropic, less the cache reads
    /// it is expected to make ([`crate::estimate::predicted_cache_reads`]),
    /// which its limit does not count.
    pub input: u64,
    /// Why it must not be sent: it does not fit the model's context window
    /// and the run says `fail`, or trimming could not make it fit.
    pub overflow: Option<String>,
    /// Its whole input as counted here (cache reads included).
    pub full_input: u64,
}

/// Counts a call's tokens by kind and its cost in the metrics (`/metrics`).
fn count_usage(model: &str, u: &Usage) {
    let price = shared::models::price(model);
    let model = shared::telemetry::model_label(model);
    for (kind, n) in [
        ("input", u.input_tokens),
        ("cached_input", u.cached_input_tokens),
        ("cache_write", u.cache_write_tokens),
        ("output", u.output_tokens),
        ("reasoning", u.reasoning_tokens),
    ] {
        if n > 0 {
            metrics::counter!(metric::TOKENS, "model" => model.clone(), "kind" => kind).increment(n);
        }
    }
    if let Some(price) = price {
        metrics::counter!(metric::COST, "model" => model).increment(shared::runs::spend::micros(price.cost_usd(u)));
    }
}

/// The host's wall clock ([`shared::clock::SystemClock`]), ms since the epoch:
/// the UTC day a call's cost counts on, when a prompt cache lapses.
pub(crate) fn now_ms() -> u64 {
    use shared::clock::Clock as _;
    shared::clock::SystemClock.now_ms().max(0) as u64
}

/// How many of a provider's tokens one of ours may be, for a cost cap: a
/// third more (Claude's tokenizer; servers and the mock that count
/// characters / 4, ~1.3× o200k on English), whatever the style — a cap's
/// estimate must not come out low (the tenant day-cap test crossed its cap
/// by 2.6 % with the context check's 5 % for OpenAI styles).
const COST_INPUT_MARGIN: f64 = 1.35;

/// A call's cost, estimated high on purpose (spend caps are checked with
/// it): the input at the dearer of the input and cache-write prices and
/// [`COST_INPUT_MARGIN`], its expected cache reads at theirs, the whole
/// output limit.
fn call_cost_estimate(price: &shared::models::Price, built: &Built, max_output: u32) -> f64 {
    let reads = built.full_input.saturating_sub(built.input);
    (built.input as f64 * COST_INPUT_MARGIN * price.input.max(price.cache_write)
        + reads as f64 * price.cached_input
        + f64::from(max_output) * price.output)
        / 1e6
}

impl SpendHold {
    /// Replaces the booking by what the call cost (a ledger that cannot be
    /// reached keeps the booking until it lapses: logged, the turn goes on).
    async fn settle(self, tenant: &str, reservation: &str, cost: f64) {
        if let Err(error) = self.ledger.ledger.settle(tenant, self.day, reservation, cost).await {
            tracing::warn!(message = "could not settle a call's cost in its tenant's ledger; its booking lapses", %error, tenant);
        }
    }
}

impl Spend {
    /// How long until the ledger's next day from `now_ms`.
    fn ledger_day_left_ms(&self, now_ms: u64) -> u64 {
        self.ledger.next_day_ms(now_ms).saturating_sub(now_ms).max(1)
    }
}

/// How many of the provider's tokens one of ours may be, at most, for the
/// context window check: o200k is OpenAI's own tokenizer (older models' a
/// little different); Claude's counts English ~10-25 % higher.
fn tokenizer_margin(style: ApiStyle) -> f64 {
    match style {
        ApiStyle::Anthropic => 1.25,
        ApiStyle::Responses | ApiStyle::Chat => 1.05,
    }
}

/// The body of a call of `spec` over `transcript` in `style` (bounded to
/// `max_history` turns), made to fit the model's context window
/// (`context_overflow`, SPEC §4a): the window is `context_window_tokens`,
/// else the built-in table's (`shared::models`), where what must fit is the
/// input at [`tokenizer_margin`] plus the output limit; and `learned`, what
/// this process learned of it from the provider's errors
/// ([`crate::context::LearnedWindows`]), in our tokens of input. With
/// `cache_fresh` (the turn before wrote the prompt cache lately) an Anthropic
/// call's expected cache reads are not counted in its input.
fn call_body(
    style: ApiStyle,
    spec: &shared::runs::RunSpec,
    transcript: &[TranscriptEntry],
    max_history: usize,
    learned: Option<u64>,
    cache_fresh: bool,
) -> Built {
    let params = turn_params(spec);
    let build = |entries: &[TranscriptEntry]| {
        let context: Vec<Value> = entries.iter().map(|e| e.item.clone()).collect();
        let body = build_body(style, &params, &context);
        let input = crate::estimate::input_tokens(&body);
        (body, input)
    };
    let entries = context_entries(transcript, max_history);
    let (mut body, mut input) = build(&entries);
    let margin = tokenizer_margin(style);
    let window = spec.context_window_tokens.or_else(|| shared::models::context_window(&spec.model));
    let needed = (input as f64 * margin) as u64 + u64::from(spec.max_output_tokens);
    // In our tokens.
    let over = window.map_or(0, |w| (needed.saturating_sub(w) as f64 / margin).ceil() as u64);
    let over = over.max(learned.map_or(0, |fits| input.saturating_sub(fits)));
    let full_input = input;
    let mut overflow = None;
    if over > 0 {
        // And 2 % of the input besides, so one pass fits.
        let excess = over + input / 50;
        let window = window.map_or_else(|| "its window".to_owned(), |w| format!("its window of {w} tokens"));
        let what = format!("the input (about {needed} tokens with the output limit) does not fit {window}");
        match spec.context_overflow {
            ContextOverflow::Fail => overflow = Some(format!("{what}, and the run says context_overflow: fail")),
            ContextOverflow::Compact if style == ApiStyle::Responses => {
                // The provider drops the oldest items itself.
                body["truncation"] = "auto".into();
            }
            ContextOverflow::Trim | ContextOverflow::Compact => {
                match crate::context::trim_to_fit(entries, excess, crate::estimate::item_tokens) {
                    Ok(fit) => (body, input) = build(&fit),
                    Err(left) => {
                        overflow = Some(format!(
                            "{what}: without every earlier tool output and turn it is still {left} tokens over"
                        ))
                    }
                }
            }
        }
    }
    if style == ApiStyle::Anthropic && cache_fresh {
        // What the pacer is asked for is what the input limit will count.
        input = input.saturating_sub(crate::estimate::predicted_cache_reads(&body)).max(1);
    }
    Built { answer_tool: answer_tool(style, &params), body, input, overflow, full_input }
}

/// The text of a call's body up to which it is built (and its tokens counted)
/// on the runtime's thread: counting this much afresh takes ~0.4 ms here (o200k,
/// release build); a history counted before is remembered (`estimate::count_text`).
const IN_PLACE_TEXT: usize = 16 * 1024;

/// The length of the text a call of `spec` over `transcript` sends, roughly
/// (its strings and keys, the whole transcript before its history is bounded):
/// what building its body costs goes with it.
fn call_text_len(spec: &shared::runs::RunSpec, transcript: &[TranscriptEntry]) -> usize {
    let len = crate::estimate::text_len;
    let instructions = spec.instructions.as_ref().map_or(0, String::len);
    instructions + spec.tools.iter().map(len).sum::<usize>() + transcript.iter().map(|e| len(&e.item)).sum::<usize>()
}

/// What the pacer is asked to reserve for a call of `spec` sending `input`
/// tokens: the input and the output reservation, one request.
fn call_estimate(spec: &shared::runs::RunSpec, input: u64) -> Estimate {
    let output = u64::from(spec.max_output_tokens);
    Estimate { tokens: input + output, requests: 1, output }
}

/// The API's [`FirstAsk`]: a run's first call counted as a worker counts it
/// (its input as turn 0, in the style of the provider it names in
/// `providers`, the first's, or Responses for a fleet of one unnamed
/// provider, whose style the API is not told: a worker whose count is larger
/// asks again, `pacing.rs` `CLEARED_SLACK`).
pub fn first_ask(providers: &ProviderTable) -> FirstAsk {
    let styles: Vec<(String, ApiStyle)> = providers.0.iter().map(|p| (p.name.clone(), p.style)).collect();
    FirstAsk::new(move |spec, tenant| {
        let style = match &spec.provider {
            Some(name) => styles.iter().find(|(n, _)| n == name).map(|(_, s)| *s),
            None => styles.first().map(|(_, s)| *s),
        }
        .unwrap_or(ApiStyle::Responses);
        let transcript: Vec<TranscriptEntry> =
            spec.input.iter().map(|item| TranscriptEntry { turn: 0, item: item.clone() }).collect();
        let built = call_body(style, spec, &transcript, crate::context::DEFAULT_MAX_HISTORY, None, true);
        PacedAsk::new(spec, tenant, call_estimate(spec, built.input))
    })
}

/// What a call of `spec` is built from.
fn turn_params(spec: &shared::runs::RunSpec) -> TurnParams<'_> {
    TurnParams {
        model: &spec.model,
        instructions: spec.instructions.as_deref(),
        tools: &spec.tools,
        max_output_tokens: Some(spec.max_output_tokens),
        metadata: Some(&spec.metadata),
        generation: Some(&spec.generation),
    }
}

/// The names of the tools a run declared: the only ones its tool calls may
/// name (a model that names another is answered "not run").
fn declared_tools(tools: &[Value]) -> Vec<&str> {
    tools.iter().filter_map(|t| t.get("name").and_then(Value::as_str)).collect()
}

/// The `turn.tool_call` events of `calls`.
fn tool_call_events(lease: &Lease, job: TurnJob, calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            json!({"turn": job.turn, "epoch": lease.epoch, "call_id": c.call_id, "name": c.name,
                   "arguments": c.arguments})
        })
        .collect()
}

/// The function calls of `turn` whose outputs are not in the transcript yet.
fn pending_tool_calls(transcript: &[TranscriptEntry], turn: u32) -> Vec<ToolCall> {
    let answered: std::collections::HashSet<&str> = transcript
        .iter()
        .filter(|e| e.item.get("type").and_then(Value::as_str) == Some("function_call_output"))
        .filter_map(|e| e.item.get("call_id").and_then(Value::as_str))
        .collect();
    transcript
        .iter()
        .filter(|e| e.turn == turn && e.item.get("type").and_then(Value::as_str) == Some("function_call"))
        .filter_map(|e| {
            let call_id = e.item.get("call_id")?.as_str()?;
            (!answered.contains(call_id)).then(|| ToolCall {
                call_id: call_id.to_owned(),
                name: e.item.get("name").and_then(Value::as_str).unwrap_or_default().to_owned(),
                arguments: e.item.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_owned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An Anthropic call asks for its input less the cache reads it expects
    /// only while the prompt cache of the turn before holds; past it (a long
    /// wait in the budget's line), its whole input, as it will be charged.
    #[test]
    fn a_turn_past_its_prompt_cache_counts_its_input_in_full() {
        let body = json!({"model": "claude-sonnet-4-5", "input": "find the answer",
                          "instructions": "Follow the house rules. ".repeat(300)});
        let spec = shared::runs::RunSpec::from_json(&body, &Default::default()).unwrap();
        let entry = |turn: u32, item: Value| TranscriptEntry { turn, item };
        let transcript = vec![
            entry(0, json!({"role": "user", "content": "find the answer"})),
            entry(1, json!({"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"})),
            entry(1, json!({"type": "function_call_output", "call_id": "c1", "output": "a short note"})),
        ];
        let fresh = call_body(ApiStyle::Anthropic, &spec, &transcript, 24, None, true);
        let stale = call_body(ApiStyle::Anthropic, &spec, &transcript, 24, None, false);
        assert_eq!(fresh.body, stale.body, "the same call either way");
        assert_eq!(stale.input, stale.full_input);
        assert!(fresh.input * 5 < stale.input, "{} of {} asked while the cache holds", fresh.input, stale.input);
        // The Responses style is charged in full anyway.
        let openai = call_body(ApiStyle::Responses, &spec, &transcript, 24, None, true);
        assert_eq!(openai.input, openai.full_input);
    }
}
