//! The worker's provider client and tool caller, driven against real servers:
//! the mock provider in-process (both wire formats, every fault knob the
//! client must read), and tiny axum servers for what the mock cannot show
//! (the Authorization header, a stream cut short, a tool endpoint).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use mock_provider::{Fault, HeaderStyle, MockConfig, MockServer};
use paceline_tests::within;
use serde_json::{json, Value};
use shared::config::Secret;
use shared::pacer::{FailureKind, Transport};
use shared::runs::ApiStyle;
use shared::runs::ToolEndpoints;
use worker::provider::{CallFailure, CallSuccess, Provider, StreamEvent};
use worker::tools::{ToolCall, ToolClient};

use crate::fixtures::{body, call};

const STYLES: [ApiStyle; 2] = [ApiStyle::Responses, ApiStyle::Chat];

// ------------------------------------------------------------------ helpers

async fn mock(config: MockConfig) -> MockServer {
    MockServer::start(config).await.expect("start the mock provider")
}

fn provider_at(base_url: &str, key: &str, style: ApiStyle) -> Provider {
    Provider::new(style, base_url, &Secret::new(key))
        .expect("a provider client")
        .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
}

fn provider(server: &MockServer, style: ApiStyle) -> Provider {
    let base = if style == ApiStyle::Anthropic { server.url() } else { server.base_url() };
    provider_at(&base, "sk-test", style)
}

fn deltas(events: &[StreamEvent]) -> Vec<&str> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::TextDelta(t) => Some(t.as_str()),
            StreamEvent::ToolCall { .. } => None,
        })
        .collect()
}

fn success(style: ApiStyle, result: Result<CallSuccess, CallFailure>) -> CallSuccess {
    result.unwrap_or_else(|f| panic!("{style:?}: expected an answer, got {f}"))
}

fn failure(style: ApiStyle, result: Result<CallSuccess, CallFailure>) -> CallFailure {
    match result {
        Ok(s) => panic!("{style:?}: expected a failure, got {:?}", s.output),
        Err(f) => f,
    }
}

/// Serves `app` on a free port; the task ends with the test's runtime.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    format!("http://{addr}")
}

// ------------------------------------------------------------------ answers

#[tokio::test]
async fn text_deltas_arrive_in_order_with_usage_and_headers() {
    let server = mock(MockConfig { output_tokens: 40, tpm: 50_000, rpm: 700, ..MockConfig::default() }).await;
    for style in STYLES {
        let (events, result) = call(&provider(&server, style), body(style, false)).await;
        let ok = success(style, result);
        let parts = deltas(&events);
        assert!(parts.len() > 2, "{style:?}: the answer came in several deltas, got {parts:?}");
        assert_eq!(parts.concat(), ok.output_text, "{style:?}: deltas, in order, are the answer");
        assert_eq!(ok.output_text.split_whitespace().count(), 40);
        assert_eq!(
            ok.output,
            vec![
                json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ok.output_text}]})
            ]
        );
        assert!(ok.tool_calls.is_empty());
        assert_eq!(ok.status, 200);
        assert_eq!(ok.incomplete_reason, None);
        let usage = ok.usage.unwrap_or_else(|| panic!("{style:?}: usage"));
        assert_eq!(usage.tokens.output_tokens, 40);
        assert!(usage.tokens.input_tokens > 0);
        assert_eq!(usage.tokens.total_tokens, usage.tokens.input_tokens + usage.tokens.output_tokens);
        assert_eq!(ok.headers.tokens.limit, Some(50_000), "{style:?}: x-ratelimit-limit-tokens");
        assert_eq!(ok.headers.requests.limit, Some(700));
        assert!(ok.headers.tokens.remaining.is_some_and(|r| r < 50_000));
        assert!(ok.headers.tokens.reset_ms.is_some());
        assert!(ok.headers_received <= Instant::now());
    }
    let stats = server.stats();
    assert_eq!(stats.requests, 2);
    for kept in &stats.bodies {
        assert_eq!(kept.body["stream"], json!(true), "the client asks for a stream");
    }
    assert!(
        stats.bodies.iter().any(|b| b.body["stream_options"]["include_usage"] == json!(true)),
        "chat asks for usage"
    );
}

