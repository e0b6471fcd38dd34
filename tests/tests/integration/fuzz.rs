//! An outside fuzzer against the API: schemathesis (PyPI) reads
//! `GET /v1/openapi.json` and sends what the document allows and what it does
//! not — its examples, its coverage of each bound, random fuzzing and stateful
//! sequences — to a real API process on a private Redis, with a tenant's token
//! and then the operator's. Not one answer may be a 5xx. `.ci/run` installs
//! schemathesis; without it the test says SKIPPED (and fails under
//! `PACELINE_CI=1`, where it must run).

use std::process::Command;
use std::time::Duration;

use api::config::ApiTokens;
use api::{ApiConfig, Application};
use paceline_tests::{unique_prefix, RedisServer};
use shared::config::RedisArgs;
use shared::runs::ToolEndpoints;

const TENANT: &str = "tok-fuzz-tenant-0123456789";
const OPERATOR: &str = "tok-fuzz-operator-0123456789";

/// The schemathesis command (program and its first arguments), when it is
/// installed: its `st` script, or the module where pip put no script on PATH.
fn schemathesis() -> Option<Vec<String>> {
    [vec!["st"], vec!["python3", "-m", "schemathesis.cli"]]
        .into_iter()
        .find(|c| Command::new(c[0]).args(&c[1..]).arg("--version").output().is_ok_and(|o| o.status.success()))
        .map(|c| c.into_iter().map(str::to_owned).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_with_a_tenants_token_or_the_operators() {
    let Some(st) = schemathesis() else {
        assert!(std::env::var("PACELINE_CI").is_err(), "schemathesis is not installed (pip install schemathesis)");
        eprintln!("SKIPPED fuzz test: schemathesis is not installed (pip install schemathesis)");
        return;
    };
    let redis = RedisServer::start();
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap(), RedisArgs::new(redis.url(), unique_prefix()));
    config.serve.tokens = ApiTokens::default().with("fuzz", TENANT);
    config.access.operator_token = Some(shared::config::Secret::new(OPERATOR));
    config.runs.tool_endpoints = ToolEndpoints::every_tenant(["http://127.0.0.1:9/tools"]);
    let app = Application::build(config).await.unwrap();
    let base = format!("http://{}", app.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    // A run of the tenant's, cancelled (so its event stream ends at once): the
    // routes that take a run id reach a real run, not only 404s.
    let http = reqwest::Client::new();
    let run: serde_json::Value = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth(TENANT)
        .json(&serde_json::json!({"model": "gpt-4.1-mini", "input": "fuzz"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = run["id"].as_str().unwrap().to_owned();
    let cancelled = http.post(format!("{base}/v1/runs/{id}/cancel")).bearer_auth(TENANT).send().await.unwrap();
    assert_eq!(cancelled.status(), 200);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(&config, format!("[parameters]\n\"path.id\" = \"{id}\"\n")).unwrap();
    for (who, token) in [("tenant", TENANT), ("operator", OPERATOR)] {
        // A run the tool itself broke in (its "ERRORS" section alone: CPython 3.11's
        // "AST constructor recursion depth mismatch" while Hypothesis describes a
        // recursive strategy, now and then under load) is run again, twice at most; a
        // failure of the API's ("FAILURES": a 5xx) fails the test at once.
        let mut tries = 0;
        loop {
            tries += 1;
            let (ok, text) = fuzz(&st, &config, &base, token).await;
            assert!(!text.contains("FAILURES"), "schemathesis with the {who}'s token found server errors:\n{text}");
            if ok {
                assert!(text.contains("passed"), "{text}");
                break;
            }
            assert!(tries < 3 && text.contains("Runtime Error"), "schemathesis with the {who}'s token failed:\n{text}");
            eprintln!("schemathesis broke on its own (not an answer of the API's); running it again:\n{text}");
        }
    }
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// One schemathesis run against `base` with `token`: whether it passed, and
/// what it printed.
async fn fuzz(st: &[String], config: &std::path::Path, base: &str, token: &str) -> (bool, String) {
    let (st, config, base, token) = (st.to_vec(), config.to_owned(), base.to_owned(), token.to_owned());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(&st[0])
            .args(&st[1..])
            .arg("--config-file")
            .arg(&config)
            .args(["run", &format!("{base}/v1/openapi.json"), "--checks", "not_a_server_error"])
            .args(["--max-examples", "25", "--request-timeout", "10", "--workers", "1"])
            .args(["--header", &format!("Authorization: Bearer {token}"), "--no-color"])
            .output()
            .expect("run schemathesis")
    })
    .await
    .unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}
