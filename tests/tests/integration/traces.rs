//! Traces over OTLP/HTTP (README, "Traces"): worker processes export a span
//! per turn, a GenAI span per provider call and a span per tool call, all in
//! the run's one trace (its `trace_id`), parented as a tree under the run's
//! root. A small collector here decodes what arrives with the OpenTelemetry
//! protocol's own message types (`opentelemetry-proto`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use bytes::Bytes;
use mock_provider::MockConfig;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use paceline_tests::{poll_until, ChildGuard};
use prost::Message as _;
use shared::runs::RunStatus;

use crate::fixtures::{secs, serve, tool_run, App};

/// A collector of OTLP/HTTP protobuf exports: every span it was sent.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Span>>>);

impl Collector {
    async fn start(&self) -> String {
        async fn traces(State(c): State<Collector>, body: Bytes) -> axum::http::StatusCode {
            let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                return axum::http::StatusCode::BAD_REQUEST;
            };
            let spans = request.resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans);
            c.0.lock().unwrap().extend(spans);
            axum::http::StatusCode::OK
        }
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(traces)).with_state(self.clone());
        format!("http://{}", serve(app).await)
    }

    fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a AnyValue> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn int(span: &Span, key: &str) -> Option<i64> {
    match attr(span, key) {
        Some(AnyValue::IntValue(n)) => Some(*n),
        _ => None,
    }
}

