//! The turn queue against a real redis-server, with real worker processes
//! (`paceline queue-probe consume`) where killing or signalling one matters.

use futures::StreamExt;
use paceline_tests::{eventually, paceline_bin, unique_prefix, within, ChildGuard, RedisOptions, RedisServer};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::queue::apalis_core::error::BoxDynError;
use shared::queue::apalis_core::task::data::Data;
use shared::queue::apalis_core::worker::builder::WorkerBuilder;
use shared::queue::{FetchWhy, Lease, QueueConfig, QueueError, Then, TurnQueue, LUA_LIB, MAX_FETCH_BATCH};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A private server, a unique prefix, and a queue on them.
struct Env {
    server: RedisServer,
    redis: RedisArgs,
    queue: TurnQueue,
}

impl Env {
    fn start(config: QueueConfig) -> Self {
        Self::start_with(RedisOptions::default(), config)
    }

    fn start_with(opts: RedisOptions, config: QueueConfig) -> Self {
        let server = RedisServer::start_with(opts);
        let redis = RedisArgs::new(server.url(), unique_prefix());
        let queue = TurnQueue::new(&redis, config).expect("queue");
        Self { server, redis, queue }
    }

    /// A worker process running the no-op probe consumer.
    fn spawn_probe(&self, extra: &[&str]) -> ChildGuard {
        let child = Command::new(paceline_bin())
            .args(["queue-probe", "consume", "--prefix", &self.redis.prefix])
            .env("REDIS_URL", &self.redis.url)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn paceline queue-probe consume");
        ChildGuard(child)
    }

    /// How many times the probe completed each turn (`--record`).
    async fn probe_done(&self) -> std::collections::HashMap<String, u64> {
        let mut conn = self.server.conn().await;
        redis::cmd("HGETALL").arg(self.redis.keys().probe_done()).query_async(&mut conn).await.unwrap_or_default()
    }

    async fn enqueue_many(&self, tag: &str, n: usize, payload: Value, delay_ms: u64) {
        let payload = &payload;
        let results: Vec<_> = futures::stream::iter(0..n)
            .map(|i| async move { self.queue.enqueue(&format!("{tag}-{i}"), payload, delay_ms).await })
            .buffer_unordered(64)
            .collect()
            .await;
        assert!(results.into_iter().all(|r| r.expect("enqueue")), "every id was new");
    }

    async fn wait_drained(&self, timeout: Duration) {
        let q = &self.queue;
        eventually("the queue to drain", timeout, || async move {
            let c = q.counts().await.ok()?;
            (c.ready + c.delayed + c.in_flight == 0).then_some(())
        })
        .await;
    }
}

/// What in-process handlers saw.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Started>>>);

#[derive(Clone, Debug)]
struct Started {
    id: String,
    due_ms: i64,
    server_now_ms: i64,
    deliveries: u32,
}

impl Seen {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn all(&self) -> Vec<Started> {
        self.0.lock().unwrap().clone()
    }
}

#[derive(Clone)]
struct HandlerState {
    seen: Seen,
    queue: TurnQueue,
    fail: bool,
    /// How long a turn is held before it is recorded.
    hold_ms: u64,
}

async fn record_turn(_payload: Value, lease: Lease, state: Data<HandlerState>) -> Result<(), BoxDynError> {
    tokio::time::sleep(Duration::from_millis(state.hold_ms)).await;
    // The server's clock, read independently of the fetch script.
    let server_now_ms = state.queue.server_time_ms().await?;
    state.seen.0.lock().unwrap().push(Started {
        id: lease.id.clone(),
        due_ms: lease.due_ms,
        server_now_ms,
        deliveries: lease.deliveries,
    });
    if state.fail {
        return Err("boom: this handler always fails".into());
    }
    Ok(())
}

/// Runs an apalis worker over the queue in this process until the returned sender fires.
fn run_worker(
    queue: &TurnQueue,
    concurrency: usize,
    state: HandlerState,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    run_worker_named(queue, concurrency, state).0
}

/// [`run_worker`], and the worker's identity (what its claims name).
fn run_worker_named(
    queue: &TurnQueue,
    concurrency: usize,
    state: HandlerState,
) -> ((tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>), String) {
    let backend = worker::backend::QueueBackend::<Value>::new(queue.clone(), concurrency);
    let name = backend.identity().to_owned();
    let worker = WorkerBuilder::new(name.as_str()).backend(backend).data(state).build(record_turn);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        worker
            .run_until(async move {
                let _ = stopped.await;
                Ok::<(), std::io::Error>(())
            })
            .await
            .expect("worker run() never ends in error");
    });
    ((stop, handle), name)
}

/// Stops workers [`run_worker`] started, and waits for them to end.
async fn stop_workers(workers: Vec<(tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)>) {
    let mut handles = vec![];
    for (stop, handle) in workers {
        let _ = stop.send(());
        handles.push(handle);
    }
    within("workers to stop", secs(10), async {
        for h in handles {
            h.await.unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn counts_are_exact_and_enqueue_is_idempotent_by_id() {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    assert!(q.enqueue("run_a", &json!({"turn": 1}), 0).await.unwrap());
    assert!(q.enqueue("run_b", &json!({"turn": 1}), 0).await.unwrap());
    assert!(q.enqueue("run_c", &json!({"turn": 1}), 60_000).await.unwrap());
    assert!(!q.enqueue("run_a", &json!({"turn": 9}), 0).await.unwrap(), "a second enqueue of an id changes nothing");
    assert_eq!(q.payload::<Value>("run_a").await.unwrap(), Some(json!({"turn": 1})));

    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight, c.dead), (2, 1, 0, 0));
    let next = c.next_due_ms.expect("a delayed turn has a due time");
    assert!((59_000..=60_000).contains(&(next - c.now_ms)), "next due in ~60 s, got {}", next - c.now_ms);

    let fetched = q.fetch("w1", 10).await.unwrap();
    assert_eq!(fetched.deliveries.len(), 2, "only the due turns are fetched");
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight, c.dead), (0, 1, 2, 0));

    // A fetch that finds nothing due is counted (the bench reports it per turn).
    assert!(q.fetch("w2", 10).await.unwrap().deliveries.is_empty());
    let mut conn = env.server.conn().await;
    // (Under its cause: `fetch` is a token's.)
    let empty: u64 =
        redis::cmd("HGET").arg(&q.keys().stats).arg("empty_fetches:token").query_async(&mut conn).await.unwrap();
    assert_eq!(empty, 1);
}

