//! The soak test (`--ignored`; about a minute, not for every CI run): 200 runs
//! of four turns through four worker processes while one of them is SIGKILLed
//! every 5 s (and replaced), one is SIGSTOPped past its lease and resumed, and
//! Redis (AOF) is restarted once. It reports lost and stuck runs, duplicated
//! transcript items and provider calls per committed turn (README, "What
//! survives what"):
//! `cargo build -p paceline && cargo test -p paceline-tests --test integration soak:: -- --ignored --nocapture`

use std::collections::HashSet;
use std::time::{Duration, Instant};

use mock_provider::MockConfig;
use paceline_tests::{RedisOptions, RedisServer};
use serde_json::json;

use crate::worker::{secs, App};

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
            workers[victim].0.kill().ok();
            workers[victim].0.wait().ok();
            workers[victim] = app.worker_process(&args, "error");
            kills += 1;
            next_kill = Instant::now() + secs(5);
        }
        if !stalled && started.elapsed() > secs(3) {
            // One stalls past its lease (2 s) and goes on.
            let pid = workers[3].0.id().to_string();
            std::process::Command::new("kill").args(["-STOP", &pid]).status().ok();
            tokio::time::sleep(secs(4)).await;
            std::process::Command::new("kill").args(["-CONT", &pid]).status().ok();
            stalled = true;
        }
        if !restarted && started.elapsed() > secs(8) {
            app.redis.restart();
            restarted = true;
        }
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
    let calls = app.mock.stats().requests;
    eprintln!(
        "soak: {} runs in {:.0} s, {kills} workers SIGKILLed, one SIGSTOPped 4 s, Redis restarted once: \
         {completed} completed, {} finished, lost {lost}, stuck {}, duplicated transcript items {duplicated}, \
         provider calls per committed turn {:.3} ({calls} calls, {turns} turns)",
        ids.len(),
        elapsed.as_secs_f64(),
        finished,
        ids.len() - finished,
        calls as f64 / turns.max(1) as f64
    );
    assert_eq!((lost, ids.len() - finished, duplicated), (0, 0, 0), "lost, stuck, duplicated");
    drop(workers);
}
