//! The figures a bench reports — its JSON object (field names are the
//! contract; more may be added) and the human table — and the arithmetic
//! behind them: the physical floor, percentiles.

use serde::Serialize;
use std::collections::BTreeMap;

/// The whole report (`--json FILE` writes exactly this).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What was run.
    pub config: ConfigOut,
    /// One entry per pacer measured (`shared`, `local`, `off`).
    pub pacers: BTreeMap<String, PacerFigures>,
    /// The throughput scenario; `null` when it was not run.
    pub throughput: Option<Throughput>,
}

/// The fleet and the mock's budget, which every scenario's `config` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// Worker processes.
    pub workers: usize,
    /// Slots per worker process.
    pub concurrency: usize,
    /// Token bucket capacity per window.
    pub tpm: u64,
    /// Request bucket capacity per window.
    pub rpm: u64,
    /// The window, s ("a minute", scaled).
    pub window_s: f64,
    /// `continuous` or `window`.
    pub bucket: String,
    /// `refund` or `keep`: what the mock does with the unused output reservation.
    pub charge: String,
    /// The mock's latency before an admitted answer, ms.
    pub latency_ms: u64,
    /// `max_output_tokens` of each call.
    pub max_output_tokens: u32,
    /// Characters of each run's input (0: the task alone).
    pub input_chars: usize,
}

/// The configuration: the workload, the budget and the fleet, and the rest of the knobs.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigOut {
    /// Fleet and budget.
    #[serde(flatten)]
    pub setup: Setup,
    /// Runs per pacer.
    pub runs: usize,
    /// Turns per run.
    pub turns: u32,
    /// The pacers, in the order run.
    pub pacer_order: Vec<String>,
    /// How runs were submitted.
    pub submit_path: String,
    /// The floor's formula, in words.
    pub floor_formula: String,
}

/// A p50/p99 pair, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// How many values.
    pub n: usize,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (sorted here).
    pub fn of(mut values: Vec<i64>) -> Self {
        values.sort_unstable();
        let pick = |p: f64| -> f64 {
            if values.is_empty() {
                return 0.0;
            }
            let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
            values[rank - 1] as f64
        };
        Self { p50: pick(0.50), p99: pick(0.99), max: values.last().copied().unwrap_or(0) as f64, n: values.len() }
    }
}

/// One pacer's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PacerFigures {
    /// First submit (the earliest run's `created_at`) → last run finished (the latest `finished_at`), s.
    pub makespan_s: f64,
    /// The least time the mock's buckets allow for what they admitted (see `floor_s`), s.
    pub floor_s: f64,
    /// `floor_s / makespan_s`.
    pub efficiency: f64,
    /// Provider calls (requests the mock received).
    pub calls: u64,
    /// 429 answers.
    pub rate_limited: u64,
    /// 429s per 100 calls.
    pub rate_limited_per_100_calls: f64,
    /// Tokens admitted per (scaled) minute: admitted / makespan × window.
    pub tokens_per_min: f64,
    /// The limit per (scaled) minute: `--tpm`.
    pub limit_tokens_per_min: f64,
    /// Start lateness of requeued deliveries (a turn that waited for budget,
    /// a 429 or a retry) against their due time, ms.
    pub lateness_ms: Percentiles,
    /// Redis commands per completed turn (`INFO commandstats` delta, the bench's own polls and hook taken out).
    pub redis_commands_per_turn: f64,
    /// The largest peak RSS (`VmHWM`) of the worker processes, MB.
    pub worker_peak_rss_mb: f64,
    /// Leases the workers lost while holding them (their heartbeat came too late).
    #[serde(default)]
    pub lease_losses: usize,
    /// The Redis server's CPU time per completed turn, ms (`INFO cpu` delta).
    #[serde(default)]
    pub redis_cpu_ms_per_turn: f64,
    /// Fetches that found nothing due, per completed turn.
    #[serde(default)]
    pub empty_fetches_per_turn: f64,
    /// Of them, per completed turn by what made the worker fetch.
    #[serde(default)]
    pub empty_fetches_breakdown: String,
    // --- beyond the pacing comparison's own figures ---
    /// Runs that completed.
    pub runs_completed: usize,
    /// Runs that failed.
    pub runs_failed: usize,
    /// Runs not finished when the bench gave up waiting.
    pub runs_unfinished: usize,
    /// The bench gave up waiting (`--timeout-s`): the makespan is a lower bound.
    pub timed_out: bool,
    /// Failed runs by `error.kind`.
    pub failures: BTreeMap<String, usize>,
    /// Turns committed, all runs.
    pub turns_completed: u64,
    /// Tokens the mock admitted (charged minus refunded).
    pub tokens_admitted: u64,
    /// Requests the mock admitted (2xx).
    pub requests_admitted: u64,
    /// Which bucket sets the floor: `tokens` or `requests`.
    pub floor_bound: String,
    /// Budget waits, all runs (turns requeued because the pacer owed them time).
    pub budget_waits: u64,
    /// Start lateness of every delivery (first ones included), ms.
    pub lateness_all_ms: Percentiles,
    /// The mock's count of input tokens over ours (tiktoken), on the bodies it kept.
    pub input_count_ratio: f64,
    /// The mock's largest overdraft (0 unless its admission is broken).
    pub largest_overdraft: u64,
    /// Redis commands per turn by command, the largest.
    pub redis_commands_breakdown: String,
}

