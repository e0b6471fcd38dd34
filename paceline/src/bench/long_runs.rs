//! The long-runs scenario (SPEC §7, §4a): long runs — many turns, a history
//! that grows by a tool output of a few thousand characters a turn — on the
//! Anthropic and OpenAI shapes, with prompt caching on (`auto`) and off, the
//! same workload each time against a fresh mock that caches as the provider
//! does (`--cache`). Per trial: the work per minute (input tokens the
//! provider processed, read from its cache or not, per minute of the
//! makespan), the share read from the cache, 429s, and what a run cost at
//! the model's list price (`shared::models`).
//!
//! On Anthropic a cache read is not counted against the input limit, so
//! caching carries more work through the same budget; on OpenAI it is, so
//! the work per minute stays where the budget puts it and only the bill and
//! the latency fall.

use indicatif::ProgressBar;
use mock_provider::{HeaderStyle, MockConfig};
use std::time::Duration;

use super::trial::{Env, Trial, TrialSpec};
use super::workload::Workload;

/// A provider shape of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LongShape {
    /// Anthropic's Messages API: split buckets, the input one binding; cache reads not counted.
    Anthropic,
    /// OpenAI's Responses API: one token bucket; cached tokens counted in full.
    Openai,
}

impl LongShape {
    /// Both, in the order the scenario runs them.
    pub const ALL: [LongShape; 2] = [LongShape::Anthropic, LongShape::Openai];

    /// Its name in the output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Anthropic => "anthropic",
            Self::Openai => "openai",
        }
    }

    /// The model its runs name (its list price is the cost's).
    fn model(self) -> &'static str {
        match self {
            Self::Anthropic => "claude-sonnet-4-5",
            Self::Openai => "gpt-4.1-mini",
        }
    }
}

/// What the scenario runs.
#[derive(Debug, Clone)]
pub struct LongRunsPlan {
    /// Worker processes.
    pub workers: usize,
    /// Slots per worker process.
    pub concurrency: usize,
    /// Runs per trial.
    pub runs: usize,
    /// Turns per run.
    pub turns: u32,
    /// The budget's input tokens per window (Anthropic: the input bucket;
    /// OpenAI: the token bucket); the output and request buckets are roomy.
    pub tpm: u64,
    /// The window.
    pub window: Duration,
    /// The mock's latency.
    pub latency: Duration,
    /// `max_output_tokens` of each run.
    pub max_output_tokens: u32,
    /// Longest wait for one trial's runs.
    pub timeout: Duration,
}

/// One trial's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LongRunFigures {
    /// `anthropic` or `openai`.
    pub shape: LongShape,
    /// Prompt caching on (`auto`) or off.
    pub cache: bool,
    /// First submit to the last answer, s.
    pub makespan_s: f64,
    /// Input tokens the runs report (cached or not).
    pub input_tokens: u64,
    /// Of them, read from the cache.
    pub cached_input_tokens: u64,
    /// Of them, written to the cache.
    pub cache_write_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input tokens processed per minute of the makespan: the work the budget carried.
    pub work_tokens_per_min: f64,
    /// The budget's input tokens per minute.
    pub limit_tokens_per_min: f64,
    /// `cached_input_tokens / input_tokens`.
    pub cached_share: f64,
    /// Calls the mock answered, 429s among them.
    pub calls: u64,
    /// 429s.
    pub rate_limited: u64,
    /// 429s per 100 calls.
    pub rate_limited_per_100_calls: f64,
    /// A run's cost at the model's list price (`null`: not known, or not
    /// every run completed: the others' cost is not a run's).
    pub cost_per_run_usd: Option<f64>,
    /// Runs completed.
    pub runs_completed: usize,
    /// Runs failed or unfinished.
    pub runs_not_completed: usize,
}

/// Runs one trial: `shape`, caching on or off.
pub async fn measure(
    env: &Env,
    plan: &LongRunsPlan,
    shape: LongShape,
    cache: bool,
    progress: &ProgressBar,
) -> anyhow::Result<LongRunFigures> {
    let workload = Workload {
        runs: plan.runs,
        turns: plan.turns,
        max_output_tokens: plan.max_output_tokens,
        answer_tokens: 40,
        model: shape.model().into(),
        input_chars: 0,
        long_outputs: true,
        prompt_cache: Some(if cache { "auto" } else { "off" }),
    };
    let (tool_rounds, output_tokens) = workload.mock_script();
    let roomy = plan.tpm.saturating_mul(100);
    let mut mock = MockConfig {
        tpm: plan.tpm,
        rpm: roomy,
        window: plan.window,
        latency: plan.latency,
        tool_rounds,
        output_tokens,
        cache: true,
        keep_bodies: 0,
        ..MockConfig::default()
    };
    let mut worker_args = vec!["--pacer".to_owned(), "shared".to_owned()];
    match shape {
        LongShape::Anthropic => {
            mock.headers = HeaderStyle::Anthropic;
            mock.itpm = Some(plan.tpm);
            mock.otpm = Some(roomy);
            worker_args.extend(["--api-style".to_owned(), "anthropic".to_owned()]);
        }
        LongShape::Openai => mock.headers = HeaderStyle::OpenAi,
    }
    let label = format!("{}{}", shape.name(), if cache { "cache" } else { "nocache" });
    let spec = TrialSpec {
        label: label.clone(),
        workers: plan.workers,
        concurrency: plan.concurrency,
        worker_args,
        mock,
        tokens: vec![],
        log_deliveries: false,
    };
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    let bodies = (0..plan.runs).map(|i| workload.body(i, &tool_url, &label)).collect();
    progress.set_length(workload.total_turns());
    progress.set_position(0);
    progress.set_message(format!("{} cache {}", shape.name(), if cache { "on" } else { "off" }));
    trial.submit(None, bodies, 16).await?;
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let data = trial.finish(drained).await?;
    let makespan_s = data.makespan_s().unwrap_or(plan.timeout.as_secs_f64());
    let sum = |f: fn(&shared::runs::Usage) -> u64| data.runs.iter().map(|r| f(&r.usage)).sum::<u64>();
    let input_tokens = sum(|u| u.input_tokens);
    let cached_input_tokens = sum(|u| u.cached_input_tokens);
    let completed = data.runs.iter().filter(|r| r.status == shared::runs::RunStatus::Completed).count();
    let price = shared::models::price(shape.model());
    let cost: Option<f64> = price.map(|p| data.runs.iter().map(|r| p.cost_usd(&r.usage)).sum());
    let per_minute = 60.0 / plan.window.as_secs_f64();
    let stats = &data.mock;
    Ok(LongRunFigures {
        shape,
        cache,
        makespan_s,
        input_tokens,
        cached_input_tokens,
        cache_write_tokens: sum(|u| u.cache_write_tokens),
        output_tokens: sum(|u| u.output_tokens),
        work_tokens_per_min: if makespan_s > 0.0 { input_tokens as f64 / makespan_s * 60.0 } else { 0.0 },
        limit_tokens_per_min: plan.tpm as f64 * per_minute,
        cached_share: if input_tokens > 0 { cached_input_tokens as f64 / input_tokens as f64 } else { 0.0 },
        calls: stats.requests,
        rate_limited: stats.rate_limited,
        rate_limited_per_100_calls: if stats.requests > 0 {
            100.0 * stats.rate_limited as f64 / stats.requests as f64
        } else {
            0.0
        },
        cost_per_run_usd: cost.filter(|_| completed == plan.runs).map(|c| c / plan.runs.max(1) as f64),
        runs_completed: completed,
        runs_not_completed: plan.runs - completed,
    })
}
