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

use crate::redis_util::RedisConn;
use serde_json::{json, Value};

use super::events::{EventId, RunEvent};
use super::pacing::{CommitPacing, FetchAsks, PacedAsk};
use super::record::{field, ErrorKind, Run, Usage};
use super::spec::RunSpec;
use super::state::{RunStatus, WaitReason};
use super::transcript::TranscriptEntry;
use super::turn::{
    Committed, Fence, ModelOutput, Next, Phase, Started, StopReason, Turn, TurnContext, TurnJob, PAYLOAD_FORMAT,
    RECORD_FORMAT,
};
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

/// What a run needs when the queue's own scripts end its turn's lease or
/// bury the turn (`hooks.lua`: the queue library's `Q_HOOKS`). Every queue
/// that carries runs' turns runs with them ([`run_queue`]); the run store's
/// scripts start with them too.
pub const QUEUE_HOOKS: &str = include_str!("hooks.lua");

/// The turn queue of runs: its scripts end a run whose turn they bury, and a
/// lease's fence on the run's record when they end it ([`QUEUE_HOOKS`]).
pub fn run_queue(
    redis: &crate::config::RedisArgs,
    config: crate::queue::QueueConfig,
) -> Result<crate::queue::TurnQueue, crate::queue::QueueError> {
    Ok(crate::queue::TurnQueue::new(redis, config)?.with_hooks(QUEUE_HOOKS))
}

/// The run store's queue as the shared pacer's host (`pacer_host.lua`): a
/// release of a budget's line makes the turn's queue entry due now, cleared,
/// and the head's timer moves its entry, in the same script as the pacer's op.
const PACER_HOST_LUA: &str = include_str!("pacer_host.lua");

static PACER_HOST_SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| {
    let n = crate::queue::QueueKeys::COUNT;
    redis::Script::new(&format!(
        "{LUA_LIB}\n{QUEUE_HOOKS}\n{PACER_HOST_LUA}\n{}\nreturn pacer_call({{KEYS[{}], KEYS[{}], KEYS[{}], KEYS[{}]}}, ARGV)",
        crate::pacer::lua_function(),
        n + 1,
        n + 2,
        n + 3,
        n + 4
    ))
});

/// The shared pacer's host for a run store under `keys`' prefix: its queue
/// ([`crate::pacer::SharedPacer::with_host`]; every worker's pacer has it).
pub fn pacer_host(keys: &Keys) -> crate::pacer::PacerHost {
    crate::pacer::PacerHost {
        script: &PACER_HOST_SCRIPT,
        keys: QueueKeys::new(keys).script_keys().iter().map(|k| (*k).to_owned()).collect(),
    }
}

static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(&format!(
        "{LUA_LIB}\n{QUEUE_HOOKS}\n{PACER_HOST_LUA}\n{}\n{}\n{}",
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

/// The most bytes of run records one page of `GET /v1/runs` reads (a search
/// reads each run's metadata and answer); past it the page ends early, with a
/// cursor to go on from.
pub const LIST_SCAN_BYTES: usize = 4 << 20;

/// Records a search reads a round trip: small, since the byte bound is
/// checked between round trips (a run's answer may be long).
const LIST_SEARCH_BATCH: usize = 16;

/// How long a fenced write keeps retrying Redis trouble in place (see
/// `RunStore::invoke_fenced`); past it the queue's own retry takes over.
pub const FENCED_WRITE_PATIENCE: Duration = Duration::from_secs(30);

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
    /// A submit over one of its tenant's quotas ([`super::Quotas`]); nothing was written.
    #[error(transparent)]
    Quota(#[from] super::QuotaExceeded),
}

/// The most times one run may be retried (`POST /v1/runs/{id}/retry`): a run
/// whose turn kills its worker must not be re-driven without end into
/// workers other tenants' turns share.
pub const MAX_RETRIES: u32 = 10;

/// The run store.
#[derive(Clone)]
pub struct RunStore {
    conn: RedisConn,
    keys: Keys,
    queue: QueueKeys,
    retention: Duration,
    quotas: std::sync::Arc<super::Quotas>,
}

impl std::fmt::Debug for RunStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunStore").field("keys", &self.keys).field("retention", &self.retention).finish()
    }
}

impl RunStore {
    /// A store over `conn`, under `keys`' prefix; finished runs are kept for `retention`.
    pub fn new(conn: RedisConn, keys: Keys, retention: Duration) -> Self {
        let queue = QueueKeys::new(&keys);
        Self { conn, keys, queue, retention, quotas: Default::default() }
    }

