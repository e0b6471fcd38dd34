//! The pacer against each provider shape with real workers (docs/pacing.md, provider
//! shapes): a cold start, a provider that keeps the charge, a fixed window,
//! Anthropic's separate input and output buckets. Each test's workload is
//! small and its window scaled to 2 s; the bench measures the same shapes at
//! full size.

use std::time::{Duration, Instant};

use mock_provider::{BucketMode, ChargeMode, HeaderStyle, MockConfig};
use serde_json::{json, Value};
use shared::keys::Keys;
use shared::pacer::{PacingConfig, SharedPacer};
use shared::runs::{Run, RunStatus};

use crate::fixtures::App;

const WINDOW: Duration = Duration::from_secs(2);

/// A run of one call (the mock answers at once: no tools offered) or, with
/// `tools`, of one tool round then the answer.
fn run_body(app: &App, i: usize, tools: bool) -> Value {
    let mut body = json!({
        "model": "gpt-test",
        "instructions": "You are a test.",
        "input": format!("question {i:02}"),
        "max_turns": 4,
        "max_output_tokens": 64,
    });
    if tools {
        body["tools"] = json!([{"type": "function", "name": "lookup", "description": "a tool",
                                "parameters": {"type": "object", "properties": {}}}]);
        body["tool_endpoint"] = json!(app.tools);
    }
    body
}

/// Submits `n` runs at once (all due at the same instant), then starts two
/// workers of 16 slots, and waits for every run.
async fn run_all(app: &mut App, n: usize, tools: bool, timeout: Duration) -> (Vec<Run>, Duration) {
    let mut ids = vec![];
    for i in 0..n {
        ids.push(app.submit(run_body(app, i, tools)).await.id);
    }
    let started = Instant::now();
    for _ in 0..2 {
        let mut config = app.config();
        config.slots.concurrency = 16;
        app.spawn_worker(config);
    }
    let mut runs = vec![];
    for id in &ids {
        runs.push(app.wait_finished(id, timeout).await);
    }
    let took = started.elapsed();
    app.stop_workers().await;
    for run in &runs {
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    }
    (runs, took)
}

/// What one call of `run_body` is charged: measured on a mock of its own.
async fn charge_of_one_call(tools: bool) -> u64 {
    let mut app = App::start(MockConfig { tool_rounds: 0, output_tokens: 10, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    let run = app.submit(run_body(&app, 0, tools)).await;
    app.wait_finished(&run.id, Duration::from_secs(20)).await;
    app.stop_workers().await;
    app.mock.stats().log.iter().map(|e| e.charged).max().unwrap_or(0)
}

/// A cold start: 30 runs due at once, a bucket that fits 10 of their calls,
/// nothing known of the provider. One probe goes first and the rest wait for
/// its headers, so the first wave is what those headers say is there: at most
/// one 429 in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_sends_one_probe_then_no_more_than_the_headers_allow() {
    let charge = charge_of_one_call(false).await;
    let tpm = 10 * charge;
    let mut app =
        App::start(MockConfig { tpm, window: WINDOW, tool_rounds: 0, output_tokens: 10, ..MockConfig::default() })
            .await;
    let (_, took) = run_all(&mut app, 30, false, Duration::from_secs(60)).await;
    let stats = app.mock.stats();
    let log = &stats.log;
    eprintln!(
        "shapes: cold start, 30 runs against a bucket of {tpm} ({charge} a call) per 2 s: {} calls, {} 429s, {took:?}",
        stats.requests, stats.rate_limited
    );
    assert!(stats.rate_limited <= 1, "{} 429s on a cold start", stats.rate_limited);
    assert_eq!(stats.largest_overdraft, 0);
    // The probe went alone: the second call reached the mock after the first was answered.
    let first_done = log[0].refunded_at_us.expect("the probe was answered");
    assert!(log[1].at_us >= first_done, "a second call went out before the probe's headers came back");
}

/// A provider that keeps the whole reservation (OpenAI's documented
/// admission rule): the pacer credits no refund until the headers show one,
/// so after the first two answers no call is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_charge_provider_sees_no_429_after_the_first_two_answers() {
    let charge = charge_of_one_call(true).await;
    let mut app = App::start(MockConfig {
        tpm: 8 * charge,
        window: WINDOW,
        charge: ChargeMode::Keep,
        tool_rounds: 1,
        output_tokens: 10,
        ..MockConfig::default()
    })
    .await;
    let (_, took) = run_all(&mut app, 30, true, Duration::from_secs(90)).await;
    let stats = app.mock.stats();
    let answered: Vec<&mock_provider::LogEntry> = stats.log.iter().filter(|e| e.status == 200).collect();
    let second = answered.get(1).map(|e| e.seq).unwrap_or(0);
    let late_429s = stats.log.iter().filter(|e| e.status == 429 && e.seq > second).count();
    eprintln!(
        "shapes: keep-charge provider, 30 runs x 2 turns: {} calls, {} 429s ({late_429s} after the first two answers), {took:?}",
        stats.requests, stats.rate_limited
    );
    assert_eq!(late_429s, 0, "429s after the first two answers");
    assert_eq!(stats.largest_overdraft, 0);
}

