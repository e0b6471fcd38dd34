//! Anthropic's Messages API (`POST /v1/messages`): reading a request into a
//! [`Prompt`], checking the rules Anthropic enforces, and writing the answer
//! as one JSON message or as the event sequence a streaming client reads:
//! `message_start`, per block `content_block_start` / `content_block_delta`
//! (`text_delta`, `input_json_delta`, `thinking_delta`, `signature_delta`) /
//! `content_block_stop`, a `ping`, `message_delta` (the `stop_reason` and
//! the output usage), `message_stop`. A mid-stream failure is an `error`
//! event `{"type":"error","error":{"type","message"}}`.
//!
//! The script is the same as for OpenAI's formats: `tool_result` blocks are
//! the conversation's tool outputs, `tool_choice: {"type": "tool"}` names the
//! tool called, `{"type": "none"}` offers none; the output limit is
//! `max_tokens` (required, as Anthropic requires it).
//!
//! A request Anthropic would refuse is refused the same way (400
//! `invalid_request_error`), so a test against the mock catches a client that
//! sends what the real API rejects: `temperature` over 1, `thinking` beside
//! `temperature`, beside a forced `tool_choice` or with a budget outside
//! 1 024..`max_tokens`, and — with thinking on — an assistant turn of tool
//! use that does not start with its thinking block.

use serde_json::{json, Value};

use crate::cache::CacheUsage;
use crate::prefix::{check_markers, Prefix};
use crate::script::{count_tokens, deltas, fnv1a, Answer, Prompt};
use crate::wire::{
    fragments, pick_tool, string_chars, Api, Reply, Request, StreamError, StreamPlan, ARG_CHARS_PER_DELTA,
    WORDS_PER_DELTA,
};

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_mock"})
}

/// The Anthropic error type of an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An OpenAI-shaped error body (what the server builds) in Anthropic's shape.
pub fn from_openai_error(status: u16, body: &Value) -> Value {
    let message = body["error"]["message"].as_str().unwrap_or("error");
    let message = if status == 529 { "Overloaded" } else { message };
    error_body(error_type(status), message)
}

/// Reads a Messages request; the error is the message of a 400.
pub fn parse(body: &Value) -> Result<Request, String> {
    let obj = body.as_object().ok_or("The request body must be a JSON object.")?;
    let model = obj.get("model").and_then(Value::as_str).ok_or("model: Field required")?.to_string();
    let max_tokens = obj.get("max_tokens").and_then(Value::as_u64).ok_or("max_tokens: Field required")?;
    let messages = obj.get("messages").and_then(Value::as_array).ok_or("messages: Field required")?;
    check(obj, messages, max_tokens)?;
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let tools = obj.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
    let choice = obj.get("tool_choice");
    let choice_type = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    let forced = choice.filter(|_| choice_type == Some("tool")).and_then(|c| c.get("name")).and_then(Value::as_str);
    let tool = pick_tool(&tools, choice_type == Some("none"), forced);
    // A forced choice cannot be answered in text: once the rounds are done,
    // `tool` keeps calling its tool, `any` calls the last tool offered (where
    // a client puts the tool that carries its structured answer).
    let must_call = match choice_type {
        Some("tool") => tool.clone(),
        Some("any") => tools.last().and_then(|t| pick_tool(std::slice::from_ref(t), false, None)),
        _ => None,
    };
    let system = obj.get("system").cloned().unwrap_or(Value::Null);
    // Checked with or without `--cache`: the real API refuses bad markers always.
    check_markers(&tools, &system, messages)?;
    let tools_chars = if tools.is_empty() { 0 } else { Value::Array(tools).to_string().chars().count() };
    let tool_outputs = messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
        .count();
    let chars = string_chars(&system) + messages.iter().map(string_chars).sum::<usize>();
    let fingerprint = fnv1a(json!([system, messages]).to_string().as_bytes(), 0);
    let thinking = obj.get("thinking").and_then(|t| t.get("type")).and_then(Value::as_str) == Some("enabled");
    Ok(Request {
        api: Api::Messages,
        prompt: Prompt {
            model,
            input_tokens: count_tokens(chars + tools_chars).max(1),
            tool_outputs,
            tool,
            max_output_tokens: Some(max_tokens),
            fingerprint,
            answer_schema: None,
            forced: must_call,
        },
        stream,
        include_usage: false,
        thinking,
        // Anthropic counts thinking as output and reports no part of it apart.
        reasoning_tokens: 0,
        prefix: Prefix::None,
        cache: CacheUsage::default(),
    })
}

