//! Dead turns (README, "Dead turns and retries"): a turn that used its deliveries ends its run
//! `failed`/`dead_lettered`, the operator lists it in `GET /v1/dead` (a tenant
//! may not), and `POST /v1/runs/{id}/retry` re-drives the run from its last
//! committed turn to completion against the mock provider; the dead set keeps
//! its retention and pages newest first.

use std::time::Duration;

use mock_provider::MockConfig;
use paceline_tests::{eventually, unique_prefix, within, RedisServer};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::queue::{QueueConfig, TurnQueue};
use shared::runs::{Fence, Next, TurnJob, Usage};
use tokio::sync::oneshot;

use crate::fixtures::{secs, App};

const ACME: &str = "tok-acme-dead-0123456789";
const BETA: &str = "tok-beta-dead-9876543210";
const OPERATOR: &str = "tok-operator-dead-5555555";

/// The API on `app`'s Redis and prefix, with tenants `acme` and `beta` and the operator.
struct Api {
    url: String,
    http: reqwest::Client,
    _stop: oneshot::Sender<()>,
}

impl Api {
    async fn start(app: &App) -> Self {
        let (url, stop) = app.tenant_api(&[("acme", ACME), ("beta", BETA)], OPERATOR).await;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
        Self { url, http, _stop: stop }
    }

    async fn call(&self, method: reqwest::Method, path: &str, token: &str, body: Option<&Value>) -> (u16, Value) {
        let mut r = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(token);
        if let Some(b) = body {
            r = r.json(b);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, token, None).await
    }

    async fn post(&self, path: &str, token: &str) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, token, None).await
    }

    /// `paceline ARGS` against this API with `env`: (exit code, stdout, stderr).
    async fn cli(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
        let out = within(
            &format!("paceline {args:?}"),
            Duration::from_secs(30),
            tokio::process::Command::new(paceline_tests::paceline_bin())
                .args(args)
                .env("PACELINE_API", &self.url)
                .env_remove("PACELINE_TOKEN")
                .env_remove("PACELINE_OPERATOR_TOKEN")
                .envs(env.iter().copied())
                .env_remove("RUST_LOG")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("run paceline");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
    }
}

