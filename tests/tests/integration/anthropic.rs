//! The provider client on Anthropic's Messages API (`PACELINE_API_STYLE=anthropic`),
//! against the mock's `POST /v1/messages` and a tiny server for what the mock
//! cannot show (the `x-api-key` and `anthropic-version` headers): answers,
//! tool use, thinking, the output limit, Anthropic's rate-limit headers and
//! every error README's "Providers" section names, classified as it says.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use mock_provider::{Fault, HeaderStyle, MockConfig, MockServer};
use serde_json::{json, Value};
use shared::config::Secret;
use shared::pacer::FailureKind;
use shared::runs::ApiStyle;
use worker::provider::{Provider, StreamEvent};

use crate::fixtures::{body, call};

async fn mock(config: MockConfig) -> MockServer {
    MockServer::start(MockConfig { headers: HeaderStyle::Anthropic, ..config }).await.expect("start the mock")
}

fn claude(server: &MockServer) -> Provider {
    Provider::new(ApiStyle::Anthropic, &server.url(), &Secret::new("sk-ant-test"))
        .expect("a provider client")
        .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
}

#[tokio::test]
async fn a_streamed_answer_with_anthropics_headers_and_usage() {
    let server = mock(MockConfig { output_tokens: 40, tpm: 50_000, otpm: Some(8_000), ..MockConfig::default() }).await;
    let (events, result) = call(&claude(&server), body(ApiStyle::Anthropic, false)).await;
    let ok = result.expect("an answer");
    let deltas: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::TextDelta(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert!(deltas.len() > 2, "several text_delta events: {deltas:?}");
    assert_eq!(deltas.concat(), ok.output_text);
    assert_eq!(ok.output_text.split_whitespace().count(), 40);
    assert_eq!(
        ok.output,
        vec![
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ok.output_text}]})
        ]
    );
    let usage = ok.usage.expect("usage from message_start and message_delta");
    assert_eq!(usage.tokens.output_tokens, 40);
    assert!(usage.tokens.input_tokens > 0);
    // anthropic-ratelimit-* headers: the pacer sees the input and output buckets, each
    // on its own, and the requests.
    assert!(ok.headers.input_tokens.limit.is_some() && ok.headers.output_tokens.limit.is_some(), "{:?}", ok.headers);
    assert!(ok.headers.requests.limit.is_some());
    assert!(ok.headers.output_tokens.reset_ms.is_some());
    assert!(ok.headers.tokens.is_empty(), "no combined bucket beside them: {:?}", ok.headers.tokens);
    let stats = server.stats();
    assert_eq!(stats.log[0].api, Some(mock_provider::wire::Api::Messages));
    assert_eq!(stats.bodies[0].body["stream"], json!(true));
    assert_eq!(stats.bodies[0].body["max_tokens"], json!(500));
    // The output bucket was charged the output limit, and got the unused part back.
    assert_eq!(stats.output_tokens_admitted, 40);
}

#[tokio::test]
async fn tool_use_comes_back_as_function_calls_and_goes_out_as_tool_results() {
    let server = mock(MockConfig { tool_rounds: 2, calls_per_round: 2, ..MockConfig::default() }).await;
    let p = claude(&server);
    let (events, first) = call(&p, body(ApiStyle::Anthropic, true)).await;
    let first = first.expect("an answer");
    assert_eq!(first.tool_calls.len(), 2);
    for (item, c) in first.output.iter().zip(&first.tool_calls) {
        assert!(c.call_id.starts_with("toolu_"), "{}", c.call_id);
        assert_eq!(
            item,
            &json!({"type": "function_call", "call_id": c.call_id, "name": "search", "arguments": c.arguments})
        );
        let args: Value = serde_json::from_str(&c.arguments).unwrap();
        assert!(args.get("query").is_some(), "{args}");
    }
    assert_eq!(events.iter().filter(|e| matches!(e, StreamEvent::ToolCall { .. })).count(), 2);

    // The next turn: the stored items, translated back, with both results in one user message.
    let mut context = vec![json!({"role": "user", "content": "What is paceline?"})];
    context.extend(first.output.iter().cloned());
    for c in &first.tool_calls {
        context.push(json!({"type": "function_call_output", "call_id": c.call_id, "output": "found"}));
    }
    let (system, messages) = worker::request::anthropic_messages(Some("Be brief."), &context, false);
    let mut next = body(ApiStyle::Anthropic, true);
    next["system"] = json!(system);
    next["messages"] = json!(messages);
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert_eq!(messages[2]["content"].as_array().unwrap().len(), 2, "one user message holds both results");
    let (_, second) = call(&p, next.clone()).await;
    let second = second.expect("an answer");
    assert!(second.tool_calls.is_empty() && !second.output_text.is_empty(), "two results: the script answers");
    assert_eq!(server.stats().log[1].tool_outputs, 2);
}