#[tokio::test]
async fn tool_calls_come_back_as_responses_function_call_items() {
    let server = mock(MockConfig { tool_rounds: 1, calls_per_round: 2, ..MockConfig::default() }).await;
    for style in STYLES {
        let (events, result) = call(&provider(&server, style), body(style, true)).await;
        let ok = success(style, result);
        assert_eq!(ok.tool_calls.len(), 2, "{style:?}");
        assert_eq!(ok.output.len(), 2);
        for (item, call) in ok.output.iter().zip(&ok.tool_calls) {
            // Exactly what a stateless resend accepts: no server id, no status.
            assert_eq!(
                item,
                &json!({"type": "function_call", "call_id": call.call_id, "name": "search", "arguments": call.arguments}),
                "{style:?}"
            );
            assert!(call.call_id.starts_with("call_"));
            let args: Value = serde_json::from_str(&call.arguments).expect("arguments are JSON");
            assert!(args.get("query").is_some(), "{style:?}: {args}");
        }
        let seen: Vec<ToolCall> = events
            .into_iter()
            .filter_map(|e| match e {
                StreamEvent::ToolCall { call_id, name, arguments } => Some(ToolCall { call_id, name, arguments }),
                StreamEvent::TextDelta(_) => None,
            })
            .collect();
        assert_eq!(seen, ok.tool_calls, "{style:?}: the callback saw each call once");
        assert!(ok.usage.is_some());
    }

    // The items go back as they are, with the outputs: the next turn answers in text.
    let p = provider(&server, ApiStyle::Responses);
    let (_, first) = call(&p, body(ApiStyle::Responses, true)).await;
    let first = success(ApiStyle::Responses, first);
    let mut next = body(ApiStyle::Responses, true);
    let input = next["input"].as_array_mut().unwrap();
    input.extend(first.output.iter().cloned());
    input.extend(
        first
            .tool_calls
            .iter()
            .map(|c| json!({"type": "function_call_output", "call_id": c.call_id, "output": "found"})),
    );
    let (_, second) = call(&p, next).await;
    let second = success(ApiStyle::Responses, second);
    assert!(second.tool_calls.is_empty());
    assert!(!second.output_text.is_empty());
}

#[tokio::test]
async fn an_answer_cut_by_max_output_tokens_is_an_incomplete_success() {
    let server = mock(MockConfig { output_tokens: 50, ..MockConfig::default() }).await;
    for style in STYLES {
        let mut b = body(style, false);
        match style {
            ApiStyle::Responses => b["max_output_tokens"] = json!(10),
            ApiStyle::Chat => b["max_completion_tokens"] = json!(10),
            ApiStyle::Anthropic => b["max_tokens"] = json!(10),
        }
        let (_, result) = call(&provider(&server, style), b).await;
        let ok = success(style, result);
        assert_eq!(ok.incomplete_reason.as_deref(), Some("max_output_tokens"), "{style:?}");
        assert_eq!(ok.output_text.split_whitespace().count(), 10);
    }
}

#[tokio::test]
async fn no_headers_give_an_empty_snapshot() {
    let server = mock(MockConfig { headers: HeaderStyle::None, ..MockConfig::default() }).await;
    for style in STYLES {
        let (_, result) = call(&provider(&server, style), body(style, false)).await;
        let ok = success(style, result);
        assert!(ok.headers.is_empty(), "{style:?}: {:?}", ok.headers);
        assert!(ok.usage.is_some());
    }
}

// ------------------------------------------------------------------ failures

#[tokio::test]
async fn a_429_carries_retry_after_and_classifies_rate_limited() {
    let server = mock(MockConfig::default()).await;
    for style in STYLES {
        server.inject(Fault::RateLimited { retry_after_ms: 1500 });
        let (events, result) = call(&provider(&server, style), body(style, false)).await;
        let f = failure(style, result);
        assert_eq!(f.status, Some(429), "{style:?}");
        assert_eq!(f.kind, FailureKind::RateLimited);
        assert_eq!(f.code.as_deref(), Some("rate_limit_exceeded"));
        assert_eq!(f.headers.retry_after_ms, Some(1500), "{style:?}: retry-after-ms is read");
        assert!(f.headers.tokens.limit.is_some(), "{style:?}: a 429's limit headers are read too");
        assert!(f.headers_received.is_some());
        assert!(f.transport.is_none());
        assert!(!f.streamed_text);
        assert!(events.is_empty());
        assert!(f.message.contains("Rate limit"), "{}", f.message);
    }
}

