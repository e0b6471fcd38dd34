//! Where the pacer's state lives: in Redis for every worker (`shared`), in the
//! process (`local`, a baseline like a single-process client), or nowhere (`off`,
//! reactive backoff only). The benchmark compares the three.
//!
//! Every call names a reservation id. A turn keeps the same id while it waits,
//! so when it comes back after its owed time it finds its place in line;
//! `settle` with the same id refunds what the call did not use.

use super::bucket;
use super::fair::Tenant;
use super::history;
use super::local::LocalPacer;
use super::model::{CallOutcome, Decision, Estimate, Flight, Mode, OwedReason, PacerState, PacingConfig, Waiter, Who};
use super::refund::RefundShare;
use crate::clock::{Clock, Millis};
use crate::keys::Keys;
use redis::aio::ConnectionManager;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The atomic operations of the shared pacer, one script (see the file's header).
static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("scripts.lua")));

/// The pacer's script as a Lua function, `pacer_call(KEYS, ARGV)`, for a
/// script that asks the pacer itself (the run store's fetch asks it for a
/// turn back from a budget wait: `runs/fetch.lua`; its commit for the next
/// turn: `runs/store.lua`). It answers what the script would, or a table
/// with `err` (`redis.error_reply`). With it, `pacer_batch(keys, cfg, now,
/// ops)`, the one way those scripts call it (`batch.lua`).
pub fn lua_function() -> String {
    format!(
        "local function pacer_call(KEYS, ARGV)\n{}\nend\n{}",
        include_str!("scripts.lua"),
        include_str!("batch.lua")
    )
}

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

/// One budget and model as the workers see it: `GET /v1/pacer` serialises it
/// as it is (the field names are the API's), with the time of the last
/// headers and the tenants' lines added as the caller may see them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetSnapshot {
    /// The budget name (`PACELINE_BUDGET`).
    pub budget: String,
    /// The model (providers report limits per model).
    pub model: String,
    /// Estimated tokens available now.
    pub remaining_tokens: Option<i64>,
    /// Token limit.
    pub limit_tokens: Option<u64>,
    /// Time until the token bucket is full again, ms.
    #[serde(rename = "reset_in_ms")]
    pub reset_tokens_in_ms: Option<u64>,
    /// Tokens reserved by calls in flight.
    pub reserved_tokens: u64,
    /// Tokens the turns waiting in line are expected to use.
    pub booked_tokens: u64,
    /// Turns waiting in line.
    pub waiting_turns: u64,
    /// How long the oldest turn in line has waited (watchdog), ms.
    pub oldest_wait_ms: u64,
    /// Time since a call was last cleared (watchdog), ms; None if never.
    pub since_admission_ms: Option<u64>,
    /// Estimated requests available now.
    pub remaining_requests: Option<i64>,
    /// Request limit.
    pub limit_requests: Option<u64>,
    /// Time until the request bucket is full again.
    pub reset_requests_in_ms: Option<u64>,
    /// Requests reserved by calls in flight.
    pub reserved_requests: u64,
    /// A 429 closed the window for this long from now.
    pub blocked_for_ms: u64,
    /// When headers were last read (ms since the epoch, Redis clock); None if
    /// never. The API shows it as `observed_at` (RFC 3339).
    #[serde(skip)]
    pub observed_at_ms: Option<Millis>,
    /// The share of a call's unused output the provider gives back, as learned
    /// from its headers (1 refunds, 0 keeps); None until learned.
    pub refund_share: Option<f64>,
    /// Each tenant's line (fair admission). The API shows the caller's own,
    /// and every line to the operator only.
    #[serde(skip)]
    pub tenants: Vec<TenantShare>,
    /// What the pacer learned of the provider's buckets.
    pub shape: BudgetShape,
}

