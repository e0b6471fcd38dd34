//! The soak test (`--ignored`; about a minute, not for every CI run): 200 runs
//! of four turns through four worker processes while one of them is SIGKILLed
//! every 5 s (and replaced), one is SIGSTOPped past its lease and resumed, and
//! Redis (AOF) is restarted once. It reports lost and stuck runs, duplicated
//! transcript items, provider calls per committed turn and recovery times
//! (README, "What survives what"):
//! `cargo build -p paceline && cargo test -p paceline-tests --test integration soak:: -- --ignored --nocapture`

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mock_provider::MockConfig;
use paceline_tests::{RedisOptions, RedisServer};
use serde_json::json;

use crate::fixtures::{secs, App};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a soak of about a minute: run it with --ignored"]
async fn two_hundred_runs_survive_killed_and_stalled_workers_and_a_redis_restart() {
    let redis = RedisServer::start_with(RedisOptions { aof: true, ..RedisOptions::default() });
    let mut app = App::start_on(
        redis,
        MockConfig {
            tpm: 1_000_000_000,
            rpm: 1_000_000_000,
            tool_rounds: 3,
            latency: Duration::from_millis(1_500),
            ..MockConfig::default()
        },
    )
    .await;
    let args = ["--concurrency", "8", "--queue-lease-ms", "2000"];
    let mut workers: Vec<_> = (0..4).map(|_| app.worker_process(&args, "error")).collect();
    let mut ids = vec![];
    for i in 0..200 {
        let body = json!({"model": "gpt-test", "input": format!("task {i}"),
            "tools": [{"type": "function", "name": "lookup", "description": "a tool",
                       "parameters": {"type": "object", "properties": {}}}],
            "tool_endpoint": app.tools, "max_turns": 10});
        ids.push(app.submit(body).await.id);
    }
    let started = Instant::now();
    let (mut kills, mut stalled, mut restarted) = (0, false, false);
    // When each disruption began (Unix ms, the clock Redis stamps events with).
    let mut disruptions: Vec<u64> = vec![];
    let mut next_kill = Instant::now() + secs(5);
    let finished = loop {
        let mut done = 0;
        for id in &ids {
            if app.store.get("default", id).await.ok().flatten().is_some_and(|r| r.status.is_finished()) {
                done += 1;
            }
        }
        if done == ids.len() || started.elapsed() > secs(240) {
            break done;
        }
        if Instant::now() >= next_kill {
            // One of the four, SIGKILLed mid-work, and replaced.
            let victim = kills % workers.len();
            disruptions.push(now_ms());
            workers[victim].0.kill().ok();
            workers[victim].0.wait().ok();
            workers[victim] = app.worker_process(&args, "error");
            kills += 1;
            next_kill = Instant::now() + secs(5);
        }
        if !stalled && started.elapsed() > secs(3) {
            // One stalls past its lease (2 s) and goes on.
            let pid = workers[3].0.id().to_string();
            disruptions.push(now_ms());
            std::process::Command::new("kill").args(["-STOP", &pid]).status().ok();
            tokio::time::sleep(secs(4)).await;
            std::process::Command::new("kill").args(["-CONT", &pid]).status().ok();
            stalled = true;
        }
        if !restarted && started.elapsed() > secs(8) {
            disruptions.push(now_ms());
            app.redis.restart();
            restarted = true;
        }
        // The soak's pace: it looks at the runs twice a second (bounded above at 240 s).
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let elapsed = started.elapsed();
    // Lost: no record; stuck: not finished; duplicated: a transcript item twice.
    let (mut lost, mut completed, mut duplicated, mut turns) = (0, 0, 0, 0u64);
    for id in &ids {
        let Some(run) = app.store.get("default", id).await.unwrap() else {
            lost += 1;
            continue;
        };
        if run.status == shared::runs::RunStatus::Completed {
            completed += 1;
        } else if let Some(e) = &run.error {
            eprintln!("soak: {id} ended {:?}: {} ({})", run.status, e.kind, e.message);
        }
        turns += u64::from(run.turns_completed);
        let tx = app.store.transcript("default", id).await.unwrap().unwrap_or_default();
        let mut seen = HashSet::new();
        for e in &tx {
            if !seen.insert(e.item.to_string() + &e.turn.to_string()) {
                duplicated += 1;
            }
        }
    }
    let mut recoveries = vec![];
    for id in &ids {
        let events = app.store.read_events(id, None, None, 100_000).await.unwrap();
        recoveries.extend(recovery_times(&events, &disruptions));
    }
    recoveries.sort_unstable();
    let pct = |q: f64| recoveries.get(((recoveries.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied();
    let calls = app.mock.stats().requests;
    eprintln!(
        "soak: {} runs in {:.0} s, {kills} workers SIGKILLed, one SIGSTOPped 4 s, Redis restarted once: \
         {completed} completed, {} finished, lost {lost}, stuck {}, duplicated transcript items {duplicated}, \
         provider calls per committed turn {:.3} ({calls} calls, {turns} turns); \
         {} interrupted turns restarted, recovery p50 {} ms, p99 {} ms, max {} ms",
        ids.len(),
        elapsed.as_secs_f64(),
        finished,
        ids.len() - finished,
        calls as f64 / turns.max(1) as f64,
        recoveries.len(),
        pct(0.5).unwrap_or(0),
        pct(0.99).unwrap_or(0),
        recoveries.last().copied().unwrap_or(0),
    );
    assert_eq!((lost, ids.len() - finished, duplicated), (0, 0, 0), "lost, stuck, duplicated");
    assert!(!recoveries.is_empty(), "the kills interrupted no turn: the soak measured nothing");
    // A killed holder's turn waits out its lease (2 s) and the fetch that
    // reclaims it; far beyond that is a turn the fleet forgot for a while.
    assert!(pct(0.99).unwrap() < 15_000, "recovery p99 {:?} ms", pct(0.99));
    drop(workers);
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// How long each interrupted turn took to run again: for every `turn.started`
/// that repeats a turn already started, the time from the latest disruption
/// since that earlier start (or from the earlier start itself, when none came
/// between) to the new start. Times are the events' stream ids (Redis ms).
fn recovery_times(events: &[shared::runs::RunEvent], disruptions: &[u64]) -> Vec<u64> {
    let mut started_at = std::collections::HashMap::new();
    let mut out = vec![];
    for e in events.iter().filter(|e| e.kind == shared::runs::state::event::TURN_STARTED) {
        let at: u64 = e.id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
        let turn = e.data["turn"].as_u64().unwrap_or(0);
        if let Some(before) = started_at.insert(turn, at) {
            let cause = disruptions.iter().copied().filter(|d| (before..=at).contains(d)).max().unwrap_or(before);
            out.push(at - cause);
        }
    }
    out
}
