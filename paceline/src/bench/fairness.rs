//! The fairness scenario (fair admission: docs/pacing.md, "One line per budget"): three trials
//! under the shared pacer, each with its own fleet of worker processes and
//! its own mock, runs submitted through the API with tenant tokens.
//!
//! 1. **Live turns first** — `bulk` saturates the budget with work runs; a
//!    few seconds in, `live` submits one companion run every gap. Per
//!    companion run: submit → the provider's admission of its first call
//!    (both on the mock's clock); and the trial's efficiency (floor /
//!    makespan, as in the pacing scenario, over every token admitted).
//! 2. **Tenants share** — four tenants with 10:1:1:1 as many runs of many
//!    turns, all backlogged; admitted tokens per tenant over a window where
//!    all four have work, their shares and Jain's index.
//! 3. **Weights** — two tenants equally backlogged, workers started with
//!    `--tenant-weights a:2,b:1`: the ratio of their admitted tokens.
//!
//! Attribution: every run's input starts with a marker `[bench tenant=T
//! run=I]`; the mock keeps every request body, and its log says when each
//! request was admitted and what it cost the bucket (charged − refunded).

use indicatif::ProgressBar;
use mock_provider::{MockConfig, Stats};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::pacing::{self, PacingPlan};
use super::report::BucketShape;
use super::trial::{Env, Trial, TrialData, TrialSpec};
use super::workload::Workload;

/// What the fairness scenario runs.
#[derive(Debug, Clone)]
pub struct FairnessPlan {
    /// Worker processes per trial.
    pub workers: usize,
    /// Slots per worker process.
    pub concurrency: usize,
    /// The mock: limits, window, bucket, latency (its script is set per trial).
    pub mock: MockConfig,
    /// `max_output_tokens` of every call.
    pub max_output_tokens: u32,
    /// Words of a final answer.
    pub answer_tokens: u64,
    /// Characters of each run's input (0: the task alone).
    pub input_chars: usize,
    /// Trial 1.
    pub live: LivePlan,
    /// Trial 2: `(tenant, runs)`, equal weights.
    pub share: Vec<(String, usize)>,
    /// Trial 3: `(tenant, runs, weight)`.
    pub weighted: Vec<(String, usize, u32)>,
    /// Turns per run in trials 2 and 3 (many, so every tenant stays backlogged).
    pub share_turns: u32,
    /// Trials 2 and 3: the share window opens this long after the first submit
    /// (the bucket starts full; its first burst is no one's fair share).
    pub share_skip: Duration,
    /// Longest wait for one trial.
    pub timeout: Duration,
    /// Where to write each trial's raw data (mock log, deliveries).
    pub dump_dir: Option<std::path::PathBuf>,
    /// Which trials to run (`live`, `share`, `weights`); the others report zeros.
    pub trials: Vec<String>,
}

/// Trial 1's shape.
#[derive(Debug, Clone)]
pub struct LivePlan {
    /// Work runs of tenant `bulk`.
    pub work_runs: usize,
    /// Turns per work run.
    pub work_turns: u32,
    /// Companion runs of tenant `live` (one turn, no tools).
    pub companions: usize,
    /// The first companion is submitted this long after the work runs.
    pub first_after: Duration,
    /// Between companion submits.
    pub gap: Duration,
}

/// Trial 1's companion runs: submit → first provider call, ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompanionWaits {
    /// Median wait, ms.
    pub p50_ms: f64,
    /// 95th percentile (nearest rank), ms.
    pub p95_ms: f64,
    /// Longest wait, ms.
    pub max_ms: f64,
    /// Companion runs measured (those whose first call was admitted).
    pub n: usize,
    /// Every companion's wait in submit order, ms (`null`: no call admitted).
    pub waits_ms: Vec<Option<f64>>,
    /// Companions submitted while work turns were still being admitted after
    /// them (the budget saturated throughout).
    pub under_load: usize,
}

/// Trial 1's work figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LiveWork {
    /// First submit → last run finished, s.
    pub makespan_s: f64,
    /// The least time the buckets allow for every token admitted (work and companion), s.
    pub floor_s: f64,
    /// `floor_s / makespan_s`.
    pub efficiency: f64,
    /// Provider calls.
    pub calls: u64,
    /// 429s.
    pub rate_limited: u64,
    /// Runs completed / failed / unfinished (work and companion).
    pub runs_completed: usize,
    /// Runs failed.
    pub runs_failed: usize,
    /// Runs unfinished at the timeout.
    pub runs_unfinished: usize,
}

