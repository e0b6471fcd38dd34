//! The turn queue: our own Redis queue, and an apalis-core 1.0 `Backend` over it.
//!
//! Why our own: `apalis-redis` 1.0 starts scheduled tasks up to a second early,
//! chokes on 8 000 due tasks, recovers orphans on worker clocks after 300 s and
//! has no fencing (ARCHITECTURE.md, "The turn queue", lists what ruled it
//! out). Here every time is the Redis server's clock in ms, every state
//! change is one Lua script, and every lease carries a fencing epoch.
//!
//! Shape (all keys under one hash tag, the prefix: `prefix:{prefix}:q:*`):
//! - `due` ZSET id → due ms: queued turns, ready (due ≤ now) or delayed;
//! - `lease` ZSET id → lease deadline ms: turns in flight;
//! - `jobs` HASH id → `epoch|deliveries|flag|payload`, the one record of a turn;
//! - `dead` ZSET + `reasons` HASH: turns that used up their deliveries;
//! - `notify` LIST: wake-up tokens idle workers `BLPOP` (the worker crate's `backend/`);
//! - `timer` STRING `due_ms|worker`: the one idle worker that watches the
//!   earliest delayed turn.
//!
//! A delivery hands the handler a [`Lease`] (id, epoch, worker, deliveries). The
//! holder settles it with [`TurnQueue::complete`], [`TurnQueue::requeue`] or
//! [`TurnQueue::dead`]; each is one script that first checks the epoch, so a
//! stale holder gets [`QueueError::Fenced`] and changes nothing. Other modules
//! build their own atomic scripts on [`LUA_LIB`] (see its doc).

/// Re-exported so workers build on the same apalis-core as the backend.
pub use apalis_core;

use crate::config::RedisArgs;
use crate::redis_util;
use crate::redis_util::RedisConn;
use serde::{de::DeserializeOwned, Serialize};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The queue's Lua library: local functions over the queue's keys, to prepend
/// to a script that must change the queue atomically with other state (the
/// worker's turn commit).
///
/// Conventions:
/// - `KEYS[1..7]` are the queue's keys in the order of [`QueueKeys::script_keys`];
///   the script's own keys start at `KEYS[Q_NKEYS + 1]` (`Q_NKEYS` = 7).
/// - `ARGV` belongs to the script; the library reads none of it.
/// - `q_now()` is the server clock in ms. `q_fence(id, epoch)` returns the turn's
///   record when `epoch` is its live lease, else `nil, why` ('gone', 'not_leased',
///   'stale'): call it first and write nothing on `nil`.
/// - With the record `r` from `q_fence`: `q_schedule(id, r, due_ms, now)` queues the
///   turn again (set `r.payload` for the next turn's payload and
///   `r.deliveries = 0` for a requeue that made progress); `q_finish(id)` removes
///   it; `q_bury(id, r, reason, now, keep_ms)` moves it to the dead set (and
///   trims the set to its retention).
///
/// A commit script: `local r, why = q_fence(ARGV[1], ARGV[2]); if not r then
/// return {'fenced', why} end; <run-store writes>; r.payload = ARGV[3];
/// r.deliveries = 0; local now = q_now(); q_schedule(ARGV[1], r, now + delay, now)` — then call
/// [`Lease::mark_settled`] so the backend does not also complete it.
pub const LUA_LIB: &str = include_str!("lib.lua");

/// Why a worker fetches, told to the fetch so that one that finds nothing is
/// counted under its cause (the queue's counters, `empty_fetches:<cause>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchWhy {
    /// A wake-up token (its fetch also clears the tokens left over).
    Token,
    /// This worker's watch of the next due time came due.
    Watch,
    /// A handler of this process queued a turn quietly (`kick`).
    Kick,
    /// The safety net's interval passed with no token.
    SafetyNet,
    /// A slot freed after a fetch that filled every slot with more due.
    Again,
    /// Not said (a first fetch, a caller that does not say).
    Unsaid,
}

impl FetchWhy {
    /// Its code in the fetch script's `ARGV[5]` (fetch.lua `Q_EMPTY_FIELD`).
    pub fn code(self) -> &'static str {
        match self {
            Self::Token => "1",
            Self::Watch => "w",
            Self::Kick => "k",
            Self::SafetyNet => "s",
            Self::Again => "a",
            Self::Unsaid => "0",
        }
    }
}

