//! `paceline bench` through the real binary, tiny (seconds), so the command
//! cannot rot: the JSON has every field README's "The pacing benchmark"
//! reports, and every run completes under the shared pacer. The bucket is
//! small enough (3 000 tokens per 2 s) that turns wait for budget, so the
//! pacing path runs too. The fairness scenario likewise, tiny: its JSON has
//! the fairness figures (companion waits, efficiency, shares, Jain's index,
//! the 2:1 ratio); the backlog scenario's, its per-turn and long-call
//! figures.

use paceline_tests::paceline_bin;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// Runs `paceline ARGS` in `dir` to its end (bounded: a bench that hangs
/// fails here instead of holding up CI), its output going to files there, not
/// to pipes nobody reads while it runs; answers its exit status, its stdout
/// and its stderr.
fn run_to_end(dir: &Path, args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let started = Instant::now();
    let mut child = std::process::Command::new(paceline_bin())
        .args(args)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("start paceline");
    let limit = Duration::from_secs(180);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("paceline {args:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    (status, read(&out), read(&err))
}

/// A tiny pacing trial: 2 workers of 4 slots, 6 runs of 2 turns, 3 000 tokens a 2-s window.
const TINY: &[&str] = &[
    "bench",
    "--workers",
    "2",
    "--concurrency",
    "4",
    "--runs",
    "6",
    "--turns",
    "2",
    "--window-s",
    "2",
    "--tpm",
    "3000",
];

/// `args` with each flag's value replaced (or the flag and value added).
fn with_values<'a>(args: &[&'a str], values: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    let mut out = args.to_vec();
    for (flag, value) in values {
        match out.iter().position(|a| a == flag) {
            Some(at) => out[at + 1] = value,
            None => out.extend([*flag, *value]),
        }
    }
    out
}

const PACER_FIELDS: &[&str] = &[
    "makespan_s",
    "floor_s",
    "efficiency",
    "calls",
    "rate_limited",
    "rate_limited_per_100_calls",
    "tokens_per_min",
    "limit_tokens_per_min",
    "lateness_ms",
    "redis_commands_per_turn",
    "worker_peak_rss_mb",
];

#[test]
fn a_tiny_bench_writes_every_spec_field_and_completes_every_shared_run() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let json_path = json.display().to_string();
    let args = [
        TINY,
        &["--pacer", "shared,off", "--throughput-runs", "20", "--throughput-turns", "3", "--queue-turns", "500"][..],
        &["--json", json_path.as_str()][..],
    ]
    .concat();
    let (status, stdout, stderr) = run_to_end(dir.path(), &args);
    assert!(status.success(), "bench failed: {status}\n{stdout}\n{stderr}");
    assert!(stdout.contains("efficiency"), "the table is printed: {stdout}");

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for field in ["workers", "concurrency", "tpm", "window_s", "bucket", "runs", "turns"] {
        assert!(!report["config"][field].is_null(), "config.{field} missing: {report:#}");
    }
    assert_eq!(report["config"]["workers"], 2);
    assert_eq!(report["config"]["bucket"], "continuous");
    for pacer in ["shared", "off"] {
        let p = &report["pacers"][pacer];
        for field in PACER_FIELDS {
            assert!(p[field].is_number() || p[field].is_object(), "pacers.{pacer}.{field} missing: {p:#}");
        }
        for q in ["p50", "p99"] {
            assert!(p["lateness_ms"][q].is_number(), "pacers.{pacer}.lateness_ms.{q} missing: {p:#}");
        }
        assert!(p["calls"].as_u64().unwrap() >= 12, "6 runs x 2 turns call the provider at least 12 times: {p:#}");
        assert!(p["makespan_s"].as_f64().unwrap() > 0.0);
    }
    let shared = &report["pacers"]["shared"];
    assert_eq!(shared["runs_completed"], 6, "every run completes under the shared pacer: {shared:#}");
    assert_eq!(shared["runs_failed"], 0, "{shared:#}");
    assert!(report["pacers"]["local"].is_null(), "only the pacers asked for are measured");
    let t = &report["throughput"];
    assert!(t["turns_per_s"].as_f64().unwrap() > 0.0, "{t:#}");
    assert!(t["redis_commands_per_turn"].as_f64().unwrap() > 0.0, "{t:#}");
    assert_eq!(t["turns"], 60, "20 runs x 3 turns: {t:#}");
}

