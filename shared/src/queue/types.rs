//! What the queue hands out and reports: leases, deliveries, counts, dead
//! turns, worker registrations.

use apalis_core::task::from_request::FromRequest;
use apalis_core::task::Task;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One delivery of a turn to a worker: what the handler holds while it works.
///
/// Get it in a handler as an argument (`lease: Lease`; it implements apalis's
/// `FromRequest`). Settle it with [`TurnQueue::complete`](super::TurnQueue::complete), [`TurnQueue::requeue`](super::TurnQueue::requeue)
/// or [`TurnQueue::dead`](super::TurnQueue::dead); a handler that returns `Ok` without settling
/// completes the turn, one that returns `Err` (or panics) retries it.
#[derive(Debug, Clone)]
pub struct Lease {
    /// The turn's id (the run id).
    pub id: String,
    /// Fencing token: unique per delivery, larger for later deliveries.
    pub epoch: u64,
    /// Identity of the worker process holding it.
    pub worker: String,
    /// How many deliveries this turn used without a verdict, this one included.
    pub deliveries: u32,
    /// When it was due (server clock, ms).
    pub due_ms: i64,
    /// When it was leased (server clock, ms); `fetched_at_ms - due_ms` is its start lateness.
    pub fetched_at_ms: i64,
    pub(super) settled: Arc<AtomicBool>,
    /// Turns true when this worker's heartbeat finds the lease taken back
    /// (it expired and another delivery began): the handler should stop.
    pub(super) lost: Arc<tokio::sync::watch::Sender<bool>>,
    /// The worker process's fetcher, as far as a handler may reach it (see
    /// [`Lease::refetches`]); set by the worker's backend.
    pub(super) fetcher: Option<Arc<dyn LocalFetcher>>,
    /// What a [`FetchScript`](super::FetchScript) did with the turn besides
    /// leasing it (the run store's fetch starts it), if anything.
    pub(super) extra: Option<Arc<Vec<String>>>,
}

/// What a handler may ask of its worker process's fetcher.
pub trait LocalFetcher: Send + Sync + std::fmt::Debug {
    /// Whether the process will fetch again (it is not shutting down).
    fn will_fetch(&self) -> bool;
    /// A turn was just queued with no wake-up token: fetch once more after
    /// this, even if idle or about to be.
    fn kick(&self);
    /// A queued turn's due time (server clock, ms) moved up with no wake-up
    /// token: this process watches it (claimed for whoever takes a token,
    /// `*`), as a token naming it would have made any idle worker do.
    fn watch(&self, due_ms: i64);
}

impl Lease {
    /// Records that the holder settled the turn itself (e.g. with its own commit
    /// script built on [`LUA_LIB`](super::LUA_LIB)), so the backend will not complete or retry it.
    pub fn mark_settled(&self) {
        self.settled.store(true, Ordering::SeqCst);
    }

    /// Whether the turn was settled (or found fenced) during this delivery.
    pub fn is_settled(&self) -> bool {
        self.settled.load(Ordering::SeqCst)
    }

    /// Records that the lease was taken back while its handler held it.
    pub fn mark_lost(&self) {
        self.lost.send_replace(true);
    }

    /// Whether the lease was taken back (see [`Lease::mark_lost`]).
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves when the lease is taken back (never, while it is held).
    pub async fn lost(&self) {
        let mut rx = self.lost.subscribe();
        if rx.wait_for(|lost| *lost).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// This lease, reaching its process's fetcher (the worker's backend gives it).
    pub fn with_fetcher(mut self, fetcher: Arc<dyn LocalFetcher>) -> Self {
        self.fetcher = Some(fetcher);
        self
    }

    /// Whether a turn this handler queues due now needs no wake-up token for
    /// another worker: its own process will fetch after the turn is queued
    /// (call [`Lease::kick`] once it is) — it takes the turn, or takes a full
    /// batch and passes the baton (fetch.lua).
    pub fn refetches(&self) -> bool {
        self.fetcher.as_ref().is_some_and(|f| f.will_fetch())
    }

    /// What the fetch did with the turn besides leasing it (the run store's
    /// fetch starts it: its start's reply), if anything.
    pub fn extra(&self) -> Option<&[String]> {
        self.extra.as_deref().map(Vec::as_slice)
    }

    /// Tells the process's fetcher that a turn was queued quietly (see
    /// [`Lease::refetches`]): it fetches once more, idle or not.
    pub fn kick(&self) {
        if let Some(f) = &self.fetcher {
            f.kick();
        }
    }

    /// Tells the process's fetcher to watch `due_ms` (see [`LocalFetcher::watch`]).
    pub fn watch(&self, due_ms: i64) {
        if let Some(f) = &self.fetcher {
            f.watch(due_ms);
        }
    }

    /// How late it was leased relative to its due time, ms.
    pub fn lateness_ms(&self) -> i64 {
        self.fetched_at_ms - self.due_ms
    }
}

impl<Args: Sync> FromRequest<Task<Args>> for Lease {
    type Error = apalis_core::task::data::MissingDataError;
    async fn from_request(task: &Task<Args>) -> Result<Self, Self::Error> {
        task.ctx().data().get_checked::<Lease>().cloned()
    }
}

/// A leased turn as the fetch script returns it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The lease.
    pub lease: Lease,
    /// The payload as stored (JSON).
    pub payload: String,
}

