//! The backlog scenario (`paceline bench --scenario backlog`, SPEC §7): what
//! waiting costs as the backlog grows, and what a call in flight costs by the
//! second.
//!
//! - **Backlog**: one-turn runs, as many as each of `--backlog-sizes`, all
//!   submitted at once against a real per-minute limit. What a run costs to
//!   submit and park (commands, CPU, memory) is measured apart: from the
//!   first submit until no turn is due (each has asked and waits parked, or
//!   runs). Then, for `--timeout-s` (most of a large backlog still waiting at
//!   the end: that is the point), what each admitted turn costs Redis
//!   (commands, CPU) and how many budget waits the span counted; the
//!   workers' RSS, the p99 of a submit and of `GET /v1/runs/{id}` while they
//!   wait.
//! - **Long calls**: a limit nothing reaches, calls that take `latency` s,
//!   `in_flight` of them at once (one each per slot): Redis CPU per
//!   call-second, and the marginal cost — what a call's extra seconds cost,
//!   from two latencies at the same count in flight — and, measured
//!   directly, the steady cost: Redis's CPU rate while every call is in
//!   flight less its idle rate read as long, over the calls (on this 2-core
//!   machine the marginal figure at 64 in flight is within the noise of the
//!   idle rate it subtracts; the steady one reads a longer window of each),
//!   and the scripts' own time the calls add (`INFO commandstats`), which
//!   that noise does not reach.

use indicatif::ProgressBar;
use mock_provider::MockConfig;
use std::time::{Duration, Instant};

use super::pacing::{self, PacingPlan};
use super::report::{PacerFigures, Percentiles};
use super::trial::{Env, Trial, TrialSpec};
use super::workload::Workload;

/// Calls shorter than this (s) get no steady figure: a window of 0.6 × the
/// call, between the last call's start and the first's answer, would be too
/// short to read a CPU rate from.
pub const STEADY_MIN_CALL_S: f64 = 2.5;

/// How long the idle rate is read before the submits.
pub const IDLE_SPAN: Duration = Duration::from_secs(10);

/// The costs of one backlog size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BacklogFigures {
    /// Runs submitted at once (nearly all of them waiting at first).
    pub runs: usize,
    /// Submitting and parking: Redis commands per run, from the first submit
    /// until no turn was due or leased (the first wave answered).
    pub setup_commands_per_run: f64,
    /// Submitting and parking: Redis CPU per run, ms.
    pub setup_cpu_ms_per_run: f64,
    /// Submitting and parking took this long, s.
    pub setup_s: f64,
    /// Calls answered (one a turn) within the measured span, after setup.
    pub admitted_turns: u64,
    /// Budget waits counted within the measured span, per admitted turn (a
    /// turn parked in its budget's line counts one wait when it parks,
    /// however long it waits).
    pub budget_waits_per_turn: f64,
    /// Redis commands per admitted turn within the measured span (`INFO
    /// commandstats`; the bench's own commands taken out: its polls of the
    /// queue, its delivery hook, and its probe of `GET /v1/runs/{id}` once a
    /// second — one `HGETALL` each, ~1.1 a turn at the default trial).
    pub redis_commands_per_turn: f64,
    /// Redis CPU per admitted turn within the measured span, ms (`INFO cpu`).
    pub redis_cpu_ms_per_turn: f64,
    /// Redis CPU over the measured span, as a share of one core.
    pub redis_cpu_share: f64,
    /// Redis's CPU rate before the submits, the fleet up and the bench
    /// polling the queue as in the span, ms a second: its idle cost (cron,
    /// the workers' idle looks and registrations, the bench's polls).
    pub idle_cpu_ms_per_s: f64,
    /// Redis commands a second in that idle time (the bench's polls taken out).
    pub idle_commands_per_s: f64,
    /// `redis_cpu_ms_per_turn` less the idle rate over the span: what the
    /// admitted turns, and holding the backlog, cost beyond an idle fleet.
    pub net_cpu_ms_per_turn: f64,
    /// Redis commands per admitted turn within the measured span, by command, the largest.
    pub redis_commands_by_command: Vec<(String, f64)>,
    /// Fetches that found nothing, per admitted turn within the measured
    /// span, by what made the worker fetch (`queue::FetchWhy`).
    pub empty_fetches_by_cause: Vec<(String, f64)>,
    /// Floor / makespan for the work admitted (see `report::FLOOR_FORMULA`).
    pub efficiency: f64,
    /// 429s.
    pub rate_limited: u64,
    /// Redis memory the submitted runs added, per run, bytes (`used_memory`
    /// after the submits less before, over the runs).
    pub redis_bytes_per_waiting_run: f64,
    /// The largest peak RSS of the worker processes, MB.
    pub worker_peak_rss_mb: f64,
    /// `POST /v1/runs` as the backlog was submitted, ms.
    pub submit_ms: Percentiles,
    /// `GET /v1/runs/{id}` of a waiting run, once a second while they wait, ms.
    pub get_run_ms: Percentiles,
    /// The pacing trial's own figures.
    pub trial: PacerFigures,
}