/// The queue's fetch as a Lua function, `q_fetch(max, lease_ms, dead_keep_ms,
/// me, why, on_leased, hold)` (`why`: [`FetchWhy::code`]) (prepend it after [`LUA_LIB`]): the queue's own fetch
/// script calls it; a [`FetchScript`] built on it does more with each turn it
/// leases (`on_leased(id, record)` returns what the delivery carries besides:
/// [`Lease::extra`]).
pub const FETCH_LIB: &str = include_str!("fetch.lua");

const ENQUEUE_LUA: &str = include_str!("enqueue.lua");
const SETTLE_LUA: &str = include_str!("settle.lua");
const HEARTBEAT_LUA: &str = include_str!("heartbeat.lua");
const READ_LUA: &str = include_str!("read.lua");
const ADMIN_LUA: &str = include_str!("admin.lua");

mod config;
mod error;
mod keys;
mod types;

pub use config::*;
pub use error::QueueError;
pub use keys::QueueKeys;
pub use types::*;

/// The scripts, loaded once per process (EVALSHA, with a reload after NOSCRIPT,
/// e.g. after a Redis restart).
struct Scripts {
    enqueue: redis::Script,
    fetch: redis::Script,
    settle: redis::Script,
    heartbeat: redis::Script,
    read: redis::Script,
    admin: redis::Script,
}

impl Scripts {
    /// The scripts, with `hooks` (Lua that sets `Q_HOOKS`: see [`LUA_LIB`])
    /// after the library.
    fn new(hooks: &str) -> Self {
        let with_lib = |body: &str| redis::Script::new(&format!("{LUA_LIB}\n{hooks}\n{body}"));
        Self {
            enqueue: with_lib(ENQUEUE_LUA),
            fetch: with_lib(&format!(
                "{FETCH_LIB}\nreturn q_fetch(tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5])"
            )),
            settle: with_lib(SETTLE_LUA),
            heartbeat: with_lib(HEARTBEAT_LUA),
            read: with_lib(READ_LUA),
            admin: with_lib(ADMIN_LUA),
        }
    }
}

/// A handle on the turn queue; cheap to clone.
#[derive(Clone)]
pub struct TurnQueue {
    conn: RedisConn,
    redis: RedisArgs,
    keys: Arc<QueueKeys>,
    config: QueueConfig,
    scripts: Arc<Scripts>,
}

impl std::fmt::Debug for TurnQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnQueue").field("keys", &self.keys.due).field("config", &self.config).finish()
    }
}

/// How a holder settles its lease.
enum Verdict<'a> {
    Complete,
    Requeue { delay_ms: u64, payload: Option<String> },
    Retry { delay_ms: u64, reason: &'a str },
    Release,
    Dead { reason: &'a str },
}

/// What a settle did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// As asked.
    Done,
    /// The turn went to the dead set (a retry that used its last delivery, or `dead`).
    Dead,
}

impl TurnQueue {
    /// A queue on `redis` (does not connect until the first command, so a
    /// process can start while Redis is down).
    pub fn new(redis: &RedisArgs, config: QueueConfig) -> Result<Self, QueueError> {
        let conn = redis_util::connect(redis, redis_util::COMMAND_TIMEOUT)?;
        let mut config = config;
        config.fetch_batch = config.fetch_batch.clamp(1, MAX_FETCH_BATCH);
        config.lease_ms = config.lease_ms.max(300);
        config.max_deliveries = config.max_deliveries.max(1);
        Ok(Self {
            conn,
            redis: redis.clone(),
            keys: Arc::new(QueueKeys::new(&redis.keys())),
            config,
            scripts: Arc::new(Scripts::new("")),
        })
    }

    /// The same queue, its scripts run with `hooks`: Lua that sets the
    /// library's `Q_HOOKS` (what the owner of the turns needs when a lease
    /// ends or a turn is buried; the run store's are `shared::runs::QUEUE_HOOKS`).
    pub fn with_hooks(mut self, hooks: &str) -> Self {
        self.scripts = Arc::new(Scripts::new(hooks));
        self
    }