    /// This store with `quotas` on submits (the SPEC's defaults otherwise).
    pub fn with_quotas(mut self, quotas: super::Quotas) -> Self {
        self.quotas = std::sync::Arc::new(quotas);
        self
    }

    /// The connection (for callers that read the queue or the pacer too).
    pub fn connection(&self) -> RedisConn {
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
    /// in one atomic step, carrying `first_ask` ([`super::FirstAsk`]) when given. With
    /// an idempotency key seen before, returns the first run instead.
    pub async fn create(
        &self,
        tenant: &str,
        spec: &RunSpec,
        idem: Option<&Idempotency>,
        first_ask: Option<PacedAsk>,
    ) -> Result<Created, StoreError> {
        self.create_in_trace(tenant, spec, idem, first_ask, None).await
    }

    /// [`RunStore::create`] with the run's spans joining the trace of
    /// `traceparent` (a W3C `traceparent`, the submitter's: its turns are
    /// children of the submitter's span); `None`, or one that does not
    /// read, starts a trace of the run's own.
    pub async fn create_in_trace(
        &self,
        tenant: &str,
        spec: &RunSpec,
        idem: Option<&Idempotency>,
        first_ask: Option<PacedAsk>,
        traceparent: Option<&str>,
    ) -> Result<Created, StoreError> {
        let id = new_run_id();
        let spec_json = serde_json::to_string(spec).map_err(|e| StoreError::Protocol(e.to_string()))?;
        // The oldest format that holds the run: a worker that knows no MCP servers
        // must not run one that has them (it would offer the model none of their tools).
        let format = if spec.mcp_servers.is_empty() { 1 } else { RECORD_FORMAT };
        let mut fields = json!({
            field::STATUS: RunStatus::Queued.as_str(),
            field::MODE: spec.mode.as_str(),
            field::MODEL: spec.model,
            field::SPEC: spec_json,
            field::TURNS: "0",
            field::MAX_TURNS: spec.max_turns.to_string(),
            field::METADATA: spec.metadata.to_string(),
            field::RETENTION_MS: self.retention_ms().to_string(),
            field::FORMAT: format.to_string(),
        });
        if let Some(url) = &spec.webhook_url {
            fields[field::WEBHOOK_URL] = json!(url);
        }
        fields[field::TRACE] = match traceparent.filter(|t| super::record::trace_id_of(t).is_some()) {
            Some(joined) => json!(joined),
            None => json!(super::record::new_traceparent()),
        };
        if let Some(s) = spec.max_run_seconds {
            fields[field::MAX_RUN_MS] = json!((u64::from(s) * 1_000).to_string());
        }
        // The first turn carries its ask, as every later one does ([`super::FirstAsk`]).
        let first = Turn {
            job: TurnJob { turn: 0, attempt: 1 },
            ask: first_ask,
            cleared: false,
            pause_ms: None,
            cached_until_ms: None,
        };
        let job = serde_json::to_string(&first).unwrap_or_default();
        let mut inv = self.invocation("create", &id, tenant, idem.map(|i| i.key.as_str()));
        inv.arg(tenant)
            .arg(idem.map(|i| i.fingerprint.as_str()).unwrap_or(""))
            .arg(IDEMPOTENCY_TTL.as_millis() as u64)
            .arg(job)
            .arg(fields.to_string())
            .arg(json!({"model": spec.model, "mode": spec.mode, "max_turns": spec.max_turns}).to_string());
        let quota = self.quotas.of(tenant);
        inv.arg(quota.max_active_runs).arg(quota.submits_per_min);
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
            "quota" => Err(StoreError::Quota(super::QuotaExceeded {
                message: run_id,
                retry_after_ms: reply.get(2).and_then(|ms| ms.parse().ok()).unwrap_or(1_000),
            })),
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
        let mut read = 0;
        // Scan the index in batches until the page is full (a status filter may
        // skip many), bounded so that one request cannot scan forever: 20
        // batches, and LIST_SCAN_BYTES of records (a search reads each run's
        // metadata and answer); past either the page ends with a cursor.
        for _ in 0..20 {
            if read >= LIST_SCAN_BYTES {
                break;
            }
            let max = after.as_ref().map(|(ms, _)| ms.to_string()).unwrap_or_else(|| "+inf".into());
            let batch: Vec<(String, i64)> = redis::cmd("ZREVRANGEBYSCORE")
                .arg(self.keys.tenant_runs(tenant))
                .arg(&max)
                .arg("-inf")
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(if search.is_some() { LIST_SEARCH_BATCH } else { limit * 2 + 1 })
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
            read += records.iter().flatten().flatten().map(String::len).sum::<usize>();
            // Parsed (each run's metadata is JSON) off the runtime's threads.
            let (who, q) = (tenant.to_owned(), search.clone());
            let looked = tokio::task::spawn_blocking(move || {
                fresh
                    .into_iter()
                    .zip(records)
                    .map(|((id, ms), values)| {
                        let gone = values.iter().all(Option::is_none);
                        let f: HashMap<String, String> = Run::FIELDS
                            .iter()
                            .zip(values)
                            .filter_map(|(k, v)| v.map(|v| ((*k).to_owned(), v)))
                            .collect();
                        let run = tenant_run(&who, &id, &f);
                        let readable = run.is_some();
                        let shown = run.filter(|r| {
                            status.is_none_or(|s| s == r.status) && q.as_deref().is_none_or(|q| run_matches(r, q))
                        });
                        (id, ms, gone, readable, shown)
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .map_err(|e| StoreError::Protocol(format!("reading a page of runs: {e}")))?;
            for (id, ms, gone, readable, shown) in looked {
                after = Some((ms, id.clone()));
                match shown {
                    Some(run) => {
                        out.push(run);
                        if out.len() == limit {
                            return Ok((out, Some(format!("{ms}:{id}"))));
                        }
                    }
                    None if readable => {}
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
        // Past the last position a cursor may name there is nothing to read.
        if from > MAX_TRANSCRIPT_POSITION {
            return Ok(Some((Vec::new(), false)));
        }
        let limit = limit.clamp(1, MAX_TRANSCRIPT_POSITION);
        let mut conn = self.conn.clone();
        // One entry more than asked for says whether there is a next page.
        let raw: Vec<String> = redis::cmd("LRANGE")
            .arg(self.keys.run_transcript(id))
            .arg(from)
            .arg(from.saturating_add(limit))
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
        let max_active = tenant.map(|t| self.quotas.of(t).max_active_runs.to_string()).unwrap_or_default();
        inv.arg(tenant.unwrap_or("")).arg(max_active).arg(MAX_RETRIES);
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
            Some("quota") => Err(StoreError::Quota(super::QuotaExceeded {
                message: reply.get(1).cloned().unwrap_or_default(),
                retry_after_ms: 5_000,
            })),
            _ => Err(StoreError::Protocol(format!("{reply:?}"))),
        }
    }

    /// Events of a run after `after` (a stream id, see [`super::valid_stream_id`];
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

    /// Keeps `tools` (JSON) as the MCP tool list of `lease`'s run unless a
    /// list is kept already, and answers the list kept: the first turn to
    /// list the run's servers decides what every later turn offers. `None`:
    /// the run is gone, or the lease is no longer its turn's.
    pub async fn keep_mcp_tools(&self, lease: &Lease, tools: &str) -> Result<Option<String>, StoreError> {
        let mut inv = self.invocation("mcp_tools", &lease.id, "", None);
        inv.arg(tools).arg(lease.epoch);
        let reply = self.invoke(inv).await?;
        Ok(match reply.first().map(String::as_str) {
            Some("ok") => reply.get(1).cloned(),
            _ => None,
        })
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
            trace: f.get(field::TRACE).filter(|t| super::record::trace_id_of(t).is_some()).cloned(),
            mcp_tools: f.get(field::MCP_TOOLS).cloned(),
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
        let libs = format!("{QUEUE_HOOKS}\n{PACER_HOST_LUA}\n{}\n{}", runs_lib(), crate::pacer::lua_function());
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
            Turn { job: next, ask: None, cleared: false, pause_ms: None, cached_until_ms: None },
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
        self.wait_shown(lease, job, next, delay_ms, None, reason, event_kind, event_data).await
    }

    /// [`wait_asking`](Self::wait_asking) for a turn the pacer parked in its
    /// budget's line: due at `due_ms` (its safety deadline, or the line's
    /// timer; the line releases it sooner), the run showing `eta_ms`.
    #[allow(clippy::too_many_arguments)]
    pub async fn wait_parked(
        &self,
        lease: &Lease,
        job: TurnJob,
        next: Turn,
        due_ms: u64,
        eta_ms: u64,
        reason: WaitReason,
        event_kind: &str,
        event_data: &Value,
    ) -> Result<Fence, StoreError> {
        self.wait_shown(lease, job, next, due_ms, Some(eta_ms), reason, event_kind, event_data).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn wait_shown(
        &self,
        lease: &Lease,
        job: TurnJob,
        next: Turn,
        delay_ms: u64,
        shown_ms: Option<u64>,
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
        if let Some(shown) = shown_ms {
            inv.arg(shown);
        }
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
        // Nor do the turns the call's settle lets go: the reply says when it let one go.
        let refetches = lease.refetches();
        let quiet = due_now && refetches;
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
            .arg(if quiet {
                "1"
            } else if refetches {
                "2"
            } else {
                "0"
            })
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
        // {'continued', turns, code, due_ms, reason, eta_ms}: the ask's answer, when it was made.
        let asked = reply.as_ref().ok().and_then(|r| {
            let answer: Vec<i64> = r.get(2..6)?.iter().map(|v| v.parse().unwrap_or(-1)).collect();
            // (The script pads a clear answer: `{0, 0, 0, 0}`.)
            crate::pacer::ops::decision(if answer.first() == Some(&0) { &answer[..1] } else { &answer })
        });
        // Whatever the answer (the turn may be queued), unless it waits; or
        // when the settle let turns go quietly (a trailing 'k').
        let released = reply.as_ref().is_ok_and(|r| r.last().is_some_and(|k| k == "k"));
        if released || (quiet && !matches!(asked, Some(crate::pacer::Decision::Owed { .. }))) {
            lease.kick();
        }
        // Or the settle moved the line's head up, and no fetch follows: this
        // process watches its time (a trailing `w<ms>`, pacer_host.lua `kicked`).
        let watch = reply.as_ref().ok().and_then(|r| r.last()?.strip_prefix('w')?.parse::<i64>().ok());
        if let Some(due_ms) = watch {
            lease.watch(due_ms);
        }
        let reply = reply?;
        let ended = reply.first().is_some_and(|o| o == "failed") && matches!(next, Next::Continue | Next::Paced { .. });
        // (Before the 'k' or 'w', if any: store.lua `reply`.)
        let unsettled = reply.iter().skip(2).any(|m| m == "u");
        Ok(Committed { fence: Self::fence(&reply)?, asked, ended, unsettled })
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

/// The run record's counter a wait for `reason` adds one to.
fn wait_counter(reason: WaitReason) -> &'static str {
    match reason {
        WaitReason::Budget | WaitReason::FairShare | WaitReason::SpendCap => field::BUDGET_WAITS,
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

/// The largest position a transcript cursor may name: far past any
/// transcript a run can hold, and small enough that a page's end (`+ limit`)
/// is still an index Redis reads (`LRANGE` takes signed 64-bit indexes).
pub const MAX_TRANSCRIPT_POSITION: usize = u32::MAX as usize;

/// The transcript cursor naming `position` (`tx_<position>`), what
/// [`parse_transcript_cursor`] reads back.
pub fn transcript_cursor(position: usize) -> String {
    format!("tx_{position}")
}

/// Reads a transcript cursor, `tx_<position>`: `None` unless the position is
/// 1 to 10 digits and at most [`MAX_TRANSCRIPT_POSITION`].
pub fn parse_transcript_cursor(cursor: &str) -> Option<usize> {
    let digits = cursor.strip_prefix("tx_")?;
    if !(1..=10).contains(&digits.len()) || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().filter(|&n| n <= MAX_TRANSCRIPT_POSITION)
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
    fn transcript_cursors_name_a_position_redis_can_read_or_nothing() {
        assert_eq!(parse_transcript_cursor("tx_0"), Some(0));
        assert_eq!(parse_transcript_cursor(&transcript_cursor(1000)), Some(1000));
        assert_eq!(parse_transcript_cursor("tx_4294967295"), Some(MAX_TRANSCRIPT_POSITION));
        for bad in [
            "tx_4294967296",
            "tx_18446744073709551615",
            "tx_99999999999999999999999",
            "tx_",
            "tx_-1",
            "tx_+1",
            "tx_1.5",
            "tx_ 1",
            "1",
            "",
        ] {
            assert_eq!(parse_transcript_cursor(bad), None, "{bad}");
        }
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
