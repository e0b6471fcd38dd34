//! The run store: a run's record, transcript and event stream in Redis, read
//! and written by the API and the worker through this one module.
//!
//! Every write is one script of `store.lua`, prepended with the queue's Lua
//! library so that a turn's commit and the enqueue of the next turn are one
//! atomic step, fenced by the lease's epoch. Run keys share the queue's hash
//! tag (the prefix), so those scripts keep to one Redis Cluster slot.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::record::{field, ErrorKind, Run, Usage};
use super::spec::RunSpec;
use super::state::{RunStatus, WaitReason};
use super::transcript::TranscriptEntry;
use crate::keys::Keys;
use crate::queue::{FetchScript, Lease, QueueKeys, LUA_LIB};

/// The most events a run's stream keeps (approximately): the script's
/// appends are trimmed to it too (prepended to `store.lua` as `EV_MAXLEN`).
const EVENTS_MAXLEN: u64 = 10_000;

/// The run store's Lua library (runs/lib.lua: a run's helpers and a turn's
/// start), with the stream length it trims to: prepended to the store's
/// script and to its fetch (after the queue's library).
fn runs_lib() -> String {
    format!("local EV_MAXLEN = {EVENTS_MAXLEN}\n{}", include_str!("lib.lua"))
}

static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{LUA_LIB}\n{}\n{}\n{}",
        runs_lib(),
        crate::pacer::lua_function(),
        include_str!("store.lua")
    ))
});

/// The body of the run store's fetch (see [`RunStore::fetch_script`]).
const FETCH_START_LUA: &str = include_str!("fetch.lua");

/// How long an `Idempotency-Key` is remembered.
pub const IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);

/// The most unfinished runs of one tenant that [`RunStore::tenant_counts`] reads.
pub const MAX_ACTIVE_READ: usize = 10_000;

/// A tenant's unfinished runs by where their turn is, as the queue's counts
/// name them (`GET /v1/queue` for a tenant).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantCounts {
    /// Its turn is due now: `queued`, or `waiting` past its due time.
    pub ready: u64,
    /// `waiting` for a later due time.
    pub delayed: u64,
    /// `running`: a worker holds its turn.
    pub in_flight: u64,
    /// The earliest due time of a delayed turn (server clock, ms).
    pub next_due_ms: Option<i64>,
    /// Server time the counts were read at, ms.
    pub now_ms: i64,
    /// It has more than [`MAX_ACTIVE_READ`] unfinished runs: these counts are of the oldest.
    pub truncated: bool,
}

impl TenantCounts {
    /// Counts runs by `(status, next_attempt_ms)` at `now_ms`; finished runs
    /// (a set member read after its run finished) count nowhere.
    pub fn tally(runs: impl IntoIterator<Item = (RunStatus, Option<i64>)>, now_ms: i64, truncated: bool) -> Self {
        let mut c = Self { now_ms, truncated, ..Self::default() };
        for (status, next) in runs {
            match (status, next) {
                (RunStatus::Running, _) => c.in_flight += 1,
                (RunStatus::Waiting, Some(due)) if due > now_ms => {
                    c.delayed += 1;
                    c.next_due_ms = Some(c.next_due_ms.map_or(due, |d| d.min(due)));
                }
                (RunStatus::Queued | RunStatus::Waiting, _) => c.ready += 1,
                _ => {}
            }
        }
        c
    }
}

/// Whether run `run`'s id or one of its metadata values contains `q` (lower case).
fn run_matches(run: &Run, q: &str) -> bool {
    run.id.to_lowercase().contains(q)
        || run.metadata.as_object().into_iter().flat_map(|m| m.values()).any(|v| match v {
            Value::String(s) => s.to_lowercase().contains(q),
            other => other.to_string().to_lowercase().contains(q),
        })
}

/// How long a fenced write keeps retrying Redis trouble in place (see
/// `RunStore::invoke_fenced`); past it the queue's own retry takes over.
pub const FENCED_WRITE_PATIENCE: Duration = Duration::from_secs(30);

/// The version of the run record's format this code writes and reads; a
/// record of a later one (field `format`) is not run by this version's workers.
pub const RECORD_FORMAT: u32 = 1;

/// The version of the queue payload's format ([`TurnJob`], field `v`) this
/// code writes and reads; a later one is buried as undecodable with its
/// reason, never run wrong.
pub const PAYLOAD_FORMAT: u32 = 1;

/// The queue payload of a run's next turn. The queue item's id is the run id:
/// a run has at most one turn queued at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TurnJobWire", into = "TurnJobWire")]
pub struct TurnJob {
    /// The turn's index (= turns completed before it).
    pub turn: u32,
    /// The call's attempt (1-based; raised by 429s and transient errors, not
    /// by budget waits).
    pub attempt: u32,
}

/// [`TurnJob`] as stored, with its format's version (absent: 1, as the
/// retry script writes it).
#[derive(Serialize, Deserialize)]
struct TurnJobWire {
    turn: u32,
    attempt: u32,
    #[serde(default = "first_format")]
    v: u32,
}

fn first_format() -> u32 {
    1
}

impl From<TurnJob> for TurnJobWire {
    fn from(j: TurnJob) -> Self {
        Self { turn: j.turn, attempt: j.attempt, v: PAYLOAD_FORMAT }
    }
}

impl TryFrom<TurnJobWire> for TurnJob {
    type Error = String;
    fn try_from(w: TurnJobWire) -> Result<Self, String> {
        if w.v > PAYLOAD_FORMAT {
            return Err(format!(
                "turn payload format {} is newer than this paceline reads ({PAYLOAD_FORMAT}): run it with a newer worker",
                w.v
            ));
        }
        Ok(Self { turn: w.turn, attempt: w.attempt })
    }
}

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
/// the start (not started, asked by its worker, owed and requeued). The binary
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
/// ([`RunStore::fetch_script_asking`]), as `runs/fetch.lua` reads them.
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
    /// ([`Turn::pause_ms`]) and waits in its worker, as the worker's own ask
    /// would have it — not requeued for a few ms (a round of the queue).
    pub in_place_ms: u64,
    /// Providers whose worker paces nothing (`--pacer off`): a turn of theirs
    /// that carries an ask (a run's first, from its submit) is started as any
    /// turn, there being no ask to make.
    pub unpaced: Vec<String>,
}

/// A turn as the queue carries it: its job and, after a budget wait, the ask
/// it makes again first. (The payload's format stays 1: a worker that does
/// not know `ask` ignores it and starts the turn as before.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// Which turn, which attempt.
    #[serde(flatten)]
    pub job: TurnJob,
    /// The pacer's ask of a turn that waited for budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask: Option<PacedAsk>,
    /// The pacer cleared this turn's call when the turn before it committed
    /// (its reservation, `run:turn:attempt`, is held): it calls without asking.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cleared: bool,
    /// The fetch asked for it and the pacer owed it no longer than the
    /// worker's in-place wait ([`FetchAsks::in_place_ms`]): the worker waits
    /// this long, then asks again, and starts it once clear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
}

/// An `Idempotency-Key` and a fingerprint of the body it came with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    /// The client's key.
    pub key: String,
    /// A hash of the body: the same key with another body is refused.
    pub fingerprint: String,
}

