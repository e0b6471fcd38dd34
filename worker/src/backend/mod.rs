//! The apalis-core 1.0 `Backend` over the turn queue, and the layer that
//! settles each delivery when its handler returns.
//!
//! Why `Backend` directly and not `custom::BackendBuilder`: a custom backend's
//! middleware is `Identity` and its `poll_close` only closes the sink, but the
//! queue needs a layer around the handler (complete on `Ok`, retry on `Err` or
//! panic, hand back at the shutdown grace, cap the slots) and a close that hands
//! back turns leased but never started.
//!
//! Waking without busy polling, lost wake-ups or a herd: each worker process
//! has one fetcher, and it fetches only when it has a free slot (no more than
//! its free slots). A fetch that took everything due tells the worker what to
//! do until the next (fetch.lua, [`Then`]): across the fleet, exactly one idle
//! worker *watches* the earliest delayed turn (the queue's `timer` key names
//! it) and sleeps towards it on a local timer (server clock arithmetic, so host
//! clocks never matter); every other idle worker blocks on `BLPOP notify` (own
//! connection, its own long response timeout) until a token or its safety-net
//! interval, which grows with the fleet so the fleet's idle checks stay as few
//! as two workers' would. A turn due now, or due before the watched time, pushes
//! one token (one worker wakes, not all); a token for a time to come names it
//! (`w` and server ms, `q_wake_at`, which claims the watch for whoever takes
//! it): the worker that takes it watches that time, its clock read from its
//! last fetch, with no fetch to learn it; a fetch that filled its batch pushes
//! one more (so idle workers join in); a fetch that a token woke and that took
//! everything clears the rest (only such a fetch: any other would pay a `DEL`
//! for tokens that are rarely there, since a token reaches a listening worker
//! at once).
//! Redis's own blocking timeouts tick at `hz` (100 ms here), too coarse for the
//! 50 ms bar, hence the local timer. A process's `BLPOP` stays outstanding
//! while it has a free slot, across its timer's wake-ups, kicks and fetches (a
//! token it takes meanwhile ends its next idle wait at once): it is issued again
//! only when it returned, so a busy process wakes and fetches without a Redis
//! command of its own. As the process's last free slot is taken it stops
//! listening (`CLIENT UNBLOCK … TIMEOUT`, a token taken in that moment pushed
//! back), so it cannot swallow a token meant for a worker with room. Where the
//! server forbids `CLIENT UNBLOCK` (some managed Redis), each idle wait is a
//! `BLPOP` with its own timeout instead (coarser by up to `hz`), quietly,
//! counted in `paceline_queue_unblock_fallbacks_total`.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::task::AtomicWaker;
use futures::{FutureExt, StreamExt};
use serde::de::DeserializeOwned;
use shared::queue::apalis_core::backend::{finalize::Ephemeral, Backend, BackendConfig};
use shared::queue::apalis_core::error::{AbortError, BoxDynError, RetryAfterError};
use shared::queue::apalis_core::task::builder::TaskBuilder;
use shared::queue::apalis_core::task::task_id::{RandomId, TaskId};
use shared::queue::apalis_core::task::Task;
use shared::queue::apalis_core::worker::context::WorkerContext;
use shared::queue::{FetchScript, Lease, LocalFetcher, QueueConfig, QueueError, Settled, Then, TurnQueue, WorkerInfo};
use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::{debug, info, warn};

mod fetcher;
mod heartbeat;
mod layer;

use fetcher::{backoff, Fetcher};
use heartbeat::heartbeat_loop;
use layer::{settle_patiently, Settlement};
pub use layer::{LeaseLayer, LeaseService};