/// One long-call trial's cost.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LongCallFigures {
    /// How long each call takes at the provider, s.
    pub call_s: f64,
    /// Calls in flight at once (and runs).
    pub in_flight: usize,
    /// Calls answered.
    pub calls: u64,
    /// Redis CPU over the trial, ms.
    pub redis_cpu_ms: f64,
    /// `redis_cpu_ms` over the calls' seconds in flight.
    pub redis_cpu_ms_per_call_second: f64,
    /// Redis's CPU with the fleet up and nothing to do (its own timers, the
    /// workers' idle beats and looks, the bench polling as it will), ms a
    /// second, measured before the submits over the steady window's length
    /// (5 s when there is none).
    pub idle_cpu_ms_per_s: f64,
    /// `redis_cpu_ms` less the idle rate over the trial: what the calls
    /// themselves cost, ms.
    pub net_cpu_ms: f64,
    /// `net_cpu_ms` over the calls' seconds in flight.
    pub net_cpu_ms_per_call_second: f64,
    /// Redis's CPU rate while every call was in flight (a window of up to
    /// 60 s once none was queued, before the first of that wave answered),
    /// ms a second; `None` when they never were all in flight at once.
    pub in_flight_cpu_ms_per_s: Option<f64>,
    /// The calls in flight in that window (all but the probe, when there was one).
    pub steady_calls: u64,
    /// The commands those calls added a second, by command (the window's
    /// less the idle one's; the bench's own polls cancel out).
    pub steady_commands_per_s: Vec<(String, f64)>,
    /// Each command's time a call in that window, µs, the longest first
    /// (`INFO commandstats`' `usec`: wall time; a script's includes the
    /// commands it calls). With every call in flight the scripts are mostly
    /// the workers' beats: what a beat takes in place, beside what
    /// redis-benchmark finds for the same script run back to back.
    pub steady_us_per_call: Vec<(String, f64)>,
    /// The scripts' own time the calls add, ms per call-second: `EVALSHA`'s
    /// time a second with every call in flight less its idle time a second
    /// (`INFO commandstats` `usec`), over the calls in flight. Steadier than
    /// [`Self::steady_cpu_ms_per_call_second`], whose idle rate swings by
    /// ±1 ms/s between trials on a shared machine; wall time, so an upper
    /// bound on the scripts' CPU, and without the event loop's share of each
    /// request.
    pub steady_script_ms_per_call_second: Option<f64>,
    /// What a call's second in flight costs, measured directly: the rate
    /// with every call in flight less the idle rate, over the calls in
    /// flight, ms per call-second. No call's fixed cost (its fetch, start,
    /// commit) and no wait before it is in it, so one call length gives it.
    pub steady_cpu_ms_per_call_second: Option<f64>,
    /// Redis commands per call.
    pub redis_commands_per_call: f64,
    /// Wall time from the first submit to the last run finished, s.
    pub makespan_s: f64,
    /// Redis commands per call by command (the bench's own polls included):
    /// what a call in flight costs, and whose.
    pub redis_commands_by_command: Vec<(String, f64)>,
}