/// `--redis-cluster 3`, tiny: the trial runs on a local 3 + 3 cluster (its
/// workers given only `PACELINE_REDIS_CLUSTER_NODES`), every run completes,
/// and the Redis figures are read from the primary of the trial's slot.
#[test]
fn a_tiny_bench_on_a_local_cluster_completes_every_run_and_counts_its_primarys_commands() {
    if !paceline_tests::cluster_supported() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let json_path = json.display().to_string();
    let args = [TINY, &["--redis-cluster", "3", "--pacer", "shared", "--json", json_path.as_str()]].concat();
    let (status, stdout, stderr) = run_to_end(dir.path(), &args);
    assert!(status.success(), "bench failed: {status}\n{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let shared = &report["pacers"]["shared"];
    assert_eq!(shared["runs_completed"], 6, "{shared:#}");
    assert!(shared["redis_commands_per_turn"].as_f64().unwrap() > 5.0, "the slot's primary did the work: {shared:#}");
}

/// `--scenario fairness`, tiny: the JSON has the fairness figures (the
/// targets are the real bench's business, not a few-second run's).
#[test]
fn a_tiny_fairness_bench_writes_its_fields() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fairness.json");
    let json_path = json.display().to_string();
    let args = [
        &[
            "bench",
            "--scenario",
            "fairness",
            "--workers",
            "2",
            "--concurrency",
            "4",
            "--window-s",
            "2",
            "--tpm",
            "3000",
        ][..],
        &[
            "--turns",
            "2",
            "--live-work-runs",
            "6",
            "--companions",
            "2",
            "--companion-start-s",
            "0.5",
            "--companion-gap-s",
            "0.5",
        ][..],
        &[
            "--share-runs",
            "4,1,1,1",
            "--weighted-runs",
            "2",
            "--share-turns",
            "3",
            "--share-skip-s",
            "0.5",
            "--timeout-s",
            "60",
        ][..],
        &["--json", json_path.as_str()][..],
    ]
    .concat();
    let (status, stdout, stderr) = run_to_end(dir.path(), &args);
    assert!(status.success(), "bench failed: {status}\n{stdout}\n{stderr}");
    assert!(stdout.contains("Jain"), "the table is printed: {stdout}");

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for field in ["workers", "concurrency", "tpm", "window_s", "share_runs", "tenant_weights"] {
        assert!(!report["config"][field].is_null(), "config.{field} missing: {report:#}");
    }
    let f = &report["fairness"];
    for field in ["p50_ms", "p95_ms", "max_ms", "n"] {
        assert!(f["companion"][field].is_number(), "fairness.companion.{field} missing: {f:#}");
    }
    assert_eq!(f["companion"]["n"], 2, "both companion runs reached the provider: {f:#}");
    assert!(f["work_efficiency"].is_number(), "{f:#}");
    assert!(f["jain"].is_number(), "{f:#}");
    for tenant in ["a", "b", "c", "d"] {
        assert!(f["tenants"][tenant].is_number(), "fairness.tenants.{tenant} missing: {f:#}");
    }
    assert!(f["weights_2_1"]["ratio"].is_number(), "{f:#}");
    for tenant in ["a", "b"] {
        assert!(f["weights_2_1"]["shares"][tenant].is_number(), "fairness.weights_2_1.shares.{tenant} missing: {f:#}");
    }
}

/// `--scenario long-runs`, tiny (2 runs of 20 turns per trial, a roomy
/// budget): the JSON has each shape's figures with caching on and off, and
/// caching on reads most of the input from the cache on both.
#[test]
fn a_tiny_long_runs_bench_reads_most_of_its_input_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("long.json");
    let json_path = json.display().to_string();
    let args = [
        "bench",
        "--scenario",
        "long-runs",
        "--workers",
        "1",
        "--concurrency",
        "4",
        "--long-run-count",
        "2",
        "--latency-ms",
        "20",
        "--long-run-tpm",
        "2000000",
        "--json",
        json_path.as_str(),
    ];
    let (status, stdout, stderr) = run_to_end(dir.path(), &args);
    assert!(status.success(), "{stdout}\n{stderr}");
    let out: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for shape in ["anthropic", "openai"] {
        let (on, off) = (&out["long_runs"][shape]["cache_on"], &out["long_runs"][shape]["cache_off"]);
        for f in [on, off] {
            assert_eq!(f["runs_completed"], 2, "{shape}: {f}");
            assert_eq!(f["rate_limited"], 0, "{shape}: {f}");
            for field in ["work_tokens_per_min", "cached_share", "cost_per_run_usd", "makespan_s", "input_tokens"] {
                assert!(f[field].is_number(), "{shape}: {field} missing in {f}");
            }
        }
        assert!(on["cached_share"].as_f64().unwrap() > 0.6, "{shape}: {on}");
    }
    // Anthropic caches only what is marked: off reads nothing, and pays for it.
    let (on, off) = (&out["long_runs"]["anthropic"]["cache_on"], &out["long_runs"]["anthropic"]["cache_off"]);
    assert_eq!(off["cached_share"].as_f64(), Some(0.0), "{off}");
    assert!(
        on["cost_per_run_usd"].as_f64().unwrap() < off["cost_per_run_usd"].as_f64().unwrap() / 2.0,
        "{on} vs {off}"
    );
    assert!(stdout.contains("anthropic bars:") && stdout.contains("openai bars:"), "{stdout}");
}