#[tokio::test]
async fn thinking_blocks_come_back_signed_and_a_turn_without_them_is_refused() {
    let server = mock(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let p = claude(&server);
    let mut b = body(ApiStyle::Anthropic, true);
    b["max_tokens"] = json!(4000);
    b["thinking"] = json!({"type": "enabled", "budget_tokens": 2000});
    let (_, first) = call(&p, b.clone()).await;
    let first = first.expect("an answer");
    let reasoning = &first.output[0];
    assert_eq!(reasoning["type"], "reasoning");
    assert!(reasoning["encrypted_content"].as_str().unwrap().starts_with("sig_"), "{reasoning}");
    let mut context = vec![json!({"role": "user", "content": "What is paceline?"})];
    context.extend(first.output.iter().cloned());
    context.push(json!({"type": "function_call_output", "call_id": first.tool_calls[0].call_id, "output": "ok"}));
    // With its thinking, the tool turn is accepted (the real API requires it) ...
    let (_, messages) = worker::request::anthropic_messages(None, &context, true);
    assert_eq!(messages[1]["content"][0]["type"], "thinking");
    let mut next = b.clone();
    next["messages"] = json!(messages);
    assert!(call(&p, next).await.1.is_ok());
    // ... without it, it is a 400, as from Anthropic.
    let (_, messages) = worker::request::anthropic_messages(None, &context, false);
    let mut next = b;
    next["messages"] = json!(messages);
    let f = call(&p, next).await.1.expect_err("refused");
    assert_eq!((f.status, f.kind), (Some(400), FailureKind::Terminal));
    assert_eq!(f.error_type.as_deref(), Some("invalid_request_error"));
}

#[tokio::test]
async fn max_tokens_is_an_incomplete_success() {
    let server = mock(MockConfig { output_tokens: 50, ..MockConfig::default() }).await;
    let mut b = body(ApiStyle::Anthropic, false);
    b["max_tokens"] = json!(10);
    let ok = call(&claude(&server), b).await.1.expect("an answer");
    assert_eq!(ok.incomplete_reason.as_deref(), Some("max_output_tokens"));
    assert_eq!(ok.output_text.split_whitespace().count(), 10);
}

#[tokio::test]
async fn anthropics_errors_are_classified_as_the_spec_says() {
    let server = mock(MockConfig::default()).await;
    let p = claude(&server);
    // 429 rate_limit_error with retry-after: a rate limit, the delay read.
    server.inject(Fault::RateLimited { retry_after_ms: 2000 });
    let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a 429");
    assert_eq!((f.status, f.kind), (Some(429), FailureKind::RateLimited));
    assert_eq!(f.error_type.as_deref(), Some("rate_limit_error"));
    assert_eq!(f.headers.retry_after_ms, Some(2000), "retry-after in seconds");
    assert!(f.headers.output_tokens.limit.is_some(), "a 429's anthropic-ratelimit-* headers are read");
    // 529 overloaded_error and 500 api_error: transient.
    for (status, kind) in [(529, "overloaded_error"), (500, "api_error")] {
        server.inject(Fault::ServerError { status });
        let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a 5xx");
        assert_eq!((f.status, f.kind), (Some(status), FailureKind::Transient), "{status}");
        assert_eq!(f.error_type.as_deref(), Some(kind));
    }
    // 400 invalid_request_error: terminal, with Anthropic's message; a prompt
    // too long is its own kind (the worker trims it and sends it once more).
    let invalid = "messages.0.content: Input should be a valid list";
    server.inject(Fault::InvalidRequest { message: Some(invalid.into()) });
    let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a 400");
    assert_eq!((f.status, f.kind), (Some(400), FailureKind::Terminal));
    assert!(f.message.contains(invalid), "{}", f.message);
    server.inject(Fault::InvalidRequest { message: None });
    let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a 400");
    assert_eq!((f.status, f.kind), (Some(400), FailureKind::ContextOverflow));
    assert!(f.message.contains("prompt is too long"), "{}", f.message);
    // A credit balance too low: a billing stop (quota), not an ordinary 400.
    server.inject(Fault::Quota);
    let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a 400");
    assert_eq!((f.status, f.kind), (Some(400), FailureKind::Quota));
    // overloaded_error inside a 200 stream, after some text: transient, text was streamed.
    server.inject(Fault::MidstreamError { code: None });
    let (events, result) = call(&p, body(ApiStyle::Anthropic, false)).await;
    let f = result.expect_err("a mid-stream error");
    assert_eq!((f.status, f.kind, f.streamed_text), (Some(200), FailureKind::Transient, true));
    assert_eq!(f.error_type.as_deref(), Some("overloaded_error"));
    assert!(!events.is_empty());
    server.inject(Fault::MidstreamError { code: Some("rate_limit_exceeded".into()) });
    let f = call(&p, body(ApiStyle::Anthropic, false)).await.1.expect_err("a mid-stream error");
    assert_eq!(f.kind, FailureKind::RateLimited);
    // Every body the mock answered was Anthropic's error shape.
    let codes: Vec<u16> = server.stats().log.iter().map(|e| e.status).collect();
    assert_eq!(codes, vec![429, 529, 500, 400, 400, 400, 200, 200]);
}

/// One request as the server saw it.
struct Request {
    api_key: Option<String>,
    version: Option<String>,
    authorization: Option<String>,
    body: String,
}

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Request>>>);