/// What the pacer learned of a budget's buckets from the headers (docs/pacing.md,
/// "Provider shapes").
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetShape {
    /// How the token bucket refills: `continuous`, `window` (whole at its
    /// boundaries) or `unknown` (not decided yet); for separate input and
    /// output buckets, the input bucket's.
    pub refill: bucket::Refill,
    /// The token limit was inferred from `remaining` alone (Azure): at least
    /// what remained plus a call's own charge, refilling per minute.
    pub limit_assumed: bool,
    /// Separate input and output buckets (Anthropic): estimated tokens left
    /// and the limit of each; null where the provider has no such bucket.
    pub remaining_input_tokens: Option<i64>,
    /// See `remaining_input_tokens`.
    pub limit_input_tokens: Option<u64>,
    /// See `remaining_input_tokens`.
    pub remaining_output_tokens: Option<i64>,
    /// See `remaining_input_tokens`.
    pub limit_output_tokens: Option<u64>,
}

/// One tenant's line in a budget (`GET /v1/pacer`, `/metrics`).
// `TenantView` is its published name in the API's OpenAPI document.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = TenantView))]
pub struct TenantShare {
    /// The tenant.
    pub tenant: String,
    /// Its weight (`PACELINE_TENANT_WEIGHTS`), as last seen.
    pub weight: f64,
    /// Tokens admitted (expected use) since the state began.
    pub admitted_tokens: u64,
    /// Tokens of its turns waiting or booked, not yet sent.
    pub waiting_tokens: u64,
    /// Times one of its turns waited in its line (for its fair share).
    pub waits: u64,
}

impl BudgetSnapshot {
    /// The snapshot of `s` at `now`.
    pub fn from_state(budget: &str, model: &str, s: &PacerState, now: Millis) -> Self {
        let level = |b: &bucket::Bucket| b.known().then(|| b.level_at(now).floor() as i64);
        let limit = |b: &bucket::Bucket| b.known().then_some(b.limit as u64);
        let reset =
            |b: &bucket::Bucket| b.known().then(|| ((b.limit - b.level_at(now)).max(0.0) / b.rate).ceil() as u64);
        Self {
            budget: budget.to_owned(),
            model: model.to_owned(),
            remaining_tokens: level(&s.tokens),
            limit_tokens: limit(&s.tokens),
            reset_tokens_in_ms: reset(&s.tokens),
            reserved_tokens: s.tokens.in_flight.max(0.0) as u64,
            booked_tokens: s.waiters.values().map(|w| w.line).sum::<f64>() as u64,
            waiting_turns: s.waiters.len() as u64,
            oldest_wait_ms: s.oldest_wait_ms(now) as u64,
            since_admission_ms: (s.last_admit_ms > 0).then(|| (now - s.last_admit_ms).max(0) as u64),
            remaining_requests: level(&s.requests),
            limit_requests: limit(&s.requests),
            reset_requests_in_ms: reset(&s.requests),
            reserved_requests: s.requests.in_flight.max(0.0) as u64,
            blocked_for_ms: (s.blocked_until_ms - now).max(0) as u64,
            observed_at_ms: (s.observed_at_ms > 0).then_some(s.observed_at_ms),
            refund_share: s.learned_share(),
            shape: BudgetShape {
                refill: if s.tokens.known() || !s.input.known() { s.tokens.refill } else { s.input.refill },
                limit_assumed: s.tokens.assumed,
                remaining_input_tokens: level(&s.input),
                limit_input_tokens: limit(&s.input),
                remaining_output_tokens: level(&s.output),
                limit_output_tokens: limit(&s.output),
            },
            tenants: s
                .tenants
                .iter()
                .map(|(tenant, t)| TenantShare {
                    tenant: tenant.clone(),
                    weight: t.weight,
                    admitted_tokens: t.admitted.max(0.0) as u64,
                    waiting_tokens: s.waiters.values().filter(|w| &w.tenant == tenant).map(|w| w.line).sum::<f64>()
                        as u64,
                    waits: t.waits.max(0.0) as u64,
                })
                .collect(),
        }
    }
}

