//! Decoding an Anthropic Messages stream (`POST /v1/messages`, `stream:
//! true`) into the Responses shape the transcript keeps.
//!
//! Events: `message_start` (the input usage), `content_block_start` /
//! `content_block_delta` (`text_delta`, `input_json_delta`, `thinking_delta`,
//! `signature_delta`) / `content_block_stop` per block, `message_delta` (the
//! `stop_reason` and the output usage), `message_stop` (the terminal),
//! `ping`, and `error` (`{"type":"error","error":{"type","message"}}`, e.g.
//! `overloaded_error` in a 200 stream). Unknown events and block types are
//! skipped.
//!
//! Blocks become items: `text` the assistant message, `tool_use` a
//! `function_call` (`call_id` = the block's id, `arguments` = its input as
//! JSON text), `thinking` a `reasoning` item carrying its text and its
//! signature as `encrypted_content` (sent back as the same block while
//! thinking is on), `redacted_thinking` one with only `encrypted_content`.
//! A `tool_use` of the run's *answer tool* (structured output, see
//! `request/anthropic.rs`) is the answer: its input, as JSON text, is the
//! message's text.
//!
//! `stop_reason`: `end_turn`, `tool_use`, `stop_sequence` finish the answer;
//! `max_tokens` finishes it with `incomplete_reason: max_output_tokens` and
//! drops a tool call whose input was cut (its JSON does not parse); `refusal`
//! is `content_filter`.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use shared::pacer::FailureKind;

use super::decode::{count, str_field, Decoded, ProviderErrorBody, Verdict};
use super::responses::assistant_message;
use super::sse::SseEvent;
use super::{CallUsage, StreamEvent, ToolCall};
use shared::runs::Usage;

/// One content block as it streams in.
#[derive(Debug, Default)]
struct Block {
    kind: String,
    text: String,
    /// `tool_use`: the id, the name, the input given at the start (a
    /// non-streamed answer carries it whole) and the streamed JSON.
    id: String,
    name: String,
    start_input: Option<Value>,
    json: String,
    /// `thinking`: the signature; `redacted_thinking`: the data.
    secret: String,
    done: bool,
}

/// Decoder state for one Messages stream.
#[derive(Debug, Default)]
pub(crate) struct AnthropicDecoder {
    /// The tool whose call is the structured answer, if the run asked for one.
    answer_tool: Option<String>,
    blocks: BTreeMap<u64, Block>,
    /// Usage as `message_start` reported it, updated by `message_delta`.
    usage: Option<Value>,
    stop_reason: Option<String>,
    /// `message_start`'s model.
    model: Option<String>,
}

impl AnthropicDecoder {
    /// A decoder; `answer_tool` names the structured answer's tool.
    pub fn new(answer_tool: Option<String>) -> Self {
        Self { answer_tool, ..Self::default() }
    }