/// The throughput scenario's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Throughput {
    /// Turns completed per second, through the real worker (one process), first submit → drained.
    pub turns_per_s: f64,
    /// Redis commands per turn through the real worker.
    pub redis_commands_per_turn: f64,
    /// Redis CPU per turn, ms (`INFO cpu` over the trial, Redis's idle rate
    /// included: at full speed it is small beside the turns' own). One core
    /// serves about 1 000 / this turns a second.
    pub redis_cpu_ms_per_turn: f64,
    /// Turns completed.
    pub turns: u64,
    /// Runs × turns submitted.
    pub runs: usize,
    /// Turns per run.
    pub turns_per_run: u32,
    /// Slots of the one worker process.
    pub concurrency: usize,
    /// The pacer the worker used.
    pub pacer: String,
    /// Redis commands per turn by command, the largest.
    pub redis_commands_breakdown: String,
    /// The queue alone (no-op consumer process, no provider, no run store).
    pub queue_only: Option<QueueOnly>,
}

/// The queue's own ceiling (`queue-probe` consumer, no-op handler).
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueOnly {
    /// No-op turns per second.
    pub turns_per_s: f64,
    /// Redis commands per turn.
    pub redis_commands_per_turn: f64,
    /// Turns run.
    pub turns: usize,
    /// Redis commands per turn by command, the largest.
    pub redis_commands_breakdown: String,
}

/// A rate-limit bucket as the mock runs it.
#[derive(Debug, Clone, Copy)]
pub struct BucketShape {
    /// Capacity per window.
    pub capacity: u64,
    /// Window, s.
    pub window_s: f64,
    /// Fixed windows (full refill at each boundary) rather than a continuous refill.
    pub fixed_window: bool,
}

/// The formula of [`floor_s`], in words (printed under the table, kept in the JSON).
pub const FLOOR_FORMULA: &str =
    "floor = max over the token and request buckets of the least time from the first submit \
until the bucket has let through what was admitted (A), starting full (capacity C, window W): \
continuous: max(0, A - C) / (C / W); window: the first boundary k*W of the mock's windows by which \
ceil(max(0, A - C) / C) refills have happened, minus the first submit's offset into the mock's clock";

/// The least time (s, from the first submit) in which `bucket` can admit
/// `admitted` units, starting full. `offset_s` is when the first submit came
/// on the mock's clock (its windows are multiples of the window since start).
pub fn floor_s(bucket: BucketShape, admitted: u64, offset_s: f64) -> f64 {
    let cap = bucket.capacity.max(1);
    let beyond = admitted.saturating_sub(cap);
    if beyond == 0 || bucket.window_s <= 0.0 {
        return 0.0;
    }
    if bucket.fixed_window {
        let refills = beyond.div_ceil(cap) as f64;
        let first_window = (offset_s / bucket.window_s).floor();
        ((first_window + refills) * bucket.window_s - offset_s).max(0.0)
    } else {
        beyond as f64 / (cap as f64 / bucket.window_s)
    }
}

fn num(v: f64, digits: usize) -> String {
    format!("{v:.digits$}")
}

