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

use crate::context::{clip_tool_output, prepare_context};
use rand::SeedableRng;
use serde_json::{json, Value};
use shared::pacer::{
    next_retry, server_delay, CallOutcome, Decision, Estimate, FailureKind, GiveUp, Mode, OwedReason, RetryDecision,
    RetryPolicy,
};
use shared::providers::ProviderTable;
use shared::queue::Lease;
use shared::runs::state::event;
use shared::runs::{
    ApiStyle, BudgetWait, CommitPacing, Committed, ErrorKind, Fence, FirstAsk, ModelOutput, Next, PacedAsk, Phase,
    RunStore, Started, StoreError, TranscriptEntry, Turn, TurnContext, TurnJob, Usage, WaitReason,
};

use crate::provider::{CallFailure, CallSuccess, StreamEvent, ToolCall};
use crate::request::{answer_tool, build_body, TurnParams};
use crate::routes::{Route, Routes};
use shared::telemetry::metric;

/// Text deltas arriving within this of each other are one `turn.output_text.delta` event.
const DELTA_BATCH: Duration = Duration::from_millis(50);

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
    /// Bench only: the list each delivery is logged to
    /// (`WorkerConfig::bench_deliveries_key`).
    pub bench_deliveries_key: Option<String>,
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

/// What the pacer said of a call, once owed time short enough to wait in place was waited.
enum Paced {
    Clear,
    /// Owed more than the in-place wait: requeue for this long.
    Owed {
        ms: u64,
        reason: OwedReason,
    },
}

impl Runner {
    /// Runs turn `job` of the run `lease.id`.
    pub async fn run_turn(&self, job: TurnJob, lease: &Lease) -> Result<TurnOutcome, TurnError> {
        self.run_turn_asking(Turn { job, ask: None, cleared: false, pause_ms: None }, lease).await
    }

    /// Runs `turn`; one back from a budget wait (`ask`) asks the pacer first,
    /// and one still owed is requeued without starting: its record and
    /// history are not read, its tokens not counted, again. One the pacer
    /// cleared when the turn before it committed (`cleared`) calls without
    /// asking, unless it waited in the queue so long that its reservation may
    /// have lapsed ([`CLEARED_FRESH_MS`]).
    pub async fn run_turn_asking(&self, turn: Turn, lease: &Lease) -> Result<TurnOutcome, TurnError> {
        let job = turn.job;
        let started = Instant::now();
        let mut cleared = None;
        if let Some(ask) = turn.ask {
            if let Some(route) = self.routes.get(ask.provider.as_deref()) {
                let est = Estimate { tokens: ask.tokens, requests: ask.requests, output: ask.output };
                let reservation = reservation_id(lease, job);
                let who = self.tenants.who(&ask.tenant);
                if turn.cleared && lease.lateness_ms() <= CLEARED_FRESH_MS {
                    cleared = Some((route, ask, reservation));
                } else {
                    // Owed a moment when its fetch asked: it waits that here
                    // (not a round of the queue), then asks.
                    if let Some(ms) = turn.pause_ms {
                        tokio::time::sleep(Duration::from_millis(ms).min(self.config.in_place_wait)).await;
                    }
                    match self.pace(route, &ask.model, &reservation, est, ask.mode, &who).await? {
                        Paced::Clear => cleared = Some((route, ask, reservation)),
                        Paced::Owed { ms, reason } => {
                            let fence = self.budget_wait(lease, job, ms, reason, ask).await?;
                            return Ok(settled(lease, fence, TurnOutcome::Requeued));
                        }
                    }
                }
            }
        }
        // The fetch started it (unless it had to ask first), or it starts now.
        let start = match self.store.started(lease) {
            Some(start) => start?,
            None => self.store.start_turn_with_history(lease, job, self.config.max_history).await?,
        };
        let ctx = match start {
            Started::Run(ctx) => ctx,
            Started::Stop(why) => {
                tracing::info!(message = "turn not started", run.id = %lease.id, why = %why);
                if let Some((route, ask, reservation)) = &cleared {
                    // Cleared, and not sent: the reservation goes back unused.
                    if let Err(error) = route.pacer.settle(&ask.model, reservation, &CallOutcome::default()).await {
                        tracing::warn!(message = "could not settle the pacer", %error, reservation);
                    }
                }
                lease.mark_settled();
                return Ok(TurnOutcome::Stopped);
            }
        };
        // From here a cancel of the run reaches this turn (cancels.rs).
        let cancel = self.cancels.watch_lease(&lease.id, Some(lease.clone()));
        let outcome = if ctx.phase == Phase::Tools {
            // The model's output is committed; its tool calls were interrupted.
            let calls = pending_tool_calls(&ctx.transcript, job.turn + 1);
            // Announced again: the delivery that recorded them may not have got that far.
            let announced = tool_call_events(lease, job, &calls);
            if let Err(error) = self.store.emit_all(&lease.id, event::TURN_TOOL_CALL, &announced).await {
                tracing::warn!(message = "could not write the tool calls' events", %error, run.id = %lease.id);
            }
            self.run_tools_and_commit(lease, job, &ctx, &calls, &cancel, None, None).await?
        } else {
            let cleared_tokens = cleared.as_ref().map(|(_, ask, _)| ask.tokens);
            self.call_model(lease, job, &ctx, &cancel, cleared_tokens).await?
        };
        metrics::counter!(metric::TURNS, "outcome" => outcome.as_str()).increment(1);
        metrics::histogram!(metric::TURN_LATENCY).record(started.elapsed().as_secs_f64());
        Ok(outcome)
    }