/// The rules the real API enforces that a client is likely to break.
fn check(obj: &serde_json::Map<String, Value>, messages: &[Value], max_tokens: u64) -> Result<(), String> {
    if let Some(t) = obj.get("temperature").and_then(Value::as_f64) {
        if !(0.0..=1.0).contains(&t) {
            return Err("temperature: Input should be less than or equal to 1".into());
        }
    }
    let thinking = obj.get("thinking").filter(|t| t.get("type").and_then(Value::as_str) == Some("enabled"));
    let Some(thinking) = thinking else { return Ok(()) };
    let budget = thinking.get("budget_tokens").and_then(Value::as_u64).unwrap_or(0);
    if budget < 1024 {
        return Err("thinking.enabled.budget_tokens: Input should be greater than or equal to 1024".into());
    }
    if budget >= max_tokens {
        return Err("`max_tokens` must be greater than `thinking.budget_tokens`".into());
    }
    if obj.contains_key("temperature") {
        return Err("`temperature` may only be set to 1 when thinking is enabled".into());
    }
    let choice = obj.get("tool_choice").and_then(|c| c.get("type")).and_then(Value::as_str);
    if matches!(choice, Some("any" | "tool")) {
        return Err("Thinking may not be enabled when tool_choice forces tool use.".into());
    }
    // The last assistant message, when it used a tool, must start with its thinking.
    if let Some((i, last)) = messages.iter().enumerate().rev().find(|(_, m)| m["role"] == "assistant") {
        let blocks = last["content"].as_array().cloned().unwrap_or_default();
        let uses_tools = blocks.iter().any(|b| b["type"] == "tool_use");
        let first = blocks.first().and_then(|b| b["type"].as_str()).unwrap_or("text");
        if uses_tools && !matches!(first, "thinking" | "redacted_thinking") {
            return Err(format!(
                "messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{first}`. When \
                 `thinking` is enabled, a final `assistant` message must start with a thinking block."
            ));
        }
    }
    Ok(())
}

/// The signed thinking of an answer (when the request turned thinking on).
fn thinking(r: &Reply) -> Option<(String, String)> {
    r.request.thinking.then(|| {
        let round = r.request.prompt.tool_outputs + 1;
        let text = format!("The mock thinks about round {round}.");
        let signature = format!("sig_{:016x}", fnv1a(text.as_bytes(), r.request.prompt.fingerprint));
        (text, signature)
    })
}

fn thinking_tokens(r: &Reply) -> u64 {
    thinking(r).map_or(0, |(t, _)| count_tokens(t.chars().count()))
}

fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.trim_start_matches("call_"))
}

/// Anthropic's usage: `input_tokens` is the part after the last cached or
/// written breakpoint; the three input fields add up to the prompt.
fn usage(r: &Reply, output_tokens: u64) -> Value {
    let cache = r.request.cache;
    let uncached = r.input_tokens().saturating_sub(cache.read + cache.write);
    json!({"input_tokens": uncached, "cache_creation_input_tokens": cache.write,
           "cache_read_input_tokens": cache.read, "output_tokens": output_tokens, "service_tier": "standard"})
}

fn stop_reason(r: &Reply) -> &'static str {
    match r.answer {
        Answer::Calls(_) => "tool_use",
        Answer::Text { truncated: true, .. } => "max_tokens",
        Answer::Text { .. } => "end_turn",
    }
}