#[tokio::test]
async fn turns_never_start_before_their_due_time() {
    let env = Env::start(QueueConfig::default());
    let seen = Seen::default();
    let (stop, worker) = run_worker(
        &env.queue,
        8,
        HandlerState { seen: seen.clone(), queue: env.queue.clone(), fail: false, hold_ms: 0 },
    );
    for i in 0..100u64 {
        env.queue.enqueue(&format!("run_{i}"), &json!({}), 50 + i * 10).await.unwrap();
    }
    eventually("100 turns to start", secs(10), || async { (seen.len() >= 100).then_some(()) }).await;
    let mut worst = 0;
    for s in seen.all() {
        assert!(s.server_now_ms >= s.due_ms, "{} started {} ms early", s.id, s.due_ms - s.server_now_ms);
        worst = worst.max(s.server_now_ms - s.due_ms);
    }
    // Not a timing claim (the bench has those): a worker that slept through its
    // timer would be seconds late.
    assert!(worst < 1000, "a turn started {worst} ms late");
    let _ = stop.send(());
    within("the worker to stop", secs(10), worker).await.unwrap();
}

/// How many fetches found nothing due (fetch.lua counts them, under their cause).
async fn empty_fetches(env: &Env) -> u64 {
    let mut conn = env.server.conn().await;
    let stats: Vec<(String, u64)> =
        redis::cmd("HGETALL").arg(&env.queue.keys().stats).query_async(&mut conn).await.unwrap_or_default();
    stats.iter().filter(|(field, _)| field.starts_with("empty_fetches")).map(|(_, n)| n).sum()
}

/// How many clients the server holds blocked (`INFO clients`): idle workers
/// waiting on `BLPOP`.
async fn blocked_clients(env: &Env) -> u64 {
    let mut conn = env.server.conn().await;
    let info: String = redis::cmd("INFO").arg("clients").query_async(&mut conn).await.unwrap();
    info.lines().find_map(|l| l.strip_prefix("blocked_clients:")).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
}

/// `n` worker processes of 2 slots (in-process backends, each its own
/// identity) that record what they start in `seen`, once every one has made
/// its first (empty) fetch and gone idle: all block on the server (`BLPOP`).
async fn idle_workers(
    env: &Env,
    n: usize,
    seen: &Seen,
) -> Vec<(tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)> {
    let workers = (0..n)
        .map(|_| {
            run_worker(
                &env.queue,
                2,
                HandlerState { seen: seen.clone(), queue: env.queue.clone(), fail: false, hold_ms: 0 },
            )
        })
        .collect();
    eventually("the idle workers to block on the queue", secs(10), || async {
        (blocked_clients(env).await >= n as u64).then_some(())
    })
    .await;
    workers
}

/// Eight idle worker processes (in-process backends, each its own identity)
/// and 40 turns due one after another: each due time is watched by one of
/// them, not slept towards by all (which cost ~7 fetches that found nothing per
/// due time before the queue's timer key).
async fn delayed_turns_reach_one_idle_worker(env: &Env) -> u64 {
    let seen = Seen::default();
    let workers = idle_workers(env, 8, &seen).await;
    let before = empty_fetches(env).await;
    for i in 0..40u64 {
        env.queue.enqueue(&format!("run_{i}"), &json!({}), 300 + i * 60).await.unwrap();
    }
    eventually("40 turns to start", secs(20), || async { (seen.len() >= 40).then_some(()) }).await;
    let empty = empty_fetches(env).await - before;
    let mut worst = 0;
    for s in seen.all() {
        assert!(s.server_now_ms >= s.due_ms, "{} started {} ms early", s.id, s.due_ms - s.server_now_ms);
        worst = worst.max(s.server_now_ms - s.due_ms);
    }
    assert!(worst < 1000, "a turn started {worst} ms late");
    for (stop, handle) in workers {
        let _ = stop.send(());
        within("a worker to stop", secs(10), handle).await.unwrap();
    }
    empty
}

#[tokio::test]
async fn a_due_time_wakes_one_idle_worker_process_not_all() {
    let env = Env::start(QueueConfig::default());
    let empty = delayed_turns_reach_one_idle_worker(&env).await;
    // One watcher takes them in turn; the rest look only at their safety net
    // (at most one each here) or when an enqueue wakes one before anybody
    // watches. Every idle worker sleeping towards each due time cost ~300.
    eprintln!("{empty} fetches found nothing for 40 delayed turns and 8 idle workers");
    assert!(empty <= 20, "{empty} fetches found nothing for 40 delayed turns and 8 idle workers");
}

#[tokio::test]
async fn a_new_earliest_due_time_is_watched_with_no_fetch_to_learn_it() {
    // Its wake-up token names the time (`q_wake_at`): the idle worker it wakes
    // sleeps towards it and fetches once, when it is due. A plain token cost
    // a fetch that found nothing first, one per turn here. (No safety-net
    // looks in the span: they would fetch nothing too.)
    let env = Env::start(QueueConfig { idle_ms: 60_000, ..QueueConfig::default() });
    let seen = Seen::default();
    let workers = idle_workers(&env, 2, &seen).await;
    let before = empty_fetches(&env).await;
    for i in 0..6usize {
        env.queue.enqueue(&format!("run_{i}"), &json!({}), 300).await.unwrap();
        eventually("the turn to start", secs(10), || async { (seen.len() > i).then_some(()) }).await;
    }
    for s in seen.all() {
        assert!(s.server_now_ms >= s.due_ms, "{} started {} ms early", s.id, s.due_ms - s.server_now_ms);
        assert!(s.server_now_ms - s.due_ms < 1000, "{} started {} ms late", s.id, s.server_now_ms - s.due_ms);
    }
    let empty = empty_fetches(&env).await - before;
    assert_eq!(empty, 0, "{empty} fetches found nothing for 6 turns due one after another");
    for (stop, handle) in workers {
        let _ = stop.send(());
        within("a worker to stop", secs(10), handle).await.unwrap();
    }
}