#[test]
fn a_bench_stopped_by_a_signal_ends_its_redis_and_its_workers() {
    // A bench is often stopped from outside (a timeout, `kill`), not only by a
    // terminal's Ctrl-C that reaches its children too: its private Redis and
    // worker processes must not outlive it.
    let dir = tempfile::tempdir().unwrap();
    // TINY's trial, made long enough to be stopped in the middle.
    let args = with_values(TINY, &[("--runs", "400"), ("--turns", "5"), ("--pacer", "shared")]);
    let mut bench = std::process::Command::new(paceline_bin())
        .args(&args)
        .stdout(std::fs::File::create(dir.path().join("stdout")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
        .spawn()
        .expect("start paceline bench");
    let children = |parent: u32| -> Vec<u32> {
        let mut found = vec![];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
            let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
            let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|v| v.trim().parse::<u32>().ok());
            if ppid == Some(parent) {
                found.push(pid);
            }
        }
        found
    };
    // Its Redis and its two workers (and the mock's, if any) are up.
    let started = Instant::now();
    let spawned = loop {
        let now = children(bench.id());
        if now.len() >= 3 {
            break now;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the bench started {} processes", now.len());
        assert!(bench.try_wait().unwrap().is_none(), "the bench ended before its trial ran");
        std::thread::sleep(Duration::from_millis(100));
    };
    let killed = std::process::Command::new("kill").arg("-TERM").arg(bench.id().to_string()).status().unwrap();
    assert!(killed.success());
    let status = bench.wait().unwrap();
    assert!(!status.success(), "a stopped bench says it did not finish");
    let alive = |pid: &u32| {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map(|s| !s.lines().any(|l| l.starts_with("State:") && l.contains("zombie")))
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while spawned.iter().any(alive) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let left: Vec<&u32> = spawned.iter().filter(|p| alive(p)).collect();
    for pid in &left {
        let _ = std::process::Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
    }
    assert!(left.is_empty(), "processes of the bench still running after it was stopped: {left:?}");
}

/// `--scenario backlog`, tiny: a backlog of 12 one-turn runs against a
/// 3 000-token 2-s bucket, then 8 calls of 4 s in flight at once. The JSON
/// has the backlog's per-turn figures and the long calls' steady figures —
/// among them each command's time a call while the calls were in flight,
/// where the workers' beats (scripts) ran.
#[test]
fn a_tiny_backlog_bench_writes_its_fields_and_times_the_beats_of_calls_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("backlog.json");
    let json_path = json.display().to_string();
    // (TINY's fleet and bucket; the scenario makes its own one-turn runs.)
    let args = with_values(
        TINY,
        &[
            ("--scenario", "backlog"),
            ("--backlog-sizes", "12"),
            ("--timeout-s", "8"),
            ("--long-calls", "4x8"),
            ("--json", json_path.as_str()),
        ],
    );
    let (status, stdout, stderr) = run_to_end(dir.path(), &args);
    assert!(status.success(), "{stdout}\n{stderr}");
    let out: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let backlog = &out["backlog"]["12"];
    assert!(backlog["admitted_turns"].as_u64().unwrap() > 0, "{backlog}");
    for field in ["budget_waits_per_turn", "redis_commands_per_turn", "redis_cpu_ms_per_turn", "efficiency"] {
        assert!(backlog[field].is_number(), "{field} missing in {backlog}");
    }
    let long = &out["long_calls"][0];
    assert_eq!(long["calls"], 8, "{long}");
    assert!(long["steady_calls"].as_u64().unwrap() >= 7, "nearly all in flight at once: {long}");
    assert!(long["steady_cpu_ms_per_call_second"].is_number(), "{long}");
    // The beats' time the calls add: more than none, and per call-second.
    let scripts = long["steady_script_ms_per_call_second"].as_f64().unwrap();
    assert!(scripts > 0.0 && scripts < 10.0, "{long}");
    let beat = long["steady_us_per_call"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row[0] == "evalsha")
        .unwrap_or_else(|| panic!("no script timed while the calls were in flight: {long}"));
    // A time a call, not the window's sum or the server's total: a beat of
    // four leases takes well under 100 ms.
    let us = beat[1].as_f64().unwrap();
    assert!(us > 0.0 && us < 100_000.0, "{beat}");
    assert!(stdout.contains("time a call then: "), "{stdout}");
}
