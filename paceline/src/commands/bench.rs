//! `paceline bench` (README, "The pacing benchmark"): the shared pacer against its baselines in one
//! invocation, and the queue's throughput through the real worker. Thin: the
//! machinery lives in `crate::bench`; this file is the flags, the order of
//! the trials, the progress bar and the output.
//!
//! Runs are submitted through the API's own code path: `api::Application`
//! in this process, `POST /v1/runs` over HTTP.

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use mock_provider::{BucketMode, MockConfig};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::bench::pacing::{self, PacingPlan};
use crate::bench::report::{self, ConfigOut, Report, Setup};
use crate::bench::shapes::Shape;
use crate::bench::throughput::{self, ThroughputPlan};
use crate::bench::trial::Env;
use crate::bench::workload::Workload;

/// Which measurements to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The pacing comparison, then the throughput scenario.
    All,
    /// Each pacer of `--pacer` against the rate-limited mock, same workload.
    Pacing,
    /// One worker process, an instant mock without limits: turns/s and Redis commands per turn.
    Throughput,
    /// Fair admission under the shared pacer, three trials: companion
    /// runs of tenant `live` cutting into tenant `bulk`'s saturating work
    /// (`fairness.companion.{p50_ms,p95_ms,max_ms,n}`: submit → the mock's
    /// admission of the run's first call; `fairness.work_efficiency`: floor /
    /// makespan over every admitted token); four tenants with `--share-runs`
    /// runs each, backlogged (`fairness.tenants.<t>`: share of the admitted
    /// tokens from `--share-skip-s` after the first submit until the first
    /// tenant's last call; `fairness.jain`: Jain's index of those tokens);
    /// two tenants equally backlogged under `--tenant-weights`
    /// (`fairness.weights_2_1.{ratio,target,error,shares}`). JSON:
    /// `{"config": …, "fairness": …}`.
    Fairness,
    /// The cost per turn as the fleet grows: the pacing trial (shared pacer)
    /// with the same total slots (`--workers` × `--concurrency`) split into
    /// each of `--fleet-sizes` worker processes; per size, Redis commands, Redis
    /// CPU and empty fetches per turn, efficiency and 429s. JSON:
    /// `{"config": …, "fleet": {"<processes>": figures}}`.
    Fleet,
    /// What waiting costs as the backlog grows: per `--backlog-sizes` (one-turn
    /// runs submitted at once, the shared pacer, measured for `--timeout-s`),
    /// Redis commands, Redis CPU and budget waits per admitted turn, Redis
    /// memory per waiting run, worker RSS, the p99 of a submit and of
    /// `GET /v1/runs/{id}`; then what a call in flight costs by the second
    /// (`--long-calls`: Redis CPU per call-second). Run it at a real
    /// per-minute limit (`--window-s 60`). JSON: `{"config": …, "backlog":
    /// {"<runs>": figures}, "long_calls": [figures], "marginal": {…}}`.
    Backlog,
    /// A long run's bill (SPEC §4a): `--long-run-count` runs of
    /// `--long-run-turns` turns, each adding a tool output of ~3 400
    /// characters, on the Anthropic shape (its input bucket, `--long-run-tpm`,
    /// binding; cache reads not counted) and the OpenAI shape (cached tokens
    /// counted), with prompt caching on and off: work per minute (input tokens
    /// processed, cached or not), the cached share, 429s, cost per run at the
    /// model's list price. JSON: `{"config": …, "long_runs": {"<shape>":
    /// {"cache_on": figures, "cache_off": figures, "work_ratio": on / off}}}`.
    LongRuns,
}

