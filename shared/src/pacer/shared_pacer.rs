//! The shared pacer: one state per budget and model in Redis, changed only
//! by the atomic script of `lua/` ([`super::script`]), which every worker
//! asks before every call. A process's concurrent calls of one budget and
//! model go to the script as one batch (`Batcher`).
//!
//! Every call names a reservation id. A turn keeps the same id while it waits,
//! so when it comes back after its owed time it finds its place in line;
//! `settle` with the same id refunds what the call did not use.

use super::history;
use super::model::{CallOutcome, Decision, Estimate, Mode, PacerState, PacingConfig, Who};
use super::ops::{decision, AcquireOp, Op, SettleOp};
use super::snapshot::{state_from_fields, BudgetSnapshot};
use super::PacerError;
use crate::clock::{Clock, Millis};
use crate::keys::Keys;
use crate::redis_util::RedisConn;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The atomic operations of the shared pacer, one script (see the file's
/// header), with no host: its releases move no queue entry (tests, the API's
/// snapshots).
static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(&super::script::source(super::script::NO_HOST)));

/// The pacer's script as a Lua function, `pacer_call(KEYS, ARGV)`, for a
/// script that runs the pacer's ops itself (the run store's fetch asks it for
/// a turn carrying an ask: `runs/fetch.lua`; its commit for the next turn:
/// `runs/store.lua`; a [`PacerHost`]'s script the batch loop's). The
/// enclosing script defines `PACER_HOST` before it. It answers what the
/// script would, or a table with `err` (`redis.error_reply`). With it,
/// `pacer_batch(keys, cfg, now, ops)`, the one way those scripts call it
/// (`batch.lua`).
pub fn lua_function() -> String {
    format!("local function pacer_call(KEYS, ARGV)\n{}\nend\n{}", super::script::source(""), include_str!("batch.lua"))
}

/// Where the shared pacer's waiting turns are kept, as the script that runs
/// its ops sees it: a script that defines `PACER_HOST` (see
/// [`super::script::source`]) and runs [`lua_function`]'s `pacer_call` with
/// its own keys first (`keys`) and the pacer's four after them. The run
/// store's is `shared::runs::pacer_host` (its queue); with it, a release of
/// the line moves the turn's queue entry in the same script.
#[derive(Debug, Clone)]
pub struct PacerHost {
    /// The script (one per process: its text names no key).
    pub script: &'static redis::Script,
    /// Its own keys, `KEYS[1..n]` (the pacer's are `KEYS[n+1..n+4]`).
    pub keys: Vec<String>,
}

/// The shared pacer: state per (budget, model) in Redis, changed only by the
/// atomic script of `lua/` ([`super::script`]).
#[derive(Clone)]
pub struct SharedPacer {
    conn: RedisConn,
    keys: Keys,
    budget: String,
    config: Arc<PacingConfig>,
    /// `None` in production: the script reads the Redis server's clock.
    test_clock: Option<Arc<dyn Clock>>,
    /// Per budget and model, the queue of this process's calls waiting for
    /// the next batch (see [`Batcher`]).
    batchers: Arc<Mutex<HashMap<(String, String), Batcher>>>,
    /// Where its waiting turns are kept (none: its releases move nothing).
    host: Option<PacerHost>,
}

/// How many calls one batch takes at most.
const MAX_BATCH: usize = 64;

/// A call waiting for its batch: its op and where its answer goes.
struct Pending {
    op: Op,
    reply: tokio::sync::oneshot::Sender<Result<Vec<i64>, PacerError>>,
    /// It may wait up to [`SETTLE_LINGER`] for company ([`SharedPacer::settle_soon`]).
    lazy: bool,
}

/// How long a settle sent with [`SharedPacer::settle_soon`] waits for another
/// call to go with it: the ask for the same run's next turn follows it once
/// the tools answer, and both then cost one script call (one read and one
/// write of the state) instead of two.
const SETTLE_LINGER: std::time::Duration = std::time::Duration::from_millis(20);