#[tokio::test]
async fn a_watch_made_stale_by_an_early_release_costs_no_fetch() {
    // The pacer's line often lets its head go before the head's timer: its
    // entry moves to now and a token wakes some idle worker, while another
    // still sleeps towards the old time. The fetch that takes the turn finds
    // nothing due before the next turn and watches that instead; the worker
    // whose watch went stale finds its claim gone when its timer goes and
    // listens, rather than fetch for nothing (one watch-woken empty fetch per
    // early release before).
    let env = Env::start(QueueConfig { idle_ms: 60_000, ..QueueConfig::default() });
    let seen = Seen::default();
    let workers = idle_workers(&env, 8, &seen).await;
    env.queue.enqueue("run_a", &json!({}), 1_500).await.unwrap();
    env.queue.enqueue("run_b", &json!({}), 3_000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = empty_fetches(&env).await;
    // A release, as the pacer's host makes it: due now, and one worker woken.
    let mut conn = env.server.conn().await;
    let keys = env.queue.keys();
    let _: () = redis::cmd("ZADD").arg(&keys.due).arg(0).arg("run_a").query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("LPUSH").arg(&keys.notify).arg("1").query_async(&mut conn).await.unwrap();
    eventually("both turns to start", secs(10), || async { (seen.len() >= 2).then_some(()) }).await;
    let b = seen.all().into_iter().find(|s| s.id == "run_b").unwrap();
    assert!(b.server_now_ms >= b.due_ms && b.server_now_ms - b.due_ms < 1_000, "{b:?}");
    let empty = empty_fetches(&env).await - before;
    assert_eq!(empty, 0, "{empty} fetches found nothing (the stale watch's among them)");
    for (stop, handle) in workers {
        let _ = stop.send(());
        within("a worker to stop", secs(10), handle).await.unwrap();
    }
}

#[tokio::test]
async fn a_watcher_whose_claim_a_later_wake_up_replaced_still_takes_its_turn() {
    // A claim whose time passed is anyone's to replace (lib.lua `q_claim_of`):
    // a wake-up for a later time (a budget line's retime, a new turn) claims
    // that time for whoever takes its token while the turn the watcher slept
    // towards is still due — its timer late under load. When its timer goes
    // it finds a later claim, not its own: one for whoever takes a token says
    // nothing of what is due before it, so it fetches. (It listened instead,
    // and the turn stayed due until an idle registration's look for a turn
    // left due: the 8-s stalls CI showed with three worker processes.) Here
    // the later claim is written before the watcher's timer goes, which is
    // the same state the watcher reads.
    let env = Env::start(QueueConfig { idle_ms: 60_000, ..QueueConfig::default() });
    let seen = Seen::default();
    let workers = idle_workers(&env, 1, &seen).await;
    env.queue.enqueue("run_a", &json!({}), 1_000).await.unwrap();
    let mut conn = env.server.conn().await;
    let keys = env.queue.keys().clone();
    // The worker took run_a's token and sleeps towards its time.
    eventually("the watcher to take the token", secs(5), || async {
        let left: u64 = redis::cmd("LLEN").arg(&keys.notify).query_async(&mut env.server.conn().await).await.ok()?;
        (left == 0).then_some(())
    })
    .await;
    let (secs_now, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let later = secs_now * 1000 + micros / 1000 + 30_000;
    let _: () = redis::cmd("SET").arg(&keys.timer).arg(format!("{later}|*")).query_async(&mut conn).await.unwrap();
    eventually("run_a to start", secs(5), || async { (!seen.all().is_empty()).then_some(()) }).await;
    let a = seen.all().into_iter().find(|s| s.id == "run_a").unwrap();
    assert!(a.server_now_ms >= a.due_ms && a.server_now_ms - a.due_ms < 1_000, "{a:?}");
    stop_workers(workers).await;
}

#[tokio::test]
async fn a_worker_whose_last_slot_is_taken_leaves_the_wake_up_tokens_to_workers_with_room() {
    // Worker A (one slot; a turn holds it 3 s) blocks on the queue before
    // worker B (one slot) and watches run_a; run_b falls due with it. A's
    // timer fetches run_a and, more being due, pushes a token, which Redis
    // hands to its oldest BLPOP: A's own. A asks for its next task only when
    // its slot frees, so its BLPOP, left outstanding, kept that token for the
    // whole turn, and run_b waited 3 s for A's slot while B sat idle (released
    // turns waited a whole call so, under load, in the long-call bench). A
    // worker stops listening as its last slot is taken, pushing such a token
    // back: B takes run_b at once.
    let env = Env::start(QueueConfig { idle_ms: 60_000, ..QueueConfig::default() });
    let seen = Seen::default();
    let state = |hold_ms| HandlerState { seen: seen.clone(), queue: env.queue.clone(), fail: false, hold_ms };
    let (a, a_name) = run_worker_named(&env.queue, 1, state(3_000));
    eventually("A to block", secs(10), || async { (blocked_clients(&env).await >= 1).then_some(()) }).await;
    // (Due in 5 s: the set-up below must end before it.)
    env.queue.enqueue("run_a", &json!({}), 5_000).await.unwrap();
    let keys = env.queue.keys().clone();
    let mut conn = env.server.conn().await;
    // A takes run_a's token (it names the time) and blocks again, watching it.
    eventually("A to take the token and block again", secs(5), || async {
        let mut conn = env.server.conn().await;
        let left: u64 = redis::cmd("LLEN").arg(&keys.notify).query_async(&mut conn).await.ok()?;
        (left == 0 && blocked_clients(&env).await >= 1).then_some(())
    })
    .await;
    // The watch is A's by name (a token's claim is whoever's takes it, which
    // B's first fetch would take over and watch too).
    let claim: String = redis::cmd("GET").arg(&keys.timer).query_async(&mut conn).await.unwrap();
    let at = claim.split_once('|').unwrap().0.to_owned();
    let _: () = redis::cmd("SET").arg(&keys.timer).arg(format!("{at}|{a_name}")).query_async(&mut conn).await.unwrap();
    let b = run_worker(&env.queue, 1, state(0));
    eventually("B to block after A", secs(10), || async { (blocked_clients(&env).await >= 2).then_some(()) }).await;
    // run_b: queued for later (no token: A watches an earlier time), then
    // moved to run_a's due time.
    env.queue.enqueue("run_b", &json!({}), 60_000).await.unwrap();
    let due_a: i64 = redis::cmd("ZSCORE").arg(&keys.due).arg("run_a").query_async(&mut conn).await.unwrap();
    assert!(env.queue.server_time_ms().await.unwrap() < due_a - 100, "the set-up outlasted run_a's due time");
    let _: () =
        redis::cmd("ZADD").arg(&keys.due).arg("XX").arg(due_a).arg("run_b").query_async(&mut conn).await.unwrap();
    eventually("run_b to start", secs(10), || async { seen.all().into_iter().find(|s| s.id == "run_b").map(|_| ()) })
        .await;
    let run_b = seen.all().into_iter().find(|s| s.id == "run_b").unwrap();
    assert!(run_b.server_now_ms - run_b.due_ms < 1_000, "run_b waited for A's slot: {run_b:?}");
    stop_workers(vec![a, b]).await;
}

#[tokio::test]
async fn without_client_unblock_due_times_are_still_kept() {
    // Managed Redis services forbid CLIENT UNBLOCK; the watcher then waits with
    // BLPOP's own timeout (coarser, never early, never lost).
    let env = Env::start(QueueConfig::default());
    let mut conn = env.server.conn().await;
    let _: () =
        redis::cmd("ACL").arg("SETUSER").arg("default").arg("-client|unblock").query_async(&mut conn).await.unwrap();
    let denied: redis::RedisResult<i64> = redis::cmd("CLIENT").arg("UNBLOCK").arg(1).query_async(&mut conn).await;
    assert!(denied.is_err(), "the ACL forbids CLIENT UNBLOCK");
    let empty = delayed_turns_reach_one_idle_worker(&env).await;
    assert!(empty <= 80, "{empty} fetches found nothing");
}

#[tokio::test]
async fn a_redis_that_asks_for_a_user_and_password_serves_the_queue() {
    // Managed Redis: a user with a password, and no CLIENT UNBLOCK for it.
    let server = RedisServer::start();
    let mut admin = server.conn().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("paceline")
        .arg("on")
        .arg(">s3cret pass")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-client|unblock")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("{}?user=paceline&pass=s3cret%20pass", server.url());
    let redis = RedisArgs::new(url, unique_prefix());
    let queue = TurnQueue::new(&redis, QueueConfig::default()).expect("queue");
    let seen = Seen::default();
    let (stop, worker) =
        run_worker(&queue, 4, HandlerState { seen: seen.clone(), queue: queue.clone(), fail: false, hold_ms: 0 });
    for i in 0..20u64 {
        queue.enqueue(&format!("run_{i}"), &json!({}), i * 20).await.unwrap();
    }
    eventually("20 turns to start", secs(10), || async { (seen.len() >= 20).then_some(()) }).await;
    assert!(seen.all().iter().all(|s| s.server_now_ms >= s.due_ms), "none early");
    let _ = stop.send(());
    within("the worker to stop", secs(10), worker).await.unwrap();

    // A wrong password is a clear error, not a hang.
    let wrong = RedisArgs::new(format!("{}?user=paceline&pass=nope", server.url()), unique_prefix());
    let queue = TurnQueue::new(&wrong, QueueConfig::default()).expect("queue");
    let err = within("a refused enqueue", secs(10), queue.enqueue("run_x", &json!({}), 0)).await.unwrap_err();
    assert!(err.to_string().to_lowercase().contains("pass") || err.to_string().contains("WRONGPASS"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_promoted_replica_mid_load_loses_no_turn_and_needs_no_restart() {
    // A primary with a replica, behind one endpoint (a managed Redis's primary
    // endpoint, a Sentinel-aware name); the workers know only the endpoint.
    let port = paceline_tests::free_tcp_port();
    let mut primary = RedisServer::start_with(RedisOptions { tcp_port: Some(port), ..RedisOptions::default() });
    let replica = RedisServer::start();
    let mut rconn = replica.conn().await;
    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(port).query_async(&mut rconn).await.unwrap();
    eventually("the replica to sync", secs(10), || {
        let mut c = rconn.clone();
        async move {
            let info: String = redis::cmd("INFO").arg("replication").query_async(&mut c).await.ok()?;
            info.contains("master_link_status:up").then_some(())
        }
    })
    .await;
    let endpoint = paceline_tests::SwitchingEndpoint::start(&primary.socket());
    let redis = RedisArgs::new(endpoint.url(), unique_prefix());
    let queue = TurnQueue::new(&redis, QueueConfig { lease_ms: 1_000, ..QueueConfig::default() }).expect("queue");
    let seen = Seen::default();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            run_worker(&queue, 8, HandlerState { seen: seen.clone(), queue: queue.clone(), fail: false, hold_ms: 0 })
        })
        .collect();
    // 300 turns due over 3 s; every enqueue acknowledged by the replica too
    // (WAIT), as an API configured for durability would have it.
    let mut pconn = primary.conn().await;
    for i in 0..300u64 {
        queue.enqueue(&format!("run_{i}"), &json!({}), i * 10).await.unwrap();
    }
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5000).query_async(&mut pconn).await.unwrap();
    assert_eq!(acked, 1, "the replica has every enqueue");
    eventually("some turns to run on the primary", secs(10), || async { (seen.len() >= 50).then_some(()) }).await;

    // The primary dies mid-load; the replica is promoted; the endpoint follows.
    primary.kill();
    let _: () = redis::cmd("REPLICAOF").arg("NO").arg("ONE").query_async(&mut rconn).await.unwrap();
    endpoint.switch(&replica.socket());

    // Every turn runs (at least once: one the primary saw finish but the
    // replica had not yet may run again), and nothing is left behind.
    eventually("all 300 turns to run", secs(30), || async {
        let ids: std::collections::HashSet<String> = seen.all().into_iter().map(|s| s.id).collect();
        (ids.len() == 300).then_some(())
    })
    .await;
    let q = &queue;
    eventually("the queue to drain on the promoted replica", secs(15), || async move {
        let c = q.counts().await.ok()?;
        (c.ready + c.delayed + c.in_flight == 0).then_some(())
    })
    .await;
    let again = seen.len() - 300;
    eprintln!("300 turns across the failover; {again} ran a second time");
    for (stop, handle) in workers {
        let _ = stop.send(());
        within("a worker to stop", secs(15), handle).await.unwrap();
    }
}

#[tokio::test]
async fn ten_thousand_turns_due_at_once_are_all_served() {
    let env = Env::start(QueueConfig::default());
    // No worker runs yet, so all 10 000 are due together when the workers start.
    env.enqueue_many("run", 10_000, json!({}), 0).await;
    // One fetch is bounded, whatever it asks for.
    let probe = env.queue.fetch("probe", 50_000).await.unwrap();
    assert_eq!(probe.deliveries.len(), MAX_FETCH_BATCH);
    for d in &probe.deliveries {
        env.queue.release(&d.lease).await.unwrap();
    }

    let seen = Seen::default();
    let state = HandlerState { seen: seen.clone(), queue: env.queue.clone(), fail: false, hold_ms: 0 };
    let workers = vec![run_worker(&env.queue, 16, state.clone()), run_worker(&env.queue, 16, state)];
    env.wait_drained(secs(60)).await;
    assert_eq!(seen.len(), 10_000, "each turn ran exactly once");
    let c = env.queue.counts().await.unwrap();
    assert_eq!(c.dead, 0);
    stop_workers(workers).await;
}

#[tokio::test]
async fn a_turn_that_outlasts_its_lease_keeps_it_while_its_worker_beats() {
    // 900-ms leases, renewed a third of a lease after they were taken or last
    // renewed; in a fleet of 16 an idle worker beats only every 8 thirds of a
    // lease, so the renewals here come from the leases' own age.
    let env = Env::start(QueueConfig { lease_ms: 900, ..QueueConfig::default() });
    let q = &env.queue;
    let now = q.counts().await.unwrap().now_ms;
    for i in 0..14 {
        let info = shared::queue::WorkerInfo {
            identity: format!("bystander-{i}"),
            host: "h".into(),
            pid: 1,
            concurrency: 1,
            in_flight: 0,
            started_at_ms: now,
            lease_ms: 60_000,
            beat_ms: 480_000,
            last_heartbeat_ms: 0,
        };
        q.heartbeat(&info.identity, Some(&info), &[]).await.unwrap();
    }
    let seen = Seen::default();
    let state = HandlerState { seen: seen.clone(), queue: q.clone(), fail: false, hold_ms: 0 };
    // It holds each turn for three leases.
    let slow = run_worker(q, 4, HandlerState { hold_ms: 3 * q.config().lease_ms, ..state.clone() });
    env.enqueue_many("long", 3, json!({}), 0).await;
    eventually("the three turns to be in flight", secs(5), || async move {
        (q.counts().await.ok()?.in_flight == 3).then_some(())
    })
    .await;
    // A quick worker beside it runs again any turn whose lease expired, which
    // a reaper beating every 100 ms (as a large fleet's many beats would) takes back.
    let quick = run_worker(q, 4, state);
    let reaper = {
        let q = q.clone();
        tokio::spawn(async move {
            loop {
                let _ = q.heartbeat("reaper", None, &[]).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    env.wait_drained(secs(20)).await;
    reaper.abort();
    let all = seen.all();
    assert_eq!(all.len(), 3, "each turn ran once, in its first delivery: {all:?}");
    assert!(all.iter().all(|s| s.deliveries == 1), "no lease was taken back: {all:?}");
    stop_workers(vec![slow, quick]).await;
}

#[tokio::test]
async fn a_stale_holder_is_fenced_and_changes_nothing() {
    let env = Env::start(QueueConfig { lease_ms: 300, ..QueueConfig::default() });
    let q = &env.queue;
    q.enqueue("run_x", &json!({"turn": 1}), 0).await.unwrap();
    let stale = q.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;

    // w1 stalls past its lease; any worker's heartbeat brings the turn back.
    eventually("the expired lease to be reclaimed", secs(5), || async {
        q.heartbeat("reaper", None, &[]).await.ok()?;
        (q.counts().await.ok()?.ready == 1).then_some(())
    })
    .await;
    assert!(matches!(q.complete(&stale).await, Err(QueueError::Fenced { ref why, .. }) if why == "not_leased"));

    let live = q.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    assert!(live.epoch > stale.epoch, "every delivery gets a larger epoch");
    assert_eq!(live.deliveries, 2);
    assert!(matches!(q.complete(&stale).await, Err(QueueError::Fenced { ref why, .. }) if why == "stale"));
    assert!(matches!(q.requeue(&stale, 0, Some(&json!({"turn": 99}))).await, Err(QueueError::Fenced { .. })));
    assert!(matches!(q.dead(&stale, "stale says so").await, Err(QueueError::Fenced { .. })));
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.in_flight, c.dead), (0, 1, 0), "the stale holder changed nothing");
    assert_eq!(q.payload::<Value>("run_x").await.unwrap(), Some(json!({"turn": 1})));

    q.requeue(&live, 0, Some(&json!({"turn": 2}))).await.unwrap();
    assert_eq!(q.payload::<Value>("run_x").await.unwrap(), Some(json!({"turn": 2})));
    let next = q.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(next.deliveries, 1, "a requeue that made progress starts the count over");
    q.complete(&next).await.unwrap();
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight, c.dead), (0, 0, 0, 0));
}

#[tokio::test]
async fn an_id_used_again_after_its_record_went_never_meets_an_old_epoch() {
    // Epochs are past the record's last and past every epoch of an earlier
    // ms of the server's clock: a turn enqueued again under an id whose
    // record was deleted starts past every epoch the id had, so a holder of
    // the old record's lease stays fenced.
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    q.enqueue("run_x", &json!({"turn": 1}), 0).await.unwrap();
    let first = q.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    q.requeue::<Value>(&first, 0, None).await.unwrap();
    let second = q.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert!(second.epoch > first.epoch, "a record's next lease is past its last epoch");
    q.complete(&second).await.unwrap();

    // The same id again, leased as often as the first record was.
    q.enqueue("run_x", &json!({"turn": 1}), 0).await.unwrap();
    let again = q.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    assert!(again.epoch > second.epoch, "epoch {} is not past the old record's {}", again.epoch, second.epoch);
    assert!(matches!(q.complete(&first).await, Err(QueueError::Fenced { .. })));
    assert!(matches!(q.complete(&second).await, Err(QueueError::Fenced { .. })));
    q.complete(&again).await.unwrap();
}

#[tokio::test]
async fn only_a_fetch_a_token_woke_clears_the_tokens_left_over() {
    // A token reaches a listening worker at once, so leftovers are rare, and
    // a fetch that took no token does not pay a DEL for them.
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let mut conn = env.server.conn().await;
    let tokens = |mut conn: redis::aio::MultiplexedConnection| {
        let key = q.keys().notify.clone();
        async move { redis::cmd("LLEN").arg(key).query_async::<u64>(&mut conn).await.unwrap() }
    };
    q.enqueue("run_a", &json!({}), 0).await.unwrap();
    q.enqueue("run_b", &json!({}), 0).await.unwrap();
    assert_eq!(tokens(conn.clone()).await, 2, "each turn due now pushed a token (nobody listened)");
    let got = q.fetch_for("w1", 10, None, FetchWhy::Unsaid).await.unwrap();
    assert_eq!(got.deliveries.len(), 2);
    assert_eq!(tokens(conn.clone()).await, 2, "a fetch no token woke leaves them");
    q.enqueue("run_c", &json!({}), 0).await.unwrap();
    let _: Option<(String, String)> =
        redis::cmd("BLPOP").arg(&q.keys().notify).arg(1).query_async(&mut conn).await.unwrap();
    let got = q.fetch_for("w1", 10, None, FetchWhy::Token).await.unwrap();
    assert_eq!(got.deliveries.len(), 1);
    assert_eq!(tokens(conn.clone()).await, 0, "the fetch a token woke took everything due and cleared the rest");
}

#[tokio::test]
async fn a_fetch_that_finds_a_watch_claimed_for_whoever_takes_its_token_watches_it_itself() {
    // A claim for whoever takes a token (`T|*`) can be left with no token:
    // a fetch a plain token woke took everything due and cleared the tokens
    // left over — the `wT` among them — or a commit claimed it for its own
    // process (no token) and that process's next fetch came before it looked.
    // The fetch that then finds `T` as the next due time is the one idle
    // worker left to watch it, and takes the claim over (given back, nobody
    // would watch `T` until an idle registration's look for a turn left due).
    let env = Env::start(QueueConfig { idle_ms: 60_000, ..QueueConfig::default() });
    let q = &env.queue;
    let mut conn = env.server.conn().await;
    let keys = q.keys().clone();
    q.enqueue("run_a", &json!({}), 1_500).await.unwrap();
    let claim: String = redis::cmd("GET").arg(&keys.timer).query_async(&mut conn).await.unwrap();
    assert!(claim.ends_with("|*"), "the enqueue claimed its time for whoever takes its token: {claim}");
    // A plain token on top (a release's), taken by this worker.
    let _: () = redis::cmd("LPUSH").arg(&keys.notify).arg("1").query_async(&mut conn).await.unwrap();
    let (_, token): (String, String) =
        redis::cmd("BLPOP").arg(&keys.notify).arg(1).query_async(&mut conn).await.unwrap();
    assert_eq!(token, "1");
    let got = q.fetch_for("w1", 10, None, FetchWhy::Token).await.unwrap();
    assert!(got.deliveries.is_empty());
    let left: u64 = redis::cmd("LLEN").arg(&keys.notify).query_async(&mut conn).await.unwrap();
    assert_eq!(left, 0, "the token-woken fetch cleared the tokens left over, the watch's among them");
    match got.then {
        Then::Watch { ms } => assert!((1..=1_500).contains(&ms), "watch in {ms} ms"),
        other => panic!("nobody is left to watch run_a's due time, and this worker {other:?}"),
    }
    let claim: String = redis::cmd("GET").arg(&keys.timer).query_async(&mut conn).await.unwrap();
    assert!(claim.ends_with("|w1"), "the claim is the watching worker's: {claim}");
}

#[tokio::test]
async fn a_commit_script_built_on_the_lua_library_is_fenced_atomically() {
    let env = Env::start(QueueConfig { lease_ms: 300, ..QueueConfig::default() });
    let q = &env.queue;
    // What the worker's commit will look like: append to the run's transcript
    // and enqueue the next turn, in one script, only with the live epoch.
    let commit = redis::Script::new(&format!(
        "{LUA_LIB}\n{}",
        r#"
        local r, why = q_fence(ARGV[1], ARGV[2])
        if not r then return {'fenced', why} end
        redis.call('RPUSH', KEYS[Q_NKEYS + 1], ARGV[3])
        r.payload = ARGV[4]
        r.deliveries = 0
        local now = q_now()
        q_schedule(ARGV[1], r, now, now)
        return {'ok'}
        "#
    ));
    let transcript = env.redis.keys().run_transcript("run_x");
    let server = &env.server;
    let run_commit = |lease: Lease, output: &'static str| {
        let commit = &commit;
        let transcript = transcript.clone();
        async move {
            let mut inv = commit.prepare_invoke();
            for k in q.keys().script_keys() {
                inv.key(k);
            }
            inv.key(&transcript).arg(&lease.id).arg(lease.epoch).arg(output).arg(r#"{"turn":2}"#);
            let mut conn = server.conn().await;
            let reply: Vec<String> = inv.invoke_async(&mut conn).await.unwrap();
            if reply[0] == "ok" {
                lease.mark_settled();
            }
            reply[0].clone()
        }
    };

    q.enqueue("run_x", &json!({"turn": 1}), 0).await.unwrap();
    let stale = q.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    eventually("the expired lease to be reclaimed", secs(5), || async {
        q.heartbeat("reaper", None, &[]).await.ok()?;
        (q.counts().await.ok()?.ready == 1).then_some(())
    })
    .await;
    let live = q.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;

    assert_eq!(run_commit(live.clone(), "turn 1 output (live)").await, "ok");
    assert_eq!(run_commit(stale, "turn 1 output (stale)").await, "fenced");
    assert_eq!(run_commit(live, "turn 1 output (again)").await, "fenced", "a commit happens once");

    let mut conn = env.server.conn().await;
    let items: Vec<String> = redis::cmd("LRANGE").arg(&transcript).arg(0).arg(-1).query_async(&mut conn).await.unwrap();
    assert_eq!(items, vec!["turn 1 output (live)".to_string()]);
    assert_eq!(q.payload::<Value>("run_x").await.unwrap(), Some(json!({"turn": 2})));
    assert_eq!(q.counts().await.unwrap().ready, 1, "the next turn is queued");
}

#[tokio::test]
async fn a_failing_turn_goes_dead_after_three_deliveries_with_its_error() {
    let env = Env::start(QueueConfig { retry_base_ms: 10, ..QueueConfig::default() });
    let seen = Seen::default();
    let (stop, worker) = run_worker(
        &env.queue,
        4,
        HandlerState { seen: seen.clone(), queue: env.queue.clone(), fail: true, hold_ms: 0 },
    );
    env.queue.enqueue("run_poison", &json!({"turn": 1}), 0).await.unwrap();
    let q = &env.queue;
    eventually("the failing turn to go dead", secs(10), || async { (q.counts().await.ok()?.dead == 1).then_some(()) })
        .await;
    assert_eq!(seen.all().iter().map(|s| s.deliveries).collect::<Vec<_>>(), vec![1, 2, 3]);
    let dead = q.list_dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, "run_poison");
    assert!(dead[0].reason.contains("boom"), "reason: {}", dead[0].reason);
    let _ = stop.send(());
    within("the worker to stop", secs(10), worker).await.unwrap();

    assert!(q.retry_dead("run_poison").await.unwrap());
    assert!(!q.retry_dead("run_poison").await.unwrap(), "it is not dead any more");
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.dead), (1, 0));
    let again = q.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(again.deliveries, 1, "a retried dead turn gets fresh deliveries");
}