/// Arguments of `paceline bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// What to measure.
    #[arg(long, value_enum, default_value = "all")]
    scenario: Scenario,
    /// Pacers to compare, in order: `shared` (the product), `local` (per-process state), `off` (reactive backoff only).
    #[arg(long, value_delimiter = ',', default_value = "shared,local,off")]
    pacer: Vec<shared::pacer::PacerKind>,
    /// Worker processes per pacer.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Slots per worker process.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Runs per pacer.
    #[arg(long, default_value_t = 120)]
    runs: usize,
    /// Turns per run (the mock answers turns - 1 tool rounds, then text).
    #[arg(long, default_value_t = 5)]
    turns: u32,
    /// The mock's token bucket: tokens per window.
    #[arg(long, default_value_t = 60_000)]
    tpm: u64,
    /// The mock's request bucket: requests per window.
    #[arg(long, default_value_t = 600)]
    rpm: u64,
    /// The mock's window, s: 60 like OpenAI, shorter to scale a minute down.
    #[arg(long, default_value_t = 10.0)]
    window_s: f64,
    /// How the mock's buckets refill.
    #[arg(long, value_enum, default_value_t = BucketMode::Continuous)]
    bucket: BucketMode,
    /// Whether the mock gives a call's unused output reservation back (`refund`) or keeps it (`keep`).
    #[arg(long, value_enum, default_value_t = mock_provider::ChargeMode::Refund)]
    charge: mock_provider::ChargeMode,
    /// The mock's latency before an admitted answer, ms.
    #[arg(long, default_value_t = 200)]
    latency_ms: u64,
    /// `max_output_tokens` of each run (reserved by the pacer; charged, then refunded, by the mock).
    #[arg(long, default_value_t = 256)]
    max_output_tokens: u32,
    /// Characters of each run's input: its task padded with background text (0: the task alone, ~100 tokens).
    #[arg(long, default_value_t = 0)]
    input_chars: usize,
    /// Words in each run's final answer.
    #[arg(long, default_value_t = 100)]
    answer_tokens: u64,
    /// Longest wait for one pacer's runs, s (then the unfinished ones are reported as such).
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Throughput scenario: runs.
    #[arg(long, default_value_t = 300)]
    throughput_runs: usize,
    /// Throughput scenario: turns per run.
    #[arg(long, default_value_t = 10)]
    throughput_turns: u32,
    /// Throughput scenario: slots of the one worker process.
    #[arg(long, default_value_t = 64)]
    throughput_concurrency: usize,
    /// Throughput scenario: no-op turns for the queue-alone figure (0 skips it).
    #[arg(long, default_value_t = 20_000)]
    queue_turns: usize,
    /// Fairness scenario: work runs of tenant `bulk` (of `--turns` turns each).
    #[arg(long, default_value_t = 80)]
    live_work_runs: usize,
    /// Fairness scenario: companion runs of tenant `live` (one turn each).
    #[arg(long, default_value_t = 10)]
    companions: usize,
    /// Fairness scenario: the first companion is submitted this long after the work, s.
    #[arg(long, default_value_t = 4.0)]
    companion_start_s: f64,
    /// Fairness scenario: between companion submits, s.
    #[arg(long, default_value_t = 2.0)]
    companion_gap_s: f64,
    /// Fairness scenario: runs of tenants a, b, c, d (equal weights), as many as listed.
    #[arg(long, value_delimiter = ',', default_value = "40,4,4,4")]
    share_runs: Vec<usize>,
    /// Fairness scenario: weights of tenants a and b in the weighted trial (`a:2,b:1` on the workers).
    #[arg(long, value_delimiter = ',', default_value = "2,1")]
    share_weights: Vec<u32>,
    /// Fairness scenario: runs of each tenant in the weighted trial (enough for a ~30 s window at the default budget).
    #[arg(long, default_value_t = 12)]
    weighted_runs: usize,
    /// Fairness scenario: turns per run in the share trials (many, so every tenant stays backlogged).
    #[arg(long, default_value_t = 12)]
    share_turns: u32,
    /// Fairness scenario: the share window opens this long after the first submit, s.
    #[arg(long, default_value_t = 10.0)]
    share_skip_s: f64,
    /// Fairness scenario: which of its trials to run (diagnostics).
    #[arg(long, hide = true, value_delimiter = ',', default_value = "live,share,weights")]
    fairness_trials: Vec<String>,
    /// Write each pacer trial's raw data (the mock's request log, the deliveries) into this dir.
    #[arg(long, hide = true)]
    dump_dir: Option<std::path::PathBuf>,
    /// Run the pacing comparison against these provider shapes (comma-separated, or `all`):
    /// continuous, keep, window, anthropic, azure, headerless, configured, unlimited. Each shape
    /// is the mock at its own default limits (from --tpm, --rpm, --window-s); one table row per
    /// shape and pacer; JSON `shapes.<name>.pacers.<pacer>`.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    shape: Vec<Vec<Shape>>,
    /// Fleet scenario: worker process counts to compare, the same total slots split among them.
    #[arg(long, value_delimiter = ',', default_value = "2,16,64")]
    fleet_sizes: Vec<usize>,
    /// Backlog scenario: runs submitted at once, one trial each (`0`: none).
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    backlog_sizes: Vec<usize>,
    /// Backlog scenario: long-call trials, each `<seconds a call takes>x<calls in flight>` (`none`: no such trial).
    #[arg(long, value_delimiter = ',', default_value = "20x64,120x64,20x1024,120x1024", value_parser = parse_long_call)]
    long_calls: Vec<Option<(f64, usize)>>,
    /// Long-runs scenario: runs per trial.
    #[arg(long, default_value_t = 16)]
    long_run_count: usize,
    /// Long-runs scenario: turns per run (at least 20).
    #[arg(long, default_value_t = 20)]
    long_run_turns: u32,
    /// Long-runs scenario: the budget's input tokens per `--window-s` (the other buckets are roomy).
    #[arg(long, default_value_t = 200_000)]
    long_run_tpm: u64,
    /// Long-runs scenario: the shapes to run.
    #[arg(long, value_delimiter = ',', default_value = "anthropic,openai", value_parser = parse_long_shape)]
    long_run_shapes: Vec<crate::bench::long_runs::LongShape>,
    /// The bench Redis's `hz` (its timers' rate, Redis's default 10). Its own
    /// timers are most of its idle CPU and of that idle rate's noise, which a
    /// net figure subtracts: `--redis-hz 1` measures paceline's own work
    /// more finely (say so beside any figure it gives).
    #[arg(long = "redis-hz", value_parser = clap::value_parser!(u32).range(1..=500))]
    redis_hz: Option<u32>,
    /// Run the trials on a private local Redis Cluster of this many primaries
    /// (and one replica each; `redis-cli --cluster` must be there) instead of
    /// one Redis: the deployment lives in one slot, and the Redis figures are
    /// that slot's primary's.
    #[arg(long = "redis-cluster", value_name = "PRIMARIES", value_parser = clap::value_parser!(u32).range(3..=16))]
    redis_cluster: Option<u32>,
    /// Write the figures as one JSON object to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// `--long-calls`: `<seconds>x<in flight>`, e.g. `20x64`; `none`.
fn parse_long_call(s: &str) -> Result<Option<(f64, usize)>, String> {
    if s == "none" {
        return Ok(None);
    }
    let (secs, n) = s.split_once('x').ok_or_else(|| format!("`{s}`: write <seconds>x<calls in flight>, e.g. 20x64"))?;
    let secs: f64 = secs.trim().parse().map_err(|_| format!("`{s}`: `{secs}` is not a number of seconds"))?;
    let n: usize = n.trim().parse().map_err(|_| format!("`{s}`: `{n}` is not a count of calls"))?;
    if !(secs > 0.0 && secs <= 3600.0) || n == 0 {
        return Err(format!("`{s}`: a call takes more than 0 and at most 3600 s, and at least one is in flight"));
    }
    Ok(Some((secs, n)))
}