/// A submitted run.
#[derive(Debug, Clone, PartialEq)]
pub struct Created {
    /// The run (the first one, when `replayed`).
    pub run: Run,
    /// The key was seen before with the same body: no new run was made.
    pub replayed: bool,
}

/// One event of a run's stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// The stream id (`1732960000000-0`): the SSE `id`, resumable with `Last-Event-ID`.
    pub id: String,
    /// The event type (`turn.completed`, …).
    pub kind: String,
    /// Its JSON data.
    pub data: Value,
}

impl RunEvent {
    /// The events of an entry of a run's events stream: `type` and `data`,
    /// then `type1`/`data1`, `type2`/`data2`, … when one step wrote several
    /// events at once (`store.lua` `event_entry`: one `XADD`, not one per
    /// event). The entry's last event has the entry's id; those before it the
    /// entry's id and their place, `<entry id>.<k>` (see [`valid_stream_id`]),
    /// so a client that got them all resumes after the entry, and one that
    /// stopped inside it resumes inside it.
    fn from_entry(entry: redis::streams::StreamId) -> Vec<Self> {
        let mut out = vec![];
        for k in 0.. {
            let suffix = if k == 0 { String::new() } else { k.to_string() };
            let Some(kind) = entry.get::<String>(&format!("type{suffix}")) else { break };
            let data: String = entry.get(&format!("data{suffix}")).unwrap_or_default();
            let id = format!("{}.{k}", entry.id);
            out.push(Self { id, kind, data: serde_json::from_str(&data).unwrap_or(Value::Null) });
        }
        if let Some(last) = out.last_mut() {
            last.id = entry.id;
        }
        out
    }
}

/// Why a run store call did not happen.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No such run (for this tenant).
    #[error("no such run")]
    NotFound,
    /// The run's state forbids it (cancelling a finished run).
    #[error("the run is {0}")]
    Conflict(String),
    /// The same `Idempotency-Key` came with another body.
    #[error("this Idempotency-Key was used with another body")]
    IdempotencyMismatch,
    /// Redis did not answer or refused.
    #[error("run store: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis answered something this code does not understand.
    #[error("run store answered {0}")]
    Protocol(String),
}

/// What a fenced worker write found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Written.
    Ok,
    /// Not written, and why. The turn ends here for this worker.
    Stop(StopReason),
}

/// Why a fenced script wrote nothing: its `{'stop', why}` answer, as a type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The turn was delivered again since this lease (`stale`).
    Stale,
    /// Its lease expired and the turn went back to the queue (`not_leased`).
    NotLeased,
    /// No such turn, or its run is gone (`gone`).
    Gone,
    /// This turn was committed already: a redelivery (`committed`).
    Committed,
    /// The run passed its wall-clock deadline and failed (`deadline`).
    Deadline,
    /// The run finished or was cancelled while the turn was out (its status).
    Finished(RunStatus),
    /// A reason this version does not know (a newer script wrote it).
    Other(String),
}

impl StopReason {
    /// Reads a script's reason.
    pub fn parse(why: &str) -> Self {
        match why {
            "stale" => Self::Stale,
            "not_leased" => Self::NotLeased,
            "gone" => Self::Gone,
            "committed" => Self::Committed,
            "deadline" => Self::Deadline,
            other => RunStatus::parse(other).map_or_else(|| Self::Other(other.to_owned()), Self::Finished),
        }
    }

    /// The script's word for it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Stale => "stale",
            Self::NotLeased => "not_leased",
            Self::Gone => "gone",
            Self::Committed => "committed",
            Self::Deadline => "deadline",
            Self::Finished(status) => status.as_str(),
            Self::Other(why) => why,
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What starting a turn found.
// Made once per turn and matched at once: boxing the context would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Started {
    /// The turn runs, with the run as it needs it.
    Run(TurnContext),
    /// It does not (cancelled, finished, already committed, a stale lease, gone): why.
    Stop(StopReason),
}

/// How a committed turn leaves the run.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Enqueue the next turn (due now); it asks the pacer when it starts.
    Continue,
    /// Enqueue the next turn, which asked the pacer at this commit: cleared
    /// (its reservation held: `Turn::cleared`), it is due now; owed, it
    /// waits in the queue for that long, the run `waiting` at once, and asks
    /// again when it comes back (`Turn::ask`). The first wait of a turn then
    /// costs no delivery, start or requeue of its own.
    Paced {
        /// The next turn as the queue carries it.
        turn: Turn,
        /// What it owes, if it is owed.
        wait: Option<BudgetWait>,
    },
    /// The model answered without tool calls: the run is done with this text.
    Complete(String),
    /// The run fails (e.g. `max_turns`).
    Fail {
        /// `error.kind`.
        kind: ErrorKind,
        /// `error.message`.
        message: String,
    },
}

/// A wait a commit puts its next turn in (see [`Next::Paced`]).
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
/// happened), and the next turn's ask (a [`Next::Paced`] turn's, not made
/// yet), made only when the commit lands: cleared, the next turn is queued
/// cleared; owed, it waits from this commit on. One script, one round trip:
/// not a pacer call of the worker's before the commit.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitPacing {
    /// The pacer's keys and knobs: [`crate::pacer::SharedPacer::commit_route`].
    pub route: Value,
    /// The call's settle op ([`crate::pacer::SharedPacer::settle_op`]).
    pub settle: Option<Vec<String>>,
    /// The next turn's acquire op ([`crate::pacer::SharedPacer::acquire_op`]).
    pub ask: Option<Vec<String>>,
}

/// What a commit did: its fence and, when it made the next turn's ask
/// ([`CommitPacing::ask`]), the pacer's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    /// Written, or why not.
    pub fence: Fence,
    /// The pacer's answer to the next turn's ask, if it was made.
    pub asked: Option<crate::pacer::Decision>,
}

/// Where a turn stands when a delivery starts it (the record's `phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The model has not answered this turn yet (no `phase`): call it.
    Model,
    /// The model's output is committed (`tools`); its tool calls still have to
    /// run. A redelivery runs them without calling the model again.
    Tools,
}

impl Phase {
    /// Reads the record's `phase` field.
    pub fn parse(phase: &str) -> Self {
        if phase == "tools" {
            Self::Tools
        } else {
            Self::Model
        }
    }
}

/// A run as a worker needs it to run a turn.
#[derive(Debug, Clone)]
pub struct TurnContext {
    /// Its spec (instructions, tools, endpoint, limits).
    pub spec: RunSpec,
    /// Its tenant.
    pub tenant: String,
    /// The whole transcript.
    pub transcript: Vec<TranscriptEntry>,
    /// Where the current turn stands.
    pub phase: Phase,
}

/// The run store.
#[derive(Clone)]
pub struct RunStore {
    conn: ConnectionManager,
    keys: Keys,
    queue: QueueKeys,
    retention: Duration,
}

impl std::fmt::Debug for RunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunStore").field("keys", &self.keys).field("retention", &self.retention).finish()
    }
}

impl RunStore {
    /// A store over `conn`, under `keys`' prefix; finished runs are kept for `retention`.
    pub fn new(conn: ConnectionManager, keys: Keys, retention: Duration) -> Self {
        let queue = QueueKeys::new(&keys);
        Self { conn, keys, queue, retention }
    }