impl BudgetSnapshot {
    /// The watchdog: turns have waited longer than `after_ms` and nothing was
    /// admitted for as long, while the token bucket is nearly full and no 429
    /// closed the window. The pacer should never be in this state.
    pub fn stalled(&self, after_ms: u64) -> bool {
        let full = match (self.remaining_tokens, self.limit_tokens) {
            (Some(r), Some(l)) => r as f64 >= 0.9 * l as f64,
            _ => false,
        };
        full && self.blocked_for_ms == 0
            && self.waiting_turns > 0
            && self.oldest_wait_ms > after_ms
            && self.since_admission_ms.is_none_or(|ms| ms > after_ms)
    }
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

/// The shared pacer: state per (budget, model) in Redis, changed only by the
/// atomic script in `scripts.lua`.
#[derive(Clone)]
pub struct SharedPacer {
    conn: ConnectionManager,
    keys: Keys,
    budget: String,
    config: Arc<PacingConfig>,
    /// `None` in production: the script reads the Redis server's clock.
    test_clock: Option<Arc<dyn Clock>>,
    /// Per budget and model, the queue of this process's calls waiting for
    /// the next batch (see [`Batcher`]).
    batchers: Arc<Mutex<HashMap<(String, String), Batcher>>>,
    /// Each batch reads the line's first this many waiters first (the
    /// script's `head`), as the run store's fetch does (tests: 0, none).
    head_read: usize,
}

/// How many calls one batch takes at most.
const MAX_BATCH: usize = 64;

/// A call waiting for its batch: the op as the script reads it (its name, then
/// its arguments) and where its answer goes.
struct Pending {
    op: Vec<String>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<i64>, PacerError>>,
    /// It may wait up to [`SETTLE_LINGER`] for company ([`SharedPacer::settle_soon`]).
    lazy: bool,
}

/// How long a settle sent with [`SharedPacer::settle_soon`] waits for another
/// call to go with it: the ask for the same run's next turn follows it once
/// the tools answer, and both then cost one script call (one read and one
/// write of the state) instead of two.
const SETTLE_LINGER: std::time::Duration = std::time::Duration::from_millis(20);

/// A process's calls of one budget and model go to the script together: while
/// one batch is in Redis, the calls that arrive meanwhile queue here and go as
/// the next, in one script call that reads and writes the state once (the
/// script's `batch`; each op is decided as it would be alone). No call waits for
/// company: an idle pacer sends a lone call at once.
#[derive(Clone)]
struct Batcher {
    tx: tokio::sync::mpsc::UnboundedSender<Pending>,
}

impl Batcher {
    /// Starts the batch loop of `model` over `pacer`'s budget.
    fn start(pacer: SharedPacer, model: String) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Pending>();
        // The loop holds no Batcher: it ends when the last sender (every clone
        // of the pacer that made it) is gone.
        let pacer = SharedPacer { batchers: Arc::default(), ..pacer };
        tokio::spawn(async move {
            // The model is listed under its budget as the loop starts (a write
            // that fails is tried again before each batch): every ask and settle
            // of it in this process comes here or, made in a commit's script,
            // starts this loop first (`SharedPacer::commit_route`); its fetch's
            // asks aside.
            let mut registered = match pacer.register(&model).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(message = "could not list the model under its budget", %error);
                    false
                }
            };
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                // Lazy calls alone wait a moment for one that is not.
                let deadline = tokio::time::Instant::now() + SETTLE_LINGER;
                while batch.len() < MAX_BATCH && batch.iter().all(|p| p.lazy) {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(p)) => batch.push(p),
                        Ok(None) | Err(_) => break,
                    }
                }
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(p) => batch.push(p),
                        Err(_) => break,
                    }
                }
                if !registered {
                    match pacer.register(&model).await {
                        Ok(()) => registered = true,
                        Err(error) => tracing::warn!(message = "could not list the model under its budget", %error),
                    }
                }
                let answers = pacer.invoke_batch(&model, &batch).await;
                match answers {
                    Ok(answers) if answers.len() == batch.len() => {
                        for (p, a) in batch.into_iter().zip(answers) {
                            let _ = p.reply.send(Ok(a));
                        }
                    }
                    Ok(answers) => {
                        let e =
                            PacerError::Protocol(format!("{} answers to a batch of {}", answers.len(), batch.len()));
                        for p in batch {
                            let _ = p.reply.send(Err(e.clone()));
                        }
                    }
                    Err(e) => {
                        for p in batch {
                            let _ = p.reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        });
        Self { tx }
    }
}