/// `--long-run-shapes`: `anthropic`, `openai`.
fn parse_long_shape(s: &str) -> Result<crate::bench::long_runs::LongShape, String> {
    use crate::bench::long_runs::LongShape;
    LongShape::ALL
        .into_iter()
        .find(|shape| shape.name() == s)
        .ok_or_else(|| format!("unknown shape `{s}` (anthropic or openai)"))
}

/// `--shape`: a shape's name, or `all`.
fn parse_shape(s: &str) -> Result<Vec<Shape>, String> {
    use clap::ValueEnum as _;
    if s == "all" {
        return Ok(Shape::ALL.to_vec());
    }
    Shape::from_str(s, false).map(|shape| vec![shape]).map_err(|_| {
        let names: Vec<String> = Shape::ALL.iter().map(|s| s.name()).collect();
        format!("unknown shape `{s}` (one of {}, or all)", names.join(", "))
    })
}

impl Args {
    /// The fleet and budget, as the JSON's `config` reports them.
    fn setup(&self) -> Setup {
        Setup {
            workers: self.workers,
            concurrency: self.concurrency,
            tpm: self.tpm,
            rpm: self.rpm,
            window_s: self.window_s,
            bucket: self.bucket.to_string(),
            charge: self.charge.to_string(),
            latency_ms: self.latency_ms,
            max_output_tokens: self.max_output_tokens,
            input_chars: self.input_chars,
        }
    }
}

fn pacer_name(kind: shared::pacer::PacerKind) -> String {
    use clap::ValueEnum as _;
    kind.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_else(|| format!("{kind:?}").to_lowercase())
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("error");
    anyhow::ensure!(args.workers > 0 && args.concurrency > 0, "--workers and --concurrency must be at least 1");
    anyhow::ensure!(args.runs > 0 && args.turns > 0, "--runs and --turns must be at least 1");
    anyhow::ensure!(args.window_s > 0.0, "--window-s must be positive");
    let started = Instant::now();
    let pacers: Vec<String> = {
        let mut seen = vec![];
        for p in args.pacer.iter().map(|k| pacer_name(*k)) {
            if !seen.contains(&p) {
                seen.push(p);
            }
        }
        seen
    };
    let workload = Workload {
        runs: args.runs,
        turns: args.turns,
        max_output_tokens: args.max_output_tokens,
        answer_tokens: args.answer_tokens,
        model: "gpt-4.1-mini".into(),
        input_chars: args.input_chars,
        long_outputs: false,
        prompt_cache: None,
    };
    let plan = PacingPlan {
        workers: args.workers,
        concurrency: args.concurrency,
        workload,
        mock: MockConfig {
            tpm: args.tpm,
            rpm: args.rpm,
            window: Duration::from_secs_f64(args.window_s),
            bucket: args.bucket,
            charge: args.charge,
            latency: Duration::from_millis(args.latency_ms),
            ..MockConfig::default()
        },
        timeout: Duration::from_secs(args.timeout_s),
        dump_dir: args.dump_dir.clone(),
        worker_args: vec![],
    };
    let env = Env::start(args.redis_hz, args.redis_cluster.map(|n| n as usize)).await?;
    let progress = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{spinner} {msg:>12} [{bar:40}] {pos}/{len} calls answered, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(200));

    if args.scenario == Scenario::Fairness {
        return fairness(&args, &plan, &env, &progress, started).await;
    }
    if args.scenario == Scenario::Fleet {
        return fleet(&args, &plan, &env, &progress, started).await;
    }
    if args.scenario == Scenario::Backlog {
        return backlog(&args, &plan, &env, &progress, started).await;
    }
    if args.scenario == Scenario::LongRuns {
        return long_runs(&args, &env, &progress, started).await;
    }
    let mut shapes: Vec<Shape> = args.shape.iter().flatten().copied().collect();
    shapes.dedup();
    if !shapes.is_empty() {
        return shape_matrix(&args, &plan, &pacers, &shapes, &env, &progress, started).await;
    }
    let mut figures = BTreeMap::new();
    if matches!(args.scenario, Scenario::All | Scenario::Pacing) {
        for pacer in &pacers {
            let f = pacing::measure(&env, &plan, pacer, &progress).await.with_context(|| format!("pacer {pacer}"))?;
            let line = format!(
                "{pacer}: makespan {:.1} s, efficiency {:.3}, {} 429s in {} calls, runs {} completed / {} failed / {} unfinished",
                f.makespan_s, f.efficiency, f.rate_limited, f.calls, f.runs_completed, f.runs_failed, f.runs_unfinished
            );
            progress.suspend(|| eprintln!("{line}"));
            figures.insert(pacer.clone(), f);
        }
    }
    let mut throughput_figures = None;
    if matches!(args.scenario, Scenario::All | Scenario::Throughput) {
        let tplan = ThroughputPlan {
            runs: args.throughput_runs,
            turns: args.throughput_turns,
            concurrency: args.throughput_concurrency,
            pacer: pacers.first().cloned().unwrap_or_else(|| "shared".into()),
            timeout: Duration::from_secs(args.timeout_s),
        };
        let mut t = throughput::measure(&env, &tplan, &progress).await.context("throughput")?;
        // (The queue alone runs on one Redis only.)
        if args.queue_turns > 0 && !env.redis.is_cluster() {
            progress.set_message("queue alone");
            let prefix = format!("benchq{}", std::process::id());
            t.queue_only = Some(
                super::queue_probe::queue_only(&env.redis.url(), &prefix, args.queue_turns, 16, 64)
                    .await
                    .context("queue alone")?,
            );
        }
        throughput_figures = Some(t);
    }
    progress.finish_and_clear();

    let report = Report {
        config: ConfigOut {
            setup: args.setup(),
            runs: args.runs,
            turns: args.turns,
            pacer_order: pacers,
            submit_path: "api::Application in-process, POST /v1/runs".into(),
            floor_formula: report::FLOOR_FORMULA.into(),
        },
        pacers: figures,
        throughput: throughput_figures,
    };
    print!("{}", report::table(&report));
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The fleet size the cost bar is set at: its commands per turn within 1.5×
/// of the smallest size's.
const FLEET_BAR_PROCESSES: usize = 64;