    /// The connection (for callers that read the queue or the pacer too).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    fn invocation(&self, op: &str, id: &str, tenant: &str, idem: Option<&str>) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.prepare_invoke();
        for k in self.queue.script_keys() {
            inv.key(k);
        }
        inv.key(self.keys.run_record(id))
            .key(self.keys.run_transcript(id))
            .key(self.keys.run_events(id))
            .key(self.keys.tenant_runs(tenant))
            .key(idem.map(|k| self.keys.idempotency(tenant, k)).unwrap_or_else(|| self.keys.idempotency(tenant, "")))
            .arg(op)
            .arg(id);
        inv
    }

    async fn invoke(&self, inv: redis::ScriptInvocation<'static>) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(inv.invoke_async(&mut conn).await?)
    }

    /// A lease holder's fenced write (start, wait, output, commit, fail):
    /// Redis trouble (a dropped connection, a timeout, a server loading or
    /// failing over) is retried in place with backoff, 100 ms doubling to 2 s,
    /// for up to [`FENCED_WRITE_PATIENCE`]. Each is idempotent — a write that
    /// landed before its answer was lost is found done by its fence the second
    /// time (`committed`, `not_leased`) — so a blip never makes the queue run a
    /// paid turn again. A script's own error is not retried.
    async fn invoke_fenced(&self, inv: redis::ScriptInvocation<'static>) -> Result<Vec<String>, StoreError> {
        let deadline = std::time::Instant::now() + FENCED_WRITE_PATIENCE;
        let mut delay = Duration::from_millis(100);
        loop {
            match inv.invoke_async::<Vec<String>>(&mut self.conn.clone()).await {
                Ok(reply) => return Ok(reply),
                Err(error)
                    if crate::redis_util::unavailable(&error) && std::time::Instant::now() + delay < deadline =>
                {
                    tracing::warn!(message = "a fenced write met Redis trouble; retrying it in place", %error,
                        retry_in_ms = delay.as_millis() as u64);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    fn retention_ms(&self) -> u64 {
        self.retention.as_millis() as u64
    }

    /// Writes a new run — record, transcript (its input as turn 0), the
    /// `run.queued` event, the tenant's index — and enqueues its first turn,
    /// in one atomic step, carrying `first_ask` ([`FirstAsk`]) when given. With
    /// an idempotency key seen before, returns the first run instead.
    pub async fn create(
        &self,
        tenant: &str,
        spec: &RunSpec,
        idem: Option<&Idempotency>,
        first_ask: Option<PacedAsk>,
    ) -> Result<Created, StoreError> {
        let id = new_run_id();
        let spec_json = serde_json::to_string(spec).map_err(|e| StoreError::Protocol(e.to_string()))?;
        let mut fields = json!({
            field::STATUS: RunStatus::Queued.as_str(),
            field::MODE: spec.mode.as_str(),
            field::MODEL: spec.model,
            field::SPEC: spec_json,
            field::TURNS: "0",
            field::MAX_TURNS: spec.max_turns.to_string(),
            field::METADATA: spec.metadata.to_string(),
            field::RETENTION_MS: self.retention_ms().to_string(),
            field::FORMAT: RECORD_FORMAT.to_string(),
        });
        if let Some(s) = spec.max_run_seconds {
            fields[field::MAX_RUN_MS] = json!((u64::from(s) * 1_000).to_string());
        }
        // The first turn carries its ask, as every later one does ([`FirstAsk`]).
        let first = Turn { job: TurnJob { turn: 0, attempt: 1 }, ask: first_ask, cleared: false, pause_ms: None };
        let job = serde_json::to_string(&first).unwrap_or_default();
        let mut inv = self.invocation("create", &id, tenant, idem.map(|i| i.key.as_str()));
        inv.arg(tenant)
            .arg(idem.map(|i| i.fingerprint.as_str()).unwrap_or(""))
            .arg(IDEMPOTENCY_TTL.as_millis() as u64)
            .arg(job)
            .arg(fields.to_string())
            .arg(json!({"model": spec.model, "mode": spec.mode, "max_turns": spec.max_turns}).to_string());
        for item in &spec.input {
            inv.arg(serde_json::to_string(&TranscriptEntry { turn: 0, item: item.clone() }).unwrap_or_default());
        }
        let reply = self.invoke(inv).await?;
        let (outcome, run_id) = match reply.as_slice() {
            [o, r, ..] => (o.as_str(), r.clone()),
            other => return Err(StoreError::Protocol(format!("{other:?}"))),
        };
        match outcome {
            // The run as the script wrote it (its fields, the tenant and the
            // server's time): a worker may have started its turn by the time
            // a read came.
            "created" => {
                let now = reply.get(2).cloned().ok_or_else(|| StoreError::Protocol("create: no time".into()))?;
                let mut fields: HashMap<String, String> = fields
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
                    .collect();
                fields.insert(field::TENANT.to_owned(), tenant.to_owned());
                fields.insert(field::CREATED_MS.to_owned(), now.clone());
                fields.insert(field::UPDATED_MS.to_owned(), now);
                let run = tenant_run(tenant, &run_id, &fields).ok_or(StoreError::NotFound)?;
                Ok(Created { run, replayed: false })
            }
            "replayed" => {
                let run = self.get(tenant, &run_id).await?.ok_or(StoreError::NotFound)?;
                Ok(Created { run, replayed: outcome == "replayed" })
            }
            "mismatch" => Err(StoreError::IdempotencyMismatch),
            other => Err(StoreError::Protocol(other.to_owned())),
        }
    }

    async fn fields(&self, id: &str) -> Result<HashMap<String, String>, StoreError> {
        let mut conn = self.conn.clone();
        Ok(redis::cmd("HGETALL").arg(self.keys.run_record(id)).query_async(&mut conn).await?)
    }

    /// One run of `tenant`; another tenant's run is `None`, like an unknown one.
    pub async fn get(&self, tenant: &str, id: &str) -> Result<Option<Run>, StoreError> {
        if !valid_id(id) {
            return Ok(None);
        }
        Ok(tenant_run(tenant, id, &self.fields(id).await?))
    }

    /// A page of `tenant`'s runs, newest first, optionally of one status. The
    /// cursor is `created_ms:id` of the last run of the previous page (see
    /// [`parse_cursor`]; one it cannot read starts from the newest).
    pub async fn list(
        &self,
        tenant: &str,
        status: Option<RunStatus>,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<Run>, Option<String>), StoreError> {
        self.list_matching(tenant, status, None, limit, cursor).await
    }

    /// [`RunStore::list`], keeping only the runs whose id or a metadata value
    /// contains `search` (case-insensitive), scanned in the same bounded batches.
    pub async fn list_matching(
        &self,
        tenant: &str,
        status: Option<RunStatus>,
        search: Option<&str>,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<Run>, Option<String>), StoreError> {
        let search = search.map(str::to_lowercase).filter(|s| !s.is_empty());
        let limit = limit.clamp(1, 200);
        let mut after: Option<(i64, String)> = cursor.and_then(parse_cursor).map(|(ms, id)| (ms, id.to_owned()));
        let mut out = vec![];
        let mut conn = self.conn.clone();
        // Scan the index in batches until the page is full (a status filter may
        // skip many), bounded so that one request cannot scan forever.
        for _ in 0..20 {
            let max = after.as_ref().map(|(ms, _)| ms.to_string()).unwrap_or_else(|| "+inf".into());
            let batch: Vec<(String, i64)> = redis::cmd("ZREVRANGEBYSCORE")
                .arg(self.keys.tenant_runs(tenant))
                .arg(&max)
                .arg("-inf")
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(limit * 2 + 1)
                .query_async(&mut conn)
                .await?;
            // Members of one score come in reverse order of their ids: skip
            // up to and including the cursor.
            let fresh: Vec<(String, i64)> = batch
                .into_iter()
                .filter(|(id, ms)| after.as_ref().is_none_or(|(ams, aid)| *ms < *ams || id < aid))
                .collect();
            if fresh.is_empty() {
                return Ok((out, None));
            }
            // The batch's records in one round trip; the loop below may stop
            // before it has looked at all of them.
            // Only the fields a run shows (`Run::FIELDS`), not its spec.
            let mut pipe = redis::pipe();
            for (id, _) in &fresh {
                pipe.cmd("HMGET").arg(self.keys.run_record(id)).arg(&Run::FIELDS[..]);
            }
            let records: Vec<Vec<Option<String>>> = pipe.query_async(&mut conn).await?;
            for ((id, ms), values) in fresh.into_iter().zip(records) {
                after = Some((ms, id.clone()));
                let gone = values.iter().all(Option::is_none);
                let f: HashMap<String, String> =
                    Run::FIELDS.iter().zip(values).filter_map(|(k, v)| v.map(|v| ((*k).to_owned(), v))).collect();
                match tenant_run(tenant, &id, &f) {
                    Some(run)
                        if status.is_none_or(|s| s == run.status)
                            && search.as_deref().is_none_or(|q| run_matches(&run, q)) =>
                    {
                        out.push(run);
                        if out.len() == limit {
                            return Ok((out, Some(format!("{ms}:{id}"))));
                        }
                    }
                    Some(_) => {}
                    None if gone => {
                        // A retired (expired) run: drop it from the index.
                        let _: () = redis::cmd("ZREM")
                            .arg(self.keys.tenant_runs(tenant))
                            .arg(&id)
                            .query_async(&mut conn)
                            .await?;
                    }
                    // A record this version cannot read (a later format) stays indexed:
                    // it is not shown, and not lost.
                    None => tracing::warn!(message = "unreadable run record left in the index", run.id = %id),
                }
            }
        }
        let next = after.map(|(ms, id)| format!("{ms}:{id}"));
        Ok((out, next))
    }

    /// Where `tenant`'s unfinished runs stand, read from its own runs (the
    /// queue does not know tenants): the server's clock, its unfinished-runs
    /// set, and those records (one pipeline).
    pub async fn tenant_counts(&self, tenant: &str) -> Result<TenantCounts, StoreError> {
        let mut conn = self.conn.clone();
        let ids: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.keys.tenant_active(tenant))
            .arg(0)
            .arg(MAX_ACTIVE_READ as i64 - 1)
            .query_async(&mut conn)
            .await?;
        let now_ms = crate::redis_util::server_time_ms(&mut conn).await?;
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.cmd("HMGET").arg(self.keys.run_record(id)).arg(field::STATUS).arg(field::NEXT_ATTEMPT_MS);
        }
        let records: Vec<(Option<String>, Option<String>)> =
            if ids.is_empty() { vec![] } else { pipe.query_async(&mut conn).await? };
        let statuses = records.into_iter().filter_map(|(status, next)| {
            let status = RunStatus::parse(status.as_deref()?)?;
            Some((status, next.and_then(|n| n.parse::<i64>().ok())))
        });
        Ok(TenantCounts::tally(statuses, now_ms, ids.len() == MAX_ACTIVE_READ))
    }

    /// The tenant of each run in `ids` (`None`: the record is gone).
    pub async fn tenants_of(&self, ids: &[String]) -> Result<Vec<Option<String>>, StoreError> {
        if ids.is_empty() {
            return Ok(vec![]);
        }
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("HGET").arg(self.keys.run_record(id)).arg(field::TENANT);
        }
        let mut conn = self.conn.clone();
        Ok(pipe.query_async(&mut conn).await?)
    }

    /// The transcript as the model was last allowed to read it.
    pub async fn transcript(&self, tenant: &str, id: &str) -> Result<Option<Vec<TranscriptEntry>>, StoreError> {
        if self.get(tenant, id).await?.is_none() {
            return Ok(None);
        }
        Ok(Some(self.read_transcript(id).await?))
    }

    /// A page of a run's transcript: at most `limit` entries from entry
    /// `from` (0: the first), and whether more follow; `None` for an unknown run.
    pub async fn transcript_page(
        &self,
        tenant: &str,
        id: &str,
        from: usize,
        limit: usize,
    ) -> Result<Option<(Vec<TranscriptEntry>, bool)>, StoreError> {
        if self.get(tenant, id).await?.is_none() {
            return Ok(None);
        }
        let limit = limit.max(1);
        let mut conn = self.conn.clone();
        // One entry more than asked for says whether there is a next page.
        let raw: Vec<String> = redis::cmd("LRANGE")
            .arg(self.keys.run_transcript(id))
            .arg(from)
            .arg(from + limit)
            .query_async(&mut conn)
            .await?;
        let more = raw.len() > limit;
        Ok(Some((parse_transcript(&raw[..raw.len().min(limit)])?, more)))
    }

    async fn read_transcript(&self, id: &str) -> Result<Vec<TranscriptEntry>, StoreError> {
        let mut conn = self.conn.clone();
        let raw: Vec<String> =
            redis::cmd("LRANGE").arg(self.keys.run_transcript(id)).arg(0).arg(-1).query_async(&mut conn).await?;
        parse_transcript(&raw)
    }

    /// Cancels an unfinished run: its queued turn is removed, one in flight
    /// stops at its commit; either way the provider is not called again.
    pub async fn cancel(&self, tenant: &str, id: &str) -> Result<Run, StoreError> {
        if !valid_id(id) {
            return Err(StoreError::NotFound);
        }
        let mut inv = self.invocation("cancel", id, tenant, None);
        inv.arg(tenant).arg(self.retention_ms()).arg(self.keys.cancel_channel());
        let reply = self.invoke(inv).await?;
        match reply.first().map(String::as_str) {
            Some("cancelled") => self.get(tenant, id).await?.ok_or(StoreError::NotFound),
            Some("conflict") => Err(StoreError::Conflict(reply.get(1).cloned().unwrap_or_default())),
            Some("not_found") => Err(StoreError::NotFound),
            _ => Err(StoreError::Protocol(format!("{reply:?}"))),
        }
    }

    /// Re-drives a failed run from its last committed turn: queued again
    /// with its next turn enqueued (fresh deliveries), its dead turn out of
    /// the dead set, its error and retention cleared, `run.queued` written —
    /// one atomic step. `tenant` `None` is the operator (any tenant's run).
    /// `Conflict` for a run that is not `failed`, or failed with `max_turns`.
    pub async fn retry(&self, tenant: Option<&str>, id: &str) -> Result<Run, StoreError> {
        if !valid_id(id) {
            return Err(StoreError::NotFound);
        }
        let mut inv = self.invocation("retry", id, tenant.unwrap_or(""), None);
        inv.arg(tenant.unwrap_or(""));
        let reply = self.invoke(inv).await?;
        match reply.first().map(String::as_str) {
            // The run as the retry left it, read in the same script: a worker
            // may have started its turn by the time a second read came.
            Some("queued") => {
                let fields = reply[2..].chunks_exact(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect();
                Run::from_fields(id, &fields).ok_or(StoreError::NotFound)
            }
            Some("conflict") => Err(StoreError::Conflict(reply.get(1).cloned().unwrap_or_default())),
            Some("not_found") => Err(StoreError::NotFound),
            _ => Err(StoreError::Protocol(format!("{reply:?}"))),
        }
    }

    /// Events of a run after `after` (a stream id, see [`valid_stream_id`];
    /// `None`: from the start), at most `count`, waiting up to `block` for new
    /// ones. `None` for an unknown run.
    /// Give a blocking read a connection whose timeout is longer than `block`.
    pub async fn events(
        &self,
        tenant: &str,
        id: &str,
        after: Option<&str>,
        block: Option<Duration>,
        count: usize,
    ) -> Result<Option<Vec<RunEvent>>, StoreError> {
        if self.get(tenant, id).await?.is_none() {
            return Ok(None);
        }
        Ok(Some(self.read_events(id, after, block, count).await?))
    }

    /// [`RunStore::events`] without asking whose run it is, for a caller that
    /// has checked the run already (an event stream checks once, when it
    /// opens, not before every read). A run that is gone, or never was, reads
    /// as no events.
    pub async fn read_events(
        &self,
        id: &str,
        after: Option<&str>,
        block: Option<Duration>,
        count: usize,
    ) -> Result<Vec<RunEvent>, StoreError> {
        let from = [(id.to_owned(), after.unwrap_or("0-0").to_owned())];
        Ok(self.read_many(&from, block, count).await?.into_iter().next().map(|(_, events)| events).unwrap_or_default())
    }

    /// One read over many runs' events: for each `(run id, after)`, the events
    /// after `after` (not a stream id: from the start), at most `count` a run,
    /// waiting up to `block` (if given) until any has one — one `XREAD` for
    /// every stream an API process follows. Runs with nothing new, and ids
    /// that are not run ids, are left out of the answer.
    pub async fn read_many(
        &self,
        from: &[(String, String)],
        block: Option<Duration>,
        count: usize,
    ) -> Result<Vec<(String, Vec<RunEvent>)>, StoreError> {
        let from: Vec<&(String, String)> = from.iter().filter(|(id, _)| valid_id(id)).collect();
        if from.is_empty() {
            return Ok(vec![]);
        }
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT").arg(count.max(1));
        if let Some(b) = block {
            cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
        }
        cmd.arg("STREAMS");
        for (id, _) in &from {
            cmd.arg(self.keys.run_events(id));
        }
        for (_, after) in &from {
            // After an event inside an entry, the read takes that entry again
            // (from the id before it) and its events up to `after` are left out below.
            cmd.arg(EventId::parse(after).map_or_else(|| "0-0".to_owned(), EventId::read_from));
        }
        let mut conn = self.conn.clone();
        let reply: Option<redis::streams::StreamReadReply> = cmd.query_async(&mut conn).await?;
        let by_key: std::collections::HashMap<String, &str> =
            from.iter().map(|(id, _)| (self.keys.run_events(id), id.as_str())).collect();
        let after_of: std::collections::HashMap<&str, Option<EventId>> =
            from.iter().map(|(id, after)| (id.as_str(), EventId::parse(after))).collect();
        let mut out = vec![];
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            let Some(id) = by_key.get(&key.key) else { continue };
            let after = after_of.get(id).copied().flatten();
            let events = key
                .ids
                .into_iter()
                .flat_map(RunEvent::from_entry)
                .filter(|e| after.is_none_or(|a| EventId::parse(&e.id).is_some_and(|e| e > a)))
                .collect();
            out.push(((*id).to_owned(), events));
        }
        Ok(out)
    }

    /// Whether turn `turn` of run `id` already streamed text to its listeners
    /// (a `turn.output_text.delta` of that turn among the run's newest 500
    /// events): a companion turn delivered again must not say it twice.
    pub async fn streamed_text(&self, id: &str, turn: u32) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let reply: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(self.keys.run_events(id))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(500)
            .query_async(&mut conn)
            .await?;
        Ok(reply.ids.into_iter().flat_map(RunEvent::from_entry).any(|e| {
            e.kind == crate::runs::state::event::TURN_OUTPUT_TEXT_DELTA && e.data["turn"].as_u64() == Some(turn as u64)
        }))
    }

    /// Appends an event outside a commit (text deltas).
    pub async fn emit(&self, id: &str, kind: &str, data: &Value) -> Result<(), StoreError> {
        self.emit_all(id, kind, std::slice::from_ref(data)).await
    }

    /// Appends events of one kind outside a commit, in order, as one entry
    /// of the stream (a turn's tool calls announced again; see [`RunEvent`]).
    pub async fn emit_all(&self, id: &str, kind: &str, data: &[Value]) -> Result<(), StoreError> {
        if data.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.keys.run_events(id)).arg("MAXLEN").arg("~").arg(EVENTS_MAXLEN).arg("*");
        for (k, d) in data.iter().enumerate() {
            let suffix = if k == 0 { String::new() } else { k.to_string() };
            cmd.arg(format!("type{suffix}")).arg(kind).arg(format!("data{suffix}")).arg(d.to_string());
        }
        let mut conn = self.conn.clone();
        let _: String = cmd.query_async(&mut conn).await?;
        Ok(())
    }

    /// The run as a worker needs it, from its record's fields and transcript;
    /// `None` when the record is not a run's (it expired).
    fn turn_context(
        id: &str,
        f: HashMap<String, String>,
        transcript: Vec<TranscriptEntry>,
    ) -> Result<Option<TurnContext>, StoreError> {
        if Run::from_fields(id, &f).is_none() {
            return Ok(None);
        }
        let format = f.get(field::FORMAT).and_then(|v| v.parse::<u32>().ok()).unwrap_or(1);
        if format > RECORD_FORMAT {
            // The queue retries, then buries the turn with this reason.
            return Err(StoreError::Protocol(format!(
                "run {id} was written in record format {format}, newer than this paceline reads ({RECORD_FORMAT})"
            )));
        }
        let spec: RunSpec = match f.get(field::SPEC).map(|s| serde_json::from_str(s)) {
            Some(Ok(spec)) => spec,
            _ => return Err(StoreError::Protocol(format!("run {id} has no readable spec"))),
        };
        Ok(Some(TurnContext {
            spec,
            tenant: f.get(field::TENANT).cloned().unwrap_or_default(),
            transcript,
            phase: Phase::parse(f.get(field::PHASE).map_or("", String::as_str)),
        }))
    }

    fn fence(reply: &[String]) -> Result<Fence, StoreError> {
        match reply.first().map(String::as_str) {
            Some("stop") => Ok(Fence::Stop(StopReason::parse(reply.get(1).map_or("", String::as_str)))),
            Some(_) => Ok(Fence::Ok),
            None => Err(StoreError::Protocol("empty reply".into())),
        }
    }

    /// Marks the run running for `lease`'s turn (and says so in the stream)
    /// and reads what the turn needs — record and transcript — in the same
    /// step (one round trip per delivery).
    pub async fn start_turn(&self, lease: &Lease, job: TurnJob) -> Result<Started, StoreError> {
        self.start_turn_with_history(lease, job, 0).await
    }

    /// [`RunStore::start_turn`], reading only the transcript entries a context
    /// of `max_history` turns needs (0: all): turn 0's and every turn from the
    /// one before the window on, which `worker::context::prepare_context`
    /// bounds to what it would make of the whole transcript. A long run's
    /// turn no longer copies its whole transcript through Lua (O(n²) over the run).
    pub async fn start_turn_with_history(
        &self,
        lease: &Lease,
        job: TurnJob,
        max_history: usize,
    ) -> Result<Started, StoreError> {
        let mut inv = self.invocation("start", &lease.id, "", None);
        inv.arg(lease.epoch).arg(job.turn).arg(job.attempt).arg(max_history);
        let reply = self.invoke_fenced(inv).await?;
        Self::started_from(&lease.id, &reply)
    }

    /// The fetch a worker leases its turns with: each turn it leases is
    /// started in the same script ([`RunStore::started`] reads what the
    /// delivery carries), with the transcript a context of `max_history`
    /// turns needs — one script per batch of turns, not one fetch and a start
    /// each. A turn back from a budget wait (its payload carries the ask) is
    /// leased only: it asks the pacer before it starts.
    pub fn fetch_script(&self, max_history: usize) -> FetchScript {
        self.fetch_script_asking(max_history, None)
    }

    /// [`fetch_script`](Self::fetch_script) that also asks the pacers of
    /// `asks` for each turn back from a budget wait before it leases it: one
    /// cleared is leased and started as a cleared turn ([`Turn::cleared`]);
    /// one still owed waits again in the queue (the run's wait fields and
    /// counter, a `turn.paced` event) without reaching a worker — a wait
    /// costs one pacer call in the fetch, not a delivery, an ask and a
    /// requeue (`runs/fetch.lua`).
    pub fn fetch_script_asking(&self, max_history: usize, asks: Option<&FetchAsks>) -> FetchScript {
        let libs = format!("{}\n{}", runs_lib(), crate::pacer::lua_function());
        let asks = asks.map(|a| serde_json::to_string(a).unwrap_or_default()).unwrap_or_default();
        FetchScript::new(&libs, FETCH_START_LUA, vec![max_history.to_string(), PAYLOAD_FORMAT.to_string(), asks])
    }

    /// The start a fetch made of `lease`'s turn ([`RunStore::fetch_script`]),
    /// if it made one.
    pub fn started(&self, lease: &Lease) -> Option<Result<Started, StoreError>> {
        lease.extra().map(|reply| Self::started_from(&lease.id, reply))
    }

    /// Reads a start's reply: `{'stop', why}` or `{'ok', n, n transcript
    /// entries, the record's field/value pairs}`.
    fn started_from(id: &str, reply: &[String]) -> Result<Started, StoreError> {
        if let Fence::Stop(why) = Self::fence(reply)? {
            return Ok(Started::Stop(why));
        }
        let bad = || StoreError::Protocol("start: malformed reply".into());
        let n: usize = reply.get(1).and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        let transcript = parse_transcript(reply.get(2..2 + n).ok_or_else(bad)?)?;
        let fields = reply[2 + n..].chunks_exact(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect();
        Ok(match Self::turn_context(id, fields, transcript)? {
            Some(ctx) => Started::Run(ctx),
            None => Started::Stop(StopReason::Gone),
        })
    }

    /// [`start_turn`](Self::start_turn), for the fence alone.
    pub async fn start(&self, lease: &Lease, job: TurnJob) -> Result<Fence, StoreError> {
        Ok(match self.start_turn(lease, job).await? {
            Started::Run(_) => Fence::Ok,
            Started::Stop(why) => Fence::Stop(why),
        })
    }

    /// Requeues the turn for `delay_ms` (budget, 429, retry): the run shows
    /// `waiting` with the reason and due time; `next` is the job that comes back.
    // Each argument is one part of the wait's record and event; a struct for
    // them would be built at its one call site and taken apart here.
    #[allow(clippy::too_many_arguments)]
    pub async fn wait(
        &self,
        lease: &Lease,
        job: TurnJob,
        next: TurnJob,
        delay_ms: u64,
        reason: WaitReason,
        event_kind: &str,
        event_data: &Value,
    ) -> Result<Fence, StoreError> {
        self.wait_asking(
            lease,
            job,
            Turn { job: next, ask: None, cleared: false, pause_ms: None },
            delay_ms,
            reason,
            event_kind,
            event_data,
        )
        .await
    }

    /// [`wait`](Self::wait) for `next`, which carries the pacer's ask to make
    /// again before the turn starts (a budget wait).
    #[allow(clippy::too_many_arguments)]
    pub async fn wait_asking(
        &self,
        lease: &Lease,
        job: TurnJob,
        next: Turn,
        delay_ms: u64,
        reason: WaitReason,
        event_kind: &str,
        event_data: &Value,
    ) -> Result<Fence, StoreError> {
        let counter = wait_counter(reason);
        let reason = serde_json::to_value(reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        let mut inv = self.invocation("wait", &lease.id, "", None);
        inv.arg(lease.epoch)
            .arg(job.turn)
            .arg(serde_json::to_string(&next).unwrap_or_default())
            .arg(delay_ms)
            .arg(reason)
            .arg(counter)
            .arg(event_kind)
            .arg(event_data.to_string());
        Self::fence(&self.invoke_fenced(inv).await?)
    }

    /// Commits the model's output of a turn whose tool calls are still to run,
    /// so that a crash while they run does not call the model again.
    pub async fn record_output(
        &self,
        lease: &Lease,
        job: TurnJob,
        items: &[Value],
        usage: Usage,
    ) -> Result<Fence, StoreError> {
        self.record_output_with_events(lease, job, items, usage, &[]).await
    }

    /// [`record_output`](Self::record_output), writing `events` (type, data)
    /// in the same fenced script: the tool calls it announces reach the
    /// stream once, and only from the holder whose output was recorded.
    pub async fn record_output_with_events(
        &self,
        lease: &Lease,
        job: TurnJob,
        items: &[Value],
        usage: Usage,
        events: &[(&str, Value)],
    ) -> Result<Fence, StoreError> {
        let mut inv = self.invocation("output", &lease.id, "", None);
        inv.arg(lease.epoch).arg(job.turn).arg(usage_arg(usage));
        event_args(&mut inv, events);
        for item in items {
            inv.arg(
                serde_json::to_string(&TranscriptEntry { turn: job.turn + 1, item: item.clone() }).unwrap_or_default(),
            );
        }
        Self::fence(&self.invoke_fenced(inv).await?)
    }

    /// Commits a turn: its items appended to the transcript, usage added, and
    /// the next turn enqueued or the run finished — atomically, fenced.
    pub async fn commit(
        &self,
        lease: &Lease,
        job: TurnJob,
        items: &[Value],
        usage: Usage,
        next: &Next,
    ) -> Result<Fence, StoreError> {
        self.commit_with_events(lease, job, items, usage, next, &[]).await
    }

    /// [`commit`](Self::commit), writing `events` (type, data) before its
    /// `turn.completed` in the same fenced script (the tool results: written
    /// once, with the commit, or not at all).
    pub async fn commit_with_events(
        &self,
        lease: &Lease,
        job: TurnJob,
        items: &[Value],
        usage: Usage,
        next: &Next,
        events: &[(&str, Value)],
    ) -> Result<Fence, StoreError> {
        Ok(self.commit_with_output(lease, job, None, items, usage, next, events, None).await?.fence)
    }

    /// [`commit_with_events`](Self::commit_with_events), committing the
    /// model's `output` too when its own step ([`record_output_with_events`](Self::record_output_with_events))
    /// has not (a turn whose tools answered at once: one script, not two). When
    /// it has — the tools were slow, or it landed just before its answer was
    /// given up on — the script finds the turn in its tools phase and writes
    /// the output's items, events and usage once, not twice. `pacing`: the
    /// pacer ops the same script makes ([`CommitPacing`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn commit_with_output(
        &self,
        lease: &Lease,
        job: TurnJob,
        output: Option<&ModelOutput<'_>>,
        items: &[Value],
        usage: Usage,
        next: &Next,
        events: &[(&str, Value)],
        pacing: Option<&CommitPacing>,
    ) -> Result<Committed, StoreError> {
        let (kind, a, b) = match next {
            Next::Continue => {
                let job = TurnJob { turn: job.turn + 1, attempt: 1 };
                ("continue", serde_json::to_string(&job).unwrap_or_default(), String::new())
            }
            Next::Paced { turn, .. } => ("continue", serde_json::to_string(turn).unwrap_or_default(), String::new()),
            Next::Complete(text) => ("complete", text.clone(), String::new()),
            Next::Fail { kind, message } => ("fail", kind.as_str().to_owned(), message.clone()),
        };
        let usage = Usage { total_tokens: usage.input_tokens + usage.output_tokens, ..usage };
        let data = json!({"turn": job.turn, "usage": usage});
        // The next turn, due now, wakes no other worker when this one's process fetches after it.
        let due_now = match next {
            Next::Continue => true,
            Next::Paced { wait, .. } => wait.is_none(),
            _ => false,
        };
        let quiet = due_now && lease.refetches();
        let wait = match next {
            Next::Paced { wait: Some(w), .. } => Some(w),
            _ => None,
        };
        let mut inv = self.invocation("commit", &lease.id, "", None);
        inv.arg(lease.epoch)
            .arg(job.turn)
            .arg(usage_arg(usage))
            .arg(kind)
            .arg(a)
            .arg(b)
            .arg(data.to_string())
            .arg(self.retention_ms())
            .arg(output.map(|o| usage_arg(o.usage)).unwrap_or_default())
            .arg(output.map_or(0, |o| o.events.len()))
            .arg(output.map_or(0, |o| o.items.len()))
            .arg(if quiet { "1" } else { "0" })
            .arg(wait.map_or(0, |w| w.ms))
            .arg(wait.map_or("", |w| w.reason.as_str()))
            .arg(wait.map_or("", |w| wait_counter(w.reason)))
            .arg(wait.map_or_else(String::new, |w| w.data.to_string()));
        inv.arg(
            // (Absent ops are left out: cjson reads a null as a value.)
            pacing.map_or_else(String::new, |p| {
                let mut o = p.route.clone();
                if let Some(settle) = &p.settle {
                    o["settle"] = json!(settle);
                }
                if let Some(ask) = &p.ask {
                    o["ask"] = json!(ask);
                }
                o.to_string()
            }),
        );
        let no_events: &[(&str, Value)] = &[];
        let output_events = output.map_or(no_events, |o| o.events);
        inv.arg(output_events.len() + events.len());
        for (kind, data) in output_events.iter().chain(events) {
            inv.arg(*kind).arg(data.to_string());
        }
        let output_items = output.map_or(&[][..], |o| o.items);
        for item in output_items.iter().chain(items) {
            inv.arg(
                serde_json::to_string(&TranscriptEntry { turn: job.turn + 1, item: item.clone() }).unwrap_or_default(),
            );
        }
        let reply = self.invoke_fenced(inv).await;
        // {'continued', turns, code, ms, reason}: the ask's answer, when it was made.
        let asked = reply.as_ref().ok().and_then(|r| match r.get(2..5) {
            Some([code, _, _]) if code == "0" => Some(crate::pacer::Decision::Clear),
            Some([code, ms, reason]) if code == "1" => Some(crate::pacer::Decision::Owed {
                ms: ms.parse().unwrap_or(0),
                reason: crate::pacer::OwedReason::from_code(reason.parse().unwrap_or(1)),
            }),
            _ => None,
        });
        // Whatever the answer (the turn may be queued), unless it waits.
        if quiet && !matches!(asked, Some(crate::pacer::Decision::Owed { .. })) {
            lease.kick();
        }
        Ok(Committed { fence: Self::fence(&reply?)?, asked })
    }

    /// Fails the run (fenced): `error.kind` and message; usage of a call that
    /// was answered is still counted.
    pub async fn fail(
        &self,
        lease: &Lease,
        job: TurnJob,
        kind: ErrorKind,
        message: &str,
        usage: Usage,
    ) -> Result<Fence, StoreError> {
        let mut inv = self.invocation("fail", &lease.id, "", None);
        inv.arg(lease.epoch)
            .arg(job.turn)
            .arg(kind.as_str())
            .arg(message)
            .arg(self.retention_ms())
            .arg(usage_arg(usage));
        Self::fence(&self.invoke_fenced(inv).await?)
    }
}