#[tokio::test]
async fn insufficient_quota_is_quota_not_a_rate_limit() {
    let server = mock(MockConfig::default()).await;
    for style in STYLES {
        server.inject(Fault::Quota);
        let (_, result) = call(&provider(&server, style), body(style, false)).await;
        let f = failure(style, result);
        assert_eq!((f.status, f.kind), (Some(429), FailureKind::Quota), "{style:?}");
        assert_eq!(f.code.as_deref(), Some("insufficient_quota"));
        assert!(!f.kind.is_retryable());
    }
}

#[tokio::test]
async fn a_5xx_is_transient_with_its_headers() {
    let server = mock(MockConfig::default()).await;
    for (style, status) in [(ApiStyle::Responses, 503), (ApiStyle::Chat, 500)] {
        server.inject(Fault::ServerError { status });
        let (_, result) = call(&provider(&server, style), body(style, false)).await;
        let f = failure(style, result);
        assert_eq!((f.status, f.kind), (Some(status), FailureKind::Transient), "{style:?}");
        assert!(f.headers.tokens.limit.is_some(), "{style:?}: headers on a 5xx are read");
    }
}

/// Architecture invariant: the provider client never retries or sleeps — every
/// retry is a requeue decided by `pacer::backoff`. A 429 (with a retry hint the
/// client must not wait out) and a 5xx each reach the mock exactly once, in
/// every wire style, and the call returns well before the hint.
#[tokio::test]
async fn a_failed_call_is_exactly_one_request_at_the_provider() {
    let server = mock(MockConfig::default()).await;
    for style in [ApiStyle::Responses, ApiStyle::Chat, ApiStyle::Anthropic] {
        let faults = [
            (Fault::RateLimited { retry_after_ms: 2_000 }, 429),
            (Fault::ServerError { status: 500 }, 500),
            (Fault::ServerError { status: 503 }, 503),
        ];
        for (fault, status) in faults {
            server.reset();
            server.inject(fault);
            let started = Instant::now();
            let (_, result) = call(&provider(&server, style), body(style, false)).await;
            let took = started.elapsed();
            assert_eq!(failure(style, result).status, Some(status), "{style:?}");
            assert!(took < Duration::from_millis(1_000), "{style:?} {status}: the client waited ({took:?})");
            // A retry in the background would arrive after the call returned.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let stats = server.stats();
            assert_eq!(stats.requests, 1, "{style:?} {status}: one request, no retry");
            assert_eq!(stats.by_status.get(&status), Some(&1), "{style:?} {status}");
        }
    }
}

#[tokio::test]
async fn a_bad_request_is_terminal_with_the_providers_message() {
    let server = mock(MockConfig::default()).await;
    for style in STYLES {
        let mut b = body(style, false);
        b.as_object_mut().unwrap().remove("model");
        let (_, result) = call(&provider(&server, style), b).await;
        let f = failure(style, result);
        assert_eq!((f.status, f.kind), (Some(400), FailureKind::Terminal), "{style:?}");
        assert!(f.message.contains("model"), "{}", f.message);
    }
}

#[tokio::test]
async fn a_mid_stream_error_after_text_says_text_was_streamed() {
    let server = mock(MockConfig { output_tokens: 60, ..MockConfig::default() }).await;
    for style in STYLES {
        server.inject(Fault::MidstreamError { code: Some("rate_limit_exceeded".into()) });
        let (events, result) = call(&provider(&server, style), body(style, false)).await;
        let f = failure(style, result);
        assert!(!deltas(&events).is_empty(), "{style:?}: some text came first");
        assert!(f.streamed_text, "{style:?}");
        assert_eq!(f.kind, FailureKind::RateLimited, "{style:?}: rate_limit_exceeded inside a 200");
        assert_eq!(f.status, Some(200));
        assert_eq!(f.code.as_deref(), Some("rate_limit_exceeded"));
        assert!(f.headers.tokens.limit.is_some(), "{style:?}: the 200's headers are kept");

        server.inject(Fault::MidstreamError { code: None });
        let (_, result) = call(&provider(&server, style), body(style, false)).await;
        let f = failure(style, result);
        assert!(f.streamed_text);
        assert_eq!(f.kind, FailureKind::Transient, "{style:?}: server_error inside a 200");
    }
}