    /// The queue's config.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The queue's key names.
    pub fn keys(&self) -> &QueueKeys {
        &self.keys
    }

    /// Where its Redis is (blocking reads open their own connection to it).
    pub fn redis(&self) -> &RedisArgs {
        &self.redis
    }

    fn invocation<'a>(&'a self, script: &'a redis::Script) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        for k in self.keys.script_keys() {
            inv.key(k);
        }
        inv
    }

    /// Enqueues turn `id` with `payload`, due `delay_ms` after now (server
    /// clock). Idempotent by id: returns false, changing nothing, when `id` is
    /// already queued, in flight or dead.
    pub async fn enqueue<T: Serialize>(&self, id: &str, payload: &T, delay_ms: u64) -> Result<bool, QueueError> {
        let payload = serde_json::to_string(payload)?;
        self.enqueue_raw(id, &payload, delay_ms).await
    }

    /// [`Self::enqueue`] with a payload already encoded.
    pub async fn enqueue_raw(&self, id: &str, payload: &str, delay_ms: u64) -> Result<bool, QueueError> {
        let mut inv = self.invocation(&self.scripts.enqueue);
        inv.arg(id).arg(payload).arg(delay_ms);
        let added: i64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(added == 1)
    }

    /// Leases up to `max` due turns to `worker` (one script). Workers use this
    /// through their apalis backend (`worker::backend`); it is public for tests and tools.
    pub async fn fetch(&self, worker: &str, max: usize) -> Result<Fetched, QueueError> {
        self.fetch_with(worker, max, None).await
    }

    /// [`Self::fetch`] by `with`, a script built on [`FETCH_LIB`] that does
    /// more with each turn it leases (`None`: the queue's own).
    pub async fn fetch_with(
        &self,
        worker: &str,
        max: usize,
        with: Option<&FetchScript>,
    ) -> Result<Fetched, QueueError> {
        self.fetch_for(worker, max, with, FetchWhy::Token).await
    }

    /// [`Self::fetch_with`], saying why the worker fetches (`why`). Only a
    /// fetch after a wake-up token ([`FetchWhy::Token`]) clears the tokens
    /// left over when it takes everything due (fetch.lua); a worker that
    /// fetches for any other reason (a slot freed, its watch's timer, a kick)
    /// finds them left for the next token-woken fetch: they are rare, since a
    /// token reaches a listening worker at once. A fetch that finds nothing is
    /// counted under its cause (`empty_fetches:<cause>` in the queue's
    /// counters; `empty_fetches` when unsaid), at the cost of the one count it
    /// made before.
    pub async fn fetch_for(
        &self,
        worker: &str,
        max: usize,
        with: Option<&FetchScript>,
        why: FetchWhy,
    ) -> Result<Fetched, QueueError> {
        let mut inv = self.invocation(with.map_or(&self.scripts.fetch, |w| &*w.script));
        inv.key(&self.keys.epoch_given)
            .key(&self.keys.stats)
            .arg(max.clamp(1, MAX_FETCH_BATCH))
            .arg(self.config.lease_ms)
            .arg(self.config.dead_retention_ms)
            .arg(worker)
            .arg(why.code());
        for a in with.map_or(&[][..], |w| &w.args[..]) {
            inv.arg(a);
        }
        let reply: Vec<redis::Value> = inv.invoke_async(&mut self.conn.clone()).await?;
        parse_fetch(reply, worker)
    }

    async fn settle(&self, lease: &Lease, verdict: Verdict<'_>) -> Result<Settled, QueueError> {
        let (op, delay, payload, reason) = match &verdict {
            Verdict::Complete => ("complete", 0, None, ""),
            Verdict::Requeue { delay_ms, payload } => ("requeue", *delay_ms, payload.as_deref(), ""),
            Verdict::Retry { delay_ms, reason } => ("retry", *delay_ms, None, *reason),
            Verdict::Release => ("release", 0, None, ""),
            Verdict::Dead { reason } => ("dead", 0, None, *reason),
        };
        let mut inv = self.invocation(&self.scripts.settle);
        inv.arg(op)
            .arg(&lease.id)
            .arg(lease.epoch)
            .arg(delay)
            .arg(payload.unwrap_or(""))
            .arg(if payload.is_some() { "1" } else { "0" })
            .arg(reason)
            .arg(self.config.max_deliveries)
            .arg(self.config.dead_retention_ms);
        let reply: Vec<String> = inv.invoke_async(&mut self.conn.clone()).await?;
        match reply.first().map(String::as_str) {
            Some("ok") => {
                lease.mark_settled();
                Ok(Settled::Done)
            }
            Some("dead") => {
                lease.mark_settled();
                Ok(Settled::Dead)
            }
            Some("fenced") => {
                // Not ours any more: the backend must not try to settle it either.
                lease.mark_settled();
                Err(QueueError::Fenced {
                    id: lease.id.clone(),
                    epoch: lease.epoch,
                    why: reply.get(1).cloned().unwrap_or_default(),
                })
            }
            _ => Err(QueueError::Protocol(format!("settle answered {reply:?}"))),
        }
    }

    /// The turn is done: removes it. `Fenced` when `lease` is not the live one.
    pub async fn complete(&self, lease: &Lease) -> Result<(), QueueError> {
        self.settle(lease, Verdict::Complete).await.map(|_| ())
    }

    /// Queues the turn again, due `delay_ms` after now on the server's clock
    /// (a budget wait, a retry, or the run's next turn), with `payload` when
    /// given. Its delivery count starts over. `Fenced` when `lease` is not the live one.
    pub async fn requeue<T: Serialize>(
        &self,
        lease: &Lease,
        delay_ms: u64,
        payload: Option<&T>,
    ) -> Result<(), QueueError> {
        let payload = payload.map(serde_json::to_string).transpose()?;
        self.settle(lease, Verdict::Requeue { delay_ms, payload }).await.map(|_| ())
    }

    /// Moves the turn to the dead set with `reason`. `Fenced` when `lease` is not the live one.
    pub async fn dead(&self, lease: &Lease, reason: &str) -> Result<(), QueueError> {
        self.settle(lease, Verdict::Dead { reason }).await.map(|_| ())
    }

    /// A failed delivery: queued again after `delay_ms`, or dead with `reason`
    /// when it used its last delivery. What the backend does on a handler error.
    pub async fn retry(&self, lease: &Lease, delay_ms: u64, reason: &str) -> Result<Settled, QueueError> {
        self.settle(lease, Verdict::Retry { delay_ms, reason }).await
    }

    /// Hands the turn back unfinished (shutdown): due now, this delivery not counted.
    pub async fn release(&self, lease: &Lease) -> Result<(), QueueError> {
        self.settle(lease, Verdict::Release).await.map(|_| ())
    }

    /// Exact counts of ready, delayed, in-flight and dead turns, in one script.
    pub async fn counts(&self) -> Result<QueueCounts, QueueError> {
        let mut inv = self.invocation(&self.scripts.read);
        inv.arg("counts");
        let v: Vec<i64> = inv.invoke_async(&mut self.conn.clone()).await?;
        if v.len() != 6 {
            return Err(QueueError::Protocol(format!("counts answered {v:?}")));
        }
        Ok(QueueCounts {
            now_ms: v[0],
            ready: v[1] as u64,
            delayed: v[2] as u64,
            in_flight: v[3] as u64,
            dead: v[4] as u64,
            next_due_ms: (v[5] >= 0).then_some(v[5]),
        })
    }

    /// The newest `limit` dead turns, newest first.
    pub async fn list_dead(&self, limit: usize) -> Result<Vec<DeadTurn>, QueueError> {
        self.list_dead_page(limit, None).await
    }

    /// A page of at most `limit` dead turns, newest first, after `cursor`
    /// (the died-at ms and id of the last turn of the previous page).
    pub async fn list_dead_page(&self, limit: usize, cursor: Option<(i64, &str)>) -> Result<Vec<DeadTurn>, QueueError> {
        let mut inv = self.invocation(&self.scripts.read);
        inv.arg("dead").arg(limit.max(1));
        match cursor {
            Some((ms, id)) => inv.arg(ms).arg(id),
            None => inv.arg("").arg(""),
        };
        let v: Vec<String> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(v.chunks_exact(4)
            .map(|c| DeadTurn {
                id: c[0].clone(),
                died_at_ms: c[1].parse().unwrap_or_default(),
                reason: c[2].clone(),
                payload: c[3].clone(),
            })
            .collect())
    }

    /// Puts dead turn `id` back in the queue, due now, with fresh deliveries.
    /// Returns false when `id` is not dead.
    pub async fn retry_dead(&self, id: &str) -> Result<bool, QueueError> {
        let mut inv = self.invocation(&self.scripts.admin);
        inv.arg("retry_dead").arg(id);
        let n: i64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(n == 1)
    }

    /// The live worker processes (heartbeat within twice the lease).
    pub async fn list_workers(&self) -> Result<Vec<WorkerInfo>, QueueError> {
        let mut inv = self.invocation(&self.scripts.read);
        // Each worker is judged by its own lease (the registration says it): an
        // API or a worker with another lease must not call it dead, or alive.
        inv.key(&self.keys.workers)
            .key(&self.keys.worker_info)
            .arg("workers")
            .arg(self.config.worker_ttl_ms())
            .arg(MAX_WORKER_TTL_MS);
        let v: Vec<String> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut out = Vec::new();
        for c in v.chunks_exact(3) {
            match serde_json::from_str::<WorkerInfo>(&c[2]) {
                Ok(mut info) => {
                    info.last_heartbeat_ms = c[1].parse().unwrap_or_default();
                    out.push(info);
                }
                Err(error) => tracing::warn!(message = "unreadable worker registration", %error, worker.id = %c[0]),
            }
        }
        Ok(out)
    }

    /// One heartbeat of worker `info` holding `leases` (id, epoch): registers
    /// it, renews those leases, reclaims expired leases of any worker. With
    /// `info` `None` it only reclaims (tools, tests).
    pub async fn heartbeat(
        &self,
        identity: &str,
        info: Option<&WorkerInfo>,
        leases: &[(String, u64)],
    ) -> Result<HeartbeatReport, QueueError> {
        let register = info.map_or(Register::No, |info| Register::With { info, census: true });
        self.beat(identity, register, leases, Some(i64::MAX)).await
    }

    /// [`TurnQueue::heartbeat`], registering as `register` says, and
    /// reclaiming expired leases if `reclaim` names a time (server ms) it
    /// runs by — a beat that reaches Redis later (retried through an outage
    /// by the client) reclaims nothing; `None`: no reclaim.
    pub async fn beat(
        &self,
        identity: &str,
        register: Register<'_>,
        leases: &[(String, u64)],
        reclaim: Option<i64>,
    ) -> Result<HeartbeatReport, QueueError> {
        let (info, census) = match register {
            Register::No => (String::new(), false),
            Register::With { info, census } => (serde_json::to_string(info)?, census),
            Register::Unchanged { census } => ("=".to_owned(), census),
        };
        let mut inv = self.invocation(&self.scripts.heartbeat);
        inv.key(&self.keys.workers)
            .key(&self.keys.worker_info)
            .arg(self.config.lease_ms)
            .arg(self.config.max_deliveries)
            .arg(identity)
            .arg(info)
            // Registrations silent this long are forgotten; whether one is alive
            // is judged on reading, by its own lease (`list_workers`).
            .arg(if census { MAX_WORKER_TTL_MS } else { 0 })
            .arg(reclaim.map_or_else(|| "0".to_owned(), |not_after| format!("200:{not_after}")))
            .arg(self.config.dead_retention_ms);
        for (id, epoch) in leases {
            inv.arg(id).arg(*epoch);
        }
        let v: Vec<redis::Value> = inv.invoke_async(&mut self.conn.clone()).await?;
        let mut report = HeartbeatReport::default();
        for (i, item) in v.into_iter().enumerate() {
            match i {
                0 => report.reclaimed = redis::from_redis_value(item).unwrap_or_default(),
                1 => report.buried = redis::from_redis_value(item).unwrap_or_default(),
                2 => report.fleet = redis::from_redis_value::<i64>(item).ok().and_then(|n| usize::try_from(n).ok()),
                3 => report.now_ms = redis::from_redis_value(item).unwrap_or_default(),
                4 => report.resend = redis::from_redis_value::<i64>(item).unwrap_or_default() == 1,
                _ => report.lost.push(redis::from_redis_value(item).unwrap_or_default()),
            }
        }
        Ok(report)
    }

    /// When the first lease of any worker expires (server clock, ms), `None`
    /// with no lease held: one `ZRANGE`, an idle worker's look between the
    /// beats that reclaim (a lease expired by its clock calls for a beat).
    pub async fn first_lease_expiry(&self) -> Result<Option<i64>, QueueError> {
        let first: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&self.keys.lease)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(first.first().map(|(_, at)| *at as i64))
    }

    /// Removes worker `identity` from the registry (a clean exit).
    pub async fn deregister(&self, identity: &str) -> Result<(), QueueError> {
        let mut inv = self.invocation(&self.scripts.admin);
        inv.key(&self.keys.workers).key(&self.keys.worker_info).arg("deregister").arg(identity);
        let _: i64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// The payload of a queued, in-flight or dead turn, decoded (tests, tools).
    pub async fn payload<T: DeserializeOwned>(&self, id: &str) -> Result<Option<T>, QueueError> {
        let rec: Option<String> =
            redis::cmd("HGET").arg(&self.keys.jobs).arg(id).query_async(&mut self.conn.clone()).await?;
        let Some(rec) = rec else { return Ok(None) };
        let payload = rec.splitn(4, '|').nth(3).unwrap_or("");
        Ok(Some(serde_json::from_str(payload)?))
    }

    /// The Redis server's clock, ms.
    pub async fn server_time_ms(&self) -> Result<i64, QueueError> {
        Ok(redis_util::server_time_ms(&mut self.conn.clone()).await?)
    }

    /// The queue's shared connection (its backend's `CLIENT UNBLOCK`).
    pub fn conn(&self) -> RedisConn {
        self.conn.clone()
    }
}