/// State one worker process's backend shares with its layer and heartbeat.
struct BackendState {
    identity: String,
    concurrency: usize,
    /// Handlers running now (slots in use).
    running: AtomicUsize,
    /// Tasks handed to apalis and not yet started: their slots are spoken for.
    handed: AtomicUsize,
    /// Signalled when a slot frees (the fetcher waits on it when all are busy).
    slot_freed: tokio::sync::Notify,
    /// Live worker processes of the fleet, as the last heartbeat counted them.
    fleet: AtomicUsize,
    /// Every lease this worker holds (fetched and not yet settled), and when
    /// it was last renewed: the heartbeat that sent it began, or the fetch
    /// that leased it was sent (both no later than the server's own clock
    /// started its lease).
    held: Mutex<HashMap<String, (Lease, Instant)>>,
    slot_waker: AtomicWaker,
    /// Turns true when the shutdown grace is over: running handlers are dropped
    /// and their turns handed back.
    grace: watch::Sender<bool>,
    /// Fetches under way. A fetch runs in a task of its own and holds what it
    /// leased before it returns, so a worker that closes mid-fetch still knows
    /// (and hands back) every lease Redis granted it.
    fetching: AtomicUsize,
    /// The worker is shutting down: it fetches no more.
    stopping: AtomicBool,
    /// A handler queued a turn without a wake-up token since the last fetch
    /// began (`Lease::kick`): fetch again before going idle.
    kicked: AtomicBool,
    /// Wakes an idle fetcher when kicked.
    kick: tokio::sync::Notify,
    /// A due time a handler's commit moved up for this process to watch
    /// (`Lease::watch`; 0: none): taken by the fetcher as a token naming it.
    watch_hint: std::sync::atomic::AtomicI64,
    /// The server lets this worker cancel its idle `BLPOP` (`CLIENT UNBLOCK`),
    /// which a kick needs; without it, turns are queued with a token as before.
    can_unblock: AtomicBool,
    /// Told when a fetch's own pacer ask owed a due turn time and left it
    /// queued (see [`QueueBackend::on_held`]).
    on_held: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl BackendState {
    /// Holds `lease`, leased by a fetch sent at `since` (a lease held
    /// already keeps its renewal time: the backend holds it again with its
    /// fetcher's handle).
    fn hold(&self, lease: &Lease, since: Instant) {
        let mut held = self.held.lock().expect("held lock");
        let since = match held.get(&lease.id) {
            Some((l, at)) if l.epoch == lease.epoch => *at,
            _ => since,
        };
        held.insert(lease.id.clone(), (lease.clone(), since));
    }

    fn forget(&self, lease: &Lease) {
        let mut held = self.held.lock().expect("held lock");
        if held.get(&lease.id).is_some_and(|(l, _)| l.epoch == lease.epoch) {
            held.remove(&lease.id);
        }
    }

    /// Tells the handler of `id` at `epoch` that its lease was taken back.
    fn lost(&self, id: &str, epoch: u64) -> bool {
        let held = self.held.lock().expect("held lock");
        match held.get(id).filter(|(l, _)| l.epoch == epoch) {
            Some((lease, _)) => {
                lease.mark_lost();
                true
            }
            None => false,
        }
    }

    fn leases(&self) -> Vec<(String, u64)> {
        self.held.lock().expect("held lock").values().map(|(l, _)| (l.id.clone(), l.epoch)).collect()
    }

    /// When the lease renewed longest ago was renewed (None: none held).
    fn oldest_renewal(&self) -> Option<Instant> {
        self.held.lock().expect("held lock").values().map(|(_, at)| *at).min()
    }

    /// Notes that a heartbeat begun at `at` renewed `leases` (the ones still
    /// held at the same epoch).
    fn renewed(&self, leases: &[(String, u64)], at: Instant) {
        let mut held = self.held.lock().expect("held lock");
        for (id, epoch) in leases {
            if let Some((l, renewed)) = held.get_mut(id) {
                if l.epoch == *epoch {
                    *renewed = (*renewed).max(at);
                }
            }
        }
    }
}

/// The apalis backend of the turn queue for one worker process.
///
/// Build a worker with it:
/// ```ignore
/// let backend = queue.backend::<TurnJob>(16);
/// let name = backend.identity().to_owned();
/// WorkerBuilder::new(name).backend(backend).data(queue.clone()).build(handle_turn)
///     .run_until(shutdown).await?;
/// async fn handle_turn(turn: TurnJob, lease: Lease, queue: Data<TurnQueue>) -> Result<(), BoxDynError>
/// ```
/// It caps running handlers at `concurrency` itself (no `.concurrency()` layer
/// needed) and fetches no more than the free slots. Each task carries its
/// [`Lease`] (an extractor). When the handler returns `Ok` without settling, the
/// turn is completed; `Err` or a panic retries it after
/// [`QueueConfig::retry_delay_ms`] or buries it after `max_deliveries`;
/// `AbortError` buries it at once; `RetryAfterError` retries after its delay.
/// On shutdown it stops fetching, lets handlers run for `grace_ms`, then hands
/// their turns back (due now), hands back fetched-but-unstarted turns, and
/// leaves the worker registry. Redis errors never end the worker's `run()`:
/// the backend logs them and retries with backoff.
pub struct QueueBackend<T> {
    queue: TurnQueue,
    /// The script it fetches with (`None`: the queue's own).
    fetch_script: Option<FetchScript>,
    shared: Arc<BackendState>,
    fetcher: Option<BoxStream<'static, Task<T>>>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    closing: Option<BoxFuture<'static, ()>>,
    _args: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for QueueBackend<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueBackend").field("identity", &self.shared.identity).finish()
    }
}