#[tokio::test]
async fn a_stalled_stream_times_out_between_events() {
    let server = mock(MockConfig { output_tokens: 60, ..MockConfig::default() }).await;
    for style in STYLES {
        // The stall outlasts the test's bound on the call: only the client's
        // between-events timeout can end it in time.
        server.inject(Fault::Stall { ms: 60_000 });
        let p = provider(&server, style).with_timeouts(Duration::from_secs(2), Duration::from_millis(300));
        let (events, result) = call(&p, body(style, false)).await;
        let f = failure(style, result);
        assert_eq!(f.transport, Some(Transport::Timeout), "{style:?}: {f}");
        assert_eq!(f.kind, FailureKind::Transient);
        assert_eq!(f.status, Some(200));
        assert!(f.streamed_text && !deltas(&events).is_empty(), "{style:?}: the stall came after some text");
    }
}

#[tokio::test]
async fn an_unreachable_provider_is_a_transient_transport_failure() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener); // nothing listens there now
    let p = provider_at(&format!("http://{addr}/v1"), "", ApiStyle::Responses);
    let (_, result) = call(&p, body(ApiStyle::Responses, false)).await;
    let f = failure(ApiStyle::Responses, result);
    assert_eq!(f.status, None);
    assert!(f.transport.is_some());
    assert_eq!(f.kind, FailureKind::Transient);
    assert!(f.headers.is_empty() && f.headers_received.is_none());
}

// ------------------------------------------------------------------ what the mock cannot show

/// A hand-written Responses stream: CRLF line ends, a keepalive comment, an
/// unknown event type, and the terminal frame.
const CANNED: &str = concat!(
    ": keepalive\r\n\r\n",
    "event: response.created\r\ndata: {\"type\":\"response.created\",\"response\":{\"output\":[]}}\r\n\r\n",
    "event: response.future_thing\r\ndata: {\"type\":\"response.future_thing\"}\r\n\r\n",
    "event: response.output_text.delta\r\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\r\n\r\n",
    "event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\",\"annotations\":[]}]}],\"usage\":{\"input_tokens\":3,\"output_tokens\":1,\"total_tokens\":4}}}\r\n\r\n",
);

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Option<String>>>>);

async fn canned(State(seen): State<Seen>, headers: HeaderMap) -> impl IntoResponse {
    let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_string());
    seen.0.lock().unwrap().push(auth);
    ([("content-type", "text/event-stream"), ("retry-after", "7")], CANNED)
}

async fn cut_short() -> impl IntoResponse {
    let body =
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hel\"}\n\n";
    ([("content-type", "text/event-stream")], body)
}

#[tokio::test]
async fn the_key_is_a_bearer_header_and_omitted_when_empty() {
    let seen = Seen::default();
    let base = serve(
        Router::new()
            .route("/v1/responses", post(canned))
            .route("/cut/responses", post(cut_short))
            .with_state(seen.clone()),
    )
    .await;

    for key in ["sk-test-key", ""] {
        let p = provider_at(&format!("{base}/v1"), key, ApiStyle::Responses);
        let (events, result) = call(&p, body(ApiStyle::Responses, false)).await;
        let ok = success(ApiStyle::Responses, result);
        assert_eq!(events, vec![StreamEvent::TextDelta("Hi".into())]);
        assert_eq!(ok.output_text, "Hi");
        assert_eq!(ok.headers.retry_after_ms, Some(7000));
        assert!(!format!("{p:?}").contains("sk-test-key"));
    }
    assert_eq!(*seen.0.lock().unwrap(), vec![Some("Bearer sk-test-key".to_string()), None]);

    // A stream that closes without its terminal event is not an answer.
    let p = provider_at(&format!("{base}/cut"), "", ApiStyle::Responses);
    let (_, result) = call(&p, body(ApiStyle::Responses, false)).await;
    let f = failure(ApiStyle::Responses, result);
    assert_eq!((f.kind, f.transport), (FailureKind::Transient, Some(Transport::ConnectionReset)));
    assert!(f.streamed_text);
}

