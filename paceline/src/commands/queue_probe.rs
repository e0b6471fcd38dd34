//! `paceline queue-probe` (hidden): a no-op turn consumer on the queue, for the
//! queue's process-level tests (SIGKILL, SIGTERM, Redis restarts) and its bench.
//!
//! `consume` runs one worker process on apalis's runtime over the turn queue.
//! Its handler reads the payload: `{"sleep_ms": N}` sleeps (capped by
//! `--max-sleep-ms`), `{"crash": true}` aborts the process (a poison turn),
//! `{"fail": true}` returns an error. With `--record` it counts each completion
//! per id and records start lateness in Redis, for tests and the lateness bench.
//!
//! `bench` measures the queue alone with one consumer process: no-op turns per
//! second, Redis commands per turn (INFO commandstats deltas), and start
//! lateness p50/p99 of 1 000 waiting turns. It starts a private redis-server
//! unless `--external-redis` is given. The pieces it shares with `paceline
//! bench` live in `crate::bench`; [`queue_only`] is also that bench's
//! queue-alone figure.

use crate::bench::redis::{BenchRedis, CommandStats};
use crate::bench::report::{Percentiles, QueueOnly};
use anyhow::Context as _;
use shared::config::RedisArgs;
use shared::queue::apalis_core::error::BoxDynError;
use shared::queue::apalis_core::task::data::Data;
use shared::queue::apalis_core::worker::builder::WorkerBuilder;
use shared::queue::{Lease, QueueConfig, TurnQueue};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Arguments of this subcommand.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Debug, clap::Subcommand)]
enum Mode {
    /// Run one consumer (worker) process until SIGTERM/SIGINT.
    Consume(ConsumeArgs),
    /// Measure throughput, commands per turn and start lateness.
    Bench(BenchArgs),
}

#[derive(Debug, Clone, clap::Args)]
struct ConsumeArgs {
    #[command(flatten)]
    redis: RedisArgs,
    #[command(flatten)]
    queue: QueueConfig,
    /// Worker slots.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Cap on a payload's `sleep_ms`.
    #[arg(long, default_value_t = u64::MAX)]
    max_sleep_ms: u64,
    /// Record completions (per id) and start lateness in Redis.
    #[arg(long)]
    record: bool,
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Use `REDIS_URL` instead of a private redis-server.
    #[arg(long)]
    external_redis: bool,
    #[command(flatten)]
    redis: RedisArgs,
    /// No-op turns for the throughput phase.
    #[arg(long, default_value_t = 20_000)]
    turns: usize,
    /// Turns waiting (delayed) for the lateness phase.
    #[arg(long, default_value_t = 1000)]
    waiting: usize,
    /// The waiting turns fall due evenly over this many ms.
    #[arg(long, default_value_t = 3000)]
    spread_ms: u64,
    /// Consumer slots.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Fetch batch of the consumer.
    #[arg(long, default_value_t = 64)]
    fetch_batch: usize,
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.mode {
        Mode::Consume(a) => consume(a).await,
        Mode::Bench(a) => bench(a).await,
    }
}

#[derive(Clone)]
struct Probe {
    conn: shared::redis_util::RedisConn,
    record: bool,
    max_sleep_ms: u64,
    done_key: String,
    lateness_key: String,
}

async fn probe_turn(payload: serde_json::Value, lease: Lease, probe: Data<Probe>) -> Result<(), BoxDynError> {
    if payload.get("crash").and_then(|v| v.as_bool()) == Some(true) {
        // A poison turn: it takes its worker process down with it.
        std::process::abort();
    }
    if payload.get("fail").and_then(|v| v.as_bool()) == Some(true) {
        return Err("probe: this turn asked to fail".into());
    }
    let sleep_ms = payload.get("sleep_ms").and_then(|v| v.as_u64()).unwrap_or(0).min(probe.max_sleep_ms);
    if sleep_ms > 0 {
        tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
    }
    if probe.record {
        let mut conn = probe.conn.clone();
        let _: () = redis::pipe()
            .hincr(&probe.done_key, &lease.id, 1)
            .ignore()
            .rpush(&probe.lateness_key, lease.lateness_ms())
            .ignore()
            .query_async(&mut conn)
            .await?;
    }
    Ok(())
}

async fn consume(args: ConsumeArgs) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("info");
    let signal = super::shutdown_signal();
    let queue = TurnQueue::new(&args.redis, args.queue.clone())?;
    let probe = Probe {
        conn: shared::redis_util::connect(&args.redis, shared::redis_util::COMMAND_TIMEOUT)?,
        record: args.record,
        max_sleep_ms: args.max_sleep_ms,
        done_key: args.redis.keys().probe_done(),
        lateness_key: args.redis.keys().probe_lateness(),
    };
    let backend = worker::backend::QueueBackend::<serde_json::Value>::new(queue.clone(), args.concurrency);
    let name = backend.identity().to_owned();
    tracing::info!(message = "queue-probe consuming", worker.id = %name, concurrency = args.concurrency);
    let worker = WorkerBuilder::new(name.as_str()).backend(backend).data(probe).build(probe_turn);
    worker
        .run_until(async move {
            signal.await;
            Ok::<(), std::io::Error>(())
        })
        .await
        .context("worker")?;
    Ok(ExitCode::SUCCESS)
}