/// Records the headers that authenticate a Messages request, and answers one
/// JSON message (a server that does not stream).
async fn messages(State(seen): State<Seen>, headers: HeaderMap, body: String) -> impl IntoResponse {
    let h = |n: &str| headers.get(n).map(|v| v.to_str().unwrap().to_string());
    seen.0.lock().unwrap().push(Request {
        api_key: h("x-api-key"),
        version: h("anthropic-version"),
        authorization: h("authorization"),
        body,
    });
    axum::Json(json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3, "output_tokens": 1}}))
}

#[tokio::test]
async fn the_key_goes_in_x_api_key_with_the_version_and_never_as_a_bearer() {
    let seen = Seen::default();
    let app = Router::new().route("/v1/messages", post(messages)).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    for key in ["sk-ant-canary-7f3a", ""] {
        let p = Provider::new(ApiStyle::Anthropic, &base, &Secret::new(key)).unwrap();
        assert!(!format!("{p:?}").contains("sk-ant-canary"));
        let (events, result) = call(&p, body(ApiStyle::Anthropic, false)).await;
        let ok = result.expect("an answer");
        assert_eq!(events, vec![StreamEvent::TextDelta("Hi".into())]);
        let u = ok.usage.unwrap();
        assert_eq!((u.tokens.input_tokens, u.tokens.cached_input_tokens, u.charged_input_tokens), (10, 3, 7));
    }
    let seen = seen.0.lock().unwrap();
    assert_eq!(seen[0].api_key.as_deref(), Some("sk-ant-canary-7f3a"));
    assert_eq!(seen[0].version.as_deref(), Some("2023-06-01"));
    assert_eq!(seen[0].authorization, None, "no Authorization header");
    assert!(!seen[0].body.contains("sk-ant-canary"), "the key is not in the body");
    assert_eq!((seen[1].api_key.as_deref(), seen[1].version.as_deref()), (None, Some("2023-06-01")));
}