/// A chat server that ignores `stream: true` and answers one JSON body.
async fn chat_json() -> impl IntoResponse {
    Json(
        json!({"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": null,
                    "tool_calls": [{"id": "call_j", "type": "function", "function": {"name": "search", "arguments": "{\"query\":\"q\"}"}}]}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}),
    )
}

#[tokio::test]
async fn a_server_that_does_not_stream_is_read_all_the_same() {
    let base = serve(Router::new().route("/v1/chat/completions", post(chat_json))).await;
    let p = provider_at(&format!("{base}/v1"), "", ApiStyle::Chat);
    let (events, result) = call(&p, body(ApiStyle::Chat, true)).await;
    let ok = success(ApiStyle::Chat, result);
    assert_eq!(
        ok.output,
        vec![json!({"type": "function_call", "call_id": "call_j", "name": "search", "arguments": "{\"query\":\"q\"}"})]
    );
    assert_eq!(events.len(), 1);
    assert_eq!(ok.usage.map(|u| u.tokens.total_tokens), Some(15));
}

/// A server that counts what reaches it, and another that redirects every
/// request to it with `status`.
async fn redirect_pair(status: StatusCode) -> (String, String, Arc<Mutex<usize>>) {
    let reached = Arc::new(Mutex::new(0));
    let counter = reached.clone();
    let target = serve(Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            *counter.lock().unwrap() += 1;
            Json(json!({"error": {"message": "the target answered"}}))
        }
    }))
    .await;
    let location = format!("{target}/v1/stolen?key=k");
    let redirector = serve(Router::new().fallback(move || {
        let location = location.clone();
        async move { (status, [("location", location)]).into_response() }
    }))
    .await;
    (redirector, target, reached)
}

#[tokio::test]
async fn a_redirecting_provider_is_a_terminal_failure_naming_its_target_which_receives_nothing() {
    for status in [
        StatusCode::MOVED_PERMANENTLY,
        StatusCode::FOUND,
        StatusCode::TEMPORARY_REDIRECT,
        StatusCode::PERMANENT_REDIRECT,
    ] {
        for style in [ApiStyle::Responses, ApiStyle::Chat, ApiStyle::Anthropic] {
            let (redirector, target, reached) = redirect_pair(status).await;
            let base = if style == ApiStyle::Anthropic { redirector } else { format!("{redirector}/v1") };
            let p = provider_at(&base, "sk-ant-secret-key", style);
            let (_, result) = call(&p, body(style, false)).await;
            let f = failure(style, result);
            assert_eq!(*reached.lock().unwrap(), 0, "{style:?} {status}: the redirect's target received the call");
            assert_eq!(f.status, Some(status.as_u16()), "{style:?}");
            assert_eq!(f.kind, FailureKind::Terminal, "{style:?} {status}: a redirect is never retried");
            assert!(
                f.message.contains(&format!("HTTP {} to {target}/v1/stolen", status.as_u16())),
                "{style:?}: the message names the target: {}",
                f.message
            );
            assert!(!f.message.contains("key=k"), "no query in the message: {}", f.message);
        }
    }
}

// ------------------------------------------------------------------ tools

#[derive(Clone)]
struct ToolServer {
    /// Both `meet` calls must be in flight at once to pass it.
    barrier: Arc<tokio::sync::Barrier>,
}