fn text(span: &Span, key: &str) -> Option<String> {
    match attr(span, key) {
        Some(AnyValue::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

/// A `paceline worker` process exporting its traces to `endpoint` (every 100 ms).
fn traced_worker(app: &App, endpoint: &str) -> ChildGuard {
    app.worker_process_with(
        &[],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "100")],
        "warn",
    )
}

/// Submits a small run through the API at `api` as tenant `t0`, with a `traceparent` header.
async fn submit_traced(api: &str, traceparent: &str) -> serde_json::Value {
    reqwest::Client::new()
        .post(format!("{api}/v1/runs"))
        .bearer_auth("t0")
        .header("traceparent", traceparent)
        .json(&serde_json::json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 16}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_run_is_one_trace_of_turns_with_genai_call_spans_and_tool_spans() {
    let app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let collector = Collector::default();
    let endpoint = collector.start().await;
    let _worker = traced_worker(&app, &endpoint);
    let mut runs = vec![];
    for _ in 0..2 {
        runs.push(app.submit(tool_run(&app, "lookup")).await);
    }
    let mut finished = vec![];
    for run in &runs {
        let done = app.wait_finished(&run.id, secs(60)).await;
        assert_eq!(done.status, RunStatus::Completed, "{done:?}");
        assert_eq!(done.turns_completed, 2, "a tool turn, then the answer");
        finished.push(done);
    }
    // Each run: its two turns, two calls and one tool call, exported.
    let by_trace = poll_until(secs(20), || async {
        let mut by_trace: HashMap<String, Vec<Span>> = HashMap::new();
        for span in collector.spans() {
            by_trace.entry(hex(&span.trace_id)).or_default().push(span);
        }
        finished
            .iter()
            .all(|r| by_trace.get(r.trace_id.as_deref().unwrap_or("")).is_some_and(|s| s.len() >= 5))
            .then_some(by_trace)
    })
    .await
    .unwrap_or_else(|| panic!("not every run's spans arrived: {} spans", collector.spans().len()));
    let mut conn = app.store.connection();
    let (mut input, mut output) = (0, 0);
    for run in &finished {
        let trace_id = run.trace_id.clone().expect("a run has a trace id");
        let root: String = redis::cmd("HGET")
            .arg(shared::keys::Keys::new(&app.prefix).run_record(&run.id))
            .arg("trace")
            .query_async(&mut conn)
            .await
            .unwrap();
        let root_span = root.split('-').nth(2).unwrap().to_owned();
        let spans = &by_trace[&trace_id];
        let named = |prefix: &str| spans.iter().filter(|s| s.name.starts_with(prefix)).collect::<Vec<_>>();
        let turns = named("turn ");
        let calls = named("chat ");
        let tools = named("execute_tool ");
        assert_eq!(
            (turns.len(), calls.len(), tools.len()),
            (2, 2, 1),
            "{:#?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        let turn_ids: Vec<String> = turns.iter().map(|t| hex(&t.span_id)).collect();
        for t in &turns {
            assert_eq!(hex(&t.parent_span_id), root_span, "a turn is a child of the run's root");
            assert_eq!(text(t, "paceline.run.id").as_deref(), Some(run.id.as_str()));
        }
        for c in calls.iter().chain(&tools) {
            assert!(turn_ids.contains(&hex(&c.parent_span_id)), "{} is a child of a turn", c.name);
        }
        for c in &calls {
            assert_eq!(text(c, "gen_ai.operation.name").as_deref(), Some("chat"));
            assert_eq!(text(c, "gen_ai.provider.name").as_deref(), Some("openai"));
            assert_eq!(text(c, "gen_ai.request.model").as_deref(), Some("gpt-test"));
            assert_eq!(int(c, "gen_ai.request.max_tokens"), Some(64), "{:?}", c.attributes);
            assert!(text(c, "gen_ai.response.finish_reasons").is_some(), "{c:?}");
            input += int(c, "gen_ai.usage.input_tokens").expect("input tokens");
            output += int(c, "gen_ai.usage.output_tokens").expect("output tokens");
        }
        assert_eq!(text(tools[0], "gen_ai.tool.name").as_deref(), Some("lookup"));
    }
    // The calls' spans say what the provider counted: the runs' usage, and the mock's own count of input.
    let usage_in: u64 = finished.iter().map(|r| r.usage.input_tokens).sum();
    let usage_out: u64 = finished.iter().map(|r| r.usage.output_tokens).sum();
    assert_eq!((input as u64, output as u64), (usage_in, usage_out));
    assert_eq!(input as u64, app.mock.stats().input_tokens_admitted, "the mock's count of input");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_collector_down_runs_go_on() {
    let app = App::start(MockConfig::default()).await;
    // Nobody listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let endpoint = format!("http://{closed}");
    let mut worker = app.worker_process_with(
        &[],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "50")],
        "warn",
    );
    for _ in 0..5 {
        let run = app.submit(serde_json::json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 16})).await;
        let done = app.wait_finished(&run.id, secs(30)).await;
        assert_eq!(done.status, RunStatus::Completed);
        assert!(done.trace_id.is_some());
    }
    // Past a few failed exports, the worker is alive and still takes runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(worker.0.try_wait().unwrap().is_none(), "the worker exited with the collector down");
    let run = app.submit(serde_json::json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 16})).await;
    assert_eq!(app.wait_finished(&run.id, secs(30)).await.status, RunStatus::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submitters_traceparent_makes_the_run_join_its_trace() {
    let app = App::start(MockConfig::default()).await;
    let collector = Collector::default();
    let endpoint = collector.start().await;
    let _worker = traced_worker(&app, &endpoint);
    let (api, _stop) = app.tenant_api(&[("default", "t0")], "op").await;
    let (trace, parent) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let created = submit_traced(&api, &format!("00-{trace}-{parent}-01")).await;
    assert_eq!(created["trace_id"], trace, "{created}");
    let id = created["id"].as_str().unwrap();
    assert_eq!(app.wait_finished(id, secs(30)).await.status, RunStatus::Completed);
    let turn = poll_until(secs(20), || async {
        collector.spans().into_iter().find(|s| s.name.starts_with("turn ") && hex(&s.trace_id) == trace)
    })
    .await
    .expect("the run's turn span, in the submitter's trace");
    assert_eq!(hex(&turn.parent_span_id), parent, "a child of the submitter's span");
    // One that does not read starts a trace of the run's own.
    let own = submit_traced(&api, "00-00000000000000000000000000000000-b7ad6b7169203331-01").await;
    let own_trace = own["trace_id"].as_str().expect("a trace id of its own");
    assert_eq!(own_trace.len(), 32);
    assert_ne!(own_trace, "00000000000000000000000000000000");
}