/// A model's batch loop ends after this long without a call (a call after it
/// starts another).
const BATCHER_IDLE: std::time::Duration = std::time::Duration::from_secs(600);

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
            loop {
                let first = match tokio::time::timeout(BATCHER_IDLE, rx.recv()).await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    // Idle: the loop ends, so a process holds loops (and the
                    // pacer lists models) only for models in use, whatever
                    // names runs gave. Closed, it takes no more (a sender
                    // starts a new loop); what came meanwhile is answered.
                    Err(_) => {
                        rx.close();
                        match rx.recv().await {
                            Some(p) => p,
                            None => break,
                        }
                    }
                };
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
    /// A shared pacer for `budget`, over a (reconnecting) connection. With no
    /// host to move its waiting turns ([`Self::with_host`]), a turn it owes
    /// time comes back at its estimate and asks again (`PacingConfig::parks`
    /// off): the pacer's own tests, and any client that asks it directly.
    pub fn new(conn: RedisConn, keys: Keys, budget: impl Into<String>, config: PacingConfig) -> Self {
        Self {
            conn,
            keys,
            budget: budget.into(),
            config: Arc::new(PacingConfig { parks: false, ..config }),
            test_clock: None,
            batchers: Arc::default(),
            host: None,
        }
    }

    /// The same pacer, its ops run in `host`'s script: a release of the line
    /// moves the turn where it waits (the worker's pacers: the run store's
    /// queue).
    pub fn with_host(mut self, host: PacerHost) -> Self {
        self.host = Some(host);
        self.config = Arc::new(PacingConfig { parks: true, ..(*self.config).clone() });
        self
    }

    /// The same pacer on an injected clock instead of the Redis server's
    /// (for tests of time-dependent policy; production never calls this).
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
        self
    }

    /// The script's KEYS for `model`, in its order (`lua/state.lua`).
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
            u8::from(c.parks).to_string(),
        ]
    }

    fn invocation(&self, op: &str, model: &str) -> redis::ScriptInvocation<'static> {
        let mut inv = match &self.host {
            Some(host) if op == "batch" => {
                let mut inv = host.script.prepare_invoke();
                for key in &host.keys {
                    inv.key(key);
                }
                inv
            }
            _ => SCRIPT.prepare_invoke(),
        };
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

    /// What a commit that runs this pacer's ops for `model` in its own script
    /// needs (store.rs `CommitPacing`): its four keys and `ARGV[2..15]` with
    /// the clock left to the script (`""` at `ARGV[11]`). Starts the model's
    /// batch loop if none runs yet, which lists the model under its budget
    /// (`GET /v1/pacer`). `None` on an injected test clock.
    pub fn commit_route(&self, model: &str) -> Option<serde_json::Value> {
        if !self.scriptable() {
            return None;
        }
        self.batcher(model);
        Some(serde_json::json!({"keys": self.script_keys(model), "cfg": self.config_args(String::new())}))
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
        for p in batch {
            inv.arg(p.op.argv());
        }
        let mut conn = self.conn.clone();
        Ok(inv.invoke_async(&mut conn).await?)
    }

    /// Runs `ops` for `model` as one batch now, past the batch loop, and
    /// returns the script's answers as it gives them (a `moves` op's among
    /// them): for tests of the line.
    pub async fn run_ops(&self, model: &str, ops: &[Op]) -> Result<redis::Value, PacerError> {
        let mut inv = self.invocation("batch", model);
        for op in ops {
            inv.arg(op.argv());
        }
        let mut conn = self.conn.clone();
        Ok(inv.invoke_async(&mut conn).await?)
    }

    /// Queues `op` for the next batch of `model` and waits for its answer.
    async fn call(&self, model: &str, op: Op) -> Result<Vec<i64>, PacerError> {
        self.enqueue(model, op, false)?.await.map_err(|_| PacerError::Protocol("the batch loop stopped".into()))?
    }

    /// The batch loop of `model`, started when there is none or it ended
    /// (idle for [`BATCHER_IDLE`]; then the loops that ended leave the map too).
    fn batcher(&self, model: &str) -> Batcher {
        let mut map = self.batchers.lock().unwrap_or_else(|e| e.into_inner());
        let key = (self.budget.clone(), model.to_owned());
        if let Some(b) = map.get(&key).filter(|b| !b.tx.is_closed()) {
            return b.clone();
        }
        map.retain(|_, b| !b.tx.is_closed());
        let b = Batcher::start(self.clone(), model.to_owned());
        map.insert(key, b.clone());
        b
    }

    /// Queues `op` for the next batch of `model` now; its answer comes on the receiver.
    fn enqueue(
        &self,
        model: &str,
        op: Op,
        lazy: bool,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<Vec<i64>, PacerError>>, PacerError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let mut pending = Pending { op, reply, lazy };
        for _ in 0..2 {
            match self.batcher(model).tx.send(pending) {
                Ok(()) => return Ok(answer),
                // Its loop is gone (idle, or a runtime that ended): start another.
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

    /// See [`super::Pacer::acquire`].
    pub async fn acquire(
        &self,
        model: &str,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
    ) -> Result<Decision, PacerError> {
        let op = Op::Acquire(AcquireOp::new(id, est, mode, who, self.jitter_u()));
        let reply = self.call(model, op).await?;
        decision(&reply).ok_or_else(|| PacerError::Protocol(format!("{reply:?}")))
    }

    /// See [`super::Pacer::settle`].
    pub async fn settle(&self, model: &str, id: &str, o: &CallOutcome) -> Result<(), PacerError> {
        self.call(model, Self::settle_op(id, o)).await?;
        Ok(())
    }

    /// See [`super::Pacer::settle_soon`]: queued now, sent with the next call of this
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

    /// The settle op of reservation `id` with `o`.
    pub fn settle_op(id: &str, o: &CallOutcome) -> Op {
        Op::Settle(SettleOp { id: id.to_owned(), outcome: *o })
    }

    /// The state of one model of this budget, as the script sees it now
    /// (of a long line, its first waiters: the snapshot counts them all, `BudgetSnapshot::waiting_turns`).
    pub async fn state(&self, model: &str) -> Result<(PacerState, Millis), PacerError> {
        let (state, now, _) = self.state_and_line(model).await?;
        Ok((state, now))
    }

    /// [`Self::state`], and how many turns wait in the line.
    async fn state_and_line(&self, model: &str) -> Result<(PacerState, Millis, u64), PacerError> {
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

    /// See [`super::Pacer::snapshot`]: every budget and model under this prefix.
    pub async fn snapshot(&self) -> Result<Vec<BudgetSnapshot>, PacerError> {
        let mut conn = self.conn.clone();
        let budgets: Vec<String> = redis::cmd("SMEMBERS").arg(self.keys.pacer_budgets()).query_async(&mut conn).await?;
        let mut out = vec![];
        for budget in budgets {
            let models: Vec<String> =
                redis::cmd("SMEMBERS").arg(self.keys.pacer_models(&budget)).query_async(&mut conn).await?;
            let other = Self { budget: budget.clone(), ..self.clone() };
            let mut listed = models.len();
            for model in models {
                // A model not used for a day has its keys expired (the
                // script's IDLE_TTL_MS): nothing to show, and it leaves the
                // list, so the list is of models in use, not of every name
                // ever given. (No batch loop still holds it: a loop ends
                // after BATCHER_IDLE without calls and lists its model
                // again when it starts.)
                let key = self.keys.pacer_state(&budget, &model);
                if !redis::cmd("EXISTS").arg(&key).query_async::<bool>(&mut conn).await? {
                    let _: () = redis::cmd("SREM")
                        .arg(self.keys.pacer_models(&budget))
                        .arg(&model)
                        .query_async(&mut conn)
                        .await?;
                    listed -= 1;
                    continue;
                }
                let (state, now, waiting) = other.state_and_line(&model).await?;
                out.push(BudgetSnapshot::from_state(&budget, &model, &state, now).of_line(waiting));
            }
            if listed == 0 {
                let _: () =
                    redis::cmd("SREM").arg(self.keys.pacer_budgets()).arg(&budget).query_async(&mut conn).await?;
            }
        }
        out.sort_by(|a, b| (&a.budget, &a.model).cmp(&(&b.budget, &b.model)));
        Ok(out)
    }
}
