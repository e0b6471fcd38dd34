//! The backend's fetcher: one per worker process, it leases turns only for
//! free slots, and between fetches either watches the earliest delayed turn
//! (the one idle worker the queue's `timer` names) or listens on `notify`
//! (see the backend's module doc for the whole waking scheme).

use super::*;
use shared::queue::FetchWhy;
use shared::redis_util::RedisConn;

/// One fetch, in a task of its own (see `BackendState::fetching`).
pub(super) async fn fetch_in_task(
    queue: TurnQueue,
    script: Option<FetchScript>,
    shared: Arc<BackendState>,
    want: usize,
    why: FetchWhy,
) -> Result<shared::queue::Fetched, QueueError> {
    shared.fetching.fetch_add(1, Ordering::SeqCst);
    let task = tokio::spawn(async move {
        let sent = Instant::now();
        let result = queue.fetch_for(&shared.identity, want, script.as_ref(), why).await;
        if let Ok(fetched) = &result {
            for d in &fetched.deliveries {
                shared.hold(&d.lease, sent);
            }
        }
        shared.fetching.fetch_sub(1, Ordering::SeqCst);
        result
    });
    task.await.unwrap_or_else(|error| Err(QueueError::Protocol(format!("fetch task: {error}"))))
}

/// Fetches leases into a small buffer, sized to the free slots.
pub(super) struct Fetcher<T> {
    pub(super) queue: TurnQueue,
    pub(super) script: Option<FetchScript>,
    pub(super) shared: Arc<BackendState>,
    pub(super) buffer: VecDeque<Task<T>>,
    /// What the last fetch said to do once its deliveries started.
    pub(super) then: Option<Then>,
    /// The connection idle waits `BLPOP` on, and its client id (for `CLIENT UNBLOCK`).
    pub(super) blocking: Option<(RedisConn, i64)>,
    /// The `BLPOP` outstanding on it (with `CLIENT UNBLOCK` only): kept across
    /// idle waits until it returns, or until every slot is taken.
    pub(super) listening: Option<Listen>,
    /// Whether the server lets this worker use `CLIENT UNBLOCK`.
    pub(super) unblock: bool,
    /// Why the next fetch is made (what ended the last idle wait, or a slot
    /// freed after a full batch): a fetch that finds nothing is counted under
    /// it, and one after a wake-up token clears any left over
    /// (`TurnQueue::fetch_for`).
    pub(super) why: FetchWhy,
    /// A token named a due time to watch (server clock, ms; `q_wake_at`): the
    /// earliest such since the last fetch.
    pub(super) watch_token: Option<i64>,
    /// The server's clock at the last fetch, and when that was here: a token's
    /// due time becomes a local timer without a fetch.
    pub(super) clock: Option<(i64, Instant)>,
    /// When the watch this process sleeps towards is due, here.
    pub(super) watching: Option<tokio::time::Instant>,
    pub(super) failures: u32,
}