/// Runs one backlog size: `plan` with `runs` one-turn runs, measured for
/// `plan.timeout`.
pub async fn measure_size(
    env: &Env,
    plan: &PacingPlan,
    runs: usize,
    progress: &ProgressBar,
) -> anyhow::Result<BacklogFigures> {
    let plan = PacingPlan { workload: Workload { runs, turns: 1, ..plan.workload.clone() }, ..plan.clone() };
    let mut mock = plan.mock.clone();
    (mock.tool_rounds, mock.output_tokens) = plan.workload.mock_script();
    mock.log_limit = 1000;
    let spec = TrialSpec {
        label: format!("backlog{runs}"),
        workers: plan.workers,
        concurrency: plan.concurrency,
        worker_args: vec!["--pacer".into(), "shared".into()],
        mock,
        tokens: vec![],
        log_deliveries: true,
    };
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    let bodies = (0..runs).map(|i| plan.workload.body(i, &tool_url, "shared")).collect();
    progress.set_length(runs as u64);
    progress.set_position(0);
    progress.set_message(format!("{runs} runs: idle"));
    // Redis's idle rate with the fleet up and nothing submitted, the bench
    // polling the queue as it will in the span: taken out for the net CPU
    // per turn (what a turn, and holding the backlog, cost beyond it).
    tokio::time::sleep(Duration::from_secs(1)).await;
    trial.mark().await?;
    let idle_for = Instant::now();
    trial.poll_for(IDLE_SPAN).await?;
    let (idle_commands, idle_cpu_s) = trial.mark().await?;
    let idle_s = idle_for.elapsed().as_secs_f64();
    progress.set_message(format!("{runs} runs"));
    let memory_before = trial.used_memory().await?;
    let set_up = Instant::now();
    let (ids, submits) = trial.submit_timed(bodies, 16).await?;
    trial.wait_parked(Duration::from_secs(600)).await?;
    let setup_s = set_up.elapsed().as_secs_f64();
    let memory_after = trial.used_memory().await?;
    // (Read before the mark: one read of each run's record is the bench's, not the product's.)
    let waits_before = trial.budget_waits_now().await?;
    let empty_before = trial.empty_fetches_by_cause().await?;
    let (setup, setup_cpu_s) = trial.mark().await?;
    let calls_before = trial.mock.summary().ok;
    let submit_ms = millis(&submits);
    // While they wait: one `GET /v1/runs/{id}` a second, of a run in the middle of the backlog.
    let api = crate::api_client::ApiClient::new(&trial.api_url(), None)?;
    let probed = ids[ids.len() / 2].clone();
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let probe = tokio::spawn(async move {
        let mut took = vec![];
        loop {
            let t = Instant::now();
            if api.run(&probed).await.is_ok() {
                took.push(t.elapsed());
            }
            tokio::select! {
                _ = &mut stopped => return took,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    });
    let measured = Instant::now();
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let span_s = measured.elapsed().as_secs_f64();
    let _ = stop.send(());
    let probes = probe.await.unwrap_or_default();
    let get_run_ms = millis(&probes);
    let mut data = trial.finish(drained).await?;
    // The probes' reads are the bench's own, as its polls are (one `HGETALL`
    // each: the API reads the run's record and nothing more).
    data.commands.take_out(&[("hgetall", probes.len() as u64)]);
    // (The runs as `finish` read them, after its last snapshot.)
    let waits_after: u64 = data.runs.iter().map(|r| r.pacing.budget_waits).sum();
    let figures = pacing::figures(&plan, &data);
    let admitted = data.mock.ok.saturating_sub(calls_before);
    let turns = admitted.max(1) as f64;
    Ok(BacklogFigures {
        runs,
        setup_commands_per_run: setup.total() as f64 / runs.max(1) as f64,
        setup_cpu_ms_per_run: setup_cpu_s * 1000.0 / runs.max(1) as f64,
        setup_s,
        admitted_turns: admitted,
        budget_waits_per_turn: waits_after.saturating_sub(waits_before) as f64 / turns,
        redis_commands_per_turn: data.commands.total() as f64 / turns,
        redis_cpu_ms_per_turn: data.redis_cpu_s * 1000.0 / turns,
        redis_cpu_share: data.redis_cpu_s / span_s.max(1e-9),
        idle_cpu_ms_per_s: idle_cpu_s * 1000.0 / idle_s,
        idle_commands_per_s: idle_commands.total() as f64 / idle_s,
        net_cpu_ms_per_turn: (data.redis_cpu_s - idle_cpu_s / idle_s * span_s).max(0.0) * 1000.0 / turns,
        redis_commands_by_command: data
            .commands
            .by_command
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 / turns))
            .collect(),
        empty_fetches_by_cause: data
            .empty_by_cause
            .iter()
            .map(|(cause, n)| {
                let before = empty_before.iter().find(|(c, _)| c == cause).map_or(0, |(_, b)| *b);
                (cause.clone(), n.saturating_sub(before) as f64 / turns)
            })
            .collect(),
        efficiency: figures.efficiency,
        rate_limited: figures.rate_limited,
        redis_bytes_per_waiting_run: (memory_after.saturating_sub(memory_before)) as f64 / runs.max(1) as f64,
        worker_peak_rss_mb: figures.worker_peak_rss_mb,
        submit_ms,
        get_run_ms,
        trial: figures,
    })
}