/// A model's output with tool calls to run: its items, its call's usage and
/// the events that announce its tool calls (see [`RunStore::commit_with_output`]).
#[derive(Debug, Clone, Copy)]
pub struct ModelOutput<'a> {
    /// The output items (function calls, messages, reasoning).
    pub items: &'a [Value],
    /// What the call used.
    pub usage: Usage,
    /// The `turn.tool_call` events (type, data).
    pub events: &'a [(&'a str, Value)],
}

/// The run record's counter a wait for `reason` adds one to.
fn wait_counter(reason: WaitReason) -> &'static str {
    match reason {
        WaitReason::Budget | WaitReason::FairShare => field::BUDGET_WAITS,
        WaitReason::RateLimited => field::RATE_LIMITED,
        WaitReason::Retry => field::RETRIES,
    }
}

/// A step's events as its script reads them: how many, then each type and data.
fn event_args(inv: &mut redis::ScriptInvocation<'static>, events: &[(&str, Value)]) {
    inv.arg(events.len());
    for (kind, data) in events {
        inv.arg(*kind).arg(data.to_string());
    }
}

/// A call's usage as the store script's argument: a JSON object named as the
/// record's counters (`store.lua` `add_usage`).
fn usage_arg(usage: Usage) -> String {
    serde_json::to_string(&usage).unwrap_or_else(|_| "{}".into())
}