/// Admitted tokens per tenant over a window where every tenant had work.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShareWindow {
    /// Window start and end, s after the first submit.
    pub window_s: [f64; 2],
    /// Tokens admitted (charged − refunded) by calls admitted in the window, per tenant.
    pub tokens: BTreeMap<String, u64>,
    /// Each tenant's fraction of the window's admitted tokens.
    pub shares: BTreeMap<String, f64>,
    /// Tokens admitted in the window per second, all tenants.
    pub tokens_per_s: f64,
    /// The budget's rate (`--tpm` per `--window-s`), tokens/s.
    pub limit_tokens_per_s: f64,
    /// 429s in the whole trial.
    pub rate_limited: u64,
    /// Which tenant ran out of work first (closing the window).
    pub first_out: String,
}

/// Trial 3's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Weighted {
    /// Tokens of the heavier-weighted tenant over the lighter one's.
    pub ratio: f64,
    /// The ratio the weights ask for.
    pub target: f64,
    /// `|ratio / target − 1|`.
    pub error: f64,
    /// Each tenant's fraction of the window's tokens.
    pub shares: BTreeMap<String, f64>,
    /// The window and its per-tenant tokens.
    pub window: ShareWindow,
    /// The weights, as passed to the workers.
    pub weights: String,
}

/// The whole scenario's figures (the JSON's `fairness`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FairnessFigures {
    /// Trial 1: companion runs' submit → first admitted provider call.
    pub companion: CompanionWaits,
    /// Trial 1: floor / makespan with the companions cutting in.
    pub work_efficiency: f64,
    /// Trial 1's other figures.
    pub live_trial: LiveWork,
    /// Trial 2: each tenant's share of the window's admitted tokens.
    pub tenants: BTreeMap<String, f64>,
    /// Trial 2: Jain's index of the tenants' admitted tokens (1 = equal).
    pub jain: f64,
    /// Trial 2's window, tokens per tenant.
    pub share_trial: ShareWindow,
    /// Trial 3: weights 2:1.
    pub weights_2_1: Weighted,
}

/// The marker every bench run's input starts with.
fn marker(tenant: &str, i: usize) -> String {
    format!("[bench tenant={tenant} run={i}]")
}

/// The (tenant, run index) of the marker in a kept body.
fn parse_marker(body: &Value) -> Option<(String, usize)> {
    let text = body.to_string();
    let start = text.find("[bench tenant=")? + "[bench tenant=".len();
    let rest = &text[start..];
    let (tenant, rest) = rest.split_once(" run=")?;
    let (i, _) = rest.split_once(']')?;
    Some((tenant.to_owned(), i.parse().ok()?))
}

/// A run body: the workload's, with the marker in front of its input.
fn body(workload: &Workload, tool_url: &str, tenant: &str, i: usize, companion: bool) -> Value {
    let mut b = workload.body(i, tool_url, "fairness");
    let input = b["input"].as_str().unwrap_or_default().to_owned();
    b["input"] = Value::String(format!("{} {input}", marker(tenant, i)));
    if companion {
        // A live reply: one turn, no tools, ahead of the work.
        b["mode"] = "companion".into();
        b["max_turns"] = 1.into();
        if let Some(o) = b.as_object_mut() {
            o.remove("tools");
            o.remove("tool_endpoint");
        }
    }
    b
}

/// One admitted call: when (µs, mock clock), whose, what it cost.
#[derive(Debug, Clone)]
struct Admitted {
    at_us: u64,
    tenant: String,
    run: usize,
    tokens: u64,
}

/// The mock's admitted (2xx) calls, attributed through the kept bodies.
fn admitted(stats: &Stats) -> Vec<Admitted> {
    let owners: HashMap<u64, (String, usize)> =
        stats.bodies.iter().filter_map(|k| parse_marker(&k.body).map(|o| (k.seq, o))).collect();
    stats
        .log
        .iter()
        .filter(|e| (200..300).contains(&e.status))
        .filter_map(|e| {
            let (tenant, run) = owners.get(&e.seq)?.clone();
            Some(Admitted { at_us: e.at_us, tenant, run, tokens: e.charged.saturating_sub(e.refunded) })
        })
        .collect()
}

/// Jain's fairness index of `xs`: `(Σx)² / (n·Σx²)`, 1 when all are equal; 0 for none.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if xs.is_empty() || squares <= 0.0 {
        0.0
    } else {
        sum * sum / (xs.len() as f64 * squares)
    }
}