/// Runs one long-call trial: `in_flight` one-turn runs against a limit
/// nothing reaches, each call taking `call_s`, `plan.workers` processes
/// sharing the slots.
pub async fn measure_long(
    env: &Env,
    plan: &PacingPlan,
    call_s: f64,
    in_flight: usize,
    progress: &ProgressBar,
) -> anyhow::Result<LongCallFigures> {
    let workers = plan.workers.min(in_flight).max(1);
    let plan = PacingPlan {
        workers,
        concurrency: in_flight.div_ceil(workers),
        workload: Workload { runs: in_flight, turns: 1, ..plan.workload.clone() },
        mock: MockConfig {
            tpm: 1_000_000_000,
            rpm: 100_000_000,
            window: Duration::from_secs(60),
            latency: Duration::from_secs_f64(call_s),
            ..plan.mock.clone()
        },
        timeout: Duration::from_secs_f64(call_s * 2.0 + 120.0),
        ..plan.clone()
    };
    let mut mock = plan.mock.clone();
    (mock.tool_rounds, mock.output_tokens) = plan.workload.mock_script();
    mock.log_limit = 1000;
    let spec = TrialSpec {
        label: format!("long{}x{in_flight}", call_s as u64),
        workers: plan.workers,
        concurrency: plan.concurrency,
        // The mock sends its headers when its latency is up: the workers wait
        // that long for them, as they would for a model that thinks silently.
        worker_args: vec![
            "--pacer".into(),
            "shared".into(),
            "--provider-idle-timeout-s".into(),
            (call_s.ceil() as u64 + 60).to_string(),
        ],
        mock,
        tokens: vec![],
        log_deliveries: false,
    };
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    let bodies = (0..in_flight).map(|i| plan.workload.body(i, &tool_url, "shared")).collect();
    progress.set_length(in_flight as u64);
    progress.set_position(0);
    progress.set_message(format!("{call_s:.0} s x {in_flight}: idle"));
    // Redis's idle rate with the fleet up, to take out of the calls' cost:
    // the bench polling the queue as it will while the calls run (at 64
    // calls in flight its polls were a fifth of what the calls seemed to cost).
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The steady window: while every call is in flight, before the first
    // can answer (the calls start within a second or two of each other);
    // none for calls too short to hold one.
    let steady = (call_s >= STEADY_MIN_CALL_S).then(|| Duration::from_secs_f64((call_s * 0.6).min(60.0)));
    let idle = trial.cpu_rate_over(steady.unwrap_or(Duration::from_secs(5))).await?;
    let idle_cpu_ms_per_s = idle.cpu_ms_per_s;
    // (The trial's own figures start here.)
    trial.mark().await?;
    progress.set_message(format!("{call_s:.0} s x {in_flight}"));
    let span = Instant::now();
    trial.submit(None, bodies, 64).await?;
    // (A budget with no observation sends one probe first and the rest when
    // its headers come: all the others are in flight a call's length after
    // the submits.)
    let steady_calls = match steady {
        Some(_) => trial.wait_all_leased(in_flight as u64, plan.timeout).await?,
        None => None,
    };
    let busy = match (steady, steady_calls) {
        (Some(span), Some(_)) => Some(trial.cpu_rate_over(span).await?),
        _ => None,
    };
    let in_flight_cpu_ms_per_s = busy.as_ref().map(|b| b.cpu_ms_per_s);
    let steady_script_ms_per_call_second = busy
        .as_ref()
        .zip(steady_calls)
        .map(|(b, calls)| (b.script_us_per_s() - idle.script_us_per_s()) / 1000.0 / calls.max(1) as f64);
    let busy = busy.unwrap_or_default();
    // What the calls in flight add, by command, a second.
    let mut steady_commands_per_s: Vec<(String, f64)> = busy
        .commands_per_s
        .iter()
        .map(|(k, busy)| {
            let idle = idle.commands_per_s.iter().find(|(i, _)| i == k).map_or(0.0, |(_, m)| *m);
            (k.clone(), busy - idle)
        })
        .filter(|(_, d)| d.abs() >= 0.05)
        .collect();
    steady_commands_per_s.sort_by(|a, b| b.1.total_cmp(&a.1));
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let span_s = span.elapsed().as_secs_f64();
    let data = trial.finish(drained).await?;
    let calls = data.mock.ok;
    let redis_cpu_ms = data.redis_cpu_s * 1000.0;
    let call_seconds = calls.max(1) as f64 * call_s;
    let net_cpu_ms = (redis_cpu_ms - idle_cpu_ms_per_s * span_s).max(0.0);
    Ok(LongCallFigures {
        call_s,
        in_flight,
        calls,
        redis_cpu_ms,
        redis_cpu_ms_per_call_second: redis_cpu_ms / call_seconds,
        idle_cpu_ms_per_s,
        net_cpu_ms,
        net_cpu_ms_per_call_second: net_cpu_ms / call_seconds,
        in_flight_cpu_ms_per_s,
        steady_calls: steady_calls.unwrap_or(0),
        steady_commands_per_s,
        steady_us_per_call: {
            let mut by = busy.us_per_call;
            by.sort_by(|a, b| b.1.total_cmp(&a.1));
            by
        },
        steady_script_ms_per_call_second,
        steady_cpu_ms_per_call_second: in_flight_cpu_ms_per_s
            .map(|busy| (busy - idle_cpu_ms_per_s) / steady_calls.unwrap_or(1).max(1) as f64),
        redis_commands_per_call: data.commands.total() as f64 / calls.max(1) as f64,
        makespan_s: data.makespan_s().unwrap_or(0.0),
        redis_commands_by_command: data
            .commands
            .by_command
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 / calls.max(1) as f64))
            .collect(),
    })
}