/// The answer's output tokens, thinking included (Anthropic counts it as output).
pub fn output_tokens(r: &Reply) -> u64 {
    r.output_tokens() + thinking_tokens(r)
}

fn message_id(r: &Reply) -> String {
    format!("msg_{}", r.id_hex())
}

/// The non-streaming Messages body.
pub fn messages_json(r: &Reply) -> Value {
    let mut content = Vec::new();
    if let Some((text, signature)) = thinking(r) {
        content.push(json!({"type": "thinking", "thinking": text, "signature": signature}));
    }
    match r.answer {
        Answer::Calls(calls) => {
            for c in calls {
                let input: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
                content
                    .push(json!({"type": "tool_use", "id": tool_use_id(&c.call_id), "name": c.name, "input": input}));
            }
        }
        Answer::Text { text, .. } => content.push(json!({"type": "text", "text": text})),
    }
    json!({
        "id": message_id(r), "type": "message", "role": "assistant", "model": r.request.prompt.model,
        "content": content, "stop_reason": stop_reason(r), "stop_sequence": null,
        "usage": usage(r, output_tokens(r)),
    })
}

/// The Messages event sequence.
pub fn messages_stream(r: &Reply) -> StreamPlan {
    let mut events: Vec<Value> = vec![json!({"type": "message_start", "message": {
        "id": message_id(r), "type": "message", "role": "assistant", "model": r.request.prompt.model,
        "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage(r, 1)}})];
    let mut index = 0;
    if let Some((text, signature)) = thinking(r) {
        events.push(json!({"type": "content_block_start", "index": index,
                           "content_block": {"type": "thinking", "thinking": ""}}));
        events.push(json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "thinking_delta", "thinking": text}}));
        events.push(json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": signature}}));
        events.push(json!({"type": "content_block_stop", "index": index}));
        index += 1;
    }
    let mut midpoint = None;
    let mut tokens_by_midpoint = 0;
    match r.answer {
        Answer::Text { text, tokens, .. } => {
            events.push(
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
            );
            events.push(json!({"type": "ping"}));
            let parts = deltas(text, WORDS_PER_DELTA);
            let half = parts.len().div_ceil(2).max(1);
            for (i, delta) in parts.iter().enumerate() {
                events.push(json!({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "text_delta", "text": delta}}));
                if i + 1 == half {
                    midpoint = Some(events.len());
                    tokens_by_midpoint = (((i + 1) * WORDS_PER_DELTA) as u64).min(*tokens);
                }
            }
            events.push(json!({"type": "content_block_stop", "index": index}));
        }
        Answer::Calls(calls) => {
            for call in calls {
                events.push(json!({"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": tool_use_id(&call.call_id), "name": call.name, "input": {}}}));
                events.push(json!({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "input_json_delta", "partial_json": ""}}));
                for frag in fragments(&call.arguments, ARG_CHARS_PER_DELTA) {
                    events.push(json!({"type": "content_block_delta", "index": index,
                                       "delta": {"type": "input_json_delta", "partial_json": frag}}));
                    if midpoint.is_none() {
                        midpoint = Some(events.len());
                        tokens_by_midpoint = count_tokens(frag.chars().count());
                    }
                }
                events.push(json!({"type": "content_block_stop", "index": index}));
                index += 1;
            }
        }
    }
    events.push(json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(r), "stop_sequence": null},
                       "usage": {"output_tokens": output_tokens(r)}}));
    events.push(json!({"type": "message_stop"}));
    let last = events.len() - 1;
    let frames = events
        .into_iter()
        .map(|event| {
            let kind = event["type"].as_str().unwrap_or_default().to_string();
            format!("event: {kind}\ndata: {event}\n\n")
        })
        .collect();
    StreamPlan { api: Api::Messages, frames, midpoint: midpoint.unwrap_or(last).min(last), tokens_by_midpoint }
}