/// The run of record fields `f` (of run `id`) if it belongs to `tenant`;
/// `None` for another tenant's run, a missing record or a bad id.
fn tenant_run(tenant: &str, id: &str, f: &HashMap<String, String>) -> Option<Run> {
    if !valid_id(id) || f.get(field::TENANT).map(String::as_str) != Some(tenant) {
        return None;
    }
    Run::from_fields(id, f)
}

/// A new run id: `run_` + a ULID, monotonic within this process so that runs
/// created in the same millisecond still list newest first.
pub fn new_run_id() -> String {
    static GENERATOR: std::sync::Mutex<Option<ulid::Generator>> = std::sync::Mutex::new(None);
    let mut g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let id = g.get_or_insert_with(ulid::Generator::new).generate().unwrap_or_else(|_| ulid::Ulid::new());
    format!("run_{id}")
}

/// Run ids are `run_` + a ULID; anything else is unknown without asking Redis.
pub fn valid_id(id: &str) -> bool {
    id.len() == 30 && id.starts_with("run_") && id[4..].chars().all(|c| c.is_ascii_alphanumeric())
}

/// Reads a list cursor, `created_ms:run_id` (what [`RunStore::list`] hands
/// back): `None` unless the milliseconds are 1 to 20 digits and the id is a
/// run id. Milliseconds past `i64::MAX` (never handed out) read as the
/// largest, which lists from the newest run like no cursor.
pub fn parse_cursor(cursor: &str) -> Option<(i64, &str)> {
    let (ms, id) = cursor.split_once(':')?;
    if !(1..=20).contains(&ms.len()) || !ms.bytes().all(|b| b.is_ascii_digit()) || !valid_id(id) {
        return None;
    }
    Some((ms.parse().unwrap_or(i64::MAX), id))
}