    /// Decodes one SSE event.
    pub fn event(&mut self, ev: &SseEvent, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        let data: Value = match serde_json::from_str(&ev.data) {
            Ok(v) => v,
            Err(error) => {
                tracing::warn!(message = "unreadable Anthropic stream frame skipped", %error, event = ?ev.event);
                return Verdict::Pending;
            }
        };
        let kind = str_field(&data, "type").or(ev.event.as_deref()).unwrap_or_default();
        let index = data.get("index").and_then(Value::as_u64).unwrap_or(0);
        match kind {
            "message_start" => {
                self.model =
                    data.get("message").and_then(|m| m.get("model")).and_then(Value::as_str).map(str::to_owned);
                if let Some(u) = data.get("message").and_then(|m| m.get("usage")).filter(|u| u.is_object()) {
                    self.usage = Some(u.clone());
                }
            }
            "content_block_start" => {
                let cb = data.get("content_block").cloned().unwrap_or(Value::Null);
                let mut block = Block {
                    kind: str_field(&cb, "type").unwrap_or_default().to_owned(),
                    id: str_field(&cb, "id").unwrap_or_default().to_owned(),
                    name: str_field(&cb, "name").unwrap_or_default().to_owned(),
                    ..Block::default()
                };
                match block.kind.as_str() {
                    "text" => {
                        let text = str_field(&cb, "text").unwrap_or_default();
                        if !text.is_empty() {
                            emit(StreamEvent::TextDelta(text.to_owned()));
                        }
                        block.text.push_str(text);
                    }
                    "tool_use" => {
                        block.start_input =
                            cb.get("input").filter(|i| i.as_object().is_some_and(|o| !o.is_empty())).cloned();
                    }
                    "thinking" => {
                        block.text.push_str(str_field(&cb, "thinking").unwrap_or_default());
                        block.secret.push_str(str_field(&cb, "signature").unwrap_or_default());
                    }
                    "redacted_thinking" => block.secret.push_str(str_field(&cb, "data").unwrap_or_default()),
                    _ => {}
                }
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let delta = data.get("delta").cloned().unwrap_or(Value::Null);
                let Some(block) = self.blocks.get_mut(&index) else { return Verdict::Pending };
                match str_field(&delta, "type") {
                    Some("text_delta") => {
                        if let Some(text) = str_field(&delta, "text").filter(|t| !t.is_empty()) {
                            block.text.push_str(text);
                            emit(StreamEvent::TextDelta(text.to_owned()));
                        }
                    }
                    Some("input_json_delta") => {
                        block.json.push_str(str_field(&delta, "partial_json").unwrap_or_default())
                    }
                    Some("thinking_delta") => block.text.push_str(str_field(&delta, "thinking").unwrap_or_default()),
                    Some("signature_delta") => {
                        block.secret.push_str(str_field(&delta, "signature").unwrap_or_default())
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                let answer_tool = self.answer_tool.clone();
                if let Some(block) = self.blocks.get_mut(&index) {
                    block.done = true;
                    if block.kind == "tool_use" {
                        if let Some(arguments) = block_arguments(block) {
                            if answer_tool.as_deref() == Some(block.name.as_str()) {
                                emit(StreamEvent::TextDelta(arguments));
                            } else {
                                emit(StreamEvent::ToolCall {
                                    call_id: block.id.clone(),
                                    name: block.name.clone(),
                                    arguments,
                                });
                            }
                        }
                    }
                }
            }
            "message_delta" => {
                if let Some(reason) = data.get("delta").and_then(|d| str_field(d, "stop_reason")) {
                    self.stop_reason = Some(reason.to_owned());
                }
                // Counts here are cumulative: they replace the start's.
                if let Some(u) = data.get("usage").and_then(Value::as_object) {
                    let usage = self.usage.get_or_insert_with(|| json!({}));
                    for (k, v) in u {
                        if !v.is_null() {
                            usage[k] = v.clone();
                        }
                    }
                }
            }
            "message_stop" => return Verdict::Finished(self.finish()),
            "error" => {
                let obj = data.get("error").filter(|e| e.is_object()).unwrap_or(&data);
                let mut body = ProviderErrorBody::from_object(obj);
                if body.error_type.as_deref() == Some("error") {
                    body.error_type = None;
                }
                return Verdict::Failed(body);
            }
            // ping, and whatever comes next.
            _ => {}
        }
        Verdict::Pending
    }

    /// The stream closed: finished if a `stop_reason` came, else nothing.
    pub fn eof(&mut self) -> Verdict {
        if self.stop_reason.is_some() {
            Verdict::Finished(self.finish())
        } else {
            Verdict::Pending
        }
    }

    fn finish(&mut self) -> Decoded {
        let cut = self.stop_reason.as_deref() == Some("max_tokens");
        let mut reasoning = Vec::new();
        let mut text = String::new();
        let mut calls = Vec::new();
        for (_, block) in std::mem::take(&mut self.blocks) {
            match block.kind.as_str() {
                "text" => text.push_str(&block.text),
                "thinking" if !block.secret.is_empty() => reasoning.push(json!({
                    "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}],
                    "encrypted_content": block.secret,
                })),
                "redacted_thinking" if !block.secret.is_empty() => {
                    reasoning.push(json!({"type": "reasoning", "summary": [], "encrypted_content": block.secret}))
                }
                "tool_use" => {
                    let Some(arguments) = block_arguments(&block).filter(|_| block.done || !cut) else {
                        tracing::warn!(message = "tool call cut by the output limit dropped", tool.name = %block.name);
                        continue;
                    };
                    if self.answer_tool.as_deref() == Some(block.name.as_str()) {
                        text.push_str(&arguments);
                    } else if !block.name.is_empty() {
                        calls.push(ToolCall { call_id: block.id.clone(), name: block.name.clone(), arguments });
                    }
                }
                other => tracing::debug!(message = "content block not kept in the transcript", block.kind = other),
            }
        }
        let mut output = reasoning;
        if !text.is_empty() {
            output.push(assistant_message(&text));
        }
        for call in &calls {
            output.push(json!({"type": "function_call", "call_id": call.call_id, "name": call.name,
                               "arguments": call.arguments}));
        }
        let incomplete_reason = match self.stop_reason.as_deref() {
            Some("max_tokens") => Some("max_output_tokens".to_owned()),
            Some("refusal") => Some("content_filter".to_owned()),
            _ => None,
        };
        Decoded {
            output,
            output_text: text,
            tool_calls: calls,
            usage: self.usage.as_ref().map(usage),
            incomplete_reason,
            model: self.model.take(),
        }
    }
}

/// A `tool_use` block's input as JSON text: the streamed JSON when there was
/// some (`None` when it does not parse: the output limit cut it), else the
/// input the start carried, else `{}`.
fn block_arguments(block: &Block) -> Option<String> {
    if !block.json.trim().is_empty() {
        let value: Value = serde_json::from_str(&block.json).ok()?;
        return Some(value.to_string());
    }
    Some(block.start_input.as_ref().map(Value::to_string).unwrap_or_else(|| "{}".to_owned()))
}

/// Anthropic's usage in paceline's terms. Its `input_tokens` are only the
/// uncached part: the input is that plus the cache writes and reads; the
/// cache reads are the cached part; and what its input rate limit counts is
/// the input without the cache reads (Anthropic does not count those).
fn usage(u: &Value) -> CallUsage {
    let uncached = count(u, "input_tokens").unwrap_or(0);
    let written = count(u, "cache_creation_input_tokens").unwrap_or(0);
    let read = count(u, "cache_read_input_tokens").unwrap_or(0);
    let output_tokens = count(u, "output_tokens").unwrap_or(0);
    let input_tokens = uncached + written + read;
    CallUsage {
        tokens: Usage {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            reasoning_tokens: 0,
            cached_input_tokens: read,
            cache_write_tokens: written,
        },
        charged_input_tokens: uncached + written,
    }
}

/// The frames a non-streamed answer (one JSON message) would have streamed,
/// so it goes through the same decoder.
pub(crate) fn frames_of_message(message: &Value) -> Vec<Value> {
    let mut start = message.clone();
    start["content"] = json!([]);
    let mut frames = vec![json!({"type": "message_start", "message": start})];
    for (index, block) in message.get("content").and_then(Value::as_array).into_iter().flatten().enumerate() {
        frames.push(json!({"type": "content_block_start", "index": index, "content_block": block}));
        frames.push(json!({"type": "content_block_stop", "index": index}));
    }
    frames.push(json!({"type": "message_delta", "delta": {"stop_reason": message.get("stop_reason")},
                       "usage": message.get("usage")}));
    frames.push(json!({"type": "message_stop"}));
    frames
}

/// Anthropic's own words for a stop no wait cures, which the shared
/// classifier (OpenAI's codes) reads as an ordinary 400: `billing_error`, and
/// "Your credit balance is too low" — a billing stop, as `insufficient_quota`.
pub(crate) fn refine(kind: FailureKind, error_type: Option<&str>, message: &str) -> FailureKind {
    if error_type == Some("billing_error") || message.to_ascii_lowercase().contains("credit balance is too low") {
        return FailureKind::Quota;
    }
    kind
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(data: Value) -> SseEvent {
        SseEvent { event: data["type"].as_str().map(str::to_string), data: data.to_string(), id: None }
    }

    fn run(events: &[Value], answer_tool: Option<&str>) -> (Vec<StreamEvent>, Verdict) {
        let mut dec = AnthropicDecoder::new(answer_tool.map(str::to_owned));
        let mut seen = Vec::new();
        for e in events {
            match dec.event(&frame(e.clone()), &mut |ev| seen.push(ev)) {
                Verdict::Pending => {}
                done => return (seen, done),
            }
        }
        let end = dec.eof();
        (seen, end)
    }

    fn start(input: u64, cache_read: u64) -> Value {
        json!({"type": "message_start", "message": {"id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message",
            "role": "assistant", "content": [], "model": "claude-sonnet-4-5", "stop_reason": null,
            "stop_sequence": null, "usage": {"input_tokens": input, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cache_read, "output_tokens": 1}}})
    }

    /// A text answer, as the Messages API streams it (the docs' example).
    #[test]
    fn a_streamed_text_answer() {
        let (seen, out) = run(
            &[
                start(25, 0),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "ping"}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                       "usage": {"output_tokens": 15}}),
                json!({"type": "message_stop"}),
            ],
            None,
        );
        assert_eq!(seen, vec![StreamEvent::TextDelta("Hello".into()), StreamEvent::TextDelta("!".into())]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.output, vec![assistant_message("Hello!")]);
        assert_eq!(d.output_text, "Hello!");
        let u = d.usage.unwrap();
        assert_eq!(
            (u.tokens.input_tokens, u.tokens.output_tokens, u.tokens.total_tokens, u.tokens.cached_input_tokens),
            (25, 15, 40, 0)
        );
        assert_eq!(d.incomplete_reason, None);
    }

    /// Thinking, text and a tool call, with cached input (the docs' shapes).
    #[test]
    fn thinking_text_and_a_tool_call_become_responses_items() {
        let (seen, out) = run(
            &[
                start(10, 2000),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Weather: call the tool."}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQBCgIYAhIM"}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Checking."}}),
                json!({"type": "content_block_stop", "index": 1}),
                json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use",
                       "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather", "input": {}}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"location\": \"San Fra"}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "ncisco, CA\"}"}}),
                json!({"type": "content_block_stop", "index": 2}),
                json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                       "usage": {"output_tokens": 89}}),
                json!({"type": "message_stop"}),
            ],
            None,
        );
        let call = StreamEvent::ToolCall {
            call_id: "toolu_01T1x1fJ34qAmk2tNTrN7Up6".into(),
            name: "get_weather".into(),
            arguments: r#"{"location":"San Francisco, CA"}"#.into(),
        };
        assert_eq!(seen, vec![StreamEvent::TextDelta("Checking.".into()), call]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(
            d.output,
            vec![
                json!({"type": "reasoning", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "Weather: call the tool."}],
                       "encrypted_content": "EqQBCgIYAhIM"}),
                assistant_message("Checking."),
                json!({"type": "function_call", "call_id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather",
                       "arguments": "{\"location\":\"San Francisco, CA\"}"}),
            ]
        );
        assert_eq!(d.tool_calls.len(), 1);
        let u = d.usage.unwrap();
        assert_eq!(u.tokens.input_tokens, 2010, "cache reads are input too");
        assert_eq!(u.tokens.cached_input_tokens, 2000);
        assert_eq!(u.charged_input_tokens, 10, "Anthropic's input limit does not count cache reads");
    }

    /// The output limit cut a tool call mid-input: dropped, the answer kept.
    #[test]
    fn max_tokens_drops_a_cut_tool_call() {
        let (_, out) = run(
            &[
                start(5, 0),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "Partial"}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"q\": \"ab"}}),
                json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 64}}),
                json!({"type": "message_stop"}),
            ],
            None,
        );
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.incomplete_reason.as_deref(), Some("max_output_tokens"));
        assert!(d.tool_calls.is_empty());
        assert_eq!(d.output_text, "Partial");
    }

    #[test]
    fn the_answer_tool_is_the_answer_text() {
        let (seen, out) = run(
            &[
                start(5, 0),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_9", "name": "verdict", "input": {}}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{\"ok\": true}"}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}),
                json!({"type": "message_stop"}),
            ],
            Some("verdict"),
        );
        assert_eq!(seen, vec![StreamEvent::TextDelta("{\"ok\":true}".into())]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert!(d.tool_calls.is_empty(), "the answer is not a call to run");
        assert_eq!(d.output, vec![assistant_message("{\"ok\":true}")]);
    }

    #[test]
    fn error_events_and_a_cut_stream() {
        let (seen, out) = run(
            &[
                start(5, 0),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
                json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            ],
            None,
        );
        assert_eq!(seen.len(), 1);
        assert_eq!(
            out,
            Verdict::Failed(ProviderErrorBody {
                code: None,
                error_type: Some("overloaded_error".into()),
                message: "Overloaded".into(),
                retry_delay_ms: None,
            })
        );
        // Closed before message_delta: no answer (the client calls it a reset).
        let (_, out) = run(&[start(5, 0)], None);
        assert_eq!(out, Verdict::Pending);
        // Closed after message_delta without message_stop: the answer is whole.
        let (_, out) =
            run(&[start(5, 0), json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})], None);
        assert!(matches!(out, Verdict::Finished(_)));
    }

    /// A non-streamed answer (the docs' tool-use example) reads the same.
    #[test]
    fn a_json_message_goes_through_the_same_decoder() {
        let message = json!({"id": "msg_01Aq9w938a90dw8q", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5", "stop_reason": "tool_use", "stop_sequence": null,
            "content": [{"type": "text", "text": "I'll check."},
                        {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
                         "input": {"location": "San Francisco, CA", "unit": "celsius"}}],
            "usage": {"input_tokens": 472, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 0, "output_tokens": 91}});
        let mut dec = AnthropicDecoder::new(None);
        let mut seen = vec![];
        let mut out = Verdict::Pending;
        for f in frames_of_message(&message) {
            out = dec.event(&frame(f), &mut |e| seen.push(e));
        }
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.output_text, "I'll check.");
        assert_eq!(d.tool_calls[0].arguments, r#"{"location":"San Francisco, CA","unit":"celsius"}"#);
        let u = d.usage.unwrap();
        assert_eq!((u.tokens.input_tokens, u.charged_input_tokens, u.tokens.output_tokens), (572, 572, 91));
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn billing_stops_are_quota() {
        assert_eq!(refine(FailureKind::Terminal, Some("billing_error"), "x"), FailureKind::Quota);
        let low = "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing.";
        assert_eq!(refine(FailureKind::Terminal, Some("invalid_request_error"), low), FailureKind::Quota);
        let long = "prompt is too long: 208310 tokens > 200000 maximum";
        assert_eq!(refine(FailureKind::Terminal, Some("invalid_request_error"), long), FailureKind::Terminal);
    }
}