impl std::fmt::Debug for SharedPacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPacer").field("budget", &self.budget).field("keys", &self.keys).finish()
    }
}

impl SharedPacer {
    /// A shared pacer for `budget`, over a (reconnecting) connection.
    pub fn new(conn: ConnectionManager, keys: Keys, budget: impl Into<String>, config: PacingConfig) -> Self {
        Self {
            conn,
            keys,
            budget: budget.into(),
            config: Arc::new(config),
            test_clock: None,
            batchers: Arc::default(),
            head_read: 0,
        }
    }

    /// The same pacer, every batch of which first reads the line's first `n`
    /// waiters (the script's `head` op), as the run store's fetch sends its
    /// asks: for tests that its answers are those without it.
    pub fn with_head_read(mut self, n: usize) -> Self {
        self.head_read = n;
        self
    }

    /// The same pacer on an injected clock instead of the Redis server's
    /// (for tests of time-dependent policy; production never calls this).
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
        self
    }

    /// The script's KEYS for `model`, in its order (scripts.lua).
    fn script_keys(&self, model: &str) -> [String; 4] {
        [
            self.keys.pacer_state(&self.budget, model),
            self.keys.pacer_waiters(&self.budget, model),
            self.keys.pacer_line(&self.budget, model),
            self.keys.pacer_history(&self.budget, model),
        ]
    }

    /// The script's `ARGV[2..15]`, the knobs (`ARGV[11]`, the clock: `now`;
    /// empty reads the server's).
    fn config_args(&self, now: String) -> Vec<String> {
        let c = &self.config;
        vec![
            c.floor(Mode::Work).to_string(),
            c.max_pace_ms.to_string(),
            c.jitter_frac.to_string(),
            c.jitter_max_ms.to_string(),
            c.reservation_ttl_ms.to_string(),
            c.probe_wait_ms.to_string(),
            c.late_ms.to_string(),
            c.configured_tpm.unwrap_or(0).to_string(),
            c.configured_rpm.unwrap_or(0).to_string(),
            now,
            c.booking_grace_ms.to_string(),
            c.recheck_ms.to_string(),
            c.floor(Mode::Companion).to_string(),
            u8::from(c.whole_waits).to_string(),
        ]
    }

    fn invocation(&self, op: &str, model: &str) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.prepare_invoke();
        for key in self.script_keys(model) {
            inv.key(key);
        }
        inv.arg(op);
        for arg in self.config_args(self.test_clock.as_ref().map(|c| c.now_ms().to_string()).unwrap_or_default()) {
            inv.arg(arg);
        }
        inv
    }

    /// Whether another script may ask this pacer itself ([`Self::script_route`]):
    /// not on an injected test clock, which a script cannot read.
    pub fn scriptable(&self) -> bool {
        self.test_clock.is_none()
    }

    /// What a script that asks this pacer itself needs ([`lua_function`]):
    /// the names of its keys for a model (each is the model's name appended
    /// to one of these) and `ARGV[2..15]` with the clock left to the caller
    /// (`""` at `ARGV[11]`). `None` on an injected test clock, which a script
    /// cannot read.
    pub fn script_route(&self) -> Option<serde_json::Value> {
        if !self.scriptable() {
            return None;
        }
        Some(serde_json::json!({"keys": self.script_keys(""), "cfg": self.config_args(String::new())}))
    }

    /// Moves up the first `k` waiters of `model`'s line whose wait, predicted
    /// now, ends sooner than their due time ([`super::model::pull_in`]): their
    /// reservation ids and new due times. (The run store's fetch does this
    /// in its own script, where it moves their queue entries too.)
    pub async fn pull_in(&self, model: &str, k: usize) -> Result<Vec<(String, i64)>, PacerError> {
        let mut inv = self.invocation("pull", model);
        inv.arg(k);
        if self.head_read > 0 {
            inv.arg(self.head_read);
        }
        let mut conn = self.conn.clone();
        let flat: Vec<String> = inv.invoke_async(&mut conn).await?;
        flat.chunks(2)
            .map(|p| match p {
                [id, due] => due
                    .parse()
                    .map(|due| (id.clone(), due))
                    .map_err(|_| PacerError::Protocol(format!("pull: due time {due:?}"))),
                _ => Err(PacerError::Protocol("pull: an odd reply".into())),
            })
            .collect()
    }

    /// What a commit that runs this pacer's ops for `model` in its own script
    /// needs (store.rs `CommitPacing`): its four keys and `ARGV[2..15]` with
    /// the clock left to the script (`""` at `ARGV[11]`). Starts the model's
    /// batch loop if none runs yet, which lists the model under its budget
    /// (`GET /v1/pacer`). `None` on an injected test clock.
    pub fn commit_route(&self, model: &str) -> Option<serde_json::Value> {
        if !self.scriptable() {
            return None;
        }
        let mut map = self.batchers.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((self.budget.clone(), model.to_owned()))
            .or_insert_with(|| Batcher::start(self.clone(), model.to_owned()));
        drop(map);
        Some(serde_json::json!({"keys": self.script_keys(model), "cfg": self.config_args(String::new())}))
    }

    /// The script's `acquire` op (see [`Self::acquire`]), for a script that
    /// asks this pacer itself.
    pub fn acquire_op(id: &str, est: Estimate, mode: Mode, who: &Who<'_>, jitter_u: f64) -> Vec<String> {
        vec![
            "acquire".to_owned(),
            id.to_owned(),
            est.tokens.to_string(),
            est.requests.to_string(),
            jitter_u.to_string(),
            mode.as_str().to_owned(),
            who.weight.to_string(),
            who.cap.to_string(),
            who.tenant.to_owned(),
            est.output.to_string(),
        ]
    }

    /// A uniform number for an ask's jitter (0 when this pacer jitters not).
    pub fn jitter_u(&self) -> f64 {
        if self.config.jitter_frac > 0.0 {
            rand::random::<f64>()
        } else {
            0.0
        }
    }

    /// Sends `batch` as one script call (`batch`); one answer per op.
    async fn invoke_batch(&self, model: &str, batch: &[Pending]) -> Result<Vec<Vec<i64>>, PacerError> {
        let mut inv = self.invocation("batch", model);
        if self.head_read > 0 {
            inv.arg("head").arg(self.head_read);
        }
        for p in batch {
            inv.arg(&p.op);
        }
        let mut conn = self.conn.clone();
        let mut answers: Vec<Vec<i64>> = inv.invoke_async(&mut conn).await?;
        if self.head_read > 0 && !answers.is_empty() {
            answers.remove(0);
        }
        Ok(answers)
    }

    /// Queues `op` for the next batch of `model` and waits for its answer.
    async fn call(&self, model: &str, op: Vec<String>) -> Result<Vec<i64>, PacerError> {
        self.enqueue(model, op, false)?.await.map_err(|_| PacerError::Protocol("the batch loop stopped".into()))?
    }

    /// Queues `op` for the next batch of `model` now; its answer comes on the receiver.
    fn enqueue(
        &self,
        model: &str,
        op: Vec<String>,
        lazy: bool,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<Vec<i64>, PacerError>>, PacerError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let mut pending = Pending { op, reply, lazy };
        for _ in 0..2 {
            let batcher = {
                let mut map = self.batchers.lock().unwrap_or_else(|e| e.into_inner());
                map.entry((self.budget.clone(), model.to_owned()))
                    .or_insert_with(|| Batcher::start(self.clone(), model.to_owned()))
                    .clone()
            };
            match batcher.tx.send(pending) {
                Ok(()) => return Ok(answer),
                // Its loop is gone (a runtime that ended): start another.
                Err(tokio::sync::mpsc::error::SendError(p)) => {
                    pending = p;
                    self.batchers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&(self.budget.clone(), model.to_owned()));
                }
            }
        }
        Err(PacerError::Protocol("no batch loop would take the call".into()))
    }

    /// Lists the model under the budget, for `snapshot` (its batch loop does,
    /// once per process: every ask and settle of the model goes through it).
    async fn register(&self, model: &str) -> Result<(), PacerError> {
        let mut conn = self.conn.clone();
        redis::pipe()
            .sadd(self.keys.pacer_budgets(), &self.budget)
            .ignore()
            .sadd(self.keys.pacer_models(&self.budget), model)
            .ignore()
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// See [`Pacer::acquire`].
    pub async fn acquire(
        &self,
        model: &str,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
    ) -> Result<Decision, PacerError> {
        let op = Self::acquire_op(id, est, mode, who, self.jitter_u());
        let reply = self.call(model, op).await?;
        match reply.as_slice() {
            [0] => Ok(Decision::Clear),
            [1, ms, reason] => Ok(Decision::Owed { ms: (*ms).max(0) as u64, reason: OwedReason::from_code(*reason) }),
            other => Err(PacerError::Protocol(format!("{other:?}"))),
        }
    }

    /// See [`Pacer::settle`].
    pub async fn settle(&self, model: &str, id: &str, o: &CallOutcome) -> Result<(), PacerError> {
        self.call(model, Self::settle_op(id, o)).await?;
        Ok(())
    }

    /// See [`Pacer::settle_soon`]: queued now, sent with the next call of this
    /// process for the same model or after 20 ms, whichever is first.
    pub fn settle_soon(
        &self,
        model: &str,
        id: &str,
        o: &CallOutcome,
    ) -> impl std::future::Future<Output = Result<(), PacerError>> + Send + 'static {
        let answer = self.enqueue(model, Self::settle_op(id, o), true);
        async move {
            answer?.await.map_err(|_| PacerError::Protocol("the batch loop stopped".into()))??;
            Ok(())
        }
    }

    /// The script's `settle` op for `o` (also for a script that settles with
    /// this pacer itself).
    pub fn settle_op(id: &str, o: &CallOutcome) -> Vec<String> {
        let opt = |v: Option<u64>| v.map(|v| v as i64).unwrap_or(-1).to_string();
        vec![
            "settle".to_owned(),
            id.to_owned(),
            opt(o.used_tokens),
            opt(o.rate_limited_ms),
            opt(o.tokens.limit),
            opt(o.tokens.remaining),
            opt(o.tokens.reset_ms),
            opt(o.requests.limit),
            opt(o.requests.remaining),
            opt(o.requests.reset_ms),
            o.headers_age_ms.to_string(),
            opt(o.input_tokens),
            opt(o.input.limit),
            opt(o.input.remaining),
            opt(o.input.reset_ms),
            opt(o.output.limit),
            opt(o.output.remaining),
            opt(o.output.reset_ms),
        ]
    }

    /// The state of one model of this budget, as the script sees it now.
    pub async fn state(&self, model: &str) -> Result<(PacerState, Millis), PacerError> {
        let inv = self.invocation("snapshot", model);
        let mut conn = self.conn.clone();
        let flat: Vec<String> = inv.invoke_async(&mut conn).await?;
        Ok(state_from_fields(&flat))
    }

    /// The last [`history::SECONDS`] of one budget and model (the
    /// dashboard's chart); see [`history`].
    pub async fn history(&self, budget: &str, model: &str) -> Result<history::History, PacerError> {
        let mut conn = self.conn.clone();
        // The refill is the state's, read through the script (its numbers are packed).
        let key = self.keys.pacer_state(budget, model);
        let refill = if redis::cmd("EXISTS").arg(&key).query_async::<bool>(&mut conn).await? {
            let other = Self { budget: budget.to_owned(), ..self.clone() };
            history::refill_per_s(&other.state(model).await?.0)
        } else {
            None
        };
        history::read(&mut conn, &self.keys, budget, model, refill).await
    }

    /// See [`Pacer::snapshot`]: every budget and model under this prefix.
    pub async fn snapshot(&self) -> Result<Vec<BudgetSnapshot>, PacerError> {
        let mut conn = self.conn.clone();
        let budgets: Vec<String> = redis::cmd("SMEMBERS").arg(self.keys.pacer_budgets()).query_async(&mut conn).await?;
        let mut out = vec![];
        for budget in budgets {
            let models: Vec<String> =
                redis::cmd("SMEMBERS").arg(self.keys.pacer_models(&budget)).query_async(&mut conn).await?;
            let other = Self { budget: budget.clone(), ..self.clone() };
            for model in models {
                // A model not used for a day has its keys expired (the
                // script's IDLE_TTL_MS): nothing to show. It stays listed, for
                // a process that still takes it as registered.
                let key = self.keys.pacer_state(&budget, &model);
                if !redis::cmd("EXISTS").arg(&key).query_async::<bool>(&mut conn).await? {
                    continue;
                }
                let (state, now) = other.state(&model).await?;
                out.push(BudgetSnapshot::from_state(&budget, &model, &state, now));
            }
        }
        out.sort_by(|a, b| (&a.budget, &a.model).cmp(&(&b.budget, &b.model)));
        Ok(out)
    }
}