/// Nearest-rank percentile of sorted `v`.
fn pick(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

impl FairnessPlan {
    fn mock(&self, tool_rounds: usize) -> MockConfig {
        let mut mock = self.mock.clone();
        mock.tool_rounds = tool_rounds;
        mock.output_tokens = self.answer_tokens;
        // Every body kept: the calls are attributed to tenants through them.
        mock.keep_bodies = 1_000_000;
        mock.log_limit = 1_000_000;
        mock
    }

    fn workload(&self, turns: u32) -> Workload {
        Workload {
            runs: 0,
            turns,
            max_output_tokens: self.max_output_tokens,
            answer_tokens: self.answer_tokens,
            model: "gpt-4.1-mini".into(),
            input_chars: self.input_chars,
            long_outputs: false,
            prompt_cache: None,
        }
    }

    fn spec(&self, label: &str, tool_rounds: usize, tenants: &[&str], extra: &[String]) -> TrialSpec {
        let mut worker_args = vec!["--pacer".to_owned(), "shared".to_owned()];
        worker_args.extend(extra.iter().cloned());
        TrialSpec {
            label: label.to_owned(),
            workers: self.workers,
            concurrency: self.concurrency,
            worker_args,
            mock: self.mock(tool_rounds),
            tokens: tenants.iter().map(|t| (t.to_string(), token(t))).collect(),
            log_deliveries: self.dump_dir.is_some(),
        }
    }

    /// `--dump-dir`: the mock log and deliveries as the pacing scenario
    /// writes them, and `fairness-<label>.calls.json`: every admitted call
    /// with its tenant, run index, conversation length and cost.
    fn dump(&self, label: &str, data: &TrialData) -> anyhow::Result<()> {
        let Some(dir) = &self.dump_dir else { return Ok(()) };
        pacing::dump(dir, &format!("fairness-{label}"), data)?;
        let calls: Vec<Value> = admitted(&data.mock)
            .iter()
            .map(|c| serde_json::json!({"at_us": c.at_us, "tenant": c.tenant, "run": c.run, "tokens": c.tokens}))
            .collect();
        std::fs::write(dir.join(format!("fairness-{label}.calls.json")), serde_json::to_string(&calls)?)?;
        Ok(())
    }
}

fn token(tenant: &str) -> String {
    format!("bench-token-{tenant}")
}

/// Runs the three trials.
pub async fn measure(env: &Env, plan: &FairnessPlan, progress: &ProgressBar) -> anyhow::Result<FairnessFigures> {
    let wants = |t: &str| plan.trials.iter().any(|x| x == t);
    let (companion, live_trial) = if wants("live") { live(env, plan, progress).await? } else { Default::default() };
    let share_trial =
        if wants("share") { shares(env, plan, &plan.share, &[], "share", progress).await? } else { Default::default() };
    let weights: String = plan.weighted.iter().map(|(t, _, w)| format!("{t}:{w}")).collect::<Vec<_>>().join(",");
    let runs: Vec<(String, usize)> = plan.weighted.iter().map(|(t, n, _)| (t.clone(), *n)).collect();
    let window = if wants("weights") {
        shares(env, plan, &runs, &["--tenant-weights".into(), weights.clone()], "weights", progress).await?
    } else {
        Default::default()
    };
    let weighted = weighted_figures(plan, window, weights);
    let tenants = share_trial.shares.clone();
    let jain = jain(&share_trial.tokens.values().map(|&t| t as f64).collect::<Vec<_>>());
    Ok(FairnessFigures {
        companion,
        work_efficiency: live_trial.efficiency,
        live_trial,
        tenants,
        jain,
        share_trial,
        weights_2_1: weighted,
    })
}

/// Trial 1: companion turns first.
async fn live(env: &Env, plan: &FairnessPlan, progress: &ProgressBar) -> anyhow::Result<(CompanionWaits, LiveWork)> {
    let lp = &plan.live;
    let work = plan.workload(lp.work_turns);
    let spec = plan.spec("live", lp.work_turns.saturating_sub(1) as usize, &["bulk", "live"], &[]);
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    progress.set_length(lp.work_runs as u64 * lp.work_turns as u64 + lp.companions as u64);
    progress.set_position(0);
    progress.set_message("live first");
    let bodies = (0..lp.work_runs).map(|i| body(&work, &tool_url, "bulk", i, false)).collect();
    let started = Instant::now();
    let bulk = token("bulk");
    trial.submit(Some(("bulk", &bulk)), bodies, 16).await?;
    let live = token("live");
    let mut submitted_us = Vec::with_capacity(lp.companions);
    for i in 0..lp.companions {
        let at = lp.first_after + lp.gap * i as u32;
        tokio::time::sleep_until((started + at).into()).await;
        progress.set_position(trial.mock.summary().ok);
        // Taken just before the POST: the wait includes the API's own answer.
        submitted_us.push(trial.mock_clock_us());
        trial.submit(Some(("live", &live)), vec![body(&work, &tool_url, "live", i, true)], 1).await?;
    }
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let data = trial.finish(drained).await?;
    plan.dump("live", &data)?;

    let calls = admitted(&data.mock);
    let mut waits_ms = vec![None; lp.companions];
    for (i, at) in submitted_us.iter().enumerate() {
        let first = calls.iter().filter(|c| c.tenant == "live" && c.run == i).map(|c| c.at_us).min();
        waits_ms[i] = first.map(|f| f.saturating_sub(*at) as f64 / 1000.0);
    }
    let last_work_us = calls.iter().filter(|c| c.tenant == "bulk").map(|c| c.at_us).max().unwrap_or(0);
    let under_load = submitted_us.iter().filter(|&&s| s < last_work_us).count();
    let mut sorted: Vec<f64> = waits_ms.iter().flatten().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let companion = CompanionWaits {
        p50_ms: pick(&sorted, 0.50),
        p95_ms: pick(&sorted, 0.95),
        max_ms: sorted.last().copied().unwrap_or(0.0),
        n: sorted.len(),
        waits_ms,
        under_load,
    };
    // The pacing scenario's figures over the same data: floor of every token
    // the bucket admitted (the companions' too) over the makespan of all runs.
    let pacing_plan = PacingPlan {
        workers: plan.workers,
        concurrency: plan.concurrency,
        workload: Workload { runs: lp.work_runs + lp.companions, ..work },
        mock: spec.mock.clone(),
        timeout: plan.timeout,
        dump_dir: None,
        worker_args: vec![],
    };
    let f = pacing::figures(&pacing_plan, &data);
    let work = LiveWork {
        makespan_s: f.makespan_s,
        floor_s: f.floor_s,
        efficiency: f.efficiency,
        calls: f.calls,
        rate_limited: f.rate_limited,
        runs_completed: f.runs_completed,
        runs_failed: f.runs_failed,
        runs_unfinished: f.runs_unfinished,
    };
    Ok((companion, work))
}

/// Trials 2 and 3: every tenant backlogged with `runs` runs of many turns,
/// until the first tenant has finished all its runs; the admitted tokens per
/// tenant from `share_skip` after the first submit until the first tenant's
/// last admitted call.
async fn shares(
    env: &Env,
    plan: &FairnessPlan,
    runs: &[(String, usize)],
    extra: &[String],
    label: &str,
    progress: &ProgressBar,
) -> anyhow::Result<ShareWindow> {
    let turns = plan.share_turns;
    let work = plan.workload(turns);
    let names: Vec<&str> = runs.iter().map(|(t, _)| t.as_str()).collect();
    let spec = plan.spec(label, turns.saturating_sub(1) as usize, &names, extra);
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    progress.set_length(runs.iter().map(|(_, n)| *n as u64 * turns as u64).sum());
    progress.set_position(0);
    progress.set_message(format!("tenants {label}"));
    // Interleaved submits, so no tenant's backlog starts ahead of another's.
    let most = runs.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let first_us = trial.mock_clock_us();
    for i in 0..most {
        for (tenant, n) in runs {
            if i < *n {
                let tok = token(tenant);
                trial.submit(Some((tenant, &tok)), vec![body(&work, &tool_url, tenant, i, false)], 1).await?;
            }
        }
    }
    let deadline = Instant::now() + plan.timeout;
    let first_out = loop {
        progress.set_position(trial.mock.summary().ok);
        if let Some(t) = trial.tenants_finished().await?.into_iter().next() {
            break t;
        }
        if Instant::now() >= deadline {
            break String::new();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let data = trial.finish(!first_out.is_empty()).await?;
    plan.dump(label, &data)?;

    let calls = admitted(&data.mock);
    let start_us = first_us + plan.share_skip.as_micros() as u64;
    // The window closes when the first tenant runs out of work: the earliest
    // of the tenants' last admitted calls.
    let end_us = names
        .iter()
        .filter_map(|t| calls.iter().filter(|c| c.tenant == *t).map(|c| c.at_us).max())
        .min()
        .unwrap_or(start_us)
        .max(start_us);
    let mut tokens: BTreeMap<String, u64> = names.iter().map(|t| (t.to_string(), 0)).collect();
    for c in calls.iter().filter(|c| c.at_us >= start_us && c.at_us < end_us) {
        *tokens.entry(c.tenant.clone()).or_default() += c.tokens;
    }
    let total: u64 = tokens.values().sum();
    let shares =
        tokens.iter().map(|(t, &n)| (t.clone(), if total > 0 { n as f64 / total as f64 } else { 0.0 })).collect();
    let span_s = (end_us - start_us) as f64 / 1e6;
    let bucket = BucketShape { capacity: plan.mock.tpm, window_s: plan.mock.window.as_secs_f64(), fixed_window: false };
    Ok(ShareWindow {
        window_s: [(start_us - first_us) as f64 / 1e6, (end_us - first_us) as f64 / 1e6],
        tokens,
        shares,
        tokens_per_s: if span_s > 0.0 { total as f64 / span_s } else { 0.0 },
        limit_tokens_per_s: bucket.capacity as f64 / bucket.window_s.max(f64::MIN_POSITIVE),
        rate_limited: data.mock.rate_limited,
        first_out,
    })
}

fn weighted_figures(plan: &FairnessPlan, window: ShareWindow, weights: String) -> Weighted {
    let mut by_weight: Vec<&(String, usize, u32)> = plan.weighted.iter().collect();
    by_weight.sort_by_key(|(_, _, w)| std::cmp::Reverse(*w));
    let (ratio, target) = match by_weight.as_slice() {
        [heavy, light, ..] => {
            let h = window.tokens.get(&heavy.0).copied().unwrap_or(0) as f64;
            let l = window.tokens.get(&light.0).copied().unwrap_or(0) as f64;
            (if l > 0.0 { h / l } else { 0.0 }, heavy.2 as f64 / light.2.max(1) as f64)
        }
        _ => (0.0, 1.0),
    };
    Weighted { ratio, target, error: (ratio / target - 1.0).abs(), shares: window.shares.clone(), window, weights }
}

/// The human table of the scenario's figures.
pub fn table(f: &FairnessFigures) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let c = &f.companion;
    let w = &f.live_trial;
    let _ = writeln!(s, "fairness (shared pacer)                      measured      target");
    let _ = writeln!(
        s,
        "1. live first: companion submit -> 1st call  p50 {:.0} ms, p95 {:.0} ms, max {:.0} ms (n={}, {} under load)   p95 <= 1000 ms",
        c.p50_ms, c.p95_ms, c.max_ms, c.n, c.under_load
    );
    let _ = writeln!(
        s,
        "   work efficiency (floor / makespan)         {:.3} ({:.1} s / {:.1} s, {} 429s in {} calls, runs {}/{}/{} done/failed/unfinished)   >= 0.95",
        w.efficiency, w.floor_s, w.makespan_s, w.rate_limited, w.calls, w.runs_completed, w.runs_failed, w.runs_unfinished
    );
    let t = &f.share_trial;
    let shares: Vec<String> = f.tenants.iter().map(|(k, v)| format!("{k} {:.3}", v)).collect();
    let _ = writeln!(
        s,
        "2. tenants share: Jain's index               {:.3} (shares {}; window {:.1}-{:.1} s, {:.0} of {:.0} tokens/s, {} ran out first)   >= 0.95",
        f.jain,
        shares.join(", "),
        t.window_s[0],
        t.window_s[1],
        t.tokens_per_s,
        t.limit_tokens_per_s,
        if t.first_out.is_empty() { "no one" } else { &t.first_out }
    );
    let g = &f.weights_2_1;
    let shares: Vec<String> = g.shares.iter().map(|(k, v)| format!("{k} {:.3}", v)).collect();
    let _ = writeln!(
        s,
        "3. weights {}: token ratio                 {:.3} (target {:.1}, off by {:.1} %; shares {}; window {:.1}-{:.1} s)   within 5 %",
        g.weights,
        g.ratio,
        g.target,
        100.0 * g.error,
        shares.join(", "),
        g.window.window_s[0],
        g.window.window_s[1]
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_and_one_over_n_for_one_taker() {
        assert!((jain(&[3.0, 3.0, 3.0, 3.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert_eq!(jain(&[]), 0.0);
    }

    #[test]
    fn the_marker_is_found_in_a_body() {
        let body = serde_json::json!({"input": [{"role": "user", "content": format!("{} Task 3", marker("b", 17))}]});
        assert_eq!(parse_marker(&body), Some(("b".to_owned(), 17)));
        assert_eq!(parse_marker(&serde_json::json!({"input": "no marker"})), None);
    }
}
