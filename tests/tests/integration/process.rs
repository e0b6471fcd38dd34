//! `paceline worker` and `paceline api` as the processes an operator runs:
//! what `--help` shows of their environment, that no key is a flag, and that
//! SIGTERM and SIGINT each drain them and exit 0.

use std::process::{Command, Stdio};
use std::time::Duration;

use mock_provider::MockConfig;
use paceline_tests::{eventually, paceline_bin, unique_prefix, ChildGuard, RedisOptions, RedisServer};
use serde_json::{json, Value};
use shared::runs::RunStatus;

use crate::fixtures::{secs, App};

/// Secrets an operator's environment holds, each with a canary to look for.
const SECRET_ENV: [(&str, &str); 6] = [
    ("REDIS_URL", "redis://:hunter2@cache.internal:6379"),
    ("OPENAI_API_KEY", "sk-canary-hunter3"),
    ("ANTHROPIC_API_KEY", "sk-ant-canary-hunter4"),
    ("PACELINE_TOOL_SECRET", "canary-hunter5"),
    ("PACELINE_API_TOKENS", "acme:canary-hunter6"),
    ("PACELINE_OPERATOR_TOKEN", "canary-hunter7"),
];

#[test]
fn help_never_shows_a_redis_password_or_a_key() {
    for args in [&["worker", "--help"][..], &["api", "--help"], &["up", "--help"], &["--help"]] {
        let out = Command::new(paceline_bin()).args(args).envs(SECRET_ENV).output().expect("run paceline --help");
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!text.contains("hunter"), "{args:?} shows a secret:\n{text}");
        if args[0] != "--help" {
            assert!(text.contains("REDIS_URL"), "{args:?} still names the variable:\n{text}");
        }
    }
}