/// The human table: one column per pacer.
pub fn table(report: &Report) -> String {
    use std::fmt::Write as _;
    let c = &report.config;
    let f = &c.setup;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "paceline bench: {} worker processes x {} slots, {} runs x {} turns, {} bucket {} tokens / {} requests per {} s window (a scaled minute), charge {}, mock latency {} ms, runs submitted via {}",
        f.workers, f.concurrency, c.runs, c.turns, f.bucket, f.tpm, f.rpm, f.window_s, f.charge, f.latency_ms, c.submit_path
    );
    let order: Vec<&String> = c.pacer_order.iter().filter(|p| report.pacers.contains_key(*p)).collect();
    if !order.is_empty() {
        let cols: Vec<&PacerFigures> = order.iter().map(|p| &report.pacers[*p]).collect();
        let mut rows: Vec<(String, Vec<String>)> = vec![];
        let mut row = |name: &str, f: &dyn Fn(&PacerFigures) -> String| {
            rows.push((name.to_owned(), cols.iter().map(|p| f(p)).collect()))
        };
        row("makespan (s)", &|p| num(p.makespan_s, 1));
        row("physical floor (s)", &|p| format!("{} ({})", num(p.floor_s, 1), p.floor_bound));
        row("efficiency (floor / makespan)", &|p| {
            let all_done = p.runs_failed + p.runs_unfinished == 0;
            format!("{}{}", num(p.efficiency, 3), if all_done { "" } else { "*" })
        });
        row("provider calls", &|p| p.calls.to_string());
        row("429s", &|p| p.rate_limited.to_string());
        row("429s per 100 calls", &|p| num(p.rate_limited_per_100_calls, 2));
        row("tokens / min admitted (limit)", &|p| {
            format!("{} ({})", num(p.tokens_per_min, 0), num(p.limit_tokens_per_min, 0))
        });
        row("runs completed / failed / unfinished", &|p| {
            format!("{} / {} / {}", p.runs_completed, p.runs_failed, p.runs_unfinished)
        });
        row("turns completed", &|p| p.turns_completed.to_string());
        row("budget waits (requeues)", &|p| p.budget_waits.to_string());
        row("requeued lateness p50 / p99 (ms)", &|p| {
            if p.lateness_ms.n == 0 {
                "- (none requeued)".into()
            } else {
                format!("{} / {} (n={})", p.lateness_ms.p50, p.lateness_ms.p99, p.lateness_ms.n)
            }
        });
        row("Redis commands per turn", &|p| num(p.redis_commands_per_turn, 1));
        row("worker peak RSS (MB)", &|p| num(p.worker_peak_rss_mb, 1));
        row("leases lost while held", &|p| p.lease_losses.to_string());
        row("Redis CPU per turn (ms)", &|p| num(p.redis_cpu_ms_per_turn, 3));
        row("empty fetches per turn", &|p| num(p.empty_fetches_per_turn, 2));
        row("mock count / our estimate (input)", &|p| num(p.input_count_ratio, 2));
        let w0 = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        let widths: Vec<usize> = (0..order.len())
            .map(|i| rows.iter().map(|(_, v)| v[i].len()).max().unwrap_or(0).max(order[i].len()))
            .collect();
        let _ = write!(out, "{:<w0$}", "");
        for (i, p) in order.iter().enumerate() {
            let _ = write!(out, "  {:>w$}", p, w = widths[i]);
        }
        let _ = writeln!(out);
        for (name, vals) in &rows {
            let _ = write!(out, "{name:<w0$}");
            for (i, v) in vals.iter().enumerate() {
                let _ = write!(out, "  {:>w$}", v, w = widths[i]);
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(out, "{}", FLOOR_FORMULA);
        if cols.iter().any(|p| p.runs_failed + p.runs_unfinished > 0) {
            let _ = writeln!(
                out,
                "*: some runs failed or did not finish, so this pacer's floor is for less work than the others': its efficiency is not comparable"
            );
        }
        for p in &order {
            let f = &report.pacers[*p];
            if !f.failures.is_empty() {
                let _ = writeln!(out, "{p}: failed runs by kind: {:?}", f.failures);
            }
            let _ = writeln!(out, "{p}: Redis commands per turn: {}", f.redis_commands_breakdown);
            let _ = writeln!(
                out,
                "{p}: empty fetches per turn, by what made the worker fetch: {}",
                f.empty_fetches_breakdown
            );
        }
    }
    if let Some(t) = &report.throughput {
        let _ = writeln!(
            out,
            "throughput (one worker process, {} slots, {} pacer, instant mock without limits): {} turns/s, {} Redis commands and {} ms of Redis CPU per turn ({} turns)",
            t.concurrency, t.pacer, num(t.turns_per_s, 0), num(t.redis_commands_per_turn, 1), num(t.redis_cpu_ms_per_turn, 3), t.turns
        );
        let _ = writeln!(out, "  per turn: {}", t.redis_commands_breakdown);
        if let Some(q) = &t.queue_only {
            let _ = writeln!(
                out,
                "queue alone (no-op consumer process): {} turns/s, {} Redis commands per turn ({} turns)",
                num(q.turns_per_s, 0),
                num(q.redis_commands_per_turn, 2),
                q.turns
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuous_floor_is_the_excess_over_the_rate() {
        let b = BucketShape { capacity: 60_000, window_s: 10.0, fixed_window: false };
        assert_eq!(floor_s(b, 50_000, 3.0), 0.0, "within the first bucket: no wait");
        assert!((floor_s(b, 360_000, 3.0) - 50.0).abs() < 1e-9, "300 000 beyond at 6 000/s");
    }

    #[test]
    fn window_floor_waits_for_the_refill_boundary() {
        let b = BucketShape { capacity: 100, window_s: 10.0, fixed_window: true };
        // Submitted at 3 s on the mock's clock: 150 units need one refill, at 10 s.
        assert!((floor_s(b, 150, 3.0) - 7.0).abs() < 1e-9);
        assert!((floor_s(b, 200, 3.0) - 7.0).abs() < 1e-9);
        assert!((floor_s(b, 201, 3.0) - 17.0).abs() < 1e-9);
        assert_eq!(floor_s(b, 100, 3.0), 0.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).rev().collect());
        assert_eq!((p.p50, p.p99, p.max, p.n), (50.0, 99.0, 100.0, 100));
        assert_eq!(Percentiles::of(vec![]).n, 0);
    }
}