    /// The body of a call of `spec` over `transcript` (bounded to the history
    /// depth), its answer tool, and what the pacer is asked to reserve for it:
    /// its input as counted here (the pacer charges it at its learned input
    /// ratio) and the output reservation.
    fn prepare_call(
        &self,
        route: &Route,
        spec: &shared::runs::RunSpec,
        transcript: &[TranscriptEntry],
    ) -> (Value, Option<String>, Estimate) {
        let build = || call_body(route.provider.api_style(), spec, transcript, self.config.max_history);
        // A short body is built in place: stepping off the runtime's thread
        // costs more than building it (a thread hand-off, and the allocator's
        // pages of another thread).
        let (body, answer_tool, input) =
            if call_text_len(spec, transcript) > IN_PLACE_TEXT { shared::cpu_bound(build) } else { build() };
        (body, answer_tool, call_estimate(spec, input))
    }

    /// The ask of the turn after `job`, made as it commits when its budget is
    /// scarce (this process heard it owe a call time lately: `OwedLately`):
    /// `new_items` (the model's output and the tool results) end the history
    /// the next call sends, so its ask is known now. Cleared, the next turn is
    /// queued with its reservation held; owed, it waits in the queue from this
    /// commit on — no delivery, start or requeue of its own for that first
    /// wait. With room in a shared budget the ask is carried, not made: the
    /// fetch that leases the turn makes it (in its own script, no round trip
    /// of the worker's), and a turn owed by then waits in the queue unstarted.
    /// Without a shared pacer (the fetch asks none), or when the pacer cannot
    /// be reached, the next turn asks when it starts (`Next::Continue`).
    /// Where the pacer lets a script ask it, a scarce budget's ask is made by
    /// the commit's own script (the acquire op returned: one round trip, not a
    /// pacer call before the commit); the turn is then `Next::Paced` with the
    /// ask not made yet, and the commit's answer says how it went.
    async fn ask_for_next(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        new_items: &[Value],
    ) -> (Next, Option<Vec<String>>) {
        let spec = &ctx.spec;
        let Some(route) = self.routes.get(spec.provider.as_deref()) else { return (Next::Continue, None) };
        let scarce = route.owed.scarce();
        // (The worker's fetch asks the pacers that let a script ask them: routes.rs `fetch_asks`.)
        let scripted = match &route.pacer {
            shared::pacer::Pacer::Shared(p) if p.scriptable() => Some(p),
            _ => None,
        };
        if matches!(route.pacer, shared::pacer::Pacer::Off) || !scarce && scripted.is_none() {
            return (Next::Continue, None);
        }
        let next = TurnJob { turn: job.turn + 1, attempt: 1 };
        let mut transcript = ctx.transcript.clone();
        transcript.extend(new_items.iter().map(|item| TranscriptEntry { turn: next.turn, item: item.clone() }));
        let (_, _, est) = self.prepare_call(route, spec, &transcript);
        let ask = PacedAsk::new(spec, &ctx.tenant, est);
        let unasked = Next::Paced {
            turn: Turn { job: next, ask: Some(ask.clone()), cleared: false, pause_ms: None },
            wait: None,
        };
        if !scarce {
            return (unasked, None);
        }
        let reservation = reservation_id(lease, next);
        let who = self.tenants.who(&ctx.tenant);
        if let Some(p) = scripted {
            let op = shared::pacer::SharedPacer::acquire_op(&reservation, est, spec.mode, &who, p.jitter_u());
            return (unasked, Some(op));
        }
        let next = match self.pace(route, &spec.model, &reservation, est, spec.mode, &who).await {
            Ok(Paced::Clear) => {
                Next::Paced { turn: Turn { job: next, ask: Some(ask), cleared: true, pause_ms: None }, wait: None }
            }
            Ok(Paced::Owed { ms, reason }) => {
                let (data, reason) = budget_wait_record(next, ms, reason);
                let wait = Some(BudgetWait { ms, reason, data });
                Next::Paced { turn: Turn { job: next, ask: Some(ask), cleared: false, pause_ms: None }, wait }
            }
            Err(error) => {
                tracing::warn!(message = "could not ask the pacer for the next turn; it asks when it starts", %error,
                    run.id = %lease.id);
                Next::Continue
            }
        };
        (next, None)
    }