/// Reads the script's flat field list into the model's state: the state
/// hash's fields, then each record as `rec:<id>` (see `decode_record`).
fn state_from_fields(flat: &[String]) -> (PacerState, Millis) {
    let mut map: HashMap<&str, f64> = HashMap::new();
    let mut state = PacerState::default();
    for kv in flat.chunks(2) {
        let [k, v] = kv else { continue };
        if let Some(id) = k.strip_prefix("rec:") {
            match decode_record(v) {
                Some(Record::Waiter(w)) => {
                    state.waiters.insert(id.to_owned(), w);
                }
                Some(Record::Flight(f)) => {
                    state.flights.insert(id.to_owned(), f);
                }
                None => tracing::warn!(message = "unreadable pacer record", record.id = %id),
            }
        } else if let Ok(x) = v.parse() {
            map.insert(k.as_str(), x);
        }
    }
    let f = |k: &str| map.get(k).copied().unwrap_or(0.0);
    let bucket = |p: &str| bucket::Bucket {
        limit: f(&format!("{p}limit")),
        rate: f(&format!("{p}rate")),
        level: f(&format!("{p}level")),
        at_ms: f(&format!("{p}at")) as Millis,
        refunded: f(&format!("{p}refunded")),
        full_at_ms: f(&format!("{p}full_at")) as Millis,
        charged_since: f(&format!("{p}charged_since")),
        rated: f(&format!("{p}rated")) > 0.0,
        full_seen_ms: f(&format!("{p}full_seen")) as Millis,
        in_flight: f(&format!("{p}inflight")),
        sent: f(&format!("{p}sent")),
        withheld: f(&format!("{p}withheld")),
        votes: f(&format!("{p}votes")),
        refill: bucket::Refill::from_code(f(&format!("{p}refill"))),
        max_reset_ms: f(&format!("{p}max_reset")),
        obs_at_ms: f(&format!("{p}obs_at")) as Millis,
        obs_missing: f(&format!("{p}obs_missing")),
        obs_reset_ms: f(&format!("{p}obs_reset")),
        boundary_ms: f(&format!("{p}boundary")) as Millis,
        probed_ms: f(&format!("{p}probed")) as Millis,
        unknown_credit: f(&format!("{p}unknown_credit")),
        assumed: f(&format!("{p}assumed")) > 0.0,
    };
    state.tokens = bucket("t_");
    state.requests = bucket("r_");
    state.input = bucket("i_");
    state.output = bucket("o_");
    state.blocked_until_ms = f("blocked_until") as Millis;
    state.probe_until_ms = f("probe_until") as Millis;
    state.headerless = f("headerless") > 0.0;
    state.hl_used = f("hl_used");
    state.hl_since_ms = f("hl_since") as Millis;
    state.hl_cut_ms = f("hl_cut") as Millis;
    state.hl_grow_ms = f("hl_grow") as Millis;
    state.hl_max = f("hl_max");
    state.hl_prev = f("hl_prev");
    state.hl_prev_span = f("hl_prev_span");
    state.observed_at_ms = f("observed_at") as Millis;
    state.last_admit_ms = f("last_admit") as Millis;
    state.usage_ratio = f("usage_ratio");
    state.input_ratio = f("input_ratio");
    state.call_ms = f("call_ms");
    state.refunds = RefundShare {
        given: f("rs_given"),
        unused: f("rs_unused"),
        pairs: f("rs_pairs"),
        at_ms: f("rs_at") as Millis,
        remaining: f("rs_remaining"),
        sent: f("rs_sent"),
        refunded: f("rs_refunded"),
        seen_ms: f("rs_seen") as Millis,
        until_ms: f("rs_until") as Millis,
        full: f("rs_full") > 0.0,
    };
    state.fair_time = f("fair_time");
    state.tenants = map
        .keys()
        .filter_map(|k| k.strip_prefix("tw:"))
        .map(|t| {
            let g = |p: &str| map.get(format!("{p}:{t}").as_str()).copied().unwrap_or(0.0);
            let tenant = Tenant {
                weight: g("tw"),
                finish: g("tf"),
                cap_due_ms: g("tc") as Millis,
                admitted: g("tadm"),
                waits: g("twait"),
            };
            (t.to_owned(), tenant)
        })
        .collect();
    (state, f("now") as Millis)
}