#[tokio::test]
async fn a_dead_lettered_run_is_listed_for_the_operator_and_completes_after_a_retry() {
    let mut app = App::start(MockConfig { tool_rounds: 0, output_tokens: 8, ..MockConfig::default() }).await;
    let api = Api::start(&app).await;
    let (status, run) = api
        .call(
            reqwest::Method::POST,
            "/v1/runs",
            ACME,
            Some(&json!({"model": "gpt-test", "input": "two steps", "max_turns": 5})),
        )
        .await;
    assert_eq!(status, 202, "{run}");
    let id = run["id"].as_str().unwrap().to_owned();

    // Turn 0 commits (played here as a worker would), so turn 1 is queued.
    let queue =
        shared::runs::run_queue(&RedisArgs::new(app.redis.url(), app.prefix.clone()), QueueConfig::default()).unwrap();
    let lease = queue.fetch("by-hand", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    assert_eq!(app.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let step =
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "step one"}]});
    let committed = app.store.commit(&lease, job, &[step], Usage::default(), &Next::Continue).await.unwrap();
    assert_eq!(committed, Fence::Ok);

    // Then its spec becomes unreadable (a record this version cannot read):
    // each delivery of turn 1 fails until its deliveries are spent.
    let mut conn = app.redis.conn().await;
    let key = shared::keys::Keys::new(app.prefix.clone()).run_record(&id);
    let spec: String = redis::cmd("HGET").arg(&key).arg("spec").query_async(&mut conn).await.unwrap();
    let () = redis::cmd("HSET").arg(&key).arg("spec").arg("{not a spec").query_async(&mut conn).await.unwrap();
    let mut config = app.config();
    config.queue.retry_base_ms = 20;
    app.spawn_worker(config);
    let failed = eventually("the run to fail dead-lettered", secs(20), || async {
        let (_, r) = api.get(&format!("/v1/runs/{id}"), ACME).await;
        (r["status"] == "failed").then_some(r)
    })
    .await;
    assert_eq!(failed["error"]["kind"], "dead_lettered", "{failed}");
    assert_eq!(failed["turns_completed"], 1, "{failed}");

    // The operator lists it; a tenant may not; the tenant's counts show it.
    let (status, dead) = api.get("/v1/dead", OPERATOR).await;
    assert_eq!(status, 200, "{dead}");
    let d0 = &dead["data"][0];
    assert_eq!(
        (d0["run_id"].as_str(), d0["tenant"].as_str(), d0["turn"].as_u64()),
        (Some(&*id), Some("acme"), Some(1))
    );
    assert!(d0["reason"].as_str().is_some_and(|r| !r.is_empty()), "{dead}");
    assert!(d0["died_at"].is_string());
    assert_eq!(dead["has_more"], false);
    let (status, body) = api.get("/v1/dead", ACME).await;
    assert_eq!((status, body["error"]["type"].as_str()), (403, Some("forbidden")), "{body}");
    let (_, q) = api.get("/v1/queue", ACME).await;
    assert_eq!(q["dead"], 1, "{q}");
    let (_, q) = api.get("/v1/queue", BETA).await;
    assert_eq!(q["dead"], 0, "{q}");

    // The CLI: `paceline dead` with the operator's token shows it in a table.
    let (code, out, err) = api.cli(&["dead"], &[("PACELINE_OPERATOR_TOKEN", OPERATOR)]).await;
    assert_eq!(code, 0, "{err}");
    let row = out.lines().find(|l| l.contains(&id)).unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("acme"), "{out}");
    let (code, _, err) = api.cli(&["dead"], &[("PACELINE_TOKEN", ACME)]).await;
    assert!(code != 0 && err.contains("API 403 forbidden"), "{err}");

    // Another tenant's run is not found; the spec fixed, its tenant re-drives it.
    let (status, _) = api.post(&format!("/v1/runs/{id}/retry"), BETA).await;
    assert_eq!(status, 404);
    let (code, _, err) = api.cli(&["retry", &id], &[("PACELINE_TOKEN", BETA)]).await;
    assert!(code != 0 && err.contains("API 404 not_found"), "{err}");
    let () = redis::cmd("HSET").arg(&key).arg("spec").arg(&spec).query_async(&mut conn).await.unwrap();
    let (status, retried) = api.post(&format!("/v1/runs/{id}/retry"), ACME).await;
    assert_eq!(status, 202, "{retried}");
    assert_eq!((retried["status"].as_str(), &retried["error"]), (Some("queued"), &Value::Null), "{retried}");
    assert_eq!(retried["finished_at"], Value::Null);
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
    assert_eq!(ttl, -1, "the retention is cancelled");
    let (_, dead) = api.get("/v1/dead", OPERATOR).await;
    assert_eq!(dead["data"], json!([]), "{dead}");

    let done = eventually("the retried run to complete", secs(20), || async {
        let (_, r) = api.get(&format!("/v1/runs/{id}"), ACME).await;
        (r["status"] == "completed").then_some(r)
    })
    .await;
    assert_eq!(done["turns_completed"], 2, "it went on from its last committed turn: {done}");
    let (_, tx) = api.get(&format!("/v1/runs/{id}/transcript"), ACME).await;
    let steps = tx["items"].as_array().unwrap().iter().filter(|i| i.to_string().contains("step one")).count();
    assert_eq!(steps, 1, "{tx}");
    let kinds: Vec<String> =
        app.store.events("acme", &id, None, None, 100).await.unwrap().unwrap().into_iter().map(|e| e.kind).collect();
    let at = |k: &str| kinds.iter().rposition(|x| x == k).unwrap_or_else(|| panic!("no {k} in {kinds:?}"));
    assert!(at("run.failed") < at("run.queued") && at("run.queued") < at("run.completed"), "{kinds:?}");

    // A completed run is not retried; the operator may retry any tenant's run.
    let (status, body) = api.post(&format!("/v1/runs/{id}/retry"), OPERATOR).await;
    assert_eq!((status, body["error"]["type"].as_str()), (409, Some("conflict")), "{body}");
    let (code, _, err) = api.cli(&["retry", &id], &[("PACELINE_TOKEN", ACME)]).await;
    assert!(code != 0 && err.contains("API 409 conflict"), "{err}");
    app.stop_workers().await;
}

/// The dead set keeps its retention (older dead turns leave it when another
/// is buried, records and all) and pages newest first with a cursor.
#[tokio::test]
async fn the_dead_set_keeps_its_retention_and_pages_newest_first() {
    let redis = RedisServer::start();
    let args = RedisArgs::new(redis.url(), unique_prefix());
    let bury = |q: TurnQueue, id: &'static str| async move {
        q.enqueue(id, &json!({"turn": 0, "attempt": 1}), 0).await.unwrap();
        let lease = q.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
        q.dead(&lease, "poison").await.unwrap();
    };
    let kept = shared::runs::run_queue(&args, QueueConfig::default()).unwrap();
    for id in ["run_a", "run_b", "run_c"] {
        bury(kept.clone(), id).await;
        // Each dies in its own millisecond, so the order is by time, not by id.
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let page = kept.list_dead_page(2, None).await.unwrap();
    let ids: Vec<&str> = page.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["run_c", "run_b"]);
    let last = &page[1];
    let rest = kept.list_dead_page(2, Some((last.died_at_ms, &last.id))).await.unwrap();
    assert_eq!(rest.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["run_a"]);

    // A 50 ms retention: the next bury trims the three older ones (the sleep
    // makes them older than it).
    tokio::time::sleep(Duration::from_millis(80)).await;
    let short =
        shared::runs::run_queue(&args, QueueConfig { dead_retention_ms: 50, ..QueueConfig::default() }).unwrap();
    bury(short.clone(), "run_d").await;
    let left: Vec<String> = short.list_dead(10).await.unwrap().into_iter().map(|d| d.id).collect();
    assert_eq!(left, ["run_d"]);
    assert!(short.payload::<Value>("run_a").await.unwrap().is_none(), "a trimmed turn's record goes too");
    assert_eq!(short.counts().await.unwrap().dead, 1);
}
