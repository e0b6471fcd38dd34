//! The throughput scenario: the queue's ceiling through the real worker. One
//! worker process, an instant mock without limits (no waiting, no 429s), many
//! short turns (tool rounds answered at once); turns per second first submit
//! → last finish, and Redis commands per turn. Beside it, the queue alone
//! (`queue-probe`'s no-op consumer), to show what the worker adds.

use indicatif::ProgressBar;
use mock_provider::MockConfig;
use std::time::Duration;

use super::report::Throughput;
use super::trial::{Env, Trial, TrialSpec};
use super::workload::Workload;

/// What the throughput trial runs.
#[derive(Debug, Clone)]
pub struct ThroughputPlan {
    /// Runs submitted.
    pub runs: usize,
    /// Turns per run.
    pub turns: u32,
    /// Slots of the one worker process.
    pub concurrency: usize,
    /// The pacer of the worker.
    pub pacer: String,
    /// Longest wait.
    pub timeout: Duration,
}

/// Runs it.
pub async fn measure(env: &Env, plan: &ThroughputPlan, progress: &ProgressBar) -> anyhow::Result<Throughput> {
    let workload = Workload {
        runs: plan.runs,
        turns: plan.turns,
        max_output_tokens: 16,
        answer_tokens: 5,
        model: "gpt-4.1-mini".into(),
        input_chars: 0,
        long_outputs: false,
        prompt_cache: None,
    };
    let (tool_rounds, output_tokens) = workload.mock_script();
    let mock = MockConfig {
        // Limits no workload reaches: the mock never makes a turn wait.
        tpm: 1_000_000_000_000,
        rpm: 1_000_000_000_000,
        tool_rounds,
        output_tokens,
        keep_bodies: 0,
        log_limit: 0,
        ..MockConfig::default()
    };
    let spec = TrialSpec {
        label: "throughput".into(),
        workers: 1,
        concurrency: plan.concurrency,
        worker_args: vec!["--pacer".into(), plan.pacer.clone()],
        mock,
        tokens: vec![],
        log_deliveries: false,
    };
    let mut trial = Trial::start(env, &spec).await?;
    let tool_url = env.tool_url();
    let bodies = (0..plan.runs).map(|i| workload.body(i, &tool_url, "throughput")).collect();
    progress.set_length(workload.total_turns());
    progress.set_position(0);
    progress.set_message("throughput");
    trial.submit(None, bodies, 32).await?;
    let drained = trial.wait_drained(plan.timeout, |mock| progress.set_position(mock.summary().ok)).await?;
    let data = trial.finish(drained).await?;
    let turns = data.turns_completed();
    let makespan = data.makespan_s().unwrap_or(plan.timeout.as_secs_f64()).max(1e-3);
    Ok(Throughput {
        turns_per_s: turns as f64 / makespan,
        redis_commands_per_turn: data.commands_per_turn(),
        redis_cpu_ms_per_turn: data.redis_cpu_s * 1000.0 / (turns.max(1) as f64),
        turns,
        runs: plan.runs,
        turns_per_run: plan.turns,
        concurrency: plan.concurrency,
        pacer: plan.pacer.clone(),
        redis_commands_breakdown: data.commands.breakdown(turns as f64, 14),
        queue_only: None,
    })
}
