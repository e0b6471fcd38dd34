//! The pacing scenario: the same workload against a fresh rate-limited mock,
//! once per pacer (`shared`, `local`, `off`), each trial on its own key prefix
//! with its own worker processes; then the figures of `report.rs` per pacer.

use indicatif::ProgressBar;
use mock_provider::{BucketMode, LimitsMode, MockConfig, Stats};
use std::collections::BTreeMap;
use std::time::Duration;

use super::report::{floor_s, BucketShape, PacerFigures, Percentiles};
use super::trial::{requeued, Env, Trial, TrialData, TrialSpec};
use super::workload::Workload;

/// What one pacing trial runs.
#[derive(Debug, Clone)]
pub struct PacingPlan {
    /// Worker processes.
    pub workers: usize,
    /// Slots per worker process.
    pub concurrency: usize,
    /// The runs.
    pub workload: Workload,
    /// The mock: limits, window, bucket, latency (its script is set from the workload).
    pub mock: MockConfig,
    /// Longest wait for the runs of one trial.
    pub timeout: Duration,
    /// Where to write each trial's raw data (the mock's request log, the
    /// deliveries), for a closer look; `None` writes nothing.
    pub dump_dir: Option<std::path::PathBuf>,
    /// `paceline worker` flags beyond the pacer's (a shape's configured limits).
    pub worker_args: Vec<String>,
}

/// Runs the workload with workers started with `--pacer {pacer}` and returns its figures.
pub async fn measure(
    env: &Env,
    plan: &PacingPlan,
    pacer: &str,
    progress: &ProgressBar,
) -> anyhow::Result<PacerFigures> {
    let mut mock = plan.mock.clone();
    (mock.tool_rounds, mock.output_tokens) = plan.workload.mock_script();
    mock.keep_bodies = 64;
    mock.log_limit = if plan.dump_dir.is_some() { 1_000_000 } else { 1000 };
    let spec = TrialSpec {
        label: pacer.to_owned(),
        workers: plan.workers,
        concurrency: plan.concurrency,
        worker_args: [vec!["--pacer".into(), pacer.to_owned()], plan.worker_args.clone()].concat(),
        mock,
        tokens: vec![],
        log_deliveries: true,
    };
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    let bodies = (0..plan.workload.runs).map(|i| plan.workload.body(i, &tool_url, pacer)).collect();
    progress.set_length(plan.workload.total_turns());
    progress.set_position(0);
    progress.set_message(format!("pacer {pacer}"));
    let trace = plan.dump_dir.as_ref().map(|_| trace_budget(&trial));
    trial.submit(None, bodies, 16).await?;
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let trace = match trace {
        Some((stop, task)) => {
            let _ = stop.send(());
            task.await.unwrap_or_default()
        }
        None => vec![],
    };
    let data = trial.finish(drained).await?;
    if let Some(dir) = &plan.dump_dir {
        dump(dir, pacer, &data)?;
        std::fs::write(dir.join(format!("{pacer}.budget-trace.json")), serde_json::to_string(&trace)?)?;
    }
    Ok(figures(plan, &data))
}

/// Diagnostics (`--dump-dir` only; its reads add to the Redis commands):
/// every 100 ms, the pacer's view of the token bucket beside the mock's own.
fn trace_budget(trial: &Trial) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Vec<serde_json::Value>>) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let redis = trial.redis.clone();
    let stats_url = format!("{}/_mock/stats?log=false", trial.mock.url());
    let task = tokio::spawn(async move {
        let mut out = vec![];
        let Ok(conn) = shared::redis_util::connect(&redis, shared::redis_util::COMMAND_TIMEOUT) else { return out };
        let pacer =
            shared::pacer::SharedPacer::new(conn, redis.keys(), "default", shared::pacer::PacingConfig::default());
        let http = reqwest::Client::new();
        let t0 = std::time::Instant::now();
        // Every 100 ms unless PACELINE_BENCH_TRACE_MS says otherwise (each read is a pacer snapshot).
        let every_ms = std::env::var("PACELINE_BENCH_TRACE_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
        loop {
            let theirs: serde_json::Value = match http.get(&stats_url).send().await {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => serde_json::Value::Null,
            };
            let ours = pacer.snapshot().await.ok().and_then(|v| v.into_iter().next());
            out.push(serde_json::json!({
                "t_ms": t0.elapsed().as_millis() as u64,
                "mock_remaining": theirs["buckets"]["tokens"]["remaining"],
                "pacer_remaining": ours.as_ref().and_then(|b| b.remaining_tokens),
                "pacer_reserved": ours.as_ref().map(|b| b.reserved_tokens),
                "pacer_booked": ours.as_ref().map(|b| b.booked_tokens),
                "refund_share": ours.as_ref().and_then(|b| b.refund_share),
                "refill": ours.as_ref().map(|b| b.shape.refill),
            }));
            tokio::select! {
                _ = &mut stopped => return out,
                _ = tokio::time::sleep(Duration::from_millis(every_ms)) => {}
            }
        }
    });
    (stop, task)
}

/// Writes `<pacer>.mock-log.json` (every request: arrival, status, tokens
/// charged and refunded) and `<pacer>.deliveries.json` into `dir`.
pub fn dump(dir: &std::path::Path, pacer: &str, data: &TrialData) -> anyhow::Result<()> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::write(dir.join(format!("{pacer}.mock-log.json")), serde_json::to_string(&data.mock.log)?)?;
    let deliveries: Vec<_> = data
        .deliveries
        .iter()
        .map(|d| serde_json::json!({"run": d.run, "turn": d.turn, "due_ms": d.due_ms, "fetched_ms": d.fetched_ms, "outcome": d.outcome}))
        .collect();
    std::fs::write(dir.join(format!("{pacer}.deliveries.json")), serde_json::to_string(&deliveries)?)?;
    Ok(())
}