/// A fetch script built on [`FETCH_LIB`] that does more with each turn it
/// leases, and the arguments it takes after the queue's four.
#[derive(Clone)]
pub struct FetchScript {
    script: Arc<redis::Script>,
    args: Vec<String>,
}

impl std::fmt::Debug for FetchScript {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchScript").field("args", &self.args).finish()
    }
}

impl FetchScript {
    /// `body` (prepended with [`LUA_LIB`] and `libs`, then [`FETCH_LIB`]) must
    /// `return q_fetch(tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], on_leased, hold)`
    /// (`hold` optional: the due turns to leave queued, `fetch.lua`);
    /// `args` are its ARGV from 6 on.
    pub fn new(libs: &str, body: &str, args: Vec<String>) -> Self {
        let source = format!("{LUA_LIB}\n{libs}\n{FETCH_LIB}\n{body}");
        Self { script: Arc::new(redis::Script::new(&source)), args }
    }
}

fn parse_fetch(reply: Vec<redis::Value>, worker: &str) -> Result<Fetched, QueueError> {
    let bad = || QueueError::Protocol("fetch answered a malformed reply".into());
    if reply.len() < 3 || !(reply.len() - 3).is_multiple_of(6) {
        return Err(bad());
    }
    let text = |v: redis::Value| redis::from_redis_value::<String>(v).map_err(|_| bad());
    let mut it = reply.into_iter();
    let now_ms: i64 = text(it.next().ok_or_else(bad)?)?.parse().map_err(|_| bad())?;
    let then = match text(it.next().ok_or_else(bad)?)?.parse::<i64>().map_err(|_| bad())? {
        -2 => Then::FetchAgain,
        -1 => Then::Listen,
        ms if ms >= 0 => Then::Watch { ms },
        _ => return Err(bad()),
    };
    let held: u64 = text(it.next().ok_or_else(bad)?)?.parse().map_err(|_| bad())?;
    let mut deliveries = Vec::with_capacity(it.len() / 6);
    while let (Some(id), Some(epoch), Some(deliv), Some(due), Some(payload), Some(extra)) =
        (it.next(), it.next(), it.next(), it.next(), it.next(), it.next())
    {
        let (id, epoch, deliv, due, payload) = (text(id)?, text(epoch)?, text(deliv)?, text(due)?, text(payload)?);
        let extra: Vec<String> = redis::from_redis_value(extra).map_err(|_| bad())?;
        deliveries.push(Delivery {
            lease: Lease {
                id,
                epoch: epoch.parse().map_err(|_| bad())?,
                worker: worker.to_owned(),
                deliveries: deliv.parse().map_err(|_| bad())?,
                due_ms: due.parse::<f64>().map_err(|_| bad())? as i64,
                fetched_at_ms: now_ms,
                settled: Arc::new(AtomicBool::new(false)),
                lost: Arc::new(tokio::sync::watch::channel(false).0),
                fetcher: None,
                extra: (!extra.is_empty()).then(|| Arc::new(extra)),
            },
            payload,
        });
    }
    Ok(Fetched { now_ms, then, held, deliveries })
}