    /// Asks the pacer until it clears the call or owes more than the in-place wait.
    async fn pace(
        &self,
        route: &Route,
        model: &str,
        reservation: &str,
        est: Estimate,
        mode: Mode,
        who: &shared::pacer::Who<'_>,
    ) -> Result<Paced, TurnError> {
        loop {
            match route.pacer.acquire(model, reservation, est, mode, who).await? {
                Decision::Clear => return Ok(Paced::Clear),
                Decision::Owed { ms, reason, .. } if Duration::from_millis(ms) <= self.config.in_place_wait => {
                    route.owed.note(reason);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Decision::Owed { ms, reason, .. } => {
                    route.owed.note(reason);
                    return Ok(Paced::Owed { ms, reason });
                }
            }
        }
    }

    /// Requeues the turn for the `ms` it owes, carrying `ask` to make again
    /// when it comes back. A budget wait is not a failure: the attempt stays.
    async fn budget_wait(
        &self,
        lease: &Lease,
        job: TurnJob,
        ms: u64,
        reason: OwedReason,
        ask: PacedAsk,
    ) -> Result<Fence, TurnError> {
        let (data, wait_reason) = budget_wait_record(job, ms, reason);
        let next = Turn { job, ask: Some(ask), cleared: false, pause_ms: None };
        Ok(self.store.wait_asking(lease, job, next, ms, wait_reason, event::TURN_PACED, &data).await?)
    }

    /// Builds the call, asks the pacer unless it cleared the call for
    /// `cleared` tokens already (enough of them: [`CLEARED_SLACK`]), calls the
    /// provider and goes on with its answer.
    async fn call_model(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        cancel: &Cancel,
        cleared: Option<u64>,
    ) -> Result<TurnOutcome, TurnError> {
        let spec = &ctx.spec;
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
        let (body, answer_tool, est) = self.prepare_call(route, spec, &ctx.transcript);
        // One reservation id per call attempt: a budget wait keeps it (so the
        // turn finds its booking when it comes back), a retry gets a new one.
        let reservation = reservation_id(lease, job);
        let short = cleared.is_some_and(|tokens| est.tokens as f64 > tokens as f64 * (1.0 + CLEARED_SLACK));
        if short {
            self.settle_pacer(spec, &reservation, &CallOutcome::default()).await;
        }
        if cleared.is_none() || short {
            let who = self.tenants.who(&ctx.tenant);
            if let Paced::Owed { ms, reason } =
                self.pace(route, &spec.model, &reservation, est, spec.mode, &who).await?
            {
                let ask = PacedAsk::new(spec, &ctx.tenant, est);
                let fence = self.budget_wait(lease, job, ms, reason, ask).await?;
                return Ok(settled(lease, fence, TurnOutcome::Requeued));
            }
        }

        // Stream text deltas to the run's events as they arrive, in order,
        // without making the provider's stream wait on Redis. Deltas that
        // arrive within 50 ms of each other go out as one event: a listener
        // sees the text as it comes, Redis sees a few writes per turn, not one
        // per token.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let store = self.store.clone();
        let run_id = lease.id.clone();
        let turn = job.turn;
        let epoch = lease.epoch;
        let forward = tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut text = first;
                let flush_at = tokio::time::Instant::now() + DELTA_BATCH;
                while let Ok(Some(more)) = tokio::time::timeout_at(flush_at, rx.recv()).await {
                    text.push_str(&more);
                }
                let data = json!({"turn": turn, "epoch": epoch, "delta": text});
                if let Err(error) = store.emit(&run_id, event::TURN_OUTPUT_TEXT_DELTA, &data).await {
                    tracing::warn!(message = "could not emit a text delta", %error, run.id = %run_id);
                }
            }
        });
        let mut on_event = move |ev: StreamEvent| {
            if let StreamEvent::TextDelta(delta) = ev {
                let _ = tx.send(delta);
            }
        };
        // A cancel of the run drops the call: its stream is aborted mid-way.
        let call = route.provider.call_answering(body, answer_tool.as_deref(), &mut on_event);
        let result = tokio::select! {
            r = call => Some(r),
            () = cancel.wait() => None,
        };
        drop(on_event);
        let _ = forward.await;
        let Some(result) = result else {
            // What the provider counted of an aborted call is not known: the
            // reservation settles as a call without usage.
            self.settle_pacer(spec, &reservation, &CallOutcome::default()).await;
            return self.cancelled(lease, ctx).await;
        };
        match result {
            Ok(success) => self.on_success(lease, job, ctx, &reservation, success, cancel).await,
            Err(failure) => self.on_failure(lease, job, ctx, &reservation, failure).await,
        }
    }

    async fn on_success(
        &self,
        lease: &Lease,
        job: TurnJob,
        ctx: &TurnContext,
        reservation: &str,
        success: CallSuccess,
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
        let settle = Settle { spec: &ctx.spec, reservation, outcome: &outcome };
        let settle = if self.settles_in_commit(&ctx.spec, &outcome) {
            Some(settle)
        } else {
            self.settle_pacer_soon(settle.spec, reservation, &outcome);
            None
        };
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
        if let Some((next, outcome)) = ends {
            let mut settle = SettleGuard { runner: self, settle };
            let pacing = self.commit_pacing(&ctx.spec, settle.settle, None);
            let committed = self
                .store
                .commit_with_output(lease, job, None, &success.output, usage, &next, &[], pacing.as_ref())
                .await;
            settle.made_by(&committed);
            return Ok(settled(lease, committed?.fence, outcome));
        }
        // The tool calls, announced by whichever script commits the output.
        let announced: Vec<(&str, Value)> =
            tool_call_events(lease, job, &success.tool_calls).into_iter().map(|e| (event::TURN_TOOL_CALL, e)).collect();
        let output = ModelOutput { items: &success.output, usage, events: &announced };
        self.run_tools_and_commit(lease, job, ctx, &success.tool_calls, cancel, Some(output), settle).await
    }

    /// Runs the tool calls and commits their results. `output`, the model's
    /// output when it is not committed yet, is committed before the tools
    /// finish if they take longer than [`OUTPUT_GRACE`] (a crash while they
    /// run then re-calls no model), else with their results, in one script.
    /// `settle`, the call's settle for the commit's script to make, is sent
    /// on its own if the tools take longer than [`SETTLE_IN_COMMIT`]: the
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
        settle: Option<Settle<'_>>,
    ) -> Result<TurnOutcome, TurnError> {
        // Whatever happens next, a settle not made by a commit is sent on its own.
        let mut settle = SettleGuard { runner: self, settle };
        if cancel.is_cancelled() {
            return self.cancelled(lease, ctx).await;
        }
        let endpoint = ctx.spec.tool_endpoint.as_deref().unwrap_or_default();
        let tools = self.tools.run(endpoint, &ctx.tenant, &lease.id, calls);
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
                () = &mut linger, if settle.settle.is_some() => settle.send_alone(),
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
        let pacing = self.commit_pacing(&ctx.spec, settle.settle, ask);
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
        if let Ok(Committed { asked: Some(Decision::Owed { ms, reason }), .. }) = &committed {
            if let Some(route) = self.routes.get(ctx.spec.provider.as_deref()) {
                route.owed.note(*reason);
            }
            // (Its record and event were written by the commit's script.)
            count_budget_wait(*ms);
        }
        let fence = committed.map(|c| c.fence);
        // (Not on Redis trouble: the commit may have landed, and its turn holds the reservation.)
        if matches!(fence, Ok(Fence::Stop(_))) {
            if let Next::Paced { turn: Turn { ask: Some(ask), cleared: true, job: next_job, .. }, .. } = &next {
                // Cleared for a turn that was not queued: the reservation goes back unused.
                if let Some(route) = self.routes.get(ask.provider.as_deref()) {
                    let reservation = reservation_id(lease, *next_job);
                    if let Err(error) = route.pacer.settle(&ask.model, &reservation, &CallOutcome::default()).await {
                        tracing::warn!(message = "could not settle the pacer", %error, reservation);
                    }
                }
            }
        }
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
        self.settle_pacer(&ctx.spec, reservation, &outcome).await;

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

    /// Notes a call into the pacer of the run's provider. A pacer that cannot
    /// be written is logged, not fatal: the call happened, and its turn must
    /// still be committed.
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

    /// Settles as [`Self::settle_pacer`] does, with the pacer's next call of
    /// this process if one follows within a few ms ([`shared::pacer::Pacer::settle_soon`]);
    /// queued before it returns.
    fn settle_pacer_soon(&self, spec: &shared::runs::RunSpec, reservation: &str, outcome: &CallOutcome) {
        let Some(route) = self.settling_route(spec, outcome) else { return };
        let settled = route.pacer.settle_soon(&spec.model, reservation, outcome);
        let reservation = reservation.to_owned();
        tokio::spawn(async move {
            if let Err(error) = settled.await {
                tracing::warn!(message = "could not settle the pacer", %error, reservation);
            }
        });
    }

    /// Whether a call's settle is left to the commit's script: where the
    /// run's pacer lets a script settle with it ([`CommitPacing`]) and its
    /// budget is scarce (the commit asks for the next turn then, and calls
    /// are few: a lone settle would cost a script call of its own). With room
    /// in the budget, settles go to the batch loop, which sends a busy
    /// process's many together (one read and write of the state for all).
    fn settles_in_commit(&self, spec: &shared::runs::RunSpec, outcome: &CallOutcome) -> bool {
        self.settling_route(spec, outcome).is_some_and(|route| {
            route.owed.scarce() && matches!(&route.pacer, shared::pacer::Pacer::Shared(p) if p.scriptable())
        })
    }

    /// The pacer ops the commit's script makes: the call's `settle` and the
    /// next turn's `ask` (an acquire op), over the route of `spec`'s pacer.
    fn commit_pacing(
        &self,
        spec: &shared::runs::RunSpec,
        settle: Option<Settle<'_>>,
        ask: Option<Vec<String>>,
    ) -> Option<CommitPacing> {
        if settle.is_none() && ask.is_none() {
            return None;
        }
        let route = self.routes.get(spec.provider.as_deref())?;
        let shared::pacer::Pacer::Shared(p) = &route.pacer else { return None };
        Some(CommitPacing {
            route: p.commit_route(&spec.model)?,
            settle: settle.map(|s| shared::pacer::SharedPacer::settle_op(s.reservation, s.outcome)),
            ask,
        })
    }

    async fn settle_pacer(&self, spec: &shared::runs::RunSpec, reservation: &str, outcome: &CallOutcome) {
        let Some(route) = self.settling_route(spec, outcome) else { return };
        if let Err(error) = route.pacer.settle(&spec.model, reservation, outcome).await {
            tracing::warn!(message = "could not settle the pacer", %error, reservation);
        }
    }

    /// The route a settle of `spec`'s call goes to, the remaining tokens its
    /// headers named put on the gauge.
    fn settling_route(&self, spec: &shared::runs::RunSpec, outcome: &CallOutcome) -> Option<&Route> {
        let route: &Route = self.routes.get(spec.provider.as_deref())?;
        if let Some(remaining) = outcome.tokens.remaining {
            metrics::gauge!(metric::PACER_REMAINING_TOKENS, "budget" => route.budget.clone(), "model" => spec.model.clone())
                .set(remaining as f64);
        }
        Some(route)
    }
}