/// Event ids are the stream's ids: `1732960000000-0`, or the milliseconds
/// alone (`1732960000000`), and for an event that is not the last of its
/// entry, the entry's id and its place in it: `1732960000000-0.1` (see
/// [`RunEvent`]). [`RunStore::events`] reads from the start after anything
/// else; the API refuses it.
pub fn valid_stream_id(id: &str) -> bool {
    EventId::parse(id).is_some()
}

/// Whether event id `a` comes after `b` in their stream (compared as numbers:
/// the entry's milliseconds and sequence, then the place in the entry, the
/// entry's own id last). An id that is not one comes before every other.
pub fn stream_id_after(a: &str, b: &str) -> bool {
    EventId::parse(a) > EventId::parse(b)
}

/// An event id as numbers: its entry's `ms-seq`, and its place in the entry
/// (`u64::MAX` for the entry's own id: its last event).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct EventId {
    ms: u64,
    seq: u64,
    place: u64,
}

impl EventId {
    fn parse(id: &str) -> Option<Self> {
        fn number(s: &str) -> Option<u64> {
            ((1..=20).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok())?
        }
        let (entry, place) = match id.split_once('.') {
            Some((entry, place)) => (entry, number(place)?.min(u64::MAX - 1)),
            None => (id, u64::MAX),
        };
        let (ms, seq) = entry.split_once('-').unwrap_or((entry, "0"));
        Some(Self { ms: number(ms)?, seq: number(seq)?, place })
    }