async fn tool_endpoint(State(state): State<ToolServer>, Json(req): Json<Value>) -> axum::response::Response {
    match req["name"].as_str().unwrap_or_default() {
        "echo" => Json(json!({"output": req.to_string()})).into_response(),
        "meet" => {
            state.barrier.wait().await;
            Json(json!({"output": "met"})).into_response()
        }
        "fail" => (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        "not_json" => "plain words".into_response(),
        "structured" => Json(json!({"output": {"rows": [1, 2]}})).into_response(),
        "hang" => std::future::pending().await,
        // 6 MiB of output: under the 8 MiB one answer may have, but three pass a turn's 16 MiB.
        "big" => Json(json!({"output": "x".repeat(6 << 20)})).into_response(),
        other => (StatusCode::NOT_FOUND, format!("no tool {other}")).into_response(),
    }
}

/// The tools the runs of these tests declared: every name `tool_endpoint` knows.
const DECLARED: [&str; 7] = ["echo", "meet", "fail", "not_json", "structured", "hang", "big"];

fn tool_call(id: &str, name: &str) -> ToolCall {
    ToolCall { call_id: id.into(), name: name.into(), arguments: r#"{"q":"x"}"#.into() }
}

#[tokio::test]
async fn tools_run_in_parallel_and_failures_become_output_text() {
    let state = ToolServer { barrier: Arc::new(tokio::sync::Barrier::new(2)) };
    let base = serve(Router::new().route("/tools", post(tool_endpoint)).with_state(state)).await;
    let endpoint = format!("{base}/tools");
    let client =
        ToolClient::new(ToolEndpoints::every_tenant([endpoint.clone()]), None, Duration::from_secs(10)).unwrap();

    let calls = [
        tool_call("call_1", "echo"),
        tool_call("call_2", "meet"),
        tool_call("call_3", "meet"),
        tool_call("call_4", "fail"),
        tool_call("call_5", "not_json"),
        tool_call("call_6", "structured"),
    ];
    // The two `meet` calls only finish when both are in flight: run one by
    // one, they would wait on each other until the timeout.
    let results =
        within("the tools", Duration::from_secs(15), client.run(&endpoint, &[], "acme", "run_1", &DECLARED, &calls))
            .await;
    let ids: Vec<&str> = results.iter().map(|r| r.call_id.as_str()).collect();
    assert_eq!(ids, ["call_1", "call_2", "call_3", "call_4", "call_5", "call_6"], "results keep the calls' order");

    let echoed: Value = serde_json::from_str(&results[0].output).unwrap();
    assert_eq!(
        echoed,
        json!({"run_id": "run_1", "call_id": "call_1", "name": "echo", "arguments": "{\"q\":\"x\"}", "tenant": "acme"})
    );
    assert!(!results[0].error);
    assert_eq!((results[1].output.as_str(), results[2].output.as_str()), ("met", "met"));
    assert!(results[3].error);
    assert_eq!(results[3].output, "tool error: HTTP 500: boom");
    assert!(
        results[4].error && results[4].output.starts_with("tool error: the answer is not JSON"),
        "{}",
        results[4].output
    );
    assert_eq!((results[5].output.as_str(), results[5].error), (r#"{"rows":[1,2]}"#, false));
}

#[tokio::test]
async fn a_hanging_or_absent_tool_becomes_an_error_text_in_time() {
    let state = ToolServer { barrier: Arc::new(tokio::sync::Barrier::new(2)) };
    let base = serve(Router::new().route("/tools", post(tool_endpoint)).with_state(state)).await;
    let client =
        ToolClient::new(ToolEndpoints::every_tenant([base.clone()]), None, Duration::from_millis(300)).unwrap();

    let calls = [tool_call("call_h", "hang"), tool_call("call_e", "echo")];
    let results = within(
        "the tools",
        Duration::from_secs(10),
        client.run(&format!("{base}/tools"), &[], "acme", "run_2", &DECLARED, &calls),
    )
    .await;
    assert_eq!(results[0].output, "tool error: timed out after 300 ms");
    assert!(results[0].error);
    assert!(!results[1].error, "a slow tool does not hold back its neighbour's result");

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = format!("http://{}/tools", listener.local_addr().unwrap());
    drop(listener);
    let results = within(
        "the tools",
        Duration::from_secs(10),
        ToolClient::new(ToolEndpoints::every_tenant([gone.clone()]), None, Duration::from_secs(5)).unwrap().run(
            &gone,
            &[],
            "acme",
            "run_2",
            &DECLARED,
            &calls[1..],
        ),
    )
    .await;
    assert!(results[0].error && results[0].output.starts_with("tool error: "), "{}", results[0].output);
}

#[tokio::test]
async fn a_tool_endpoint_outside_the_workers_prefixes_is_not_called() {
    let calls = [tool_call("call_a", "echo"), tool_call("call_b", "echo")];
    // Nothing listens there: a call would fail with a connection error instead.
    let endpoint = "http://127.0.0.1:9/tools";
    // Allowed to acme alone, and to everyone under another path.
    let allowed = ToolEndpoints::every_tenant(["http://127.0.0.1:9/other"]).with(Some("acme"), "http://127.0.0.1:9/");
    let client = ToolClient::new(allowed, None, Duration::from_secs(5)).unwrap();
    let results =
        within("the tools", Duration::from_secs(5), client.run(endpoint, &[], "beta", "run_3", &DECLARED, &calls))
            .await;
    for r in &results {
        assert!(r.error);
        assert_eq!(r.output, "tool error: the endpoint \"http://127.0.0.1:9/tools\" is not allowed on this worker");
    }
    // acme's run may: it is called (and nothing answers there).
    let results =
        within("the tools", Duration::from_secs(5), client.run(endpoint, &[], "acme", "run_3", &DECLARED, &calls))
            .await;
    assert!(results[0].error && !results[0].output.contains("not allowed"), "{}", results[0].output);
}

#[tokio::test]
async fn a_call_to_a_tool_the_run_never_declared_is_not_run_and_never_reaches_the_endpoint() {
    let reached = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = reached.clone();
    let base = serve(Router::new().fallback(move |Json(req): Json<Value>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(req["name"].as_str().unwrap_or_default().to_owned());
            Json(json!({"output": "ran"}))
        }
    }))
    .await;
    let endpoint = format!("{base}/tools");
    let client =
        ToolClient::new(ToolEndpoints::every_tenant([endpoint.clone()]), None, Duration::from_secs(5)).unwrap();
    let calls = [tool_call("call_1", "search"), tool_call("call_2", "delete_everything"), tool_call("call_3", "")];
    let results =
        within("the tools", Duration::from_secs(10), client.run(&endpoint, &[], "acme", "run_4", &["search"], &calls))
            .await;
    assert_eq!(*reached.lock().unwrap(), vec!["search"], "only the declared tool reached the endpoint");
    assert_eq!((results[0].output.as_str(), results[0].error), ("ran", false));
    assert_eq!(results[1].output, "tool error: not run: the run declared no tool named \"delete_everything\"");
    assert_eq!(results[2].output, "tool error: not run: the run declared no tool named \"\"");
    assert!(results[1].error && results[2].error);
}

#[tokio::test]
async fn a_turns_tool_answers_share_16_mib_and_an_answer_past_its_share_is_answered_too_large() {
    let state = ToolServer { barrier: Arc::new(tokio::sync::Barrier::new(2)) };
    let base = serve(Router::new().route("/tools", post(tool_endpoint)).with_state(state)).await;
    let endpoint = format!("{base}/tools");
    let client =
        ToolClient::new(ToolEndpoints::every_tenant([endpoint.clone()]), None, Duration::from_secs(30)).unwrap();
    let big = |n: usize| (0..n).map(|i| tool_call(&format!("call_{i}"), "big")).collect::<Vec<_>>();
    // Two calls share 16 MiB: 8 MiB each, and 6 MiB answers are read whole.
    let two =
        within("the tools", Duration::from_secs(60), client.run(&endpoint, &[], "acme", "run_5", &DECLARED, &big(2)))
            .await;
    assert!(
        two.iter().all(|r| !r.error && r.output.len() == 6 << 20),
        "{:?}",
        two.iter().map(|r| &r.output[..60]).collect::<Vec<_>>()
    );
    // Three: 5.3 MiB each, and not one 6 MiB answer is held whole.
    let three =
        within("the tools", Duration::from_secs(60), client.run(&endpoint, &[], "acme", "run_5", &DECLARED, &big(3)))
            .await;
    for r in &three {
        assert_eq!(
            r.output,
            "tool error: the answer is larger than 5461 KiB, its share of the 16 MiB a turn's tool answers may take together"
        );
    }
    assert_eq!(worker::tools::MAX_TOOL_ANSWERS_PER_TURN, 16 << 20);
}