#[test]
fn no_key_is_accepted_as_a_flag() {
    for flag in ["--api-key", "--anthropic-api-key", "--tool-secret"] {
        let out = Command::new(paceline_bin())
            .args(["worker", flag, "sk-canary"])
            .env("REDIS_URL", "redis://127.0.0.1:1")
            .stdin(Stdio::null())
            .output()
            .expect("run paceline worker");
        assert!(!out.status.success(), "{flag} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("unexpected argument"), "{flag}: {stderr}");
    }
}

#[test]
fn no_redis_url_or_api_token_is_accepted_as_a_flag() {
    let commands: [(&str, &[&str]); 5] = [
        ("api", &["--redis-url", "--api-tokens", "--operator-token"]),
        ("worker", &["--redis-url"]),
        ("up", &["--redis-url", "--api-tokens", "--operator-token"]),
        // The CLI client's tokens too.
        ("dead", &["--token", "--operator-token"]),
        ("runs", &["--token", "--operator-token"]),
    ];
    for (command, flags) in commands {
        for flag in flags {
            let value = if *flag == "--redis-url" { "redis://:hunter2@127.0.0.1:1" } else { "acme:canary-token" };
            // Everything else as it should be, so only the flag is at fault.
            let listen: &[&str] = if matches!(command, "api" | "up") { &["--listen", "127.0.0.1:0"] } else { &[] };
            let (status, stderr) =
                exit_and_stderr(Command::new(paceline_bin()).arg(command).args(listen).args([*flag, value]), secs(10));
            assert!(status.is_some_and(|s| !s.success()), "{command} {flag} was accepted");
            assert!(stderr.contains("unexpected argument"), "{command} {flag}: {stderr}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_url_and_the_api_tokens_may_come_from_files_named_in_the_environment() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{text}\n")).unwrap();
        path
    };
    let port = paceline_tests::free_tcp_port();
    let base = format!("http://127.0.0.1:{port}");
    let prefix = unique_prefix();
    let _api = ChildGuard(
        Command::new(paceline_bin())
            .args(["api", "--listen", &format!("127.0.0.1:{port}"), "--prefix", &prefix])
            .env_remove("REDIS_URL")
            .env_remove("PACELINE_API_TOKENS")
            .env_remove("PACELINE_OPERATOR_TOKEN")
            .env("REDIS_URL_FILE", file("redis_url", &redis.url()))
            .env("PACELINE_API_TOKENS_FILE", file("tokens", "acme:file-token-1"))
            .env("PACELINE_OPERATOR_TOKEN_FILE", file("operator", "file-operator-token"))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start paceline api"),
    );
    let http = reqwest::Client::new();
    let status = |path: &'static str, token: Option<&'static str>| {
        let mut request = http.get(format!("{base}{path}"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move { request.send().await.map_or(0, |r| r.status().as_u16()) }
    };
    eventually("the API to reach the Redis its file names", secs(15), || async {
        (status("/readyz", None).await == 200).then_some(())
    })
    .await;
    assert_eq!(status("/v1/queue", Some("file-token-1")).await, 200, "the tenant's token from its file");
    assert_eq!(status("/v1/queue", None).await, 401, "not open mode");
    assert_eq!(status("/v1/workers", Some("file-operator-token")).await, 200, "the operator's token from its file");
    assert_eq!(status("/v1/workers", Some("file-token-1")).await, 403);
    // The run lands in the Redis the file names (not one on the default address).
    let submitted = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth("file-token-1")
        .json(&json!({"model": "gpt-test", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(submitted.status(), 202);
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("{prefix}*")).query_async(&mut redis.conn().await).await.unwrap();
    assert!(!keys.is_empty(), "nothing written to the Redis of REDIS_URL_FILE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_drains_its_turn_and_exits_0_on_sigterm_and_on_sigint() {
    for signal in ["TERM", "INT"] {
        // The provider takes 1.5 s to answer: the signal comes with the call in flight.
        let mock = MockConfig { tool_rounds: 0, latency: Duration::from_millis(1_500), ..MockConfig::default() };
        let app = App::start(mock).await;
        let mut child = app.worker_process(&[], "warn");
        let run = app.submit(json!({"model": "gpt-test", "input": "x"})).await;
        eventually("the provider call to be in flight", secs(15), || async {
            (app.mock.stats().requests >= 1).then_some(())
        })
        .await;

        child.signal(signal);
        let status = child.wait_timeout(secs(15)).unwrap_or_else(|| panic!("no exit within 15 s of SIG{signal}"));
        assert!(status.success(), "SIG{signal}: exit status {status:?}");
        let run = app.store.get("default", &run.id).await.unwrap().unwrap();
        assert_eq!(run.status, RunStatus::Completed, "SIG{signal}: the turn in flight finished within the grace");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_process_with_an_open_event_stream_exits_0_on_sigterm_and_on_sigint() {
    for signal in ["TERM", "INT"] {
        let redis = RedisServer::start();
        let port = paceline_tests::free_tcp_port();
        let base = format!("http://127.0.0.1:{port}");
        let mut child = ChildGuard(
            Command::new(paceline_bin())
                .args(["api", "--listen", &format!("127.0.0.1:{port}"), "--prefix", &unique_prefix()])
                .env("REDIS_URL", redis.url())
                .env_remove("PACELINE_API_TOKENS")
                .env_remove("PACELINE_OPERATOR_TOKEN")
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .expect("start paceline api"),
        );
        let http = reqwest::Client::new();
        eventually("the API to answer /readyz", secs(15), || async {
            let resp = http.get(format!("{base}/readyz")).send().await.ok()?;
            resp.status().is_success().then_some(())
        })
        .await;
        // A run no worker takes, and a client following its events: the stream stays open.
        let run: Value = http
            .post(format!("{base}/v1/runs"))
            .json(&json!({"model": "gpt-test", "input": "x"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = run["id"].as_str().expect("a run id");
        let stream = http.get(format!("{base}/v1/runs/{id}/events")).send().await.unwrap();
        assert_eq!(stream.status(), 200);

        child.signal(signal);
        let status = child.wait_timeout(secs(10)).unwrap_or_else(|| panic!("no exit within 10 s of SIG{signal}"));
        assert!(status.success(), "SIG{signal}: exit status {status:?}");
        drop(stream);
    }
}

#[test]
fn api_worker_and_up_each_refuse_a_redis_that_evicts_keys_naming_its_policy() {
    let redis = RedisServer::start_with(RedisOptions {
        extra_args: vec!["--maxmemory-policy".into(), "allkeys-lru".into()],
        ..RedisOptions::default()
    });
    for args in [&["api", "--listen", "127.0.0.1:0"][..], &["worker"], &["up", "--listen", "127.0.0.1:0"]] {
        let (status, stderr) = exit_and_stderr(
            Command::new(paceline_bin())
                .args(args)
                .env("REDIS_URL", redis.url())
                .env_remove("PACELINE_API_TOKENS")
                .env("RUST_LOG", "warn"),
            secs(20),
        );
        assert!(status.is_some(), "{args:?} kept running on an evicting Redis");
        assert!(!status.unwrap().success(), "{args:?} exited 0: {stderr}");
        assert!(stderr.contains("maxmemory-policy allkeys-lru"), "{args:?} does not name the policy: {stderr}");
    }
}

/// Runs `cmd` (on a prefix of its own, no stdin or stdout) until it exits or
/// `timeout` passes: its exit status (`None`: still running, then killed) and
/// what it wrote to stderr.
fn exit_and_stderr(cmd: &mut Command, timeout: Duration) -> (Option<std::process::ExitStatus>, String) {
    let mut child = ChildGuard(
        cmd.env("PACELINE_PREFIX", unique_prefix())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run paceline"),
    );
    let status = child.wait_timeout(timeout);
    if status.is_none() {
        let _ = child.0.kill();
    }
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}