/// A reservation record as the script keeps it.
enum Record {
    Waiter(Waiter),
    Flight(Flight),
}

/// Reads one record of the script (`rec_encode` in `scripts.lua`):
/// `w|order|tokens|requests|output|line|due|clear|since|reason|tenant` or
/// `f|tokens|requests|output|mark|expiry|input|sent|alone|held_input|held_output|omark|rsent|isent|osent`.
fn decode_record(s: &str) -> Option<Record> {
    // A waiter's last field, its tenant, is the rest of the record.
    let fields = if s.starts_with("w|") { 11 } else { 16 };
    let mut parts = s.splitn(fields, '|');
    let kind = parts.next()?;
    let mut num = || parts.next()?.parse::<f64>().ok();
    match kind {
        "w" => {
            let order = num()?;
            let est = Estimate { tokens: num()? as u64, requests: num()? as u64, output: num()? as u64 };
            let (line, due, clear, since, reason) = (num()?, num()?, num()?, num()?, num()?);
            let tenant = parts.next()?.to_owned();
            Some(Record::Waiter(Waiter {
                order,
                est,
                line,
                tenant,
                due_ms: due as Millis,
                clear_ms: clear as Millis,
                since_ms: since as Millis,
                reason: OwedReason::from_code(reason as i64),
            }))
        }
        "f" => {
            let est = Estimate { tokens: num()? as u64, requests: num()? as u64, output: num()? as u64 };
            let (mark, expiry, input, sent, alone) = (num()?, num()?, num()?, num()?, num()?);
            let (held_input, held_output, omark) = (num()?, num()?, num()?);
            let marks = [num()?, num()?, num()?];
            Some(Record::Flight(Flight {
                est,
                input: input as u64,
                mark,
                sent,
                held_input: held_input as u64,
                held_output: held_output as u64,
                omark,
                marks,
                alone: alone > 0.0,
                expiry_ms: expiry as Millis,
            }))
        }
        _ => None,
    }
}