/// Enqueues `n` turns with 64 enqueues in flight; `delay(i)` gives each one's delay.
async fn enqueue_many(queue: &TurnQueue, tag: &str, n: usize, delay: impl Fn(usize) -> u64) -> anyhow::Result<()> {
    use futures::StreamExt;
    let results: Vec<_> = futures::stream::iter(0..n)
        .map(|i| {
            let d = delay(i);
            async move { queue.enqueue_raw(&format!("{tag}-{i}"), "{}", d).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(())
}

async fn wait_until_drained(queue: &TurnQueue, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let c = queue.counts().await?;
        if c.ready + c.delayed + c.in_flight == 0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "queue not drained after {timeout:?}: {c:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spawn_consumer(
    redis: &RedisArgs,
    concurrency: usize,
    fetch_batch: usize,
    record: bool,
) -> anyhow::Result<std::process::Child> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    // Redis's URL (a password in it) goes by the environment, not the command line.
    cmd.args(["queue-probe", "consume", "--prefix", &redis.prefix])
        .env("REDIS_URL", &redis.url)
        .args(["--concurrency", &concurrency.to_string(), "--queue-fetch-batch", &fetch_batch.to_string()])
        .env("RUST_LOG", "warn");
    if record {
        cmd.arg("--record");
    }
    Ok(cmd.spawn()?)
}

/// The queue alone: one no-op consumer process (`queue-probe consume`) on a
/// fresh prefix `prefix` at `url`, `turns` turns enqueued at once (64 enqueues
/// in flight, overlapping the consumer); turns per second until drained and
/// Redis commands per turn. `paceline bench --scenario throughput` reports it
/// beside the real worker's figure.
pub async fn queue_only(
    url: &str,
    prefix: &str,
    turns: usize,
    concurrency: usize,
    fetch_batch: usize,
) -> anyhow::Result<QueueOnly> {
    let redis = RedisArgs::new(url, prefix);
    let queue = TurnQueue::new(&redis, QueueConfig::default())?;
    let mut admin = shared::redis_util::manager(&redis.url).await?;
    let mut child = spawn_consumer(&redis, concurrency, fetch_batch, false)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while queue.list_workers().await?.is_empty() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the consumer did not register within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = CommandStats::read(&mut admin).await?;
    let t0 = Instant::now();
    let result = async {
        enqueue_many(&queue, "tp", turns, |_| 0).await?;
        wait_until_drained(&queue, Duration::from_secs(600)).await
    }
    .await;
    let elapsed = t0.elapsed();
    let after = CommandStats::read(&mut admin).await;
    let _ = child.kill();
    let _ = child.wait();
    result?;
    let delta = after?.since(&before);
    Ok(QueueOnly {
        turns_per_s: turns as f64 / elapsed.as_secs_f64(),
        redis_commands_per_turn: delta.total() as f64 / turns.max(1) as f64,
        turns,
        redis_commands_breakdown: delta.breakdown(turns as f64, 14),
    })
}

async fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("warn");
    let private = if args.external_redis { None } else { Some(BenchRedis::start("queue-bench").await?) };
    let url = private.as_ref().map(BenchRedis::url).unwrap_or_else(|| args.redis.url.clone());
    let prefix = format!("bench{}", std::process::id());

    // Phase 1: throughput and commands per turn, one consumer process.
    let q = queue_only(&url, &prefix, args.turns, args.concurrency, args.fetch_batch).await?;
    println!("queue bench: one consumer process, concurrency {}, fetch batch {}", args.concurrency, args.fetch_batch);
    println!("throughput: {} no-op turns, {:.0} turns/s (enqueue overlapping)", q.turns, q.turns_per_s);
    println!(
        "redis commands per turn: {:.2} (enqueue + fetch + ack + heartbeats + this bench's count polls, scripts' inner calls included)",
        q.redis_commands_per_turn
    );
    println!("  per turn: {}", q.redis_commands_breakdown);

    // Phase 2: start lateness of turns waiting for their due time.
    let redis = RedisArgs::new(url, prefix);
    let queue = TurnQueue::new(&redis, QueueConfig::default())?;
    let mut admin = shared::redis_util::manager(&redis.url).await?;
    let mut child = spawn_consumer(&redis, args.concurrency, args.fetch_batch, true)?;
    let spread = args.spread_ms.max(1);
    let n = args.waiting.max(1);
    // Due 1 s from now, then evenly over the spread: all of them wait first.
    enqueue_many(&queue, "late", n, |i| 1000 + spread * i as u64 / n as u64).await?;
    wait_until_drained(&queue, Duration::from_secs(120)).await?;
    let late: Vec<i64> =
        redis::cmd("LRANGE").arg(redis.keys().probe_lateness()).arg(0).arg(-1).query_async(&mut admin).await?;
    let early = late.iter().filter(|l| **l < 0).count();
    let p = Percentiles::of(late);
    println!(
        "start lateness of {} waiting turns (due over {} ms): p50 {} ms, p99 {} ms, max {} ms, early starts: {}",
        p.n, spread, p.p50, p.p99, p.max, early
    );
    let _ = child.kill();
    let _ = child.wait();
    Ok(ExitCode::SUCCESS)
}
