//! The worker end to end against real Redis, the mock provider and a tool
//! endpoint: runs with tools complete; what the provider received shows the
//! back-pressure; 429s, quota, transient errors and mid-stream failures follow
//! docs/pacing.md; a cancelled run calls the provider no more; a SIGKILLed worker
//! process loses no run and doubles no turn.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use mock_provider::{Fault, HeaderStyle, MockConfig};
use paceline_tests::{command_calls, eventually, ChildGuard};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::runs::{RunSpec, RunStatus, SubmitPolicy, ToolEndpoints};

use crate::fixtures::{secs, submit_tool_runs, tool_endpoint, tool_run, wait_finished_for, App, QueueTrace, TENANT};

/// Every function_call_output in a sent body has its function_call before it.
fn assert_no_orphans(body: &Value) {
    let items = body["input"].as_array().expect("a Responses body");
    let mut calls = HashSet::new();
    for item in items {
        match item["type"].as_str() {
            Some("function_call") => {
                calls.insert(item["call_id"].as_str().unwrap().to_owned());
            }
            Some("function_call_output") => {
                assert!(calls.contains(item["call_id"].as_str().unwrap()), "orphaned output in {items:#?}")
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_tools_completes_and_the_provider_saw_the_back_pressure() {
    let mut app = App::start(MockConfig { tool_rounds: 3, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    let run = app.submit(tool_run(&app, "browser__snapshot")).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.turns_completed, 4, "3 tool rounds and the answer");
    assert!(run.output_text.as_deref().is_some_and(|t| !t.is_empty()));
    assert!(run.usage.total_tokens > 0);

    let bodies = app.mock.stats().bodies;
    assert_eq!(bodies.len(), 4, "one call per turn, none re-sent");
    let last = &bodies.last().unwrap().body;
    assert_no_orphans(last);
    let outputs: Vec<&str> = last["input"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call_output")
        .map(|i| i["output"].as_str().unwrap())
        .collect();
    assert_eq!(outputs.len(), 3);
    // Every browser view but the newest is a one-line placeholder ...
    for old in &outputs[..2] {
        assert!(old.len() < 300 && old.contains("snapshot"), "not elided: {}", &old[..old.len().min(200)]);
    }
    // ... and the newest is clipped to its cap, saying so.
    let newest = outputs[2];
    assert!(newest.chars().count() <= worker::context::BROWSER_TOOL_OUTPUT_CAP);
    assert!(newest.contains("30013"), "the clip note says how much there was: {}", &newest[newest.len() - 200..]);
    // The transcript shows the clipped text too: one constant, not two.
    let tx = app.store.transcript(TENANT, &run.id).await.unwrap().unwrap();
    let stored: Vec<&Value> = tx.iter().filter(|e| e.item["type"] == "function_call_output").map(|e| &e.item).collect();
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[2]["output"].as_str().unwrap(), newest);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_is_bounded_without_orphaning_a_tool_output() {
    let mut app = App::start(MockConfig { tool_rounds: 6, ..MockConfig::default() }).await;
    let mut config = app.config();
    config.slots.max_history = 2;
    app.spawn_worker(config);
    // The scripted model never sees more than 2 tool outputs, so it keeps
    // asking for tools until max_turns: 10 bounded requests.
    let run = app.submit(tool_run(&app, "lookup")).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.error.as_ref().map(|e| e.kind.as_str()), Some("max_turns"), "{run:?}");
    assert_eq!(app.mock.stats().bodies.len(), 10);
    for kept in app.mock.stats().bodies {
        assert_no_orphans(&kept.body);
        let items = kept.body["input"].as_array().unwrap();
        assert_eq!(items[0]["content"], "do the task", "the task is always sent");
        let calls = items.iter().filter(|i| i["type"] == "function_call").count();
        assert!(calls <= 2, "more than 2 turns of history sent: {calls} calls");
    }
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_retried_after_its_retry_after_and_nobody_sends_into_the_window() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    app.mock.inject(Fault::RateLimited { retry_after_ms: 3_000 });
    app.spawn_worker(app.config());
    app.spawn_worker(app.config());
    let first = app.submit(json!({"model": "gpt-test", "input": "one"})).await;
    let first = app.wait_finished(&first.id, secs(30)).await;
    assert_eq!(first.status, RunStatus::Completed, "{first:?}");
    assert_eq!(first.pacing.rate_limited, 1);
    let log = app.mock.stats().log;
    let limited = log.iter().find(|e| e.status == 429).expect("the injected 429");
    let after: Vec<_> = log.iter().filter(|e| e.seq > limited.seq).collect();
    assert!(!after.is_empty());
    for e in &after {
        assert!(
            e.at_ms >= limited.at_ms + 3_000,
            "a call {} ms after the 429 went into the closed window",
            e.at_ms - limited.at_ms
        );
    }
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insufficient_quota_fails_the_run_after_exactly_one_request() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    app.mock.inject(Fault::Quota);
    app.spawn_worker(app.config());
    let run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Failed);
    assert_eq!(run.error.as_ref().map(|e| e.kind.as_str()), Some("quota"));
    assert_eq!(app.mock.stats().requests, 1);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_failures_reach_runs_and_events_without_urls_or_keys() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    // A provider's own message that quotes the key and a URL: its words stay, they do not.
    app.mock.inject(Fault::InvalidRequest {
        message: Some(
            "Incorrect API key provided: sk-proj-Ab12****************************Yz89. \
             You can find your API key at https://platform.openai.com/account/api-keys."
                .into(),
        ),
    });
    app.spawn_worker(app.config());
    let run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "provider_error");
    assert_eq!(error.message, "Incorrect API key provided: [redacted]. You can find your API key at [url].");
    let events = app.store.events(TENANT, &run.id, None, None, 50).await.unwrap().unwrap();
    let shown = serde_json::to_string(&events.iter().map(|e| &e.data).collect::<Vec<_>>()).unwrap();
    assert!(!shown.contains("sk-proj") && !shown.contains("openai.com"), "{shown}");
    app.stop_workers().await;

    // A provider that cannot be reached: the retry's reason is a stable sentence,
    // not reqwest's text with the URL (and the credentials in it).
    let mut config = app.config();
    config.provider.url = Some("http://paceline:hunter2@127.0.0.1:1/v1".into());
    app.spawn_worker(config);
    let run = app.submit(json!({"model": "gpt-test", "input": "y"})).await;
    let retry = eventually("a turn.retry event", secs(20), || async {
        let events = app.store.events(TENANT, &run.id, None, None, 50).await.ok()??;
        events.into_iter().find(|e| e.kind == "turn.retry")
    })
    .await;
    let reason = retry.data["reason"].as_str().expect("a reason").to_owned();
    assert!(reason.starts_with("could not connect to the provider"), "{reason}");
    for secret in ["127.0.0.1", "hunter2", "http"] {
        assert!(!reason.contains(secret), "{secret} in {reason:?}");
    }
    app.store.cancel(TENANT, &run.id).await.unwrap();
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_with_backoff_and_six_429s_fail_the_run() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    app.mock.inject(Fault::ServerError { status: 503 });
    app.spawn_worker(app.config());
    let run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.pacing.retries, 1);
    let log = app.mock.stats().log;
    let gap = log[1].at_ms - log[0].at_ms;
    assert!(gap >= 800, "the retry came {gap} ms after the 503, not after ~1 s of backoff");

    for _ in 0..6 {
        app.mock.inject(Fault::RateLimited { retry_after_ms: 50 });
    }
    let before = app.mock.stats().requests;
    let run = app.submit(json!({"model": "gpt-test", "input": "y"})).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Failed);
    assert_eq!(run.error.as_ref().map(|e| e.kind.as_str()), Some("rate_limited"));
    assert_eq!(app.mock.stats().requests - before, 6, "at most 6 attempts");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_companion_run_that_already_spoke_is_not_resent_but_a_work_run_is() {
    let mut app = App::start(MockConfig { tool_rounds: 0, output_tokens: 40, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    app.mock.inject(Fault::MidstreamError { code: None });
    let live = app.submit(json!({"model": "gpt-test", "input": "x", "mode": "companion"})).await;
    let live = app.wait_finished(&live.id, secs(20)).await;
    assert_eq!(live.status, RunStatus::Failed);
    assert_eq!(live.error.as_ref().map(|e| e.kind.as_str()), Some("partial_output"));
    assert_eq!(app.mock.stats().requests, 1);

    app.mock.inject(Fault::MidstreamError { code: None });
    let work = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    let work = app.wait_finished(&work.id, secs(20)).await;
    assert_eq!(work.status, RunStatus::Completed, "{work:?}");
    assert_eq!(app.mock.stats().requests, 3, "the work run's call was re-sent once");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_makes_no_further_provider_request() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    // The window is closed for 2 s: the run's turn is requeued to wait ...
    app.mock.inject(Fault::RateLimited { retry_after_ms: 2_000 });
    app.spawn_worker(app.config());
    let run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    eventually("the run to wait", secs(10), || async {
        let r = app.store.get(TENANT, &run.id).await.ok()??;
        (r.status == RunStatus::Waiting).then_some(())
    })
    .await;
    // ... and is cancelled while it waits.
    app.store.cancel(TENANT, &run.id).await.unwrap();
    // Time passes beyond the 2 s window, when the turn would have been sent
    // again: nothing to wait for, the point is that nothing happens.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(app.mock.stats().requests, 1, "the cancelled run called the provider again");
    assert_eq!(app.store.get(TENANT, &run.id).await.unwrap().unwrap().status, RunStatus::Cancelled);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_process_loses_no_run_and_doubles_no_turn() {
    let app =
        App::start(MockConfig { tool_rounds: 2, latency: Duration::from_millis(150), ..MockConfig::default() }).await;
    let spawn = || app.worker_process(&["--queue-lease-ms", "1500", "--concurrency", "8"], "warn");
    let mut doomed = spawn();
    let mut ids = vec![];
    for i in 0..8 {
        let mut body = tool_run(&app, "lookup");
        body["input"] = json!(format!("task {i}"));
        ids.push(app.submit(body).await.id);
    }
    // Kill the worker while turns are in flight.
    eventually("turns in flight", secs(10), || async { (app.mock.stats().requests >= 4).then_some(()) }).await;
    doomed.signal("KILL");
    let _ = doomed.wait_timeout(secs(5));
    let started = Instant::now();
    let _rescuer = spawn();
    for id in &ids {
        let run = app.wait_finished(id, secs(40)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        assert_eq!(run.turns_completed, 3);
        let tx = app.store.transcript(TENANT, id).await.unwrap().unwrap();
        let mut seen = HashSet::new();
        for e in &tx {
            if let Some(call) = e.item["call_id"].as_str() {
                let key = format!("{}:{call}", e.item["type"]);
                assert!(seen.insert(key), "an item appears twice in {id}'s transcript");
            }
        }
    }
    eprintln!("worker: all runs completed {:?} after the kill", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_worker_processes_share_a_tight_budget_with_almost_no_429s() {
    // 6 000 tokens per 2 s window (a tight TPM, scaled down), continuous refill.
    let window = Duration::from_secs(2);
    let tpm = 6_000u64;
    let app = App::start(MockConfig {
        tpm,
        rpm: 10_000,
        window,
        tool_rounds: 4,
        latency: Duration::from_millis(50),
        log_limit: 10_000,
        ..MockConfig::default()
    })
    .await;
    let _workers: Vec<ChildGuard> = (0..4).map(|_| app.worker_process(&["--concurrency", "16"], "error")).collect();
    let started = Instant::now();
    let ids = submit_tool_runs(&app, 40, |i| format!("task number {i}"), 48).await;
    for id in &ids {
        let run = app.wait_finished(id, secs(120)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        assert_eq!(run.turns_completed, 5);
    }
    let makespan = started.elapsed().as_secs_f64();
    let stats = app.mock.stats();
    let calls = stats.requests;
    let per_100 = stats.rate_limited as f64 * 100.0 / calls as f64;
    // The least time the bucket allows for the tokens admitted: what exceeds its
    // capacity, at its refill rate.
    let rate_per_s = tpm as f64 / window.as_secs_f64();
    let floor = (stats.tokens_admitted as f64 - tpm as f64).max(0.0) / rate_per_s;
    eprintln!(
        "worker: 4 processes x 16 slots, 40 runs x 5 turns: {calls} calls, {} 429s ({per_100:.2} per 100 calls), \
         {} tokens admitted, makespan {makespan:.1} s, floor {floor:.1} s, efficiency {:.2}, overdraft {}",
        stats.rate_limited,
        stats.tokens_admitted,
        floor / makespan,
        stats.largest_overdraft
    );
    assert_eq!(calls, 200 + stats.rate_limited, "one call per turn, plus the 429'd ones");
    assert!(per_100 <= 1.0, "{per_100:.2} 429s per 100 calls");
}

/// The workload that once stalled the fleet with a full bucket (the pacer never
/// stalls: docs/pacing.md, "Liveness is a property, not a case"), scaled from 10 s to a 2 s window: three worker
/// processes × 16 slots; tenant `alpha` submits 40 work runs of 5 turns
/// (~2 000 characters of input, `max_output_tokens` 300, one tool, little of
/// the output used, so the learned usage ratio falls far below 1); from 1 s
/// on, tenant `beta` submits a companion run every 0.4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_and_companion_runs_all_finish_with_a_full_bucket_never_idle() {
    let window = Duration::from_secs(2);
    let tpm = 30_000u64;
    let app = App::start(MockConfig {
        tpm,
        rpm: 10_000,
        window,
        tool_rounds: 4,
        output_tokens: 40,
        latency: Duration::from_millis(50),
        log_limit: 10_000,
        ..MockConfig::default()
    })
    .await;
    let _workers: Vec<ChildGuard> = (0..3).map(|_| app.worker_process(&["--concurrency", "16"], "error")).collect();
    let policy =
        SubmitPolicy { tool_endpoints: ToolEndpoints::every_tenant([app.tools.clone()]), ..SubmitPolicy::default() };
    let background = "Background: the team runs many long agent sessions on one account. ".repeat(30);
    let trace = QueueTrace::start(&app).await;
    let started = Instant::now();
    let mut work = vec![];
    for i in 0..40 {
        let mut body = tool_run(&app, "lookup");
        body["input"] = json!(format!("task {i}. {background}"));
        body["max_output_tokens"] = json!(300);
        let spec = RunSpec::from_json(&body, &policy).expect("valid spec");
        work.push(app.store.create("alpha", &spec, None, None).await.unwrap().run.id);
    }
    // The workload's schedule (see above): companions from 1 s on, one every 0.4 s.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut live_waits = vec![];
    for i in 0..8 {
        let body = json!({"model": "gpt-test", "input": format!("a question {i}"), "mode": "companion",
                          "max_turns": 2, "max_output_tokens": 300});
        let spec = RunSpec::from_json(&body, &policy).expect("valid spec");
        let asked = Instant::now();
        let run = app.store.create("beta", &spec, None, None).await.unwrap().run;
        let run = wait_finished_for(&app, "beta", &run.id, secs(20)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        live_waits.push(asked.elapsed());
        tokio::time::sleep(Duration::from_millis(400).saturating_sub(asked.elapsed())).await;
    }
    let mut unfinished_when_live_done = 0;
    for id in &work {
        if !app.store.get("alpha", id).await.unwrap().unwrap().status.is_finished() {
            unfinished_when_live_done += 1;
        }
    }
    for id in &work {
        let run = wait_finished_for(&app, "alpha", id, secs(120)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        assert_eq!(run.turns_completed, 5);
    }
    let makespan = started.elapsed().as_secs_f64();
    let stats = app.mock.stats();
    let per_100 = stats.rate_limited as f64 * 100.0 / stats.requests as f64;
    let floor = (stats.tokens_admitted as f64 - tpm as f64).max(0.0) / (tpm as f64 / window.as_secs_f64());
    live_waits.sort();
    let p95 = live_waits[live_waits.len() * 95 / 100 - 1];
    eprintln!(
        "worker: 40 work runs x 5 turns + 8 companion runs, 3 processes x 16: {} calls, {} 429s, {} tokens \
         admitted, makespan {makespan:.1} s, floor {floor:.1} s, efficiency {:.2}; companion submit -> done \
         p95 {p95:?} (max {:?}); {unfinished_when_live_done} work runs still waiting when the last companion finished",
        stats.requests,
        stats.rate_limited,
        stats.tokens_admitted,
        floor / makespan,
        live_waits.last().unwrap(),
    );
    assert!(unfinished_when_live_done > 0, "the work runs were not saturating the budget: the test shows nothing");
    assert!(p95 <= Duration::from_secs(1), "companion runs waited {live_waits:?}");
    // 0.77-0.92 measured here with debug workers over several runs on one
    // day (0.81-0.86 on the same day before the shape-aware pacer; 0.93 on
    // another day); with two busy loops beside it on the 2 cores, 0.64-0.85
    // over twelve runs (the bar was 0.7 and failed there): the makespan carries
    // seconds of start-up and contention that a 6 s floor cannot absorb. The
    // efficiency figure is the bench's (its release trial of this workload
    // reaches 0.99, BENCHMARKS.md); here the bar only catches a fleet that
    // idles with budget free, with a margin that holds on a loaded 2-core
    // CI machine.
    let mut log: Vec<u64> = stats.log.iter().map(|e| e.at_ms).collect();
    log.sort();
    let gap = log.windows(2).max_by_key(|w| w[1] - w[0]).map_or((0, 0), |w| (w[0], w[1]));
    eprintln!("the longest gap between calls: {} ms (from {} ms after the mock started)", gap.1 - gap.0, gap.0);
    if floor / makespan < 0.5 || gap.1 - gap.0 > 2_000 {
        let report = format!("gap {gap:?}, makespan {makespan:.1} s\n{}", trace.report());
        eprintln!("what the queue and the pacer held, every 100 ms:\n{report}");
        // (Where a stall seen under load is kept for reading when the test passes anyway.)
        if let Ok(dir) = std::env::var("PACELINE_TEST_TRACE_DIR") {
            let _ = std::fs::write(format!("{dir}/stall-{}.txt", std::process::id()), report);
        }
    }
    assert!(floor / makespan >= 0.5, "efficiency {:.2}: the fleet idled with budget free", floor / makespan);
    // 0 in five runs alone; 3 in 211 calls once, with the whole suite running
    // beside it on 2 cores (debug workers: a call cleared reaches the provider
    // late under load). A pacer that overdraws shows far more.
    assert!(per_100 <= 2.0, "{per_100:.2} 429s per 100 calls");
}

/// A provider without rate-limit headers (vLLM, Ollama) and no configured
/// limits: no proactive pacing (docs/pacing.md, "A provider without headers"). The first answer shows there are no
/// headers; from then on nothing waits for a probe, so 32 one-call runs on 16
/// slots take about two latencies, not one latency each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_without_headers_is_not_paced_at_all() {
    let latency = Duration::from_millis(300);
    let mut app =
        App::start(MockConfig { headers: HeaderStyle::None, tool_rounds: 0, latency, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    let started = Instant::now();
    let mut ids = vec![];
    for i in 0..32 {
        let mut body = tool_run(&app, "lookup");
        body["input"] = json!(format!("question {i}"));
        ids.push(app.submit(body).await.id);
    }
    for id in &ids {
        let run = app.wait_finished(id, secs(60)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    }
    let took = started.elapsed();
    eprintln!("worker: 32 one-call runs against a provider without headers took {took:?}");
    // One at a time would take 32 x 300 ms = 9.6 s.
    assert!(took < Duration::from_secs(4), "the fleet crawled: {took:?}");
    assert_eq!(app.mock.stats().rate_limited, 0);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_tools_completes_over_chat_completions_too() {
    let mut app = App::start(MockConfig { tool_rounds: 2, ..MockConfig::default() }).await;
    let mut config = app.config();
    config.provider.api_style = shared::runs::ApiStyle::Chat;
    app.spawn_worker(config);
    let run = app.submit(tool_run(&app, "lookup")).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.turns_completed, 3);
    let log = app.mock.stats().log;
    assert!(log.iter().all(|e| e.api == Some(mock_provider::wire::Api::Chat)), "every call went to /chat/completions");
    // The transcript keeps the Responses shape whatever the transport.
    let tx = app.store.transcript(TENANT, &run.id).await.unwrap().unwrap();
    assert_eq!(tx.iter().filter(|e| e.item["type"] == "function_call").count(), 2);
    assert_eq!(tx.iter().filter(|e| e.item["type"] == "function_call_output").count(), 2);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_aborts_the_call_in_flight_and_no_tool_runs_after_it() {
    // The model takes 6 s to answer, and would ask for a tool.
    let mut app =
        App::start(MockConfig { latency: Duration::from_secs(6), tool_rounds: 1, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    let run = app.submit(tool_run(&app, "lookup")).await;
    eventually("the model call in flight", secs(10), || async { (app.mock.stats().requests >= 1).then_some(()) }).await;
    let cancelled_at = Instant::now();
    app.store.cancel(TENANT, &run.id).await.unwrap();
    // The turn stops at the cancel, not when the provider would have answered:
    // its lease goes long before the 6 s are up.
    let queue = shared::runs::run_queue(&RedisArgs::new(app.redis.url(), &app.prefix), Default::default()).unwrap();
    let q = &queue;
    eventually("the turn to stop", secs(4), || async move {
        let c = q.counts().await.ok()?;
        (c.in_flight + c.ready + c.delayed == 0).then_some(())
    })
    .await;
    assert!(cancelled_at.elapsed() < secs(4), "stopped {:?} after the cancel", cancelled_at.elapsed());
    // Nothing of the turn was written after the cancel: no tool call, no output
    // (the sleep lets the 6 s the answer would have taken pass).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let events = app.store.events(TENANT, &run.id, None, None, 100).await.unwrap().unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["run.queued", "turn.started", "run.cancelled"], "{kinds:?}");
    assert_eq!(app.store.transcript(TENANT, &run.id).await.unwrap().unwrap().len(), 1, "the task alone");
    assert_eq!(app.mock.stats().requests, 1, "no second call");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_writes_for_a_while_during_a_commit_runs_no_tool_and_no_call_twice() {
    // A tool endpoint that, as it answers its first call, makes Redis refuse
    // every write for 3 s (a replica of a primary that is not there, as in a
    // failover): the tool results' events (best-effort) are lost, and the
    // commit that follows meets READONLY; it is retried in place until Redis
    // takes writes again, so the turn is not run again.
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let tools = {
        let calls = calls.clone();
        let client = app.redis.client();
        let tool = move || {
            let calls = calls.clone();
            let client = client.clone();
            async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(1).query_async(&mut conn).await.unwrap();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        let _: () = redis::cmd("REPLICAOF").arg("NO").arg("ONE").query_async(&mut conn).await.unwrap();
                    });
                }
                axum::Json(json!({"output": "found"}))
            }
        };
        tool_endpoint(tool).await
    };
    app.tools = tools;
    app.spawn_worker(app.config());
    let run = app.submit(tool_run(&app, "lookup")).await;
    let done = app.wait_finished(&run.id, secs(40)).await;
    assert_eq!(done.status, RunStatus::Completed, "{:?}", done.error);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the tool ran again: the turn was retried, not its commit");
    assert_eq!(app.mock.stats().requests, 2, "a model call was paid twice");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_companion_turn_delivered_again_after_it_streamed_text_fails_instead_of_repeating_it() {
    // Answers pause 8 s mid-way, after some text.
    let mut app =
        App::start(MockConfig { output_tokens: 40, stall: Duration::from_secs(8), ..MockConfig::default() }).await;
    let run = app.submit(json!({"model": "gpt-test", "input": "talk to me", "mode": "companion"})).await;
    // A worker process streams the first words, then dies mid-answer.
    let mut first = app.worker_process(&["--queue-lease-ms", "1000"], "warn");
    let store = &app.store;
    let id = run.id.clone();
    eventually("text to stream", secs(15), || async { store.streamed_text(&id, 0).await.unwrap().then_some(()) }).await;
    first.0.kill().unwrap();
    let _ = first.0.wait();
    // Another worker takes the turn back when its lease expires.
    let mut config = app.config();
    config.queue.lease_ms = 1_000;
    app.spawn_worker(config);
    let done = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(done.status, RunStatus::Failed);
    assert_eq!(done.error.as_ref().map(|e| e.kind.as_str()), Some("partial_output"), "{:?}", done.error);
    assert_eq!(app.mock.stats().requests, 1, "the model was not asked again");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_whose_lease_is_taken_back_stops_its_call_and_writes_no_text() {
    // Answers take 3 s; two workers of one slot each.
    let mut app =
        App::start(MockConfig { latency: Duration::from_secs(3), output_tokens: 20, ..MockConfig::default() }).await;
    for _ in 0..2 {
        let mut config = app.config();
        config.slots.concurrency = 1;
        config.queue.lease_ms = 1_000;
        app.spawn_worker(config);
    }
    let run = app.submit(json!({"model": "gpt-test", "input": "say something"})).await;
    eventually("the first call", secs(10), || async { (app.mock.stats().requests >= 1).then_some(()) }).await;
    // Its lease is taken back while the call is out (as when its worker
    // stalls past the lease): the turn goes to the other worker.
    let queue = shared::runs::run_queue(&RedisArgs::new(app.redis.url(), &app.prefix), Default::default()).unwrap();
    let mut conn = app.redis.conn().await;
    // (Its holder renews it every third of a second: a renewal landing between
    // the expiry written here and the reclaim undoes the expiry, so try again.
    // The other worker's own beat may reclaim it first: then the second call
    // comes without this reclaim counting it.)
    let mut taken_back = false;
    for _ in 0..40 {
        if app.mock.stats().requests >= 2 {
            taken_back = true;
            break;
        }
        let lease = &queue.keys().lease;
        let _: () = redis::cmd("ZADD").arg(lease).arg(0).arg(&run.id).query_async(&mut conn).await.unwrap();
        let reclaimed = queue.heartbeat("test-reclaimer", None, &[]).await.unwrap().reclaimed;
        if reclaimed > 0 {
            taken_back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(taken_back, "the lease was never taken back");
    let done = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(done.status, RunStatus::Completed, "{:?}", done.error);
    assert_eq!(app.mock.stats().requests, 2);
    // The stale holder stopped when its heartbeat found the lease gone: its
    // answer never reached the stream, so the streamed text is said once.
    let events = app.store.events(TENANT, &run.id, None, None, 500).await.unwrap().unwrap();
    let streamed: String = events
        .iter()
        .filter(|e| e.kind == "turn.output_text.delta")
        .map(|e| e.data["delta"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(Some(streamed.as_str()), done.output_text.as_deref(), "text from two holders interleaved");
    // Each delivery said it started, with its epoch; every delta carries the second's.
    let started: Vec<u64> =
        events.iter().filter(|e| e.kind == "turn.started").map(|e| e.data["epoch"].as_u64().unwrap()).collect();
    assert_eq!(started.len(), 2, "{started:?}");
    assert!(started[1] > started[0]);
    assert!(events.iter().filter(|e| e.kind == "turn.output_text.delta").all(|e| e.data["epoch"] == started[1]));
    app.stop_workers().await;
}

/// The answer's last text delta, still gathering when the answer ended, is
/// written by the commit, in the entry it writes anyway, before
/// `turn.completed`: the streamed text is whole and in order, and a turn
/// whose answer comes in one batch writes no delta entry of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_text_delta_rides_in_the_commits_entry_before_turn_completed() {
    let mut app = App::start(MockConfig { output_tokens: 20, ..MockConfig::default() }).await;
    app.spawn_worker(app.config());
    let run = app.submit(json!({"model": "gpt-test", "input": "say something"})).await;
    let done = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(done.status, RunStatus::Completed, "{:?}", done.error);
    let events = app.store.events(TENANT, &run.id, None, None, 500).await.unwrap().unwrap();
    let deltas: Vec<_> = events.iter().filter(|e| e.kind == "turn.output_text.delta").collect();
    let streamed: String = deltas.iter().map(|e| e.data["delta"].as_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(Some(streamed.as_str()), done.output_text.as_deref());
    let entry = |id: &str| id.split('.').next().unwrap().to_owned();
    let completed = events.iter().position(|e| e.kind == "turn.completed").expect("turn.completed");
    let last = events.iter().rposition(|e| e.kind == "turn.output_text.delta").expect("a delta");
    assert_eq!(last + 1, completed, "the last delta just before turn.completed: {events:?}");
    assert_eq!(entry(&events[last].id), entry(&events[completed].id), "in the commit's entry: {events:?}");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_or_record_of_a_newer_format_ends_its_run_with_the_reason_not_a_wrong_turn() {
    let mut app = App::start(MockConfig::default()).await;
    let payload_run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
    let record_run = app.submit(json!({"model": "gpt-test", "input": "y"})).await;
    let queue = shared::runs::run_queue(&RedisArgs::new(app.redis.url(), &app.prefix), Default::default()).unwrap();
    let mut conn = app.redis.conn().await;
    // What a newer paceline would have written: a turn payload of format 2,
    // and a run record of the format after this version's.
    let newer = format!("0|0|q|{}", json!({"turn": 0, "attempt": 1, "v": 2}));
    let _: () = redis::cmd("HSET")
        .arg(&queue.keys().jobs)
        .arg(&payload_run.id)
        .arg(newer)
        .query_async(&mut conn)
        .await
        .unwrap();
    let record = shared::keys::Keys::new(app.prefix.clone()).run_record(&record_run.id);
    let newer_record = shared::runs::turn::RECORD_FORMAT + 1;
    let _: () = redis::cmd("HSET").arg(&record).arg("format").arg(newer_record).query_async(&mut conn).await.unwrap();
    app.spawn_worker(app.config());
    let record_says = format!("record format {newer_record}");
    for (run, says) in [(&payload_run, "payload format 2"), (&record_run, record_says.as_str())] {
        let done = app.wait_finished(&run.id, secs(30)).await;
        let error = done.error.expect("an error");
        assert_eq!((done.status, error.kind.as_str()), (RunStatus::Failed, "dead_lettered"), "{}", error.message);
        assert!(error.message.contains(says), "{}", error.message);
    }
    assert_eq!(app.mock.stats().requests, 0, "neither was run");
    app.stop_workers().await;
}

/// A turn owed budget is parked in the queue with its ask in its payload, and
/// released by the pacer when it clears (or, at the head of its line, asks
/// again at the line's timer): one still owed stays parked without its run or
/// history being read, so a turn starts once, when it is finally clear (a
/// run's first turn carries the ask its submit counted; a later turn was asked
/// as the turn before it committed) — and every run still completes with
/// every call paced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_still_owed_when_it_comes_back_waits_again_without_starting() {
    // 3 000 tokens per 2 s window: 12 runs of ~700-token calls queue for it.
    let app = App::start(MockConfig {
        tpm: 3_000,
        rpm: 10_000,
        window: Duration::from_secs(2),
        tool_rounds: 1,
        latency: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    let mut app = app;
    app.spawn_worker(app.config());
    let ids = submit_tool_runs(&app, 12, |i| format!("task number {i}: {}", "background ".repeat(100)), 300).await;
    let (mut turns, mut asked_at_commit, mut first_waited) = (0, 0, 0);
    for id in &ids {
        let run = app.wait_finished(id, secs(90)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        let events = app.store.events(TENANT, id, None, None, 1_000).await.unwrap().unwrap();
        for turn in 0..run.turns_completed {
            let of = |kind: &str| {
                events.iter().filter(|e| e.kind == kind && e.data["turn"].as_u64() == Some(turn as u64)).count()
            };
            let (started, paced) = (of("turn.started"), of("turn.paced"));
            turns += 1;
            assert!(started <= 2, "run {id} turn {turn}: started {started} times for {paced} waits");
            // The first turn waits unstarted: its fetch asked for it with the
            // ask its submit counted (one its fetch owed a moment for the
            // budget's probe only is started then, and once more if a budget
            // wait follows). A later one was asked when the turn before it
            // committed (once this process had heard the pacer owe time: a
            // scarce budget), or by its fetch, so it starts once, when clear.
            assert!(started <= 1 + usize::from(paced > 0), "run {id} turn {turn}: {paced} waits");
            if turn == 0 {
                first_waited += usize::from(paced > 0);
            } else {
                asked_at_commit += usize::from(paced > 0 && started == 1);
            }
        }
    }
    assert!(asked_at_commit >= 3, "only {asked_at_commit} later turns were put to wait by the commit before them");
    assert!(first_waited >= 3, "only {first_waited} of {turns} first turns waited: the test proves nothing");
    assert_eq!(app.mock.stats().rate_limited, 0, "a turn asked again and sent before it was clear");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tool_finds_the_models_output_committed_before_it_answers() {
    // A tool that answers at once has the model's output committed with its
    // result (one script); one that takes longer than the short grace finds
    // the output committed while it runs, so a crash during it would not call
    // the model again.
    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let called = std::sync::Arc::new(tokio::sync::Notify::new());
    let tools = {
        let (release, called) = (release.clone(), called.clone());
        let tool = move || {
            let (release, called) = (release.clone(), called.clone());
            async move {
                called.notify_one();
                release.notified().await;
                axum::Json(json!({"output": "found"}))
            }
        };
        tool_endpoint(tool).await
    };
    app.tools = tools;
    app.spawn_worker(app.config());
    let run = app.submit(tool_run(&app, "lookup")).await;
    tokio::time::timeout(secs(15), called.notified()).await.expect("the tool was called");
    // While the tool runs, the model's output reaches the transcript and the
    // tool call its event.
    let committed = eventually("the output to be committed while the tool runs", secs(5), || async {
        let tx = app.store.transcript(TENANT, &run.id).await.ok()??;
        tx.iter().any(|e| e.item["type"] == "function_call").then_some(tx)
    })
    .await;
    assert!(
        committed.iter().all(|e| e.item["type"] != "function_call_output"),
        "the result came before the tool answered"
    );
    let events = app.store.read_events(&run.id, None, None, 50).await.unwrap();
    assert!(events.iter().any(|e| e.kind == "turn.tool_call"));
    release.notify_one();
    let done = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(done.status, RunStatus::Completed, "{:?}", done.error);
    let tx = app.store.transcript(TENANT, &run.id).await.unwrap().unwrap();
    let kinds: Vec<&str> = tx.iter().filter_map(|e| e.item["type"].as_str()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "function_call").count(), 1, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| **k == "function_call_output").count(), 1, "{kinds:?}");
    let events = app.store.read_events(&run.id, None, None, 50).await.unwrap();
    let calls = events.iter().filter(|e| e.kind == "turn.tool_call").count();
    assert_eq!(calls, 1, "the tool call was announced once");
    assert_eq!(app.mock.stats().requests, 2);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_takes_its_runs_next_turns_without_a_wake_up_token() {
    // A turn's commit queues the next turn with no token to wake another
    // worker: its own process fetches after it — at once when its every slot
    // is busy (one slot), and when idle (four slots) because the commit
    // kicks its fetcher out of its wait. Only the submit pushes a token, and
    // each run goes turn after turn without waiting for the safety net (a
    // minute here).
    for concurrency in [1, 4] {
        let mut app = App::start(MockConfig { tool_rounds: 3, ..MockConfig::default() }).await;
        let mut config = app.config();
        config.slots.concurrency = concurrency;
        config.queue.idle_ms = 60_000;
        app.spawn_worker(config);
        let run = app.submit(tool_run(&app, "lookup")).await;
        let done = app.wait_finished(&run.id, secs(20)).await;
        assert_eq!((done.status, done.turns_completed), (RunStatus::Completed, 4), "{:?}", done.error);
        let mut conn = app.redis.conn().await;
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
        let pushes = command_calls(&info, "lpush");
        assert_eq!(pushes, 1, "{concurrency} slots: wake-up tokens pushed: the submit's alone\n{info}");
        app.stop_workers().await;
    }
}

/// A scarce budget's line moves by its releases and its head's timer alone:
/// one worker process whose safety net is a minute (so no look of its own
/// moves anything) takes 16 runs that wait in line, every one completes, and
/// the wake-up tokens pushed after the submits are a few, not one a turn (a
/// release in a fetch or a commit wakes no other worker; a timer moved up is
/// watched by the process that moved it: the fetch's, or the commit's,
/// `Lease::watch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scarce_budgets_line_moves_with_no_safety_net_and_few_wake_up_tokens() {
    let app = App::start(MockConfig {
        tpm: 2_000,
        rpm: 10_000,
        window: Duration::from_secs(2),
        latency: Duration::from_millis(50),
        ..MockConfig::default()
    })
    .await;
    let _worker = app.worker_process(&["--concurrency", "8", "--queue-idle-ms", "60000", "--pacer", "shared"], "error");
    let runs = 16;
    let mut ids = vec![];
    for i in 0..runs {
        let body = json!({"model": "gpt-test", "input": format!("task {i} {}", "words ".repeat(200)), "max_output_tokens": 100});
        ids.push(app.submit(body).await.id);
    }
    let mut conn = app.redis.conn().await;
    let lpush = |info: &str| command_calls(info, "lpush");
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    let submitted = lpush(&info);
    for id in &ids {
        let run = app.wait_finished(id, secs(60)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    }
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    let pushed = lpush(&info) - submitted;
    let stats = app.mock.stats();
    eprintln!(
        "{runs} runs: {} calls, {} 429s; tokens pushed {submitted} by the submits, {pushed} after",
        stats.requests, stats.rate_limited
    );
    assert!(pushed <= 4, "{pushed} wake-up tokens pushed while {runs} turns were let go one by one");
}

/// A first turn cleared for fewer tokens than its worker counts (the API's
/// ask is its count of the body in the style it knows; here an ask of 5
/// tokens) gives the reservation back and asks for what it will send: the
/// pacer clears the worker's count too, not just the 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_turn_cleared_for_fewer_tokens_than_its_worker_counts_asks_again() {
    use shared::pacer::{Mode, PacingConfig, SharedPacer};
    let mut app = App::start(MockConfig::default()).await;
    app.spawn_worker(app.config());
    let policy = SubmitPolicy::default();
    let body = json!({"model": "gpt-test", "input": "word ".repeat(400), "max_output_tokens": 300});
    let spec = RunSpec::from_json(&body, &policy).expect("valid spec");
    let short = shared::runs::PacedAsk {
        model: "gpt-test".into(),
        provider: None,
        mode: Mode::Work,
        tenant: TENANT.into(),
        tokens: 5,
        requests: 1,
        output: 1,
    };
    let run = app.store.create(TENANT, &spec, None, Some(short)).await.unwrap().run;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let keys = shared::keys::Keys::new(app.prefix.clone());
    let pacer = SharedPacer::new(app.store.connection(), keys, "default", PacingConfig::default());
    let history = pacer.history("default", "gpt-test").await.unwrap();
    let cleared: u64 = history.admitted_tokens.iter().sum();
    // The fetch cleared the 5; the worker then asked for its own count: 400
    // words, the framing and the 300 reserved for output.
    assert!(cleared >= 5 + 700, "cleared {cleared} tokens: the worker called on the 5-token clearance");
    app.stop_workers().await;
}

/// A budget its worker never asked itself (every ask made by its fetch, each
/// owed a long wait) still counts as scarce to that worker: the fetch tells it
/// (`QueueBackend::on_held`), so the commits of the turns that do go ask the
/// pacer for their next turn there, which then waits from the commit on (its
/// `turn.paced` written with the turn's `turn.completed`, one stream entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_that_owed_a_turn_makes_its_workers_commits_ask_for_the_next_turn() {
    // No headers: the configured 3 000 tokens a minute pace from the first ask
    // (no probe, no short waits a worker would ask again for in place).
    let mut app = App::start(MockConfig {
        headers: HeaderStyle::None,
        tool_rounds: 1,
        latency: Duration::from_millis(20),
        ..MockConfig::default()
    })
    .await;
    let mut config = app.config();
    config.pacer.tpm = Some(3_000);
    app.spawn_worker(config);
    let ids = submit_tool_runs(&app, 8, |i| format!("task {i}: {}", "background ".repeat(150)), 200).await;
    // The first few clear at once; each one's commit asks for its next turn.
    let asked_at_commit = eventually("commits that put the next turn to wait", secs(20), || async {
        let mut n = 0;
        for id in &ids {
            let events = app.store.events(TENANT, id, None, None, 100).await.ok()??;
            let completed = events.iter().find(|e| e.kind == "turn.completed" && e.data["turn"] == 0);
            let paced = events.iter().find(|e| e.kind == "turn.paced" && e.data["turn"] == 1);
            if let (Some(c), Some(p)) = (completed, paced) {
                // One entry: turn.completed is `<entry>.<k>`, its last event the entry's id.
                n += usize::from(c.id.split('.').next() == Some(p.id.as_str()));
            }
        }
        (n >= 2).then_some(n)
    })
    .await;
    assert!(asked_at_commit >= 2);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_that_expired_while_redis_was_down_are_renewed_by_their_holders_not_taken_by_another_worker() {
    // Calls of 5 s, leases of 1 s: Redis down for 2.5 s in the middle of the calls, so every
    // lease has expired when it comes back. The first worker back must not take the
    // other's turns (their holder is alive): each turn is called once.
    let redis = paceline_tests::RedisServer::start_with(paceline_tests::RedisOptions {
        aof: true,
        ..paceline_tests::RedisOptions::default()
    });
    let mut app = App::start_on(redis, MockConfig { latency: Duration::from_secs(5), ..MockConfig::default() }).await;
    let workers: Vec<ChildGuard> =
        (0..2).map(|_| app.worker_process(&["--concurrency", "8", "--queue-lease-ms", "1000"], "warn")).collect();
    let mut ids = Vec::new();
    for i in 0..12 {
        ids.push(app.submit(json!({"model": "gpt-test", "input": format!("run {i}")})).await.id);
    }
    let mock = &app.mock;
    eventually("every call in flight", secs(20), || async move { (mock.stats().requests >= 12).then_some(()) }).await;
    app.redis.kill();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    app.redis.spawn();
    for id in &ids {
        let run = app.wait_finished(id, secs(40)).await;
        assert_eq!(run.status, RunStatus::Completed, "{:?}", run.error);
    }
    assert_eq!(app.mock.stats().requests, 12, "a turn whose lease expired while Redis was down was called again");
    drop(workers);
}
