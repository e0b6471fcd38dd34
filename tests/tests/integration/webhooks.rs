//! Completion webhooks (README, "Webhooks"): a run's end enqueues one event,
//! workers deliver it signed by the Standard Webhooks scheme, retry it with
//! the same `webhook-id`, stop at a 410, and lose none to a killed worker.
//! The signatures are checked by an outside verifier: the `standardwebhooks`
//! package from PyPI (without it the test says SKIPPED, and fails under
//! `PACELINE_CI=1`, where `.ci/run` installs it).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use mock_provider::MockConfig;
use paceline_tests::poll_until;
use serde_json::{json, Value};
use shared::config::Secret;
use shared::runs::{RunStatus, ToolEndpoints};
use worker::config::KeySource;
use worker::webhooks::WEBHOOK_SECRET_ENV;

use crate::fixtures::{secs, serve, tool_run, App, TENANT};

/// The Standard Webhooks test secret (24 bytes).
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// One request the receiver took.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    headers: BTreeMap<String, String>,
    body: String,
}

/// A webhook receiver: records every request, answers each path from its
/// script of statuses (200 once it runs out), and holds every answer while
/// `hold` is set.
#[derive(Clone, Default)]
struct Receiver {
    seen: Arc<Mutex<Vec<Seen>>>,
    answers: Arc<Mutex<HashMap<String, VecDeque<u16>>>>,
    hold: Arc<AtomicBool>,
}

impl Receiver {
    fn answering(self, path: &str, statuses: &[u16]) -> Self {
        self.answers.lock().unwrap().insert(path.to_owned(), statuses.iter().copied().collect());
        self
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn router(&self) -> axum::Router {
        async fn receive(State(r): State<Receiver>, uri: Uri, headers: HeaderMap, body: String) -> StatusCode {
            let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_owned())).collect();
            r.seen.lock().unwrap().push(Seen { path: uri.path().to_owned(), headers, body });
            while r.hold.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let status = r.answers.lock().unwrap().get_mut(uri.path()).and_then(VecDeque::pop_front).unwrap_or(200);
            StatusCode::from_u16(status).unwrap()
        }
        axum::Router::new().fallback(axum::routing::post(receive)).with_state(self.clone())
    }

    async fn serve(&self) -> SocketAddr {
        serve(self.router()).await
    }
}

/// A worker config on `app` that sends webhooks to what `allow` allows,
/// signing with [`SECRET`], on the Standard Webhooks schedule scaled by 0.01
/// (5 s -> 50 ms, 5 min -> 3 s).
fn hooked(app: &App, allow: &str) -> worker::WorkerConfig {
    let mut c = app.config();
    c.keys = KeySource::Given(BTreeMap::from([(WEBHOOK_SECRET_ENV.to_owned(), Secret::new(SECRET))]));
    c.runs.webhook_endpoints = ToolEndpoints::every_tenant([allow]);
    c.webhooks.retry_scale = 0.01;
    c
}

fn plain_run(url: &str) -> Value {
    json!({"model": "gpt-test", "input": "say hi", "max_output_tokens": 32, "webhook_url": url})
}

/// The python command with `standardwebhooks` importable, when there is one.
fn verifier() -> Option<&'static str> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import standardwebhooks"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some("python3")
}