    /// The id an `XREAD` reads after to get the events after this one: its
    /// entry's own for its last event, else the one before its entry (the
    /// entry is read again).
    fn read_from(self) -> String {
        match (self.place, self.seq, self.ms) {
            (u64::MAX, seq, ms) => format!("{ms}-{seq}"),
            (_, 0, 0) => "0-0".to_owned(),
            (_, 0, ms) => format!("{}-{}", ms - 1, u64::MAX),
            (_, seq, ms) => format!("{ms}-{}", seq - 1),
        }
    }
}

/// Transcript entries as stored (JSON).
fn parse_transcript(raw: &[String]) -> Result<Vec<TranscriptEntry>, StoreError> {
    raw.iter()
        .map(|s| serde_json::from_str(s).map_err(|e| StoreError::Protocol(format!("transcript entry: {e}"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_job_has_the_shape_the_retry_script_writes() {
        // store.lua `retry` writes '{"turn":%d,"attempt":1}'.
        let job: TurnJob = serde_json::from_str(r#"{"turn":7,"attempt":1}"#).unwrap();
        assert_eq!(job, TurnJob { turn: 7, attempt: 1 });
        // Written with its format's version; a later version is refused, by name.
        assert_eq!(serde_json::to_string(&job).unwrap(), r#"{"turn":7,"attempt":1,"v":1}"#);
        let newer = serde_json::from_str::<TurnJob>(r#"{"turn":7,"attempt":1,"v":2}"#).unwrap_err();
        assert!(newer.to_string().contains("payload format 2"), "{newer}");
    }

    #[test]
    fn a_tenants_runs_are_counted_where_their_turn_is() {
        use RunStatus::*;
        let runs = [
            (Queued, None),
            (Waiting, Some(900)),
            (Waiting, Some(1500)),
            (Waiting, Some(1200)),
            (Running, None),
            (Completed, None),
            (Failed, None),
        ];
        let c = TenantCounts::tally(runs, 1000, false);
        assert_eq!((c.ready, c.delayed, c.in_flight, c.next_due_ms), (2, 2, 1, Some(1200)));
        assert_eq!(TenantCounts::tally([], 5, true), TenantCounts { now_ms: 5, truncated: true, ..Default::default() });
    }

    #[test]
    fn stream_ids_are_checked() {
        for ok in ["1732960000000-0", "1-1", "1732960000000", "1732960000000-0.0", "1-1.12"] {
            assert!(valid_stream_id(ok), "{ok}");
        }
        for bad in
            ["", "-1", "1-", "abc", "1-2-3", "1 -2", "99999999999999999999999-0", "1-0.", "1-0.x", ".1", "1-0.1.2"]
        {
            assert!(!valid_stream_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_events_of_one_entry_come_in_order_and_before_the_next_entry() {
        // An entry of three events: 10-1.0, 10-1.1, then 10-1 itself.
        let order = ["9-5", "10-0", "10-1.0", "10-1.1", "10-1", "10-2.0", "10-2", "11-0"];
        for w in order.windows(2) {
            assert!(stream_id_after(w[1], w[0]) && !stream_id_after(w[0], w[1]), "{} then {}", w[0], w[1]);
        }
        assert!(!stream_id_after("10-1", "10-1"));
        // A read after an entry's last event starts after the entry; after one
        // inside it, before the entry (whose earlier events are then left out).
        let from = |id: &str| EventId::parse(id).unwrap().read_from();
        assert_eq!(from("10-1"), "10-1");
        assert_eq!(from("10-1.0"), "10-0");
        assert_eq!(from("10-0.3"), format!("9-{}", u64::MAX));
        assert_eq!(from("0-0.1"), "0-0");
        assert_eq!(from("1732960000000"), "1732960000000-0");
    }

    #[test]
    fn cursors_are_parsed() {
        let id = "run_01JDXXXXXXXXXXXXXXXXXXXXXX";
        assert_eq!(parse_cursor(&format!("1732960000000:{id}")), Some((1_732_960_000_000, id)));
        assert_eq!(parse_cursor(&format!("99999999999999999999:{id}")), Some((i64::MAX, id)));
        for bad in
            ["", "1", "1:run_", "1:../../etc", "-1:run_01JDXXXXXXXXXXXXXXXXXXXXXX", "+1:run_01JDXXXXXXXXXXXXXXXXXXXXXX"]
        {
            assert_eq!(parse_cursor(bad), None, "{bad}");
        }
    }
}