/// `--scenario fleet`: the shared pacer's trial at each fleet size, one table
/// row per size, each size's cost against the smallest, and the cost bar
/// ([`FLEET_BAR_PROCESSES`], or the largest size where none is that) checked.
async fn fleet(
    args: &Args,
    plan: &PacingPlan,
    env: &Env,
    progress: &ProgressBar,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.fleet_sizes.is_empty() && args.fleet_sizes.iter().all(|n| *n > 0),
        "--fleet-sizes lists worker process counts of at least 1"
    );
    let slots = args.workers * args.concurrency;
    let mut sizes = args.fleet_sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let mut rows: BTreeMap<usize, report::PacerFigures> = BTreeMap::new();
    for &n in &sizes {
        let sized = PacingPlan { workers: n, concurrency: (slots / n).max(1), ..plan.clone() };
        let f = pacing::measure(env, &sized, "shared", progress).await.with_context(|| format!("{n} processes"))?;
        let line = format!(
            "{n} processes x {}: {:.1} Redis commands / turn, {:.2} empty fetches / turn, efficiency {:.3}",
            sized.concurrency, f.redis_commands_per_turn, f.empty_fetches_per_turn, f.efficiency
        );
        progress.suspend(|| eprintln!("{line}"));
        rows.insert(n, f);
    }
    progress.finish_and_clear();
    println!(
        "paceline bench --scenario fleet: {slots} slots in all, {} runs x {} turns, the shared pacer, mock {} tokens / {} s",
        args.runs, args.turns, args.tpm, args.window_s
    );
    println!(
        "{:>9} {:>6} {:>12} {:>14} {:>14} {:>10} {:>6} {:>9} {:>8}",
        "processes",
        "slots",
        "cmds / turn",
        "Redis CPU ms",
        "empty fetches",
        "efficiency",
        "429s",
        "runs c/f",
        "RSS MB"
    );
    for (n, f) in &rows {
        println!(
            "{:>9} {:>6} {:>12.1} {:>14.3} {:>14.2} {:>10.3} {:>6} {:>9} {:>8.1}",
            n,
            (slots / n).max(1),
            f.redis_commands_per_turn,
            f.redis_cpu_ms_per_turn,
            f.empty_fetches_per_turn,
            f.efficiency,
            f.rate_limited,
            format!("{}/{}", f.runs_completed, f.runs_failed),
            f.worker_peak_rss_mb
        );
    }
    if let Some((small, fs)) = rows.iter().next() {
        let ratio = |f: &report::PacerFigures| f.redis_commands_per_turn / fs.redis_commands_per_turn.max(1e-9);
        let ratios: Vec<String> = rows.iter().skip(1).map(|(n, f)| format!("{n}: {:.2}x", ratio(f))).collect();
        println!("commands per turn against {small} processes: {}", ratios.join(", "));
        // The bar is set at 64 processes (the largest size, where none is 64).
        if let Some((large, fl)) = rows.iter().find(|(n, _)| **n == FLEET_BAR_PROCESSES).or(rows.iter().next_back()) {
            let r = ratio(fl);
            println!(
                "bar: commands per turn at {large} processes within 1.5x of {small}: {r:.2}x: {}",
                if r <= 1.5 { "yes" } else { "NO" }
            );
        }
    }
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let fleet: BTreeMap<String, &report::PacerFigures> = rows.iter().map(|(n, f)| (n.to_string(), f)).collect();
        let out = serde_json::json!({"config": args.setup(), "fleet": fleet});
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The backlog scenario's bars (issue 37): from the smallest backlog to the
/// largest, commands and CPU per admitted turn grow at most this much …
const BACKLOG_GROWTH_BAR: f64 = 1.5;
/// … with at most this many budget waits …
const BACKLOG_WAITS_BAR: f64 = 2.0;
/// … and Redis commands per admitted turn at every size.
const BACKLOG_COMMANDS_BAR: f64 = 40.0;