/// Checks every delivery in `seen` with the outside verifier (`standardwebhooks`
/// from PyPI) under [`SECRET`], and that a verifier holding another secret
/// refuses each; returns each verified payload. `None`: skipped (not installed).
fn verify_outside(seen: &[Seen]) -> Option<Vec<Value>> {
    let Some(python) = verifier() else {
        assert!(
            std::env::var("PACELINE_CI").is_err(),
            "standardwebhooks is not installed (pip install standardwebhooks)"
        );
        eprintln!("SKIPPED the outside verification: standardwebhooks is not installed (pip install standardwebhooks)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deliveries.json");
    let rows: Vec<Value> = seen.iter().map(|s| json!({"headers": s.headers, "body": s.body})).collect();
    std::fs::write(&file, serde_json::to_string(&rows).unwrap()).unwrap();
    const SCRIPT: &str = r#"
import base64, json, sys
from standardwebhooks.webhooks import Webhook
secret, path = sys.argv[1], sys.argv[2]
other = "whsec_" + base64.b64encode(b"not the key that signed these!!!").decode()
out = []
for d in json.load(open(path)):
    payload = Webhook(secret).verify(d["body"], d["headers"])
    try:
        Webhook(other).verify(d["body"], d["headers"])
        raise SystemExit("another secret verified it")
    except SystemExit:
        raise
    except Exception:
        pass
    out.append(payload)
print(json.dumps(out))
"#;
    let run = std::process::Command::new(python).args(["-c", SCRIPT, SECRET]).arg(&file).output().unwrap();
    assert!(run.status.success(), "the outside verifier refused a delivery: {}", String::from_utf8_lossy(&run.stderr));
    Some(serde_json::from_slice(&run.stdout).unwrap())
}

async fn wait_seen(r: &Receiver, n: usize, timeout: Duration) -> Vec<Seen> {
    poll_until(timeout, || async { (r.seen().len() >= n).then(|| r.seen()) })
        .await
        .unwrap_or_else(|| panic!("the receiver saw {} requests, not {n}: {:#?}", r.seen().len(), r.seen()))
}

async fn webhook_state(app: &App, id: &str, state: &str) -> shared::runs::webhooks::WebhookState {
    let reached = poll_until(secs(40), || async {
        let run = app.store.get(TENANT, id).await.unwrap()?;
        run.webhook.filter(|w| w.state.as_deref() == Some(state))
    })
    .await;
    match reached {
        Some(w) => w,
        None => panic!("run {id}'s webhook never reached {state}: {:?}", app.store.get(TENANT, id).await),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_failed_and_cancelled_runs_each_get_one_signed_event_an_outside_verifier_accepts() {
    let mut app = App::start(MockConfig { tool_rounds: 3, ..MockConfig::default() }).await;
    let receiver = Receiver::default();
    let url = format!("http://{}/hooks", receiver.serve().await);
    // Cancelled before any worker runs: the API's own script enqueues its event.
    let cancelled = app.submit(plain_run(&url)).await;
    app.store.cancel(TENANT, &cancelled.id).await.unwrap();
    app.spawn_worker(hooked(&app, &url));
    let completed = app.submit(plain_run(&url)).await;
    // A run asking for tools past its one turn fails with max_turns.
    let mut failing = tool_run(&app, "lookup");
    failing["max_turns"] = json!(1);
    failing["webhook_url"] = json!(url);
    let failed = app.submit(failing).await;
    assert_eq!(app.wait_finished(&completed.id, secs(30)).await.status, RunStatus::Completed);
    assert_eq!(app.wait_finished(&failed.id, secs(30)).await.status, RunStatus::Failed);
    let seen = wait_seen(&receiver, 3, secs(20)).await;
    // Exactly one each: nothing more comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seen_after = receiver.seen();
    assert_eq!(seen_after.len(), 3, "one event a run: {seen_after:#?}");
    let mut by_run: BTreeMap<String, String> = BTreeMap::new();
    for s in &seen {
        let body: Value = serde_json::from_str(&s.body).unwrap();
        by_run.insert(body["data"]["id"].as_str().unwrap().to_owned(), body["type"].as_str().unwrap().to_owned());
        assert_eq!(s.path, "/hooks");
        assert!(s.headers["webhook-id"].starts_with("evt_"), "{:?}", s.headers);
        assert!(s.headers["webhook-signature"].starts_with("v1,"), "{:?}", s.headers);
        assert_eq!(s.headers["content-type"], "application/json");
        assert_eq!(body["data"]["status"].as_str().unwrap(), &body["type"].as_str().unwrap()["run.".len()..]);
    }
    let want = BTreeMap::from([
        (completed.id.clone(), "run.completed".to_owned()),
        (failed.id.clone(), "run.failed".to_owned()),
        (cancelled.id.clone(), "run.cancelled".to_owned()),
    ]);
    assert_eq!(by_run, want);
    if let Some(payloads) = verify_outside(&seen) {
        let verified: BTreeMap<String, String> = payloads
            .iter()
            .map(|p| (p["data"]["id"].as_str().unwrap().to_owned(), p["type"].as_str().unwrap().to_owned()))
            .collect();
        assert_eq!(verified, want, "what the outside verifier read");
    }
    for id in want.keys() {
        let w = webhook_state(&app, id, "delivered").await;
        assert_eq!((w.attempts, w.last_status, w.url.as_str()), (1, Some(200), url.as_str()), "{w:?}");
    }
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_500_twice_gets_the_third_attempt_with_the_same_id_and_body() {
    let mut app = App::start(MockConfig::default()).await;
    let receiver = Receiver::default().answering("/flaky", &[500, 500]);
    let base = format!("http://{}", receiver.serve().await);
    app.spawn_worker(hooked(&app, &base));
    let run = app.submit(plain_run(&format!("{base}/flaky"))).await;
    let seen = wait_seen(&receiver, 3, secs(30)).await;
    assert_eq!(seen.len(), 3, "{seen:#?}");
    let ids: Vec<&str> = seen.iter().map(|s| s.headers["webhook-id"].as_str()).collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "one id on every attempt: {ids:?}");
    assert!(seen.iter().all(|s| s.body == seen[0].body), "one body on every attempt");
    let w = webhook_state(&app, &run.id, "delivered").await;
    assert_eq!((w.attempts, w.last_status, w.event_id.as_deref()), (3, Some(200), Some(ids[0])));
    verify_outside(&seen);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_a_while_gets_the_event_when_it_comes_up() {
    let mut app = App::start(MockConfig::default()).await;
    // A port nobody listens on yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let url = format!("http://{addr}/hooks");
    app.spawn_worker(hooked(&app, &url));
    let run = app.submit(plain_run(&url)).await;
    // Two attempts fail (no answer), the third is ~3 s after the second.
    let w = webhook_state(&app, &run.id, "retrying").await;
    assert!(w.last_status.is_none() && w.last_error.is_some(), "{w:?}");
    poll_until(secs(5), || async {
        let run = app.store.get(TENANT, &run.id).await.unwrap()?;
        run.webhook.filter(|w| w.attempts >= 2)
    })
    .await
    .expect("a second failed attempt");
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let router = receiver.router();
    tokio::spawn(async move { axum::serve(listener, router).await.ok() });
    // The third attempt comes ~3 s after the second; a fourth, should the third have
    // found it down still, ~18 s after that.
    let seen = wait_seen(&receiver, 1, secs(60)).await;
    let w = webhook_state(&app, &run.id, "delivered").await;
    assert!(w.attempts >= 3, "{w:?}");
    assert_eq!(seen.len(), 1);
    verify_outside(&seen);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_stops_the_deliveries() {
    let mut app = App::start(MockConfig::default()).await;
    let receiver = Receiver::default().answering("/gone", &[410, 410, 410]);
    let base = format!("http://{}", receiver.serve().await);
    app.spawn_worker(hooked(&app, &base));
    let run = app.submit(plain_run(&format!("{base}/gone"))).await;
    let w = webhook_state(&app, &run.id, "stopped").await;
    assert_eq!((w.attempts, w.last_status), (1, Some(410)));
    // Past when the next two attempts would have come (50 ms, then 3 s).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(receiver.seen().len(), 1, "nothing after the 410");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_uses_every_attempt_is_dead_lettered_and_an_operator_redrives_it() {
    let mut app = App::start(MockConfig::default()).await;
    let receiver = Receiver::default().answering("/broken", &[503; 8]);
    let base = format!("http://{}", receiver.serve().await);
    let mut config = hooked(&app, &base);
    // Eight attempts in well under a second.
    config.webhooks.retry_scale = 0.00001;
    app.spawn_worker(config);
    let run = app.submit(plain_run(&format!("{base}/broken"))).await;
    let w = webhook_state(&app, &run.id, "failed").await;
    assert_eq!((w.attempts, w.last_status), (8, Some(503)), "{w:?}");
    let (api, _stop) = app.tenant_api(&[("default", "t0")], "op").await;
    let http = reqwest::Client::new();
    let dead: Value =
        http.get(format!("{api}/v1/webhooks/dead")).bearer_auth("op").send().await.unwrap().json().await.unwrap();
    let event = w.event_id.clone().unwrap();
    assert_eq!(dead["data"][0]["event_id"], json!(event), "{dead}");
    assert_eq!(
        (dead["data"][0]["run_id"].as_str(), dead["data"][0]["attempts"].as_u64()),
        (Some(run.id.as_str()), Some(8))
    );
    // A tenant may not; an id that cannot be one is 404 before Redis, one not dead 404
    // from it; the operator re-drives it.
    let tenant = http.post(format!("{api}/v1/webhooks/{event}/retry")).bearer_auth("t0").send().await.unwrap();
    assert_eq!(tenant.status(), 403);
    for unknown in ["evt_nope_1", "evt_a%3Ab"] {
        let answer = http.post(format!("{api}/v1/webhooks/{unknown}/retry")).bearer_auth("op").send().await.unwrap();
        assert_eq!(answer.status(), 404, "{unknown}");
    }
    let redriven = http.post(format!("{api}/v1/webhooks/{event}/retry")).bearer_auth("op").send().await.unwrap();
    assert_eq!(redriven.status(), 202);
    let w = webhook_state(&app, &run.id, "delivered").await;
    assert_eq!(w.last_status, Some(200));
    let seen = receiver.seen();
    assert_eq!(seen.len(), 9);
    assert!(seen.iter().all(|s| s.headers["webhook-id"] == event && s.body == seen[0].body));
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_with_sigkill_while_deliveries_are_pending_lose_none() {
    let app = App::start(MockConfig::default()).await;
    let receiver = Receiver::default();
    receiver.hold.store(true, Ordering::SeqCst);
    let url = format!("http://{}/hooks", receiver.serve().await);
    let worker = |app: &App| {
        app.worker_process_with(
            &["--webhook-endpoints", &url, "--webhook-retry-scale", "0.01", "--webhook-timeout-s", "3"],
            &[(WEBHOOK_SECRET_ENV, SECRET)],
            "warn",
        )
    };
    let mut first = worker(&app);
    let mut ids = vec![];
    for _ in 0..5 {
        ids.push(app.submit(plain_run(&url)).await.id);
    }
    // Every event claimed and its POST held open by the receiver (5 ids seen): then the worker dies.
    poll_until(secs(30), || async {
        let ids: std::collections::HashSet<String> =
            receiver.seen().iter().map(|s| s.headers["webhook-id"].clone()).collect();
        (ids.len() == 5).then_some(())
    })
    .await
    .expect("the five events in flight");
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    receiver.hold.store(false, Ordering::SeqCst);
    let _second = worker(&app);
    for id in &ids {
        let w = webhook_state(&app, id, "delivered").await;
        assert_eq!(w.last_status, Some(200), "{w:?}");
    }
    // Every run's one event, delivered (an attempt cut off by the kill is sent
    // again with the same id: a receiver dedupes by it).
    let seen = receiver.seen();
    let mut events: HashMap<String, String> = HashMap::new();
    for s in &seen {
        let run = serde_json::from_str::<Value>(&s.body).unwrap()["data"]["id"].as_str().unwrap().to_owned();
        let id = s.headers["webhook-id"].clone();
        assert_eq!(events.entry(run).or_insert_with(|| id.clone()), &id, "one event id a run");
    }
    assert_eq!(events.len(), 5);
    verify_outside(&seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_url_not_allowed_is_a_422_naming_it_and_writes_nothing() {
    let app = App::start(MockConfig::default()).await;
    // The test API allows no webhook endpoint (PACELINE_WEBHOOK_ENDPOINTS unset).
    let (api, _stop) = app.tenant_api(&[("default", "t0")], "op").await;
    let http = reqwest::Client::new();
    for url in ["http://127.0.0.1:9/hooks", "ftp://hooks.example.com/x"] {
        let answer = http.post(format!("{api}/v1/runs")).bearer_auth("t0").json(&plain_run(url)).send().await.unwrap();
        assert_eq!(answer.status(), 422, "{url}");
        let body: Value = answer.json().await.unwrap();
        assert_eq!(body["error"]["field"], "webhook_url", "{body}");
    }
    let runs: Value = http.get(format!("{api}/v1/runs")).bearer_auth("t0").send().await.unwrap().json().await.unwrap();
    assert_eq!(runs["data"], json!([]), "nothing written");
}

#[test]
fn a_worker_refuses_to_start_with_a_malformed_secret_and_says_why() {
    for (secret, says) in [("hunter2", "must start with whsec_"), ("whsec_c2hvcnQ=", "holds 5 bytes")] {
        let out = std::process::Command::new(paceline_tests::paceline_bin())
            .args(["worker", "--provider-url", "http://127.0.0.1:9/v1"])
            .env("REDIS_URL", "redis://127.0.0.1:9")
            .env(WEBHOOK_SECRET_ENV, secret)
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{secret}: it started");
        assert!(stderr.contains(says) && stderr.contains(WEBHOOK_SECRET_ENV), "{secret}: {stderr}");
        assert!(!stderr.contains(secret) || secret.starts_with("whsec_"), "the secret is not echoed: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sends_at_most_four_deliveries_at_once_to_one_receiver() {
    let mut app = App::start(MockConfig::default()).await;
    let slow = Receiver::default();
    slow.hold.store(true, Ordering::SeqCst);
    let slow_url = format!("http://{}/hooks", slow.serve().await);
    let other = Receiver::default();
    let other_url = format!("http://{}/hooks", other.serve().await);
    let mut config = hooked(&app, "http://127.0.0.1");
    config.runs.webhook_endpoints = ToolEndpoints::every_tenant([slow_url.as_str(), other_url.as_str()]);
    app.spawn_worker(config);
    let mut ids = vec![];
    for _ in 0..10 {
        ids.push(app.submit(plain_run(&slow_url)).await.id);
    }
    for id in &ids {
        app.wait_finished(id, secs(30)).await;
    }
    wait_seen(&slow, 4, secs(20)).await;
    // Another receiver's event is not held up behind the slow one's backlog.
    let quick = app.submit(plain_run(&other_url)).await;
    webhook_state(&app, &quick.id, "delivered").await;
    assert_eq!(slow.seen().len(), 4, "four at once to the slow receiver, the rest wait");
    slow.hold.store(false, Ordering::SeqCst);
    for id in &ids {
        webhook_state(&app, id, "delivered").await;
    }
    assert_eq!(slow.seen().len(), 10, "each once");
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_slower_than_the_timeout_counts_as_a_failed_attempt_and_is_sent_again() {
    let mut app = App::start(MockConfig::default()).await;
    let receiver = Receiver::default();
    receiver.hold.store(true, Ordering::SeqCst);
    let url = format!("http://{}/hooks", receiver.serve().await);
    let mut config = hooked(&app, &url);
    config.webhooks.timeout_s = 1;
    app.spawn_worker(config);
    let run = app.submit(plain_run(&url)).await;
    let w = webhook_state(&app, &run.id, "retrying").await;
    assert!(w.last_status.is_none() && w.last_error.as_deref().is_some_and(|e| e.contains("timed out")), "{w:?}");
    receiver.hold.store(false, Ordering::SeqCst);
    let w = webhook_state(&app, &run.id, "delivered").await;
    assert!(w.attempts >= 2, "{w:?}");
    let seen = receiver.seen();
    assert!(seen.len() >= 2 && seen.iter().all(|s| s.headers["webhook-id"] == seen[0].headers["webhook-id"]));
    app.stop_workers().await;
}