/// The marginal cost of a call's seconds in flight: between two trials at the
/// same count in flight, the extra Redis CPU per call (the idle rate taken
/// out) over the extra seconds, ms per call-second.
pub fn marginal_ms_per_call_second(short: &LongCallFigures, long: &LongCallFigures) -> Option<f64> {
    let extra_s = long.call_s - short.call_s;
    (extra_s > 0.0 && short.calls > 0 && long.calls > 0)
        .then(|| (long.net_cpu_ms / long.calls as f64 - short.net_cpu_ms / short.calls as f64) / extra_s)
}

/// Durations as percentiles in ms (to the µs).
fn millis(took: &[Duration]) -> Percentiles {
    let p = Percentiles::of(took.iter().map(|d| d.as_micros() as i64).collect());
    Percentiles { p50: p.p50 / 1000.0, p99: p.p99 / 1000.0, max: p.max / 1000.0, n: p.n }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(call_s: f64, calls: u64, net_cpu_ms: f64) -> LongCallFigures {
        LongCallFigures {
            call_s,
            in_flight: 64,
            calls,
            redis_cpu_ms: net_cpu_ms,
            redis_cpu_ms_per_call_second: 0.0,
            idle_cpu_ms_per_s: 0.0,
            net_cpu_ms,
            net_cpu_ms_per_call_second: 0.0,
            in_flight_cpu_ms_per_s: None,
            steady_calls: 0,
            steady_commands_per_s: vec![],
            steady_us_per_call: vec![],
            steady_script_ms_per_call_second: None,
            steady_cpu_ms_per_call_second: None,
            redis_commands_per_call: 0.0,
            makespan_s: 0.0,
            redis_commands_by_command: vec![],
        }
    }

    #[test]
    fn the_marginal_cost_is_the_extra_cpu_per_call_over_the_extra_seconds() {
        // 2 ms a call at 20 s, 4 ms at 120 s: 2 ms more over 100 s more.
        let m = marginal_ms_per_call_second(&long(20.0, 64, 128.0), &long(120.0, 64, 256.0)).unwrap();
        assert!((m - 0.02).abs() < 1e-12, "{m}");
        assert_eq!(marginal_ms_per_call_second(&long(20.0, 64, 1.0), &long(20.0, 64, 2.0)), None);
    }

    #[test]
    fn durations_become_millisecond_percentiles() {
        let p = millis(&[Duration::from_micros(1_500), Duration::from_micros(2_500)]);
        assert_eq!((p.p50, p.max, p.n), (1.5, 2.5, 2));
    }
}