impl<T> Drop for QueueBackend<T> {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}

impl<T> QueueBackend<T> {
    /// An apalis backend that delivers the turns of `queue` (payload `T`) to
    /// this worker process, with `concurrency` slots.
    pub fn new(queue: TurnQueue, concurrency: usize) -> Self {
        let (grace, _) = watch::channel(false);
        Self {
            queue,
            fetch_script: None,
            shared: Arc::new(BackendState {
                identity: shared::queue::new_worker_identity(),
                concurrency: concurrency.max(1),
                running: AtomicUsize::new(0),
                handed: AtomicUsize::new(0),
                slot_freed: tokio::sync::Notify::new(),
                fleet: AtomicUsize::new(1),
                held: Mutex::new(HashMap::new()),
                slot_waker: AtomicWaker::new(),
                grace,
                fetching: AtomicUsize::new(0),
                stopping: AtomicBool::new(false),
                kicked: AtomicBool::new(false),
                kick: tokio::sync::Notify::new(),
                watch_hint: std::sync::atomic::AtomicI64::new(0),
                can_unblock: AtomicBool::new(true),
                on_held: std::sync::OnceLock::new(),
            }),
            fetcher: None,
            heartbeat: None,
            closing: None,
            _args: PhantomData,
        }
    }

    /// This worker process's identity (unique per start); use it as the apalis worker name.
    pub fn identity(&self) -> &str {
        &self.shared.identity
    }

    /// This backend, fetching with `script` (a fetch that does more with
    /// each turn it leases: the run store's starts it; what it did rides on
    /// the task's [`Lease`], `Lease::extra`).
    pub fn fetching_with(mut self, script: FetchScript) -> Self {
        self.fetch_script = Some(script);
        self
    }

    /// This backend, telling `f` when a fetch's own pacer ask owed a due turn
    /// time and left it queued (the worker notes its budget scarce: its
    /// commits then ask for the next turn themselves, `OwedLately`).
    pub fn on_held(self, f: impl Fn() + Send + Sync + 'static) -> Self {
        let _ = self.shared.on_held.set(Box::new(f));
        self
    }

    /// What tells the backend that its worker is shutting down (see [`Stopping`]).
    pub fn stopping(&self) -> Stopping {
        Stopping(self.shared.clone())
    }
}

/// A handler's reach into its process's fetcher (`Lease::refetches`, `Lease::kick`).
/// Weak: the backend's state holds its leases.
struct FetcherHandle(std::sync::Weak<BackendState>);

impl std::fmt::Debug for FetcherHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FetcherHandle")
    }
}

impl LocalFetcher for FetcherHandle {
    fn will_fetch(&self) -> bool {
        self.0.upgrade().is_some_and(|s| !s.stopping.load(Ordering::SeqCst) && s.can_unblock.load(Ordering::SeqCst))
    }

    fn kick(&self) {
        if let Some(s) = self.0.upgrade() {
            s.kicked.store(true, Ordering::SeqCst);
            s.kick.notify_waiters();
        }
    }