/// One fetch's outcome.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Server time of the fetch, ms.
    pub now_ms: i64,
    /// What the worker does once it has started these deliveries.
    pub then: Then,
    /// Due turns the fetch left queued with a new due time (the run store's
    /// fetch: turns back from a budget wait that the pacer still owes time).
    pub held: u64,
    /// The turns leased.
    pub deliveries: Vec<Delivery>,
}

/// What a worker does after a fetch (fetch.lua): across the fleet, a due time
/// wakes one idle worker process, not every idle one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// The batch was full and more may be due: fetch again when a slot is free.
    FetchAgain,
    /// Nothing more is due, and another worker (or none: nothing is queued)
    /// watches the next due time: wait for a wake-up token, or the safety net.
    Listen,
    /// Nothing more is due, and this worker is the one that sleeps towards the
    /// next due turn, due in `ms` (server clock arithmetic).
    Watch {
        /// Until the next due turn, ms.
        ms: i64,
    },
}

/// Exact counts, read in one script (O(log n) at worst: ZCOUNT, ZCARD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueCounts {
    /// Due now and waiting for a worker slot.
    pub ready: u64,
    /// Queued with a due time in the future (budget waits, retries).
    pub delayed: u64,
    /// Leased by a worker.
    pub in_flight: u64,
    /// In the dead set.
    pub dead: u64,
    /// Due time of the next delayed turn (server clock, ms).
    pub next_due_ms: Option<i64>,
    /// Server time the counts were read at, ms.
    pub now_ms: i64,
}

/// A dead turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadTurn {
    /// The turn's id.
    pub id: String,
    /// When it died (server clock, ms).
    pub died_at_ms: i64,
    /// Why.
    pub reason: String,
    /// Its payload (JSON).
    pub payload: String,
}

/// A worker process's registration (for `GET /v1/workers`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Unique per process start: `host-pid-ulid`.
    pub identity: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Worker slots.
    pub concurrency: usize,
    /// Turns it holds (running or about to).
    pub in_flight: usize,
    /// When it started (server clock, ms).
    pub started_at_ms: i64,
    /// Its lease, ms: it is alive while its last heartbeat is younger than
    /// two of them (0: not said, a registration from before this was kept;
    /// the reader's own lease is used).
    #[serde(default)]
    pub lease_ms: u64,
    /// The longest it goes between heartbeats, ms: a third of its lease while
    /// it holds turns, longer while idle (the fleet's idle beats stay few). It
    /// is alive while its last heartbeat is younger than two of these (or of
    /// its leases, the longer). 0: not said.
    #[serde(default)]
    pub beat_ms: u64,
    /// Last heartbeat (server clock, ms); filled in from the registry.
    #[serde(default)]
    pub last_heartbeat_ms: i64,
}

/// What a heartbeat found.
#[derive(Debug, Clone, Default)]
pub struct HeartbeatReport {
    /// Expired leases (of any worker) it put back in the queue.
    pub reclaimed: u64,
    /// Expired leases that used their last delivery and went dead.
    pub buried: u64,
    /// Of the leases it renewed, those this worker no longer holds.
    pub lost: Vec<String>,
    /// Worker processes that beat in the last 30 s (this one included);
    /// `None` from a beat that did not register (only those count).
    pub fleet: Option<usize>,
    /// The server's clock when the beat ran, ms.
    pub now_ms: i64,
    /// A registration without its info ([`Register::Unchanged`]) found none
    /// (the worker was forgotten, or Redis lost it): the next sends it.
    pub resend: bool,
}

/// What a heartbeat does with the worker's registration.
#[derive(Debug, Clone, Copy)]
pub enum Register<'a> {
    /// Renews and reclaims only.
    No,
    /// Registers with this info; `census`: forgets registrations silent for
    /// an hour and counts the fleet too.
    With { info: &'a WorkerInfo, census: bool },
    /// Registers with the info this worker last wrote (one command less).
    Unchanged { census: bool },
}