/// A mid-stream failure as Anthropic sends it: a server error is
/// `overloaded_error`, a rate limit `rate_limit_error`.
pub fn error_frame(err: &StreamError) -> String {
    let (kind, message) = if err.code == "rate_limit_exceeded" {
        ("rate_limit_error", err.message.as_str())
    } else {
        ("overloaded_error", "Overloaded")
    };
    let data = json!({"type": "error", "error": {"type": kind, "message": message}});
    format!("event: error\ndata: {data}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::script::{answer, Script};

    const SCRIPT: Script = Script { tool_rounds: 1, calls_per_round: 1, output_tokens: 20 };

    fn body() -> Value {
        json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": true, "system": "Be brief.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
               "tools": [{"name": "search", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]})
    }

    #[test]
    fn parses_a_messages_request() {
        let req = parse(&body()).unwrap();
        assert_eq!(req.prompt.max_output_tokens, Some(100));
        assert_eq!(req.prompt.tool.as_ref().unwrap().name, "search");
        let mut with_result = body();
        with_result["messages"] = json!([
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]);
        assert_eq!(parse(&with_result).unwrap().prompt.tool_outputs, 1);
        let mut none = body();
        none["tool_choice"] = json!({"type": "none"});
        assert!(parse(&none).unwrap().prompt.tool.is_none());
        let mut no_max = body();
        no_max.as_object_mut().unwrap().remove("max_tokens");
        assert!(parse(&no_max).unwrap_err().contains("max_tokens"));
    }

    #[test]
    fn what_anthropic_refuses_is_refused() {
        let with = |patch: Value| {
            let mut b = body();
            for (k, v) in patch.as_object().unwrap() {
                b[k] = v.clone();
            }
            parse(&b).map(|_| ())
        };
        assert!(with(json!({"temperature": 1.5})).is_err());
        assert!(with(json!({"temperature": 0.7})).is_ok());
        let thinking = json!({"type": "enabled", "budget_tokens": 1024});
        assert!(with(json!({"thinking": thinking})).is_err(), "budget >= max_tokens");
        assert!(with(json!({"thinking": thinking, "max_tokens": 2000})).is_ok());
        assert!(with(json!({"thinking": thinking, "max_tokens": 2000, "temperature": 0.5})).is_err());
        assert!(with(json!({"thinking": thinking, "max_tokens": 2000, "tool_choice": {"type": "any"}})).is_err());
        let unsigned_turn = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]);
        let err = with(json!({"thinking": thinking, "max_tokens": 2000, "messages": unsigned_turn})).unwrap_err();
        assert!(err.contains("must start with a thinking block"), "{err}");
    }

    #[test]
    fn the_stream_is_anthropics_event_sequence() {
        let mut b = body();
        b["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
        b["max_tokens"] = json!(2000);
        let req = parse(&b).unwrap();
        let ans = answer(&req.prompt, &SCRIPT);
        let plan = messages_stream(&Reply { request: &req, body: &b, answer: &ans, seq: 1, created: 0 });
        let kinds: Vec<String> = plan.frames.iter().map(|f| f.lines().next().unwrap().to_string()).collect();
        assert_eq!(kinds.first().unwrap(), "event: message_start");
        assert_eq!(kinds[1], "event: content_block_start");
        assert!(plan.frames[2].contains("thinking_delta") && plan.frames[3].contains("signature_delta"));
        assert!(plan.frames.iter().any(|f| f.contains("input_json_delta")));
        assert_eq!(kinds[kinds.len() - 2], "event: message_delta");
        assert!(plan.frames[kinds.len() - 2].contains("\"stop_reason\":\"tool_use\""));
        assert_eq!(kinds.last().unwrap(), "event: message_stop");
        let json = messages_json(&Reply { request: &req, body: &b, answer: &ans, seq: 1, created: 0 });
        assert_eq!(json["content"][0]["type"], "thinking");
        assert_eq!(json["content"][1]["type"], "tool_use");
        assert!(json["content"][1]["id"].as_str().unwrap().starts_with("toolu_"));
    }
}
