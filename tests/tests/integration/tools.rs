//! Tool calls as a tool server sees them (README, "Tool endpoints"): no redirect is followed,
//! the worker checks a run's tenant against the allow-list again, a host
//! name is called only on public addresses, and each call names its tenant
//! and is signed with its tool server's key, derived from `PACELINE_TOOL_SECRET`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use mock_provider::MockConfig;
use serde_json::{json, Value};
use shared::config::Secret;
use shared::runs::{RunStatus, ToolEndpoints};
use worker::config::{KeySource, TOOL_SECRET_ENV};
use worker::tools::{endpoint_key, ToolCall, ToolClient};

use crate::fixtures::{secs, serve, tool_outputs, App};

/// A tool server that answers every call with `output` and counts the calls.
async fn counting_tool(output: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
    let reached = Arc::new(AtomicUsize::new(0));
    let counter = reached.clone();
    let addr = serve(axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            axum::Json(json!({"output": output}))
        }
    }))
    .await;
    (addr, reached)
}

/// A run that calls its tool once, at `endpoint`, then answers.
fn one_tool_round(endpoint: &str) -> Value {
    json!({
        "model": "gpt-test", "input": "do the task", "max_turns": 5, "max_output_tokens": 64,
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
        "tool_endpoint": endpoint,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirecting_tool_endpoint_never_reaches_its_target_and_the_run_completes() {
    // The target counts what reaches it; the redirector sends everything there.
    let (target, reached) = counting_tool("the target answered").await;
    let to = format!("http://{target}/internal");
    let location = to.clone();
    let redirector = serve(axum::Router::new().fallback(move || {
        let location = location.clone();
        async move { (StatusCode::TEMPORARY_REDIRECT, [("location", location)]).into_response() }
    }))
    .await;
    let endpoint = format!("http://{redirector}/tools");

    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let mut config = app.config();
    // Both are allowed: what is refused is following a redirect at all.
    config.runs.tool_endpoints = ToolEndpoints::every_tenant([endpoint.clone(), format!("http://{target}/")]);
    app.spawn_worker(config);
    let run = app.submit(one_tool_round(&endpoint)).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "a tool's redirect is its output, not a run failure: {run:?}");
    assert_eq!(reached.load(Ordering::SeqCst), 0, "the redirect's target was reached");
    let outputs = tool_outputs(&app, &run.id).await;
    assert_eq!(outputs.len(), 1);
    assert!(outputs[0].starts_with("tool error: the endpoint redirected (HTTP 307"), "{}", outputs[0]);
    assert!(outputs[0].contains(&to), "the output names where it pointed: {}", outputs[0]);
    app.stop_workers().await;
}

/// What the verifying tool server saw of one call: the tenant header, the
/// body's tenant, whether the signature verifies with its own key, and with
/// a key that is not its own (the fleet's secret, another server's key).
type SeenCall = (Option<String>, Value, bool, bool);

#[derive(Clone, Default)]
struct Seen {
    calls: Arc<Mutex<Vec<SeenCall>>>,
    /// The tool server's own key, and keys that must not verify.
    keys: Arc<Mutex<(Option<Secret>, Vec<Secret>)>>,
}

const SECRET: &str = "whsec_test_0123456789";

async fn verifying_tool(
    axum::extract::State(seen): axum::extract::State<Seen>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::Json<Value> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let signature = headers.get("x-paceline-signature").and_then(|v| v.to_str().ok()).unwrap_or_default();
    let (own, others) = seen.keys.lock().unwrap().clone();
    let good = worker::tools::verify(&own.expect("the server's key"), signature, &body, now, 300);
    let wrong = others.iter().any(|key| worker::tools::verify(key, signature, &body, now, 300));
    let tenant = headers.get("x-paceline-tenant").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    seen.calls.lock().unwrap().push((tenant, parsed["tenant"].clone(), good, wrong));
    axum::Json(json!({"output": if good { "verified" } else { "refused" }}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_name_the_tenant_and_carry_a_signature_the_tool_server_verifies() {
    let seen = Seen::default();
    let server = serve(axum::Router::new().fallback(verifying_tool).with_state(seen.clone())).await;
    let endpoint = format!("http://{server}/tools");
    // The server knows its own key only: the one its origin derives.
    let secret = Secret::new(SECRET);
    let own = endpoint_key(&secret, &format!("http://{server}")).unwrap();
    let another = endpoint_key(&secret, "https://tools.other.internal").unwrap();
    *seen.keys.lock().unwrap() = (Some(own), vec![secret, another, Secret::new("whsec_wrong")]);

    let mut app = App::start(MockConfig { tool_rounds: 2, ..MockConfig::default() }).await;
    let mut config = app.config();
    config.runs.tool_endpoints = ToolEndpoints::every_tenant([endpoint.clone()]);
    config.keys = KeySource::Given([(TOOL_SECRET_ENV.to_owned(), Secret::new(SECRET))].into_iter().collect());
    app.spawn_worker(config);
    let run = app.submit(one_tool_round(&endpoint)).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let calls = seen.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "two tool rounds");
    for (header, body_tenant, good, wrong) in calls {
        assert_eq!(header.as_deref(), Some("default"), "X-Paceline-Tenant");
        assert_eq!(body_tenant, json!("default"), "the body's tenant");
        assert!(good, "the signature verifies with the server's own key");
        assert!(!wrong, "and not with the fleet's secret or another server's key");
    }
    assert_eq!(tool_outputs(&app, &run.id).await, vec!["verified", "verified"]);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_refuses_a_tool_endpoint_allowed_to_another_tenant() {
    let (server, reached) = counting_tool("called").await;
    let endpoint = format!("http://{server}/tools");

    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let mut config = app.config();
    // The run is tenant `default`'s; the endpoint is acme's alone (a run
    // written before the list changed, or by another API's list).
    config.runs.tool_endpoints = ToolEndpoints::default().with(Some("acme"), endpoint.clone());
    app.spawn_worker(config);
    let run = app.submit(one_tool_round(&endpoint)).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(reached.load(Ordering::SeqCst), 0, "the endpoint was called");
    let outputs = tool_outputs(&app, &run.id).await;
    assert!(outputs[0].contains("is not allowed on this worker"), "{}", outputs[0]);
    app.stop_workers().await;
}

/// An unsigned worker (no secret) still names the tenant and sends no signature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_secret_calls_name_the_tenant_and_carry_no_signature() {
    let headers_seen = Arc::new(Mutex::new(Vec::<HeaderMap>::new()));
    let keep = headers_seen.clone();
    let server = serve(axum::Router::new().fallback(move |headers: HeaderMap| {
        let keep = keep.clone();
        async move {
            keep.lock().unwrap().push(headers);
            axum::Json(json!({"output": "ok"}))
        }
    }))
    .await;
    let endpoint = format!("http://{server}/tools");
    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let mut config = app.config();
    config.runs.tool_endpoints = ToolEndpoints::every_tenant([endpoint.clone()]);
    app.spawn_worker(config);
    let run = app.submit(one_tool_round(&endpoint)).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let seen = headers_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["x-paceline-tenant"], "default");
    assert!(seen[0].get("x-paceline-signature").is_none());
    app.stop_workers().await;
}

/// One call of a declared tool.
fn lookup_call() -> [ToolCall; 1] {
    [ToolCall { call_id: "call_1".into(), name: "lookup".into(), arguments: "{}".into() }]
}

#[tokio::test]
async fn a_tool_host_named_by_a_name_that_resolves_to_loopback_is_never_called_even_when_allowed() {
    let (server, reached) = counting_tool("called").await;
    // `localhost` is allowed by name; it resolves to 127.0.0.1 (and ::1).
    let by_name = format!("http://localhost:{}/tools", server.port());
    let client = ToolClient::new(ToolEndpoints::every_tenant([by_name.clone()]), None, secs(5)).unwrap();
    let results = client.run(&by_name, &[], "acme", "run_1", &["lookup"], &lookup_call()).await;
    assert_eq!(reached.load(Ordering::SeqCst), 0, "a name resolving to loopback was called");
    let output = &results[0].output;
    assert!(results[0].error, "{output}");
    assert!(output.contains("the tool host localhost resolves to "), "{output}");
    assert!(output.contains("(loopback), not a public address"), "{output}");

    // The same server named by its address, which the prefix names itself: called.
    let by_address = format!("http://{server}/tools");
    let client = ToolClient::new(ToolEndpoints::every_tenant([format!("http://{server}/")]), None, secs(5)).unwrap();
    let results = client.run(&by_address, &[], "acme", "run_1", &["lookup"], &lookup_call()).await;
    assert_eq!((results[0].output.as_str(), results[0].error), ("called", false));
    assert_eq!(reached.load(Ordering::SeqCst), 1);
}