/// How long a call's settle waits for its turn's tools before it goes on its
/// own rather than with the commit (as long as the shared pacer's batch loop
/// lets a settle wait for company).
const SETTLE_IN_COMMIT: Duration = Duration::from_millis(20);

/// A call's settle the commit's script is to make (or that is sent alone if
/// it does not).
#[derive(Clone, Copy)]
struct Settle<'a> {
    spec: &'a shared::runs::RunSpec,
    reservation: &'a str,
    outcome: &'a CallOutcome,
}

/// Sends its settle on its own when dropped still holding it (a turn that
/// ended before its commit: cancelled, fenced, an error; or a commit that
/// failed on Redis trouble, which may not have landed).
struct SettleGuard<'r, 'a> {
    runner: &'r Runner,
    settle: Option<Settle<'a>>,
}

impl SettleGuard<'_, '_> {
    /// The settle was made by a commit's script that answered (fenced or
    /// not, the script settles); an error leaves it to be sent alone — twice
    /// at worst, if the commit landed: the pacer then observes the same
    /// headers again and finds no reservation to charge.
    fn made_by<T>(&mut self, committed: &Result<T, StoreError>) {
        if committed.is_ok() {
            self.settle = None;
        }
    }

    fn send_alone(&mut self) {
        if let Some(s) = self.settle.take() {
            self.runner.settle_pacer_soon(s.spec, s.reservation, s.outcome);
        }
    }
}