/// `--scenario backlog`: one trial per backlog size, then the long calls;
/// the table, the bars, `--json`.
async fn backlog(
    args: &Args,
    plan: &PacingPlan,
    env: &Env,
    progress: &ProgressBar,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    use crate::bench::backlog::{marginal_ms_per_call_second, measure_long, measure_size};
    let mut sizes = args.backlog_sizes.clone();
    sizes.retain(|n| *n > 0);
    sizes.sort_unstable();
    sizes.dedup();
    let mut rows = BTreeMap::new();
    for &n in &sizes {
        let f = measure_size(env, plan, n, progress).await.with_context(|| format!("{n} runs"))?;
        let line = format!(
            "{n} runs: {} turns admitted, {:.2} budget waits / turn, {:.1} commands / turn, {:.2} ms Redis CPU / turn",
            f.admitted_turns, f.budget_waits_per_turn, f.redis_commands_per_turn, f.redis_cpu_ms_per_turn
        );
        progress.suspend(|| eprintln!("{line}"));
        rows.insert(n, f);
    }
    let mut long = vec![];
    for &(secs, n) in args.long_calls.iter().flatten() {
        let f = measure_long(env, plan, secs, n, progress).await.with_context(|| format!("{secs} s x {n}"))?;
        let line = format!(
            "{secs} s x {n} in flight: {:.4} ms Redis CPU per call-second, {:.1} commands per call; steady: {}",
            f.redis_cpu_ms_per_call_second,
            f.redis_commands_per_call,
            steady_line(&f)
        );
        progress.suspend(|| eprintln!("{line}"));
        long.push(f);
    }
    progress.finish_and_clear();
    println!(
        "paceline bench --scenario backlog: {} workers x {} slots, one-turn runs, the shared pacer, mock {} tokens / {} requests per {} s, each size measured for {} s",
        args.workers, args.concurrency, args.tpm, args.rpm, args.window_s, args.timeout_s
    );
    println!(
        "{:>7} {:>10} {:>12} {:>7} {:>7} {:>12} {:>11} {:>12} {:>10} {:>9} {:>10} {:>5} {:>11} {:>7} {:>15} {:>15}",
        "runs",
        "setup cmds",
        "setup CPU ms",
        "setup s",
        "turns",
        "waits/turn",
        "cmds/turn",
        "CPU ms/turn",
        "net CPU ms",
        "CPU core",
        "efficiency",
        "429s",
        "B/waiting",
        "RSS MB",
        "submit p50/p99",
        "GET run p50/p99"
    );
    for (n, f) in &rows {
        println!(
            "{:>7} {:>10.1} {:>12.3} {:>7.1} {:>7} {:>12.2} {:>11.1} {:>12.3} {:>10.3} {:>8.1}% {:>10.3} {:>5} {:>11.0} {:>7.1} {:>15} {:>15}",
            n,
            f.setup_commands_per_run,
            f.setup_cpu_ms_per_run,
            f.setup_s,
            f.admitted_turns,
            f.budget_waits_per_turn,
            f.redis_commands_per_turn,
            f.redis_cpu_ms_per_turn,
            f.net_cpu_ms_per_turn,
            f.redis_cpu_share * 100.0,
            f.efficiency,
            f.rate_limited,
            f.redis_bytes_per_waiting_run,
            f.worker_peak_rss_mb,
            format!("{:.1}/{:.1}", f.submit_ms.p50, f.submit_ms.p99),
            format!("{:.1}/{:.1}", f.get_run_ms.p50, f.get_run_ms.p99)
        );
    }
    println!("(setup: per run, from the first submit until no turn was due or leased (the first wave answered); the rest: per turn admitted after it, within the measured span; net CPU: less Redis's idle rate, read for {} s before the submits with the fleet up and the bench polling)", crate::bench::backlog::IDLE_SPAN.as_secs());
    for (n, f) in &rows {
        println!(
            "{n} runs: idle before the submits: {:.2} ms Redis CPU and {:.1} commands a second",
            f.idle_cpu_ms_per_s, f.idle_commands_per_s
        );
    }
    for (n, f) in &rows {
        let by: Vec<String> = f.redis_commands_by_command.iter().map(|(k, v)| format!("{k} {v:.1}")).collect();
        println!("{n} runs: commands per admitted turn: {}", by.join(", "));
        let empty: Vec<String> = f.empty_fetches_by_cause.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        println!("{n} runs: empty fetches per admitted turn, by what made the worker fetch: {}", empty.join(", "));
    }
    if let (Some((small, fs)), Some((large, fl))) = (rows.iter().next(), rows.iter().next_back()) {
        let growth = |a: f64, b: f64| b / a.max(1e-9);
        let (commands, cpu, net) = (
            growth(fs.redis_commands_per_turn, fl.redis_commands_per_turn),
            growth(fs.redis_cpu_ms_per_turn, fl.redis_cpu_ms_per_turn),
            growth(fs.net_cpu_ms_per_turn, fl.net_cpu_ms_per_turn),
        );
        let waits = rows.values().map(|f| f.budget_waits_per_turn).fold(0.0, f64::max);
        let most = rows.values().map(|f| f.redis_commands_per_turn).fold(0.0, f64::max);
        let yes = |ok: bool| if ok { "yes" } else { "NO" };
        println!(
            "bars: {small} -> {large} runs, commands per turn x{commands:.2}, CPU per turn x{cpu:.2} (net of the idle rate x{net:.2}) (<= {BACKLOG_GROWTH_BAR}: {}); budget waits per turn <= {BACKLOG_WAITS_BAR} at every size ({waits:.2}: {}); commands per turn <= {BACKLOG_COMMANDS_BAR} at every size ({most:.1}: {})",
            yes(commands <= BACKLOG_GROWTH_BAR && cpu <= BACKLOG_GROWTH_BAR),
            yes(waits <= BACKLOG_WAITS_BAR),
            yes(most <= BACKLOG_COMMANDS_BAR)
        );
    }
    let mut marginal = BTreeMap::new();
    if !long.is_empty() {
        println!(
            "{:>8} {:>10} {:>7} {:>14} {:>20} {:>12} {:>24} {:>12}",
            "call s",
            "in flight",
            "calls",
            "Redis CPU ms",
            "CPU ms / call-second",
            "idle ms / s",
            "net CPU ms / call-second",
            "cmds / call"
        );
        for f in &long {
            println!(
                "{:>8.0} {:>10} {:>7} {:>14.1} {:>20.4} {:>12.2} {:>24.4} {:>12.1}",
                f.call_s,
                f.in_flight,
                f.calls,
                f.redis_cpu_ms,
                f.redis_cpu_ms_per_call_second,
                f.idle_cpu_ms_per_s,
                f.net_cpu_ms_per_call_second,
                f.redis_commands_per_call
            );
        }
        for f in &long {
            println!("{:.0} s x {} in flight, steady: {}", f.call_s, f.in_flight, steady_line(f));
        }
        for n in long.iter().map(|f| f.in_flight).collect::<std::collections::BTreeSet<_>>() {
            let at: Vec<_> = long.iter().filter(|f| f.in_flight == n).collect();
            let (short, longest) = (
                at.iter().min_by(|a, b| a.call_s.total_cmp(&b.call_s)),
                at.iter().max_by(|a, b| a.call_s.total_cmp(&b.call_s)),
            );
            if let (Some(s), Some(l)) = (short, longest) {
                if let Some(m) = marginal_ms_per_call_second(s, l) {
                    println!(
                        "{n} in flight: a call's extra second ({:.0} s -> {:.0} s) costs {m:.4} ms of Redis CPU",
                        s.call_s, l.call_s
                    );
                    marginal.insert(n.to_string(), m);
                }
            }
        }
    }
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let backlog: BTreeMap<String, _> = rows.iter().map(|(n, f)| (n.to_string(), f)).collect();
        let out = serde_json::json!({
            "config": args.setup(),
            "backlog": backlog,
            "long_calls": long,
            "marginal_ms_per_call_second": marginal,
        });
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A long-call trial's steady cost, said: per call-second, and the two
/// rates it comes from.
fn steady_line(f: &crate::bench::backlog::LongCallFigures) -> String {
    match (f.steady_cpu_ms_per_call_second, f.in_flight_cpu_ms_per_s) {
        (Some(per), Some(busy)) => format!(
            "{per:.4} ms of Redis CPU a call-second ({busy:.2} ms/s with {} in flight, {:.2} idle; the scripts' own time {} ms a call-second; commands they add a second: {}; time a call then: {})",
            f.steady_calls,
            f.idle_cpu_ms_per_s,
            f.steady_script_ms_per_call_second.map_or_else(|| "-".to_owned(), |s| format!("{s:.4}")),
            f.steady_commands_per_s.iter().take(8).map(|(k, v)| format!("{k} {v:.1}")).collect::<Vec<_>>().join(", "),
            f.steady_us_per_call.iter().take(4).map(|(k, v)| format!("{k} {v:.0} µs")).collect::<Vec<_>>().join(", ")
        ),
        _ if f.call_s < crate::bench::backlog::STEADY_MIN_CALL_S => format!(
            "not measured (calls under {} s hold no window)",
            crate::bench::backlog::STEADY_MIN_CALL_S
        ),
        _ => "not measured (the calls were never all in flight at once)".to_owned(),
    }
}

/// Work per minute with caching on over off, on the Anthropic shape: the bar.
const LONG_RUNS_WORK_BAR: f64 = 3.0;
/// The cached share with caching on: Anthropic's bar, then OpenAI's.
const LONG_RUNS_CACHED_BARS: (f64, f64) = (0.70, 0.60);

async fn long_runs(args: &Args, env: &Env, progress: &ProgressBar, started: Instant) -> anyhow::Result<ExitCode> {
    use crate::bench::long_runs::{measure, LongRunsPlan, LongShape};
    anyhow::ensure!(args.long_run_turns >= 20, "--long-run-turns must be at least 20: these are long runs");
    anyhow::ensure!(
        args.long_run_count > 0 && args.long_run_tpm > 0,
        "--long-run-count and --long-run-tpm must be at least 1"
    );
    let plan = LongRunsPlan {
        workers: args.workers,
        concurrency: args.concurrency,
        runs: args.long_run_count,
        turns: args.long_run_turns,
        tpm: args.long_run_tpm,
        window: Duration::from_secs_f64(args.window_s),
        latency: Duration::from_millis(args.latency_ms),
        max_output_tokens: args.max_output_tokens,
        timeout: Duration::from_secs(args.timeout_s.max(1800)),
    };
    let mut out = BTreeMap::new();
    for &shape in &args.long_run_shapes {
        let mut pair = BTreeMap::new();
        for cache in [true, false] {
            let f = measure(env, &plan, shape, cache, progress)
                .await
                .with_context(|| format!("{} cache {cache}", shape.name()))?;
            let line = format!(
                "{} cache {}: {:.0} s, {:.0} input tokens / min ({:.2} of the limit), {:.1} % cached, {} 429s in {} calls, {} of {} runs completed",
                shape.name(),
                if cache { "on" } else { "off" },
                f.makespan_s,
                f.work_tokens_per_min,
                f.work_tokens_per_min / f.limit_tokens_per_min,
                f.cached_share * 100.0,
                f.rate_limited,
                f.calls,
                f.runs_completed,
                plan.runs
            );
            progress.suspend(|| eprintln!("{line}"));
            pair.insert(if cache { "cache_on" } else { "cache_off" }, f);
        }
        out.insert(shape, pair);
    }
    progress.finish_and_clear();
    println!(
        "paceline bench --scenario long-runs: {} runs x {} turns (a ~3 400-character tool output a turn), {} workers x {} slots, the shared pacer, {} input tokens per {} s, latency {} ms",
        plan.runs, plan.turns, args.workers, args.concurrency, plan.tpm, args.window_s, args.latency_ms
    );
    println!(
        "{:>10} {:>6} {:>10} {:>16} {:>9} {:>9} {:>14} {:>14} {:>6} {:>8} {:>14}",
        "shape",
        "cache",
        "makespan s",
        "input tok / min",
        "x limit",
        "cached %",
        "cache writes",
        "output tokens",
        "429s",
        "calls",
        "USD / run"
    );
    let mut json = serde_json::Map::new();
    for (shape, pair) in &out {
        for (key, f) in pair {
            println!(
                "{:>10} {:>6} {:>10.1} {:>16.0} {:>9.2} {:>8.1}% {:>14} {:>14} {:>6} {:>8} {:>14}",
                shape.name(),
                if f.cache { "on" } else { "off" },
                f.makespan_s,
                f.work_tokens_per_min,
                f.work_tokens_per_min / f.limit_tokens_per_min,
                f.cached_share * 100.0,
                f.cache_write_tokens,
                f.output_tokens,
                f.rate_limited,
                f.calls,
                f.cost_per_run_usd.map_or_else(|| "unknown".to_owned(), |c| format!("{c:.4}"))
            );
            let _ = key;
        }
        let (on, off) = (&pair["cache_on"], &pair["cache_off"]);
        let ratio = on.work_tokens_per_min / off.work_tokens_per_min.max(1e-9);
        let yes = |ok: bool| if ok { "yes" } else { "NO" };
        match shape {
            LongShape::Anthropic => println!(
                "anthropic bars: work per minute x{ratio:.2} with caching (>= {LONG_RUNS_WORK_BAR}: {}), {:.1} % cached (>= {:.0} %: {}), {} 429s (0: {})",
                yes(ratio >= LONG_RUNS_WORK_BAR),
                on.cached_share * 100.0,
                LONG_RUNS_CACHED_BARS.0 * 100.0,
                yes(on.cached_share >= LONG_RUNS_CACHED_BARS.0),
                on.rate_limited,
                yes(on.rate_limited == 0)
            ),
            LongShape::Openai => println!(
                "openai bars: {:.1} % cached (>= {:.0} %: {}), {:.2} 429s per 100 calls (<= 0.1: {}); work per minute x{ratio:.2}",
                on.cached_share * 100.0,
                LONG_RUNS_CACHED_BARS.1 * 100.0,
                yes(on.cached_share >= LONG_RUNS_CACHED_BARS.1),
                on.rate_limited_per_100_calls,
                yes(on.rate_limited_per_100_calls <= 0.1)
            ),
        }
        json.insert(
            shape.name().to_owned(),
            serde_json::json!({"cache_on": on, "cache_off": off, "work_ratio": ratio}),
        );
    }
    println!("(work: input tokens the provider processed, read from its cache or not; USD at the model's list price, shared::models, {})", shared::models::TABLE_DATE);
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let out = serde_json::json!({"config": args.setup(), "long_runs": json});
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The fairness scenario's configuration, as the JSON's `config`.
#[derive(Debug, serde::Serialize)]
struct FairnessConfig {
    #[serde(flatten)]
    setup: Setup,
    pacer: &'static str,
    live_work_runs: usize,
    live_work_turns: u32,
    companions: usize,
    companion_start_s: f64,
    companion_gap_s: f64,
    share_runs: BTreeMap<String, usize>,
    weighted_runs: BTreeMap<String, usize>,
    tenant_weights: String,
    share_turns: u32,
    share_skip_s: f64,
    companion_wait: &'static str,
    share_window: &'static str,
}

/// `--scenario fairness`: its three trials, the table, `--json`.
async fn fairness(
    args: &Args,
    plan: &PacingPlan,
    env: &Env,
    progress: &ProgressBar,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    use crate::bench::fairness::{self, FairnessPlan, LivePlan};
    anyhow::ensure!(!args.share_runs.is_empty() && args.share_runs.len() <= 26, "--share-runs lists 1 to 26 tenants");
    anyhow::ensure!(args.share_weights.len() == 2, "--share-weights takes two weights (tenants a and b)");
    let name = |i: usize| ((b'a' + i as u8) as char).to_string();
    let share: Vec<(String, usize)> = args.share_runs.iter().enumerate().map(|(i, n)| (name(i), *n)).collect();
    let weighted: Vec<(String, usize, u32)> =
        args.share_weights.iter().enumerate().map(|(i, w)| (name(i), args.weighted_runs, *w)).collect();
    let fplan = FairnessPlan {
        workers: args.workers,
        concurrency: args.concurrency,
        mock: plan.mock.clone(),
        max_output_tokens: args.max_output_tokens,
        answer_tokens: args.answer_tokens,
        input_chars: args.input_chars,
        live: LivePlan {
            work_runs: args.live_work_runs,
            work_turns: args.turns,
            companions: args.companions,
            first_after: Duration::from_secs_f64(args.companion_start_s.max(0.0)),
            gap: Duration::from_secs_f64(args.companion_gap_s.max(0.0)),
        },
        share: share.clone(),
        weighted: weighted.clone(),
        share_turns: args.share_turns.max(1),
        share_skip: Duration::from_secs_f64(args.share_skip_s.max(0.0)),
        timeout: Duration::from_secs(args.timeout_s),
        dump_dir: args.dump_dir.clone(),
        trials: args.fairness_trials.clone(),
    };
    let figures = fairness::measure(env, &fplan, progress).await.context("fairness")?;
    progress.finish_and_clear();
    let config = FairnessConfig {
        setup: args.setup(),
        pacer: "shared",
        live_work_runs: args.live_work_runs,
        live_work_turns: args.turns,
        companions: args.companions,
        companion_start_s: args.companion_start_s,
        companion_gap_s: args.companion_gap_s,
        share_runs: share.into_iter().collect(),
        weighted_runs: weighted.iter().map(|(t, n, _)| (t.clone(), *n)).collect(),
        tenant_weights: figures.weights_2_1.weights.clone(),
        share_turns: fplan.share_turns,
        share_skip_s: args.share_skip_s,
        companion_wait: "just before POST /v1/runs (bench clock, read as the mock's) -> the mock's admission of the run's first 2xx call",
        share_window: "from share_skip_s after the first submit until the earliest of the tenants' last admitted calls; \
tokens = charged - refunded of the 2xx calls admitted in it, attributed by a marker in each run's input",
    };
    print!("{}", fairness::table(&figures));
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let out = serde_json::json!({"config": config, "fairness": figures});
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One shape's configuration and figures (`shapes.<name>` in the JSON).
#[derive(Debug, serde::Serialize)]
struct ShapeReport {
    /// The mock as the shape runs it.
    mock: ShapeMock,
    /// `paceline worker` flags the shape adds (configured limits).
    worker_args: Vec<String>,
    /// Figures per pacer, as `report.rs` names them.
    pacers: BTreeMap<String, report::PacerFigures>,
}

/// The mock of one shape.
#[derive(Debug, serde::Serialize)]
struct ShapeMock {
    headers: String,
    limits: String,
    bucket: String,
    charge: String,
    tpm: u64,
    rpm: u64,
    itpm: Option<u64>,
    otpm: Option<u64>,
    window_s: f64,
}

/// `--shape`: the pacing comparison against each provider shape, one table
/// row per shape and pacer, and each shape's bars checked on `shared`.
#[allow(clippy::too_many_arguments)]
async fn shape_matrix(
    args: &Args,
    plan: &PacingPlan,
    pacers: &[String],
    shapes: &[Shape],
    env: &Env,
    progress: &ProgressBar,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    let mut out: BTreeMap<String, ShapeReport> = BTreeMap::new();
    for shape in shapes {
        let (mock, worker_args) = shape.mock(&plan.mock);
        let shape_plan = PacingPlan {
            mock: mock.clone(),
            worker_args: worker_args.clone(),
            timeout: shape.timeout(plan.timeout),
            ..plan.clone()
        };
        let mut figures = BTreeMap::new();
        for pacer in pacers {
            progress.set_message(format!("{} {pacer}", shape.name()));
            let f = pacing::measure(env, &shape_plan, pacer, progress)
                .await
                .with_context(|| format!("shape {} pacer {pacer}", shape.name()))?;
            let line = format!(
                "{} / {pacer}: makespan {:.1} s, efficiency {:.3}, {} 429s in {} calls, runs {} completed / {} failed / {} unfinished",
                shape.name(), f.makespan_s, f.efficiency, f.rate_limited, f.calls, f.runs_completed, f.runs_failed, f.runs_unfinished
            );
            progress.suspend(|| eprintln!("{line}"));
            figures.insert(pacer.clone(), f);
        }
        let view = ShapeMock {
            headers: format!("{:?}", mock.headers).to_lowercase(),
            limits: format!("{:?}", mock.limits).to_lowercase(),
            bucket: mock.bucket.to_string(),
            charge: mock.charge.to_string(),
            tpm: mock.tpm,
            rpm: mock.rpm,
            itpm: mock.headers.splits_tokens().then(|| mock.input_capacity()),
            otpm: mock.headers.splits_tokens().then(|| mock.output_capacity()),
            window_s: mock.window.as_secs_f64(),
        };
        out.insert(shape.name(), ShapeReport { mock: view, worker_args, pacers: figures });
    }
    progress.finish_and_clear();
    print!("{}", shape_table(args, pacers, shapes, &out));
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "config": {"setup": args.setup(), "runs": args.runs, "turns": args.turns, "pacer_order": pacers,
                       "floor_formula": report::FLOOR_FORMULA},
            "shapes": out,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The shape matrix as a table, and the bars of "the pacer fits every
/// provider's bucket" checked on `shared`.
fn shape_table(args: &Args, pacers: &[String], shapes: &[Shape], out: &BTreeMap<String, ShapeReport>) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "paceline bench --shape: {} worker processes x {} slots, {} runs x {} turns, max_output_tokens {}, mock latency {} ms",
        args.workers, args.concurrency, args.runs, args.turns, args.max_output_tokens, args.latency_ms
    );
    let _ = writeln!(
        s,
        "{:<11} {:<7} {:>10} {:>9} {:>11} {:>7} {:>6} {:>7} {:>10}  mock",
        "shape", "pacer", "makespan s", "floor s", "efficiency", "calls", "429s", "/100", "runs c/f/u"
    );
    for shape in shapes {
        let r = &out[&shape.name()];
        let m = &r.mock;
        let limits = match (m.itpm, m.otpm) {
            (Some(i), Some(o)) => format!("{i}in+{o}out/{}rq per {}s", m.rpm, m.window_s),
            _ if m.limits == "none" => "no limits".to_string(),
            _ => format!("{}tok/{}rq per {}s", m.tpm, m.rpm, m.window_s),
        };
        let mock = format!("{} {} {} {}", m.headers, m.bucket, m.charge, limits);
        for pacer in pacers {
            let Some(f) = r.pacers.get(pacer) else { continue };
            let runs = format!("{}/{}/{}", f.runs_completed, f.runs_failed, f.runs_unfinished);
            let _ = writeln!(
                s,
                "{:<11} {:<7} {:>10.1} {:>9.1} {:>11.3} {:>7} {:>6} {:>7.2} {:>10}  {mock}",
                shape.name(),
                pacer,
                f.makespan_s,
                f.floor_s,
                f.efficiency,
                f.calls,
                f.rate_limited,
                f.rate_limited_per_100_calls,
                runs
            );
        }
    }
    // The bars, on `shared`.
    let _ = writeln!(s, "bars (shared):");
    for shape in shapes {
        let r = &out[&shape.name()];
        let Some(shared) = r.pacers.get("shared") else { continue };
        let mut notes = vec![];
        let all_done = shared.runs_failed + shared.runs_unfinished == 0;
        notes.push(format!("every run completed: {}", if all_done { "yes" } else { "NO" }));
        if shape.paced() {
            let ok = shared.rate_limited_per_100_calls <= 0.5;
            notes.push(format!("429s/100 {:.2} <= 0.5: {}", shared.rate_limited_per_100_calls, yes(ok)));
        }
        let bar = match shape {
            Shape::Window => Some(0.9),
            Shape::Headerless => None,
            Shape::Unlimited => None,
            _ => Some(0.95),
        };
        if let Some(bar) = bar {
            notes.push(format!("efficiency {:.3} >= {bar}: {}", shared.efficiency, yes(shared.efficiency >= bar)));
        }
        if *shape == Shape::Unlimited {
            notes.push(format!(
                "makespan {:.1} s against {:.1} s of latency alone (efficiency {:.3})",
                shared.makespan_s, shared.floor_s, shared.efficiency
            ));
        }
        for other in ["local", "off"] {
            if let Some(o) = r.pacers.get(other) {
                let (a, b) = (shared.rate_limited, o.rate_limited);
                let ok = b == 0 && a == 0 || (a as f64) * 10.0 <= b as f64;
                notes.push(format!("{a} vs {other} {b} 429s (>= 10x fewer): {}", yes(ok)));
            }
        }
        let _ = writeln!(s, "  {:<11} {}", shape.name(), notes.join("; "));
    }
    s
}

fn yes(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "NO"
    }
}