    fn watch(&self, due_ms: i64) {
        if let Some(s) = self.0.upgrade() {
            // The earliest, if two commits hint before the fetcher looks.
            let _ = s
                .watch_hint
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| Some(if h > 0 { h.min(due_ms) } else { due_ms }));
            // (Not `kicked`: that asks for a fetch; this only wakes an idle wait.)
            s.kick.notify_waiters();
        }
    }
}

/// Tells a backend that its worker is shutting down: from then on it never
/// counts on fetching again, so the turns its handlers requeue wake another
/// worker. Call it as the shutdown begins (apalis stops asking for turns then).
#[derive(Clone)]
pub struct Stopping(Arc<BackendState>);

impl Stopping {
    /// The shutdown has begun.
    pub fn stop(&self) {
        self.0.stopping.store(true, Ordering::SeqCst);
    }
}

impl<T: DeserializeOwned + Send + 'static> Backend for QueueBackend<T> {
    type Task = Task<T>;
    type Error = QueueError;

    fn poll_ready(&mut self, _cx: &mut Context<'_>, _worker: &WorkerContext) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Option<Result<Self::Task, Self::Error>>> {
        if self.heartbeat.is_none() {
            // On the worker's own runtime, on purpose: a heartbeat that kept
            // renewing the leases of a process whose handlers cannot run (a
            // wedged runtime) would hold its turns forever. CPU-bound work in
            // a turn steps off the runtime's threads instead (worker's
            // `cpu_bound`), so it cannot starve this.
            let hb = heartbeat_loop(self.queue.clone(), self.shared.clone(), worker.clone());
            self.heartbeat = Some(tokio::spawn(hb));
        }
        let fetcher = self.fetcher.get_or_insert_with(|| {
            let state = Fetcher::<T> {
                queue: self.queue.clone(),
                script: self.fetch_script.clone(),
                shared: self.shared.clone(),
                buffer: VecDeque::new(),
                then: None,
                blocking: None,
                listening: None,
                unblock: true,
                why: shared::queue::FetchWhy::Unsaid,
                watch_token: None,
                clock: None,
                watching: None,
                failures: 0,
            };
            futures::stream::unfold(state, |mut f| async move {
                let task = f.next_task().await;
                Some((task, f))
            })
            .boxed()
        });
        // The fetcher never ends and never yields an error: Redis trouble is
        // retried inside, so the worker's `run()` survives a Redis restart.
        fetcher.poll_next_unpin(cx).map(|t| t.map(Ok))
    }

    fn poll_close(&mut self, cx: &mut Context<'_>, _worker: &WorkerContext) -> Poll<Result<(), Self::Error>> {
        if self.closing.is_none() {
            // Handlers have all returned by now (apalis drains them first), so
            // every lease still held was fetched and never started.
            // (A fetch under way finishes in its own task and holds what it got.)
            self.fetcher = None;
            let shared = self.shared.clone();
            let queue = self.queue.clone();
            let identity = self.shared.identity.clone();
            let heartbeat = self.heartbeat.take();
            self.closing = Some(
                async move {
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                    while shared.fetching.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    let unstarted: Vec<Lease> =
                        shared.held.lock().expect("held lock").drain().map(|(_, (l, _))| l).collect();
                    for lease in &unstarted {
                        settle_patiently(&queue, lease, Settlement::Release).await;
                    }
                    if let Some(h) = heartbeat {
                        h.abort();
                    }
                    if let Err(error) = queue.deregister(&identity).await {
                        warn!(message = "could not leave the worker registry", %error, worker.id = %identity);
                    }
                    info!(message = "worker left the queue", worker.id = %identity, handed_back = unstarted.len());
                }
                .boxed(),
            );
        }
        self.closing.as_mut().expect("closing set").poll_unpin(cx).map(|()| Ok(()))
    }
}

impl<T: DeserializeOwned + Send + 'static> BackendConfig for QueueBackend<T> {
    type Args = T;
    type Id = RandomId;
    type Kind = Ephemeral;
    type Config = QueueConfig;
    type Layer = LeaseLayer;

    fn config(&self) -> &Self::Config {
        self.queue.config()
    }

    fn middleware(&mut self, _worker: &mut WorkerContext) -> Self::Layer {
        LeaseLayer { queue: self.queue.clone(), shared: self.shared.clone() }
    }
}