impl Drop for SettleGuard<'_, '_> {
    fn drop(&mut self) {
        self.send_alone();
    }
}

/// The body of a call of `spec` over `transcript` in `style` (bounded to
/// `max_history` turns), its answer tool, and its input tokens as counted here.
fn call_body(
    style: ApiStyle,
    spec: &shared::runs::RunSpec,
    transcript: &[TranscriptEntry],
    max_history: usize,
) -> (Value, Option<String>, u64) {
    let params = turn_params(spec);
    let context = prepare_context(transcript, max_history);
    let body = build_body(style, &params, &context);
    let input = crate::estimate::input_tokens(&body);
    (body, answer_tool(style, &params), input)
}

/// The text of a call's body up to which it is built (and its tokens counted)
/// on the runtime's thread: counting this much afresh takes ~0.4 ms here (o200k,
/// release build); a history counted before is remembered (`estimate::count_text`).
const IN_PLACE_TEXT: usize = 16 * 1024;

/// The length of the text a call of `spec` over `transcript` sends, roughly
/// (its strings and keys, the whole transcript before its history is bounded):
/// what building its body costs goes with it.
fn call_text_len(spec: &shared::runs::RunSpec, transcript: &[TranscriptEntry]) -> usize {
    fn len(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(len).sum(),
            Value::Object(o) => o.iter().map(|(k, v)| k.len() + len(v)).sum(),
            _ => 8,
        }
    }
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
/// asks again, [`CLEARED_SLACK`]).
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
        let (_, _, input) = call_body(style, spec, &transcript, crate::context::DEFAULT_MAX_HISTORY);
        PacedAsk::new(spec, tenant, call_estimate(spec, input))
    })
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
    metrics::counter!(metric::BUDGET_WAITS).increment(1);
    metrics::histogram!(metric::REQUEUE_DELAY, "reason" => "budget").record(ms as f64 / 1000.0);
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

/// The pacer's reservation id of a call attempt: `run:turn:attempt`.
fn reservation_id(lease: &Lease, job: TurnJob) -> String {
    format!("{}:{}:{}", lease.id, job.turn, job.attempt)
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