/// A fixed-window provider: the pacer tells the shape from the headers,
/// spends each window and waits for its boundary: at most one 429 a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_provider_finishes_with_at_most_one_429_a_window() {
    let charge = charge_of_one_call(true).await;
    let mut app = App::start(MockConfig {
        tpm: 12 * charge,
        window: WINDOW,
        bucket: BucketMode::Window,
        tool_rounds: 1,
        output_tokens: 10,
        ..MockConfig::default()
    })
    .await;
    let (_, took) = run_all(&mut app, 30, true, Duration::from_secs(90)).await;
    let stats = app.mock.stats();
    let windows = (took.as_secs_f64() / WINDOW.as_secs_f64()).ceil() as u64 + 1;
    eprintln!(
        "shapes: window provider, 30 runs x 2 turns: {} calls, {} 429s over {windows} windows, {took:?}",
        stats.requests, stats.rate_limited
    );
    assert!(stats.rate_limited <= windows, "{} 429s in {windows} windows", stats.rate_limited);
    assert_eq!(stats.largest_overdraft, 0);
}

/// Anthropic's separate buckets with a tight output bucket: the pacer learns
/// both from the headers and paces on output (the turns wait while the input
/// bucket has plenty), refusing at most a few calls.
///
/// Why a few and not none: calls cleared within `BURST_GAP_MS` of each other
/// are taken as seen by each other's headers (either may reach the provider
/// first; taking them as unseen costs the simulator's workloads up to a third
/// of their pace, measured). On a loaded machine a worker's send lags its
/// clearance by more than the gap between two clearances, and the later one
/// cleared, counted in the earlier one's headers, reaches the provider after
/// them: one refused call for each such pair. Counted with copies of the
/// test binary started at once on a 2-core machine (`…integration-* shapes::an_anthropic
/// --nocapture`): alone or beside two busy loops, 0 429s in 16 runs; eight at
/// a time, one run of 32 had one; fourteen at a time, one of 42; a CI run had 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_provider_with_a_tight_output_bucket_pauses_on_output() {
    // 64 output tokens reserved a call for its 300 ms, 10 used: 640 a window
    // holds 10 calls in flight at once, of the 32 slots; the input bucket is large.
    let mut app = App::start(MockConfig {
        headers: HeaderStyle::Anthropic,
        itpm: Some(100_000),
        otpm: Some(640),
        window: WINDOW,
        tool_rounds: 0,
        output_tokens: 10,
        latency: Duration::from_millis(300),
        ..MockConfig::default()
    })
    .await;
    let (runs, took) = run_all(&mut app, 40, false, Duration::from_secs(90)).await;
    let stats = app.mock.stats();
    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = SharedPacer::new(conn, Keys::new(&app.prefix), "default", PacingConfig::default());
    let budget = pacer.snapshot().await.unwrap().into_iter().next().expect("a budget");
    let waits: u64 = runs.iter().map(|r| r.pacing.budget_waits).sum();
    eprintln!(
        "shapes: anthropic, 40 runs, output 640 / input 100 000 per 2 s: {} calls, {} 429s, {waits} budget waits, {took:?}; \
pacer sees input {:?}/{:?}, output {:?}/{:?}",
        stats.requests,
        stats.rate_limited,
        budget.shape.remaining_input_tokens,
        budget.shape.limit_input_tokens,
        budget.shape.remaining_output_tokens,
        budget.shape.limit_output_tokens
    );
    assert_eq!(budget.shape.limit_input_tokens, Some(100_000));
    assert_eq!(budget.shape.limit_output_tokens, Some(640));
    assert_eq!(budget.limit_tokens, None, "no combined bucket: the two are paced each on its own");
    assert!(waits > 0, "the output bucket never held a turn: the test shows nothing");
    // The input bucket never came near its limit: the waits were for output.
    assert!(stats.input_tokens_admitted < 50_000, "{} input tokens", stats.input_tokens_admitted);
    assert!(stats.rate_limited <= 4, "{} 429s", stats.rate_limited);
    assert_eq!(stats.largest_overdraft, 0);
}