#[tokio::test]
async fn each_worker_is_judged_alive_by_its_own_lease() {
    // The reader runs the default 3-s lease; the workers do not.
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let mut conn = env.server.conn().await;
    let now = q.counts().await.unwrap().now_ms;
    let keys = q.keys();
    for (id, lease_ms, silent_ms) in [("slow-but-alive", 10_000, 7_000), ("fast-and-gone", 1_000, 7_000)] {
        let info = json!({"identity": id, "host": "h", "pid": 1, "concurrency": 4, "in_flight": 0,
                          "started_at_ms": now - 60_000, "lease_ms": lease_ms});
        let _: () =
            redis::cmd("ZADD").arg(&keys.workers).arg(now - silent_ms).arg(id).query_async(&mut conn).await.unwrap();
        let _: () = redis::cmd("HSET")
            .arg(&keys.worker_info)
            .arg(id)
            .arg(info.to_string())
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let alive: Vec<String> = q.list_workers().await.unwrap().into_iter().map(|w| w.identity).collect();
    assert_eq!(alive, vec!["slow-but-alive".to_string()], "7 s silent: alive on a 10-s lease, gone on a 1-s one");
    // Another worker's heartbeat forgets neither registration yet.
    let report = q.heartbeat("reaper", None, &[]).await.unwrap();
    let n: u64 = redis::cmd("ZCARD").arg(&keys.workers).query_async(&mut conn).await.unwrap();
    assert_eq!(n, 2);
    // A beat that does not register (leases only) counts no fleet; one that does,
    // counts the workers that beat in the last 30 s, itself with them.
    assert_eq!(report.fleet, None);
    let info = shared::queue::WorkerInfo {
        identity: "reaper".into(),
        host: "h".into(),
        pid: 2,
        concurrency: 1,
        in_flight: 0,
        started_at_ms: now,
        lease_ms: 3_000,
        beat_ms: 8_000,
        last_heartbeat_ms: 0,
    };
    assert_eq!(q.heartbeat("reaper", Some(&info), &[]).await.unwrap().fleet, Some(3));
}

#[tokio::test]
async fn a_registration_with_its_info_unchanged_keeps_it_and_asks_for_it_once_it_is_gone() {
    use shared::queue::Register;
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let info = shared::queue::WorkerInfo {
        identity: "w1".into(),
        host: "h".into(),
        pid: 7,
        concurrency: 4,
        in_flight: 0,
        started_at_ms: 1,
        lease_ms: 3_000,
        beat_ms: 16_000,
        last_heartbeat_ms: 0,
    };
    let first = q.beat("w1", Register::With { info: &info, census: true }, &[], None).await.unwrap();
    assert!(!first.resend);
    assert_eq!(first.fleet, Some(1), "a census counts the fleet");
    assert!(first.now_ms > 0, "a beat says the server's clock");
    // Registering again with the info unchanged: the registration stands as written,
    // no census (no fleet count), no resend.
    let again = q.beat("w1", Register::Unchanged { census: false }, &[], None).await.unwrap();
    assert!(!again.resend);
    assert_eq!(again.fleet, None);
    let listed = q.list_workers().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].pid, listed[0].concurrency), (7, 4));
    // Redis lost the registration (a restart without persistence, a hand edit): an
    // unchanged registration adds the worker back and asks for its info.
    let mut conn = env.server.conn().await;
    let keys = q.keys();
    let _: () = redis::cmd("DEL").arg(&keys.workers).arg(&keys.worker_info).query_async(&mut conn).await.unwrap();
    let lost = q.beat("w1", Register::Unchanged { census: false }, &[], None).await.unwrap();
    assert!(lost.resend, "the info is gone: the worker sends it with its next registration");
    q.beat("w1", Register::With { info: &info, census: false }, &[], None).await.unwrap();
    assert_eq!(q.list_workers().await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_record_fetch_cannot_read_is_buried_with_its_reason_not_dropped() {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    q.enqueue("run_ok", &json!({"turn": 1}), 0).await.unwrap();
    // A record this version cannot read (another version's format, a hand edit).
    let mut conn = env.server.conn().await;
    let keys = q.keys();
    let _: () =
        redis::cmd("HSET").arg(&keys.jobs).arg("run_garbled").arg("v2:{}").query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("ZADD").arg(&keys.due).arg(0).arg("run_garbled").query_async(&mut conn).await.unwrap();

    let fetched = q.fetch("w1", 10).await.unwrap();
    let ids: Vec<&str> = fetched.deliveries.iter().map(|d| d.lease.id.as_str()).collect();
    assert_eq!(ids, vec!["run_ok"], "the readable turn is leased, the other is not");
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.in_flight, c.dead), (0, 1, 1), "buried, not dropped");
    let dead = q.list_dead(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, "run_garbled");
    assert!(dead[0].reason.contains("unreadable"), "reason: {}", dead[0].reason);
    let raw: String = redis::cmd("HGET").arg(&keys.jobs).arg("run_garbled").query_async(&mut conn).await.unwrap();
    assert!(raw.ends_with("v2:{}"), "its raw text is kept for whoever reads it: {raw}");
}