impl<T: DeserializeOwned + Send + 'static> Fetcher<T> {
    pub(super) async fn next_task(&mut self) -> Task<T> {
        loop {
            if let Some(task) = self.buffer.pop_front() {
                self.shared.handed.fetch_add(1, Ordering::SeqCst);
                // The last free slot is taken: stop listening now. The worker
                // asks for its next task only once a slot frees (the layer's
                // `poll_ready`), so `free_slot` would stop it a call's length
                // later, and meanwhile the `BLPOP` still outstanding took the
                // tokens meant for workers with room — among them the one this
                // very fetch pushed, with more due, when it was the fleet's
                // oldest (released turns then waited a call for a slot here).
                if self.listening.is_some() && self.busy() >= self.shared.concurrency {
                    self.stop_listening().await;
                }
                return task;
            }
            self.free_slot().await;
            let backlog = matches!(self.then, Some(Then::FetchAgain));
            match self.then.take() {
                Some(Then::Listen) => self.idle(None).await,
                // Due now (a turn its own fetch left queued, released, to ask
                // for again): fetch at once — no timer, and no claim to read,
                // which a wake-up for a later time may have replaced already.
                // Watched as due now, so a token or a commit's hint taken
                // meanwhile cannot put that fetch off (`watch_from_token`).
                Some(Then::Watch { ms }) if ms <= 0 => {
                    self.watching = Some(tokio::time::Instant::now());
                    self.why = FetchWhy::Watch;
                }
                Some(Then::Watch { ms }) => {
                    let until = tokio::time::Instant::now() + Duration::from_millis(ms as u64);
                    self.watching = Some(self.watching.map_or(until, |w| w.min(until)));
                    self.idle(Some(ms)).await;
                    if self.why == FetchWhy::Watch {
                        // Nothing is due here yet: the claim is for a later time.
                        match self.after_watch().await {
                            AfterWatch::Fetch => {}
                            AfterWatch::Listen => {
                                self.watching = None;
                                self.why = FetchWhy::Unsaid;
                                self.then = Some(Then::Listen);
                                continue;
                            }
                            AfterWatch::Watch { ms } => {
                                self.watching = None;
                                self.why = FetchWhy::Unsaid;
                                self.then = Some(Then::Watch { ms });
                                continue;
                            }
                        }
                    }
                }
                Some(Then::FetchAgain) => self.why = FetchWhy::Again,
                None => {}
            }
            // A due time this process's commit moved up (`Lease::watch`): as a
            // token naming it — unless a fetch comes next anyway (more was due,
            // or a kick): that fetch claims the watch of what it finds.
            let hint = self.shared.watch_hint.swap(0, Ordering::SeqCst);
            if hint > 0 && !backlog && !self.shared.kicked.load(Ordering::SeqCst) {
                self.watch_token = Some(self.watch_token.map_or(hint, |t| t.min(hint)));
            }
            if let Some(ms) = self.watch_from_token() {
                // A token named the next due time: watch it (and any earlier
                // watch of this process), with no fetch to learn it.
                self.then = Some(Then::Watch { ms });
                continue;
            }
            self.watching = None;
            // Kicks from here on are for turns this fetch may not see.
            self.shared.kicked.store(false, Ordering::SeqCst);
            // Counted after the idle wait: handlers may have started or ended in it.
            let mut free = self.free_slot().await;
            let batch = self.queue.config().fetch_batch.min(self.shared.concurrency);
            if backlog && free < batch / 4 {
                // The last fetch filled every free slot and more was due: the
                // slots free one by one as handlers return. Gather a quarter
                // of a batch for one fetch (its fixed cost shared), for at
                // most GATHER, which no due turn notices.
                let until = tokio::time::Instant::now() + GATHER;
                while free < batch / 4 {
                    let freed = self.shared.slot_freed.notified();
                    if tokio::time::timeout_at(until, freed).await.is_err() {
                        break;
                    }
                    free = self.free_slot().await;
                }
                free = self.free_slot().await;
            }
            let want = free.min(self.queue.config().fetch_batch);
            let why = std::mem::replace(&mut self.why, FetchWhy::Unsaid);
            match fetch_in_task(self.queue.clone(), self.script.clone(), self.shared.clone(), want, why).await {
                Ok(fetched) => {
                    debug!(message = "fetched", ?why, want, got = fetched.deliveries.len(), held = fetched.held, then = ?fetched.then);
                    self.failures = 0;
                    self.clock = Some((fetched.now_ms, Instant::now()));
                    self.then = Some(fetched.then);
                    // Turns the fetch's own pacer ask owed time again: budget
                    // waits as much as the ones a turn's ask requeues.
                    if fetched.held > 0 {
                        metrics::counter!(shared::telemetry::metric::BUDGET_WAITS).increment(fetched.held);
                        if let Some(f) = self.shared.on_held.get() {
                            f();
                        }
                    }
                    for d in fetched.deliveries {
                        self.accept(d.lease, &d.payload).await;
                    }
                }
                Err(error) => {
                    self.failures += 1;
                    warn!(message = "fetch failed; retrying", %error, attempt = self.failures);
                    tokio::time::sleep(backoff(self.failures)).await;
                }
            }
        }
    }

    /// Waits until a slot is free, and returns how many are. A wait here makes
    /// the last fetch's advice stale (the worker was busy, not idle): the next
    /// step is a fetch.
    pub(super) async fn free_slot(&mut self) -> usize {
        loop {
            let busy = self.busy();
            if busy < self.shared.concurrency {
                return self.shared.concurrency - busy;
            }
            self.then = None;
            // No room: a token taken now would wait for a slot here.
            self.stop_listening().await;
            // `notify_one` keeps a permit when nobody waits, so a slot freed
            // between the check and this wait is not missed.
            self.shared.slot_freed.notified().await;
        }
    }

    /// Slots taken: handlers running, and tasks handed to the worker that
    /// have not started yet.
    fn busy(&self) -> usize {
        self.shared.running.load(Ordering::SeqCst) + self.shared.handed.load(Ordering::SeqCst)
    }

    pub(super) async fn accept(&mut self, lease: Lease, payload: &str) {
        match serde_json::from_str::<T>(payload) {
            Ok(args) => {
                let lease = lease.with_fetcher(Arc::new(FetcherHandle(Arc::downgrade(&self.shared))));
                self.shared.hold(&lease, Instant::now());
                let task = TaskBuilder::new(args)
                    .task_id(TaskId::from(format!("{}#{}", lease.id, lease.epoch)))
                    .attempt(lease.deliveries as usize)
                    .data(lease)
                    .build();
                self.buffer.push_back(task);
            }
            Err(error) => {
                // A payload no handler can read would fail every delivery: bury it now.
                warn!(message = "undecodable payload; turn goes dead", %error, queue.id = %lease.id);
                self.shared.forget(&lease);
                let reason = format!("undecodable payload: {error}");
                if let Err(error) = self.queue.dead(&lease, &reason).await {
                    warn!(message = "could not bury an undecodable turn", %error, queue.id = %lease.id);
                }
            }
        }
    }

    /// Waits until a token arrives, the watched due time passes (`watch_ms`),
    /// a handler of this process queues a turn quietly (a kick), or the
    /// safety-net interval elapses.
    pub(super) async fn idle(&mut self, watch_ms: Option<i64>) {
        let shared = self.shared.clone();
        let kicked = shared.kick.notified();
        tokio::pin!(kicked);
        kicked.as_mut().enable();
        if shared.kicked.load(Ordering::SeqCst) {
            // Queued since the last fetch began: it may not have seen it.
            self.why = FetchWhy::Kick;
            return;
        }
        let cap = self.safety_net();
        // +1 ms: the timer must not fire before the due time; the fetch script
        // re-checks against the server clock anyway.
        let wait = watch_ms.map(|w| Duration::from_millis(w.max(0) as u64 + 1)).unwrap_or(cap).min(cap);
        // What ends the wait unless a token or a kick does first.
        self.why = if wait < cap { FetchWhy::Watch } else { FetchWhy::SafetyNet };
        let Some((conn, _)) = self.blocking_conn(cap).await else {
            tokio::time::sleep(wait.min(backoff(self.failures.max(1)))).await;
            return;
        };
        if !self.unblock {
            // Without CLIENT UNBLOCK, the server's own timeout ends a watch (at
            // least 10 ms: 0 would block forever), and nothing stays outstanding.
            let result = blpop(conn, self.queue.keys().notify.clone(), wait.max(Duration::from_millis(10))).await;
            self.listened(result);
            return;
        }
        // One BLPOP outstanding, ended by a token or the safety net (the
        // server's timeout); the watch's timer and a kick leave it listening.
        let listen = self.listening.get_or_insert_with(|| blpop(conn, self.queue.keys().notify.clone(), cap));
        let timer = async move {
            if wait < cap {
                tokio::time::sleep(wait).await
            } else {
                std::future::pending().await
            }
        };
        // (Biased, the read first: however the wait ends, its BLPOP has gone
        // to its connection, so a later `stop_listening` finds it on its way
        // or blocked on the server, not unsent.)
        tokio::select! {
            biased;
            r = listen => {
                self.listening = None;
                self.why = FetchWhy::SafetyNet;
                self.listened(r);
            }
            _ = timer => {}
            _ = kicked => self.why = FetchWhy::Kick,
        }
        debug!(message = "idle wait ended", why = ?self.why);
    }

    /// What to do when the watch this process's timer ended: the queue's
    /// claim (`timer`, `due|worker`) is the earliest due time any worker
    /// watches (turns due at once wake workers with tokens of their own). Its
    /// time passed, or there is none (expired): fetch (anyone's to act on; 50
    /// ms of slack for this process's reading of the server's clock). Still
    /// ahead and this worker's: watch it. Still ahead and another worker's:
    /// that worker's fetch claimed it, and a fetch takes everything due before
    /// the time it claims — the turn this worker watched was released early
    /// and taken, or its line's head moved — so a fetch now would find
    /// nothing: listen. Still ahead and for whoever takes a token (`*`):
    /// fetch. Such a claim says nothing of what is due before it: a claim
    /// whose time passed is anyone's to replace (lib.lua `q_claim_of`), so a
    /// wake-up for a later time overwrites this worker's own claim while the
    /// turn it watched is still due (a timer late under load); listening then
    /// left that turn due with nobody to take it until an idle registration's
    /// look for a turn left due, seconds later. One `GET` instead of a fetch
    /// when the claim is another worker's; on any doubt (an error, a clock not
    /// read yet), the worker fetches.
    async fn after_watch(&mut self) -> AfterWatch {
        let claim: redis::RedisResult<Option<String>> =
            redis::cmd("GET").arg(&self.queue.keys().timer).query_async(&mut self.queue.conn()).await;
        let Ok(Some(claim)) = claim else { return AfterWatch::Fetch };
        let Some((at, who)) = claim.split_once('|') else { return AfterWatch::Fetch };
        let (Ok(at), Some((server_ms, read))) = (at.parse::<i64>(), self.clock) else { return AfterWatch::Fetch };
        let server_now = server_ms + read.elapsed().as_millis() as i64;
        if at <= server_now + 50 || who == "*" {
            AfterWatch::Fetch
        } else if who == self.shared.identity {
            AfterWatch::Watch { ms: at - server_now }
        } else {
            AfterWatch::Listen
        }
    }

    /// How long until the due time a token named, or this process's own watch
    /// if that is sooner (ms, from the server's clock as the last fetch read
    /// it); `None` when no token named one, it is due already, or no fetch has
    /// read the clock yet: then the worker fetches.
    fn watch_from_token(&mut self) -> Option<i64> {
        let due = self.watch_token.take()?;
        let (server_ms, at) = self.clock?;
        let server_now = server_ms + at.elapsed().as_millis() as i64;
        let mut ms = due - server_now;
        if let Some(w) = self.watching {
            ms = ms.min(w.saturating_duration_since(tokio::time::Instant::now()).as_millis() as i64);
        }
        (ms > 0).then_some(ms)
    }

    /// A `BLPOP` returned: on an error, the blocking connection is opened
    /// again at the next wait. A token that names a due time (`w` and server
    /// ms) is watched; any other wakes a fetch.
    pub(super) fn listened(&mut self, result: redis::RedisResult<Option<(String, String)>>) {
        if let Ok(Some((_, token))) = &result {
            match token.strip_prefix('w').and_then(|t| t.parse::<i64>().ok()) {
                Some(due) => self.watch_token = Some(self.watch_token.map_or(due, |d| d.min(due))),
                None => self.why = FetchWhy::Token,
            }
        }
        if let Err(error) = result {
            debug!(message = "blocking read failed; reconnecting", %error);
            self.blocking = None;
            self.listening = None;
        }
    }

    /// Stops listening (every slot is taken): the outstanding `BLPOP` is
    /// cancelled on the server, and a token it took in that moment is pushed
    /// back for a worker with room.
    pub(super) async fn stop_listening(&mut self) {
        let Some(mut listen) = self.listening.take() else { return };
        // Returned already (a token taken while the process was busy): nothing to cancel.
        let result = match (&mut listen).now_or_never() {
            Some(result) => result,
            None => {
                let client_id = self.blocking.as_ref().map_or(-1, |b| b.1);
                let mut looks = 0;
                loop {
                    let unblock: redis::RedisResult<i64> = redis::cmd("CLIENT")
                        .arg("UNBLOCK")
                        .arg(client_id)
                        .arg("TIMEOUT")
                        .query_async(&mut self.queue.conn())
                        .await;
                    match unblock {
                        Err(error) => {
                            if error.code().is_some() {
                                // Forbidden here (a managed Redis, an ACL): watch with BLPOP's own timeout from now on.
                                info!(message = "CLIENT UNBLOCK is not allowed; watching with BLPOP timeouts instead", %error);
                                metrics::counter!(shared::telemetry::metric::QUEUE_UNBLOCK_FALLBACKS).increment(1);
                                self.unblock = false;
                                self.shared.can_unblock.store(false, Ordering::SeqCst);
                            }
                            // The connection goes with its BLPOP (closing it ends the BLPOP).
                            self.blocking = None;
                            return;
                        }
                        // Unblocked: its reply (nil, or a token taken in that moment) comes at once.
                        Ok(n) if n > 0 => match tokio::time::timeout(Duration::from_secs(2), &mut listen).await {
                            Ok(result) => break result,
                            Err(_) => {
                                self.blocking = None;
                                return;
                            }
                        },
                        // Nothing blocked: the BLPOP has not reached Redis yet (sent on its
                        // own connection, it can arrive after this), its reply is on its way
                        // (a token), or, on a cluster, the id is of the primary before a
                        // failover (its client moved the read to the new one). Look again
                        // shortly; after ~100 ms the connection goes — closing it ends its
                        // read — and the next has its own id.
                        Ok(_) => match tokio::time::timeout(Duration::from_millis(10), &mut listen).await {
                            Ok(result) => break result,
                            Err(_) if looks < 10 => looks += 1,
                            Err(_) => {
                                self.blocking = None;
                                return;
                            }
                        },
                    }
                }
            }
        };
        match result {
            Ok(Some((_, token))) => {
                debug!(message = "every slot taken: a wake-up token pushed back", %token);
                let pushed: redis::RedisResult<i64> = redis::cmd("LPUSH")
                    .arg(&self.queue.keys().notify)
                    .arg(token)
                    .query_async(&mut self.queue.conn())
                    .await;
                if let Err(error) = pushed {
                    debug!(message = "could not push back a wake-up token", %error);
                }
            }
            other => self.listened(other),
        }
    }

    /// How long an idle worker waits for a token before it looks anyway: the
    /// configured interval times four times the fleet (at most 64×), so the
    /// fleet looks about as often as one worker every four intervals would,
    /// whatever its size; jittered ±20 % so the fleet's looks spread out. (A
    /// turn left due is found sooner by the idle workers' beats,
    /// heartbeat.lua; this net is for a Redis that loses what those write.)
    pub(super) fn safety_net(&self) -> Duration {
        let base = self.queue.config().idle_ms.max(100) as f64;
        let scale = (self.shared.fleet.load(Ordering::Relaxed) as f64 * 4.0).clamp(1.0, 64.0);
        Duration::from_millis((base * scale * (0.8 + 0.4 * rand::random::<f64>())) as u64)
    }

    pub(super) async fn blocking_conn(&mut self, cap: Duration) -> Option<(RedisConn, i64)> {
        if let Some(b) = &self.blocking {
            return Some(b.clone());
        }
        // An id of -1: CLIENT forbidden altogether, so no UNBLOCK either (see `idle`).
        match shared::redis_util::blocking(self.queue.redis(), cap + Duration::from_secs(5)).await {
            Ok(b) => {
                if b.1 < 0 && self.unblock {
                    info!(message = "CLIENT is not allowed; watching with BLPOP timeouts instead");
                    metrics::counter!(shared::telemetry::metric::QUEUE_UNBLOCK_FALLBACKS).increment(1);
                    self.unblock = false;
                    self.shared.can_unblock.store(false, Ordering::SeqCst);
                }
                self.blocking = Some(b.clone());
                Some(b)
            }
            Err(error) => {
                self.failures += 1;
                warn!(message = "cannot open the blocking connection; retrying", %error, attempt = self.failures);
                None
            }
        }
    }
}

/// A `BLPOP` on the wake-up tokens, owning its connection handle.
type Listen = BoxFuture<'static, redis::RedisResult<Option<(String, String)>>>;

fn blpop(mut conn: RedisConn, key: String, timeout: Duration) -> Listen {
    async move { redis::cmd("BLPOP").arg(&key).arg(timeout.as_secs_f64()).query_async(&mut conn).await }.boxed()
}

/// How long a saturated worker gathers freed slots before it fetches.
const GATHER: Duration = Duration::from_millis(2);

/// Exponential backoff for Redis trouble: 50 ms doubling to 2 s.
pub(super) fn backoff(failures: u32) -> Duration {
    Duration::from_millis((50u64 << failures.min(6)).min(2000))
}

/// What a worker whose watch's timer went does ([`Fetcher::after_watch`]).
enum AfterWatch {
    /// Its time (or a later claim's) is due: fetch.
    Fetch,
    /// Another worker's fetch claimed a later time: listen.
    Listen,
    /// This worker's own claim is for a later time: watch that, `ms` from now.
    Watch { ms: i64 },
}