/// The longest a registration may go without a heartbeat and still be read
/// (its own two leases decide); past it, it is not even looked at.
const MAX_WORKER_TTL_MS: u64 = 3_600_000;

/// The warning a worker logs for a lease it lost while it held it (its
/// heartbeat came too late); the bench counts these lines.
pub const LEASE_LOST_MESSAGE: &str = "lease lost while held (this worker stalled past it); its commit will be fenced";

/// A worker process's identity: unique per start (`host-pid-ulid`).
pub fn new_worker_identity() -> String {
    format!("{}-{}-{}", host_name(), std::process::id(), ulid::Ulid::new())
}

/// This host's name, or `unknown`.
pub fn host_name() -> String {
    hostname::get().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_and_cap() {
        let c = QueueConfig::default();
        assert_eq!(c.retry_delay_ms(1), 1000);
        assert_eq!(c.retry_delay_ms(2), 2000);
        assert_eq!(c.retry_delay_ms(3), 4000);
        assert_eq!(c.retry_delay_ms(30), 30_000);
    }

    #[test]
    fn queue_keys_share_the_prefix_hash_tag() {
        let k = QueueKeys::new(&crate::keys::Keys::new("paceline"));
        assert_eq!(k.due, "paceline:{paceline}:q:due");
        for key in k.script_keys() {
            assert!(key.starts_with("paceline:{paceline}:q:"), "{key}");
        }
    }

    #[test]
    fn a_fetch_reply_parses_into_leases() {
        let text = |s: &str| redis::Value::BulkString(s.as_bytes().to_vec());
        let words = |w: &[&str]| w.iter().map(|s| text(s)).collect::<Vec<_>>();
        let mut reply = words(&["1000", "-2", "3", "run_1", "7", "2", "990", "{\"a\":1}"]);
        reply.push(redis::Value::Array(words(&["ok", "0"])));
        reply.extend(words(&["run_2", "8", "1", "995", "{}"]));
        reply.push(redis::Value::Array(vec![]));
        let f = parse_fetch(reply, "w").unwrap();
        assert_eq!(f.deliveries.len(), 2);
        assert_eq!(f.held, 3);
        let l = &f.deliveries[0].lease;
        assert_eq!((l.id.as_str(), l.epoch, l.deliveries, l.due_ms, l.lateness_ms()), ("run_1", 7, 2, 990, 10));
        assert_eq!(f.deliveries[0].payload, "{\"a\":1}");
        assert_eq!(f.deliveries[0].lease.extra(), Some(&["ok".to_owned(), "0".to_owned()][..]));
        assert!(f.deliveries[1].lease.extra().is_none());
        assert_eq!(f.then, Then::FetchAgain);
        let idle = parse_fetch(words(&["1000", "250", "0"]), "w").unwrap();
        assert_eq!(idle.then, Then::Watch { ms: 250 });
        let empty = parse_fetch(words(&["1000", "-1", "0"]), "w").unwrap();
        assert_eq!((empty.then, empty.held), (Then::Listen, 0));
        assert!(parse_fetch(words(&["1000", "-3", "0"]), "w").is_err());
        assert!(parse_fetch(words(&["1000", "-1"]), "w").is_err(), "no count of turns held");
        assert!(parse_fetch(words(&["1000", "-2", "0", "run_1", "7", "2", "990", "{}"]), "w").is_err(), "no extra");
    }
}