#[tokio::test]
async fn a_turn_that_kills_its_worker_goes_dead_after_three_deliveries() {
    let env = Env::start(QueueConfig { lease_ms: 500, ..QueueConfig::default() });
    env.queue.enqueue("run_crash", &json!({"crash": true}), 0).await.unwrap();
    let q = &env.queue;
    let mut crashes = 0;
    for _ in 0..6 {
        if q.counts().await.unwrap().dead == 1 {
            break;
        }
        let mut worker = env.spawn_probe(&["--queue-lease-ms", "500", "--concurrency", "2"]);
        let deadline = Instant::now() + secs(10);
        loop {
            if worker.wait_timeout(Duration::from_millis(50)).is_some() {
                crashes += 1;
                break;
            }
            if q.counts().await.unwrap().dead == 1 {
                break;
            }
            assert!(Instant::now() < deadline, "the poison turn neither crashed its worker nor went dead");
        }
    }
    assert_eq!(crashes, 3, "the poison turn was delivered exactly three times");
    let dead = q.list_dead(10).await.unwrap();
    assert_eq!(dead.len(), 1, "dead: {dead:?}");
    assert!(dead[0].reason.contains("lease expired on delivery 3 of 3"), "reason: {}", dead[0].reason);
    assert_eq!(dead[0].payload, r#"{"crash":true}"#);
}

#[tokio::test]
async fn a_sigkilled_worker_has_its_turns_back_within_5_s() {
    killed_workers_turns_back_within_5_s(false).await;
}

#[tokio::test]
async fn an_idle_worker_already_running_has_a_sigkilled_workers_turns_back_within_5_s() {
    killed_workers_turns_back_within_5_s(true).await;
}

/// A worker holding 4 long turns is SIGKILLed; a second one finishes them
/// within 5 s of the kill: started after it, or (`idle_before`) up and idle
/// before it — then it finds the expired leases with its own looks (one
/// command each, scheduled by the first lease's expiry), not a first beat.
async fn killed_workers_turns_back_within_5_s(idle_before: bool) {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let first = env.spawn_probe(&["--concurrency", "4"]);
    env.enqueue_many("run", 4, json!({"sleep_ms": 600_000}), 0).await;
    eventually("the first worker to hold all 4 turns", secs(10), || async {
        (q.counts().await.ok()?.in_flight == 4).then_some(())
    })
    .await;
    let rescuer_args = ["--concurrency", "4", "--max-sleep-ms", "0", "--record"];
    let mut rescuer = None;
    if idle_before {
        rescuer = Some(env.spawn_probe(&rescuer_args));
        eventually("the second worker to register", secs(10), || async {
            (q.list_workers().await.ok()?.len() == 2).then_some(())
        })
        .await;
        // Long enough for the first's leases to be renewed under the rescuer's looks.
        tokio::time::sleep(secs(4)).await;
        assert!(env.probe_done().await.is_empty(), "the rescuer took nothing while the first worker lived");
    }

    first.signal("KILL");
    let killed_at = Instant::now();
    let _rescuer = rescuer.unwrap_or_else(|| env.spawn_probe(&rescuer_args));
    eventually("another worker to finish the killed worker's turns", secs(5), || async {
        (env.probe_done().await.len() == 4).then_some(())
    })
    .await;
    println!("killed worker's turns finished {} ms after the kill", killed_at.elapsed().as_millis());
    env.wait_drained(secs(5)).await;
    assert_eq!(q.counts().await.unwrap().dead, 0);
}

#[tokio::test]
async fn a_redis_restart_mid_load_loses_nothing_and_needs_no_process_restart() {
    let mut env = Env::start_with(RedisOptions { aof: true, ..RedisOptions::default() }, QueueConfig::default());
    let mut worker = env.spawn_probe(&["--concurrency", "8", "--record"]);
    env.enqueue_many("before", 300, json!({"sleep_ms": 20}), 0).await;
    eventually("some turns to be done", secs(10), || async { (env.probe_done().await.len() >= 50).then_some(()) })
        .await;

    env.server.restart();

    // The same queue handle (this process's connection) works again without a restart.
    let q = env.queue.clone();
    eventually("enqueue to work after the restart", secs(10), || async {
        q.enqueue("after-0", &json!({"sleep_ms": 20}), 0).await.ok()
    })
    .await;
    for i in 1..100 {
        q.enqueue(&format!("after-{i}"), &json!({"sleep_ms": 20}), 0).await.unwrap();
    }
    eventually("every turn from before and after the restart to be done", secs(30), || async {
        (env.probe_done().await.len() == 400).then_some(())
    })
    .await;
    env.wait_drained(secs(10)).await;
    assert_eq!(q.counts().await.unwrap().dead, 0);
    assert!(worker.0.try_wait().unwrap().is_none(), "the worker process survived the restart");
    worker.signal("TERM");
    let status = worker.wait_timeout(secs(10)).expect("worker exits on SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn sigterm_drains_in_flight_turns_and_exits_0() {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let mut worker = env.spawn_probe(&["--concurrency", "4", "--record"]);
    // Turns long enough that all four slots stay busy for a while between
    // fetches, however slowly a loaded machine starts the process.
    env.enqueue_many("run", 20, json!({"sleep_ms": 2_000}), 0).await;
    let pid = worker.0.id();
    let registered = eventually("the worker to register and take turns", secs(10), || async {
        let workers = q.list_workers().await.ok()?;
        let me = workers.into_iter().find(|w| w.pid == pid)?;
        (me.in_flight > 0 && q.counts().await.ok()?.in_flight == 4).then_some(me)
    })
    .await;
    assert_eq!(registered.concurrency, 4);
    assert!(registered.last_heartbeat_ms >= registered.started_at_ms);

    worker.signal("TERM");
    let status = worker.wait_timeout(secs(10)).expect("the worker exits after SIGTERM");
    assert!(status.success(), "exit status {status:?}");

    let c = q.counts().await.unwrap();
    let done = env.probe_done().await.len() as u64;
    assert_eq!(c.in_flight, 0, "nothing left leased by the exited worker");
    assert_eq!(c.dead, 0);
    assert!(done >= 4, "the turns in flight at SIGTERM finished ({done} done)");
    assert_eq!(done + c.ready, 20, "every turn is done or back in the queue");
    assert!(q.list_workers().await.unwrap().iter().all(|w| w.pid != pid), "it left the worker registry");
}

#[tokio::test]
async fn sigterm_hands_back_turns_still_running_after_the_grace() {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let mut worker = env.spawn_probe(&["--concurrency", "4", "--shutdown-grace-ms", "300"]);
    env.enqueue_many("run", 2, json!({"sleep_ms": 600_000}), 0).await;
    eventually("the worker to take both turns", secs(10), || async {
        (q.counts().await.ok()?.in_flight == 2).then_some(())
    })
    .await;

    worker.signal("TERM");
    let status = worker.wait_timeout(secs(5)).expect("the worker exits after its grace");
    assert!(status.success(), "exit status {status:?}");
    let c = q.counts().await.unwrap();
    assert_eq!((c.ready, c.in_flight, c.dead), (2, 0, 0), "both turns handed back, due now");
    let back = q.fetch("w", 10).await.unwrap();
    assert!(back.deliveries.iter().all(|d| d.lease.deliveries == 1), "a hand-back does not use up a delivery");
}

/// A Redis whose AOF lost its last second (`appendfsync everysec`) comes back
/// without the leases made in it, while their holders still work: the next
/// lease of such a turn gets an epoch past theirs, so a holder from the lost
/// second stays fenced (with epochs drawn from a counter, the counter rolled
/// back too and the same epoch was handed out twice).
#[tokio::test]
async fn after_redis_loses_its_last_second_no_epoch_is_handed_out_twice() {
    let env = Env::start(QueueConfig::default());
    let q = &env.queue;
    let mut conn = env.server.conn().await;
    q.enqueue("run_x", &json!({"turn": 1}), 0).await.unwrap();
    // Every key as it was before the lost second …
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    let mut saved = vec![];
    for key in &keys {
        let dump: Vec<u8> = redis::cmd("DUMP").arg(key).query_async(&mut conn).await.unwrap();
        saved.push((key.clone(), dump));
    }
    // … a lease made in it, whose holder goes on working …
    let lost = q.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    // … and the restart: the keys as they were, the lease gone.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    for (key, dump) in saved {
        let _: () = redis::cmd("RESTORE").arg(&key).arg(0).arg(dump).query_async(&mut conn).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let again = q.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    assert!(again.epoch > lost.epoch, "epoch {} handed out again (the lost lease had {})", again.epoch, lost.epoch);
    assert!(matches!(q.complete(&lost).await, Err(QueueError::Fenced { .. })), "the lost second's holder is fenced");
    q.complete(&again).await.unwrap();
}

#[tokio::test]
async fn a_beat_that_reaches_redis_past_its_not_after_reclaims_nothing() {
    use shared::queue::Register;
    let env = Env::start(QueueConfig { lease_ms: 300, ..QueueConfig::default() });
    let q = &env.queue;
    assert!(q.enqueue("run_a", &json!({"turn": 1}), 0).await.unwrap());
    assert_eq!(q.fetch("w1", 1).await.unwrap().deliveries.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let now = q.server_time_ms().await.unwrap();
    // Sent before an outage, run after it: not_after has passed, the lease stays.
    let late = q.beat("w2", Register::No, &[], Some(now - 1_000)).await.unwrap();
    assert_eq!(late.reclaimed, 0, "a late beat reclaimed a lease");
    assert_eq!(q.counts().await.unwrap().in_flight, 1);
    // In time: the expired lease is taken back.
    let timely = q.beat("w2", Register::No, &[], Some(now + 10_000)).await.unwrap();
    assert_eq!(timely.reclaimed, 1);
}

#[tokio::test]
async fn a_beat_renews_the_leases_it_holds_and_names_those_it_does_not() {
    // The beat reads a record's epoch and flag alone (heartbeat.lua): the
    // holder's lease is pushed out; an epoch delivered since, a turn no
    // longer leased and one gone are each named lost, and none is renewed.
    use shared::queue::Register;
    let env = Env::start(QueueConfig { lease_ms: 60_000, ..QueueConfig::default() });
    let q = &env.queue;
    for id in ["run_held", "run_stale", "run_back"] {
        assert!(q.enqueue(id, &json!({"turn": 1, "text": "a payload | with bars | 1|2|l|"}), 0).await.unwrap());
    }
    let leases: Vec<Lease> = q.fetch("w1", 3).await.unwrap().deliveries.into_iter().map(|d| d.lease).collect();
    let lease = |id: &str| leases.iter().find(|l| l.id == id).unwrap().clone();
    let deadline = |id: &'static str| {
        let key = q.keys().lease.clone();
        let server = &env.server;
        async move {
            let mut conn = server.conn().await;
            let at: Option<f64> = redis::cmd("ZSCORE").arg(&key).arg(id).query_async(&mut conn).await.unwrap();
            at
        }
    };
    let (before, stale_before) = (deadline("run_held").await.unwrap(), deadline("run_stale").await);
    q.release(&lease("run_back")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let held = [
        ("run_held".to_owned(), lease("run_held").epoch),
        ("run_stale".to_owned(), lease("run_stale").epoch + 1),
        ("run_back".to_owned(), lease("run_back").epoch),
        ("run_gone".to_owned(), 7),
    ];
    let report = q.beat("w1", Register::No, &held, None).await.unwrap();
    let mut lost = report.lost.clone();
    lost.sort();
    assert_eq!(lost, ["run_back", "run_gone", "run_stale"]);
    assert!(deadline("run_held").await.unwrap() > before, "the held lease was not renewed");
    assert_eq!(deadline("run_stale").await, stale_before, "a lease delivered since was renewed");
    assert_eq!(deadline("run_back").await, None);
}