/// The figures of one trial.
pub fn figures(plan: &PacingPlan, data: &TrialData) -> PacerFigures {
    let stats = &data.mock;
    let window_s = plan.mock.window.as_secs_f64();
    let fixed_window = plan.mock.bucket == BucketMode::Window;
    let makespan = data.makespan_s().unwrap_or(plan.timeout.as_secs_f64());
    let requests_admitted = stats.by_status.get(&200).copied().unwrap_or(0);
    let tokens = |capacity: u64, admitted: u64| {
        floor_s(BucketShape { capacity, window_s, fixed_window }, admitted, data.mock_offset_s)
    };
    // Separate input and output buckets (Anthropic): the later of the two.
    let token_floor = if plan.mock.headers.splits_tokens() {
        tokens(plan.mock.input_capacity(), stats.input_tokens_admitted)
            .max(tokens(plan.mock.output_capacity(), stats.output_tokens_admitted))
    } else {
        tokens(plan.mock.tpm, stats.tokens_admitted)
    };
    let request_floor =
        floor_s(BucketShape { capacity: plan.mock.rpm, window_s, fixed_window }, requests_admitted, data.mock_offset_s);
    let (floor, bound) = if plan.mock.limits == LimitsMode::None {
        // No limits: the least time the workers' slots and the mock's latency
        // allow, every run's turns one after another, the runs in waves of
        // all the slots.
        let slots = (plan.workers * plan.concurrency).max(1);
        let waves = plan.workload.runs.div_ceil(slots) as f64;
        (waves * plan.workload.turns as f64 * plan.mock.latency.as_secs_f64(), "latency")
    } else if request_floor > token_floor {
        (request_floor, "requests")
    } else {
        (token_floor, "tokens")
    };
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for run in data.runs.iter().filter(|r| r.status == shared::runs::RunStatus::Failed) {
        *failures.entry(run.error.as_ref().map(|e| e.kind.clone()).unwrap_or_default()).or_default() += 1;
    }
    let completed = data.runs.iter().filter(|r| r.status == shared::runs::RunStatus::Completed).count();
    let failed = failures.values().sum();
    let per = |n: u64| if stats.requests == 0 { 0.0 } else { 100.0 * n as f64 / stats.requests as f64 };
    PacerFigures {
        makespan_s: makespan,
        floor_s: floor,
        efficiency: if makespan > 0.0 { floor / makespan } else { 0.0 },
        calls: stats.requests,
        rate_limited: stats.rate_limited,
        rate_limited_per_100_calls: per(stats.rate_limited),
        tokens_per_min: if makespan > 0.0 { stats.tokens_admitted as f64 / makespan * window_s } else { 0.0 },
        limit_tokens_per_min: plan.mock.tpm as f64,
        lateness_ms: Percentiles::of(requeued(&data.deliveries).iter().map(|d| d.lateness_ms()).collect()),
        redis_commands_per_turn: data.commands_per_turn(),
        worker_peak_rss_mb: data.worker_peak_rss_mb,
        lease_losses: data.lease_losses,
        redis_cpu_ms_per_turn: 1000.0 * data.redis_cpu_s / data.turns_completed().max(1) as f64,
        empty_fetches_per_turn: data.empty_fetches as f64 / data.turns_completed().max(1) as f64,
        empty_fetches_breakdown: data
            .empty_by_cause
            .iter()
            .map(|(cause, n)| format!("{cause} {:.2}", *n as f64 / data.turns_completed().max(1) as f64))
            .collect::<Vec<_>>()
            .join(", "),
        runs_completed: completed,
        runs_failed: failed,
        runs_unfinished: plan.workload.runs.saturating_sub(completed + failed),
        timed_out: !data.drained,
        failures,
        turns_completed: data.turns_completed(),
        tokens_admitted: stats.tokens_admitted,
        requests_admitted,
        floor_bound: bound.to_owned(),
        budget_waits: data.runs.iter().map(|r| r.pacing.budget_waits).sum(),
        lateness_all_ms: Percentiles::of(data.deliveries.iter().map(|d| d.lateness_ms()).collect()),
        input_count_ratio: input_count_ratio(stats),
        largest_overdraft: stats.largest_overdraft,
        redis_commands_breakdown: data.commands.breakdown(data.turns_completed() as f64, 24),
    }
}

/// The mock's count of input tokens over the worker's own estimate
/// (`worker::estimate::input_tokens`, tiktoken o200k_base), summed over the
/// request bodies the mock kept: how far the reservations are from what the
/// provider charges.
fn input_count_ratio(stats: &Stats) -> f64 {
    let counted: std::collections::HashMap<u64, u64> =
        stats.log.iter().filter(|e| e.input_tokens > 0).map(|e| (e.seq, e.input_tokens)).collect();
    let (mut theirs, mut ours) = (0u64, 0u64);
    for kept in &stats.bodies {
        if let Some(n) = counted.get(&kept.seq) {
            theirs += n;
            ours += worker::estimate::input_tokens(&kept.body);
        }
    }
    if ours == 0 {
        0.0
    } else {
        theirs as f64 / ours as f64
    }
}
