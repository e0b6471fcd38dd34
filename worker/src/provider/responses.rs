//! Decoding a Responses API stream (`POST /responses`, `stream: true`).
//!
//! Text deltas and finished function calls are handed to the caller as they
//! arrive; the terminal event's `response` is the source of truth for the
//! output and the usage. Terminals: `response.completed`,
//! `response.incomplete` (a success with what it has, see [`ResponsesDecoder`]),
//! `response.failed`, and the `error` event (flat or nested). Unknown event
//! types are skipped: new ones appear over time.

use serde_json::{json, Value};

use super::decode::{count, str_field, Decoded, ProviderErrorBody, Verdict};
use super::sse::SseEvent;
use super::{CallUsage, StreamEvent, ToolCall};
use shared::runs::Usage;

/// Decoder state for one Responses stream.
///
/// `response.incomplete` is decoded as a **success** carrying
/// `incomplete_reason` (`max_output_tokens`, `content_filter`): the
/// `max_output_tokens` cut is the run's own limit doing its job, the provider
/// spent the tokens and re-sending would be cut at the same place, so it is
/// neither retryable nor the provider's failure. What is unusable is dropped
/// instead: a `function_call` the cut left `incomplete` (its arguments are
/// truncated JSON) is not returned and not run.
#[derive(Debug, Default)]
pub(crate) struct ResponsesDecoder {
    /// Text deltas so far (used only when the terminal event has no message).
    text: String,
    /// Items from `response.output_item.done`, in case the terminal event
    /// carries no `output`.
    items: Vec<Value>,
}

impl ResponsesDecoder {
    /// Decodes one SSE event.
    pub fn event(&mut self, ev: &SseEvent, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        let data: Value = match serde_json::from_str(&ev.data) {
            Ok(v) => v,
            Err(error) => {
                // One unreadable frame is skipped like an unknown event; if it
                // was the terminal, the stream ends without one and is retried.
                tracing::warn!(message = "unreadable Responses stream frame skipped", %error, event = ?ev.event);
                return Verdict::Pending;
            }
        };
        let kind = str_field(&data, "type").or(ev.event.as_deref()).unwrap_or_default();
        match kind {
            "response.output_text.delta" => {
                if let Some(delta) = str_field(&data, "delta").filter(|d| !d.is_empty()) {
                    self.text.push_str(delta);
                    emit(StreamEvent::TextDelta(delta.to_string()));
                }
                Verdict::Pending
            }
            "response.output_item.done" => {
                if let Some(item) = data.get("item") {
                    if let Some(call) = function_call(item) {
                        emit(StreamEvent::ToolCall {
                            call_id: call.call_id,
                            name: call.name,
                            arguments: call.arguments,
                        });
                    }
                    self.items.push(item.clone());
                }
                Verdict::Pending
            }
            "response.completed" => Verdict::Finished(self.finish(data.get("response"), None)),
            "response.incomplete" => {
                let response = data.get("response");
                let reason = response
                    .and_then(|r| r.get("incomplete_details"))
                    .and_then(|d| str_field(d, "reason"))
                    .unwrap_or("unknown");
                Verdict::Finished(self.finish(response, Some(reason.to_string())))
            }
            "response.failed" => {
                let error = data.get("response").and_then(|r| r.get("error")).filter(|e| e.is_object());
                Verdict::Failed(match error {
                    Some(e) => ProviderErrorBody::from_object(e),
                    None => ProviderErrorBody {
                        message: "the response failed without an error object".into(),
                        ..ProviderErrorBody::default()
                    },
                })
            }
            "error" => {
                // Documented flat, sent nested: read the nested object when there is one.
                let obj = data.get("error").filter(|e| e.is_object()).unwrap_or(&data);
                let mut body = ProviderErrorBody::from_object(obj);
                if body.error_type.as_deref() == Some("error") {
                    body.error_type = None; // the flat shape's `type` is the event's own
                }
                Verdict::Failed(body)
            }
            _ => Verdict::Pending,
        }
    }

    /// The stream closed: without a terminal event there is no answer.
    pub fn eof(&mut self) -> Verdict {
        Verdict::Pending
    }

    fn finish(&mut self, response: Option<&Value>, incomplete_reason: Option<String>) -> Decoded {
        let streamed = std::mem::take(&mut self.items);
        let output = match response.and_then(|r| r.get("output")).and_then(Value::as_array) {
            Some(items) if !items.is_empty() || streamed.is_empty() => items.clone(),
            _ => streamed,
        };
        let mut output: Vec<Value> = output.iter().filter_map(resendable).collect();
        let mut output_text = message_text(&output);
        if output_text.is_empty() && !self.text.is_empty() && !output.iter().any(is_message) {
            // Deltas but no message item: keep what the caller was shown.
            output_text = std::mem::take(&mut self.text);
            output.insert(0, assistant_message(&output_text));
        }
        let tool_calls = output.iter().filter_map(function_call).collect();
        let usage = response.and_then(|r| r.get("usage")).filter(|u| u.is_object()).map(|u| {
            let input_tokens = count(u, "input_tokens").unwrap_or(0);
            let output_tokens = count(u, "output_tokens").unwrap_or(0);
            let detail = |outer: &str, inner: &str| u.get(outer).and_then(|d| count(d, inner)).unwrap_or(0);
            CallUsage {
                tokens: Usage {
                    input_tokens,
                    output_tokens,
                    total_tokens: count(u, "total_tokens").unwrap_or(input_tokens + output_tokens),
                    reasoning_tokens: detail("output_tokens_details", "reasoning_tokens"),
                    cached_input_tokens: detail("input_tokens_details", "cached_tokens"),
                    cache_write_tokens: 0,
                },
                charged_input_tokens: input_tokens,
            }
        });
        let model = response.and_then(|r| r.get("model")).and_then(Value::as_str).map(str::to_owned);
        Decoded { output, output_text, tool_calls, usage, incomplete_reason, model }
    }
}

/// An assistant message item with one `output_text` part.
pub(crate) fn assistant_message(text: &str) -> Value {
    json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
}

fn is_message(item: &Value) -> bool {
    str_field(item, "type") == Some("message")
}

/// The text of every `output_text` part of the message items, joined.
pub(crate) fn message_text(output: &[Value]) -> String {
    output
        .iter()
        .filter(|i| is_message(i))
        .filter_map(|i| i.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|p| str_field(p, "type") == Some("output_text"))
        .filter_map(|p| str_field(p, "text"))
        .collect()
}

/// A complete `function_call` item as a [`ToolCall`]; `None` for other items
/// and for a call the output limit cut (`status: "incomplete"`).
fn function_call(item: &Value) -> Option<ToolCall> {
    if str_field(item, "type") != Some("function_call") || str_field(item, "status") == Some("incomplete") {
        return None;
    }
    Some(ToolCall {
        call_id: str_field(item, "call_id")?.to_string(),
        name: str_field(item, "name")?.to_string(),
        arguments: str_field(item, "arguments").unwrap_or_default().to_string(),
    })
}

/// An output item as a stateless (`store: false`) request can send it back,
/// or `None` when it cannot be sent back at all.
///
/// Server-side `id`s (`msg_…`, `fc_…`) and `status` are dropped: with
/// `store: false` nothing is persisted under those ids, and an item that
/// names one can be refused ("Item with id … not found"); `call_id` is what
/// ties a call to its output. A `reasoning` item is kept only with its
/// `encrypted_content` (the only form a stateless request accepts; it keeps
/// its `id`, which the encrypted form is checked against). Server-side tool
/// items (web search and the like) cannot be replayed and are dropped.
fn resendable(item: &Value) -> Option<Value> {
    match str_field(item, "type")? {
        "message" => {
            let parts: Vec<Value> = item
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|p| match str_field(p, "type")? {
                    "output_text" => {
                        Some(json!({"type": "output_text", "text": str_field(p, "text").unwrap_or_default()}))
                    }
                    "refusal" => {
                        Some(json!({"type": "refusal", "refusal": str_field(p, "refusal").unwrap_or_default()}))
                    }
                    _ => None,
                })
                .collect();
            if parts.is_empty() {
                return None;
            }
            let role = str_field(item, "role").unwrap_or("assistant");
            Some(json!({"type": "message", "role": role, "content": parts}))
        }
        "function_call" => {
            let call = function_call(item)?;
            Some(
                json!({"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}),
            )
        }
        "reasoning" => {
            let encrypted = str_field(item, "encrypted_content").filter(|e| !e.is_empty())?;
            let mut kept = json!({"type": "reasoning", "summary": item.get("summary").cloned().unwrap_or(json!([])),
                                  "encrypted_content": encrypted});
            if let Some(id) = item.get("id") {
                kept["id"] = id.clone();
            }
            Some(kept)
        }
        other => {
            tracing::debug!(message = "output item not kept in the transcript", item.kind = other);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(data: Value) -> SseEvent {
        SseEvent { event: data["type"].as_str().map(str::to_string), data: data.to_string(), id: None }
    }

    fn run(events: &[Value]) -> (Vec<StreamEvent>, Verdict) {
        let mut dec = ResponsesDecoder::default();
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

    fn call_item(status: &str, args: &str) -> Value {
        json!({"id": "fc_1", "type": "function_call", "status": status, "arguments": args, "call_id": "call_1", "name": "search"})
    }

    fn usage() -> Value {
        json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5, "total_tokens": 15})
    }

    #[test]
    fn reasoning_and_cached_tokens_are_read_from_the_details() {
        let usage = json!({"input_tokens": 2000, "input_tokens_details": {"cached_tokens": 1536},
                           "output_tokens": 900, "output_tokens_details": {"reasoning_tokens": 640}, "total_tokens": 2900});
        let (_, out) = run(&[json!({"type": "response.completed", "response": {"output": [], "usage": usage}})]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        let u = d.usage.unwrap();
        assert_eq!(
            (u.tokens.input_tokens, u.tokens.cached_input_tokens, u.tokens.output_tokens, u.tokens.reasoning_tokens),
            (2000, 1536, 900, 640)
        );
        assert_eq!(u.charged_input_tokens, 2000);
    }

    #[test]
    fn text_deltas_then_completed() {
        let msg = json!({"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                         "content": [{"type": "output_text", "text": "Hello world", "annotations": []}]});
        let (seen, out) = run(&[
            json!({"type": "response.created", "response": {"output": []}}),
            json!({"type": "keepalive"}),
            json!({"type": "response.output_text.delta", "delta": "Hello"}),
            json!({"type": "response.output_text.delta", "delta": " world"}),
            json!({"type": "response.output_item.done", "item": msg}),
            json!({"type": "response.completed", "response": {"status": "completed", "output": [msg], "usage": usage()}}),
        ]);
        assert_eq!(seen, vec![StreamEvent::TextDelta("Hello".into()), StreamEvent::TextDelta(" world".into())]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.output, vec![assistant_message("Hello world")]);
        assert_eq!(d.output_text, "Hello world");
        assert_eq!(d.usage, Some(CallUsage::new(10, 5)));
        assert_eq!(d.incomplete_reason, None);
    }

    #[test]
    fn function_calls_are_emitted_when_done_and_returned_without_server_ids() {
        let done = call_item("completed", r#"{"q":"x"}"#);
        let (seen, out) = run(&[
            json!({"type": "response.output_item.added", "item": call_item("in_progress", "")}),
            json!({"type": "response.function_call_arguments.delta", "delta": "{\"q\""}),
            json!({"type": "response.output_item.done", "item": done}),
            json!({"type": "response.completed", "response": {"output": [done], "usage": usage()}}),
        ]);
        let call = ToolCall { call_id: "call_1".into(), name: "search".into(), arguments: r#"{"q":"x"}"#.into() };
        assert_eq!(
            seen,
            vec![StreamEvent::ToolCall {
                call_id: call.call_id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone()
            }]
        );
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(
            d.output,
            vec![json!({"type": "function_call", "call_id": "call_1", "name": "search", "arguments": "{\"q\":\"x\"}"})]
        );
        assert_eq!(d.tool_calls, vec![call]);
        assert_eq!(d.output_text, "");
    }

    #[test]
    fn incomplete_is_a_success_that_drops_a_cut_function_call() {
        let (_, out) = run(&[json!({"type": "response.incomplete", "response": {
            "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "cut"}]},
                       call_item("incomplete", "{\"q\":")],
            "usage": usage()}})]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.incomplete_reason.as_deref(), Some("max_output_tokens"));
        assert_eq!(d.output_text, "cut");
        assert!(d.tool_calls.is_empty());
        assert_eq!(d.output.len(), 1);
    }

    #[test]
    fn error_events_flat_and_nested_and_response_failed() {
        let (seen, out) = run(&[
            json!({"type": "response.output_text.delta", "delta": "Hi"}),
            json!({"type": "error", "error": {"type": "tokens", "code": "rate_limit_exceeded", "message": "Rate limit reached", "param": null}}),
        ]);
        assert_eq!(seen.len(), 1);
        assert_eq!(
            out,
            Verdict::Failed(ProviderErrorBody {
                code: Some("rate_limit_exceeded".into()),
                error_type: Some("tokens".into()),
                message: "Rate limit reached".into(),
                retry_delay_ms: None,
            })
        );
        let (_, out) = run(&[json!({"type": "error", "code": "server_error", "message": "boom", "param": null})]);
        assert_eq!(
            out,
            Verdict::Failed(ProviderErrorBody {
                code: Some("server_error".into()),
                error_type: None,
                message: "boom".into(),
                retry_delay_ms: None,
            })
        );
        let (_, out) = run(&[json!({"type": "response.failed", "response": {"status": "failed",
            "error": {"code": "server_error", "message": "The model failed"}}})]);
        assert_eq!(
            out,
            Verdict::Failed(ProviderErrorBody {
                code: Some("server_error".into()),
                error_type: None,
                message: "The model failed".into(),
                retry_delay_ms: None,
            })
        );
    }

    #[test]
    fn no_terminal_event_is_pending_and_bad_frames_are_skipped() {
        let mut dec = ResponsesDecoder::default();
        let bad = SseEvent { event: Some("response.output_text.delta".into()), data: "{not json".into(), id: None };
        assert_eq!(dec.event(&bad, &mut |_| {}), Verdict::Pending);
        let (_, out) = run(&[json!({"type": "response.output_text.delta", "delta": "Hi"})]);
        assert_eq!(out, Verdict::Pending);
    }

    #[test]
    fn terminal_without_output_falls_back_to_streamed_items_and_deltas() {
        let (_, out) = run(&[
            json!({"type": "response.output_item.done", "item": call_item("completed", "{}")}),
            json!({"type": "response.completed", "response": {"usage": null}}),
        ]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.tool_calls.len(), 1);
        assert_eq!(d.usage, None);
        let (_, out) = run(&[
            json!({"type": "response.output_text.delta", "delta": "only deltas"}),
            json!({"type": "response.completed", "response": {"output": []}}),
        ]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.output, vec![assistant_message("only deltas")]);
    }

    #[test]
    fn reasoning_is_kept_only_with_encrypted_content() {
        assert_eq!(resendable(&json!({"type": "reasoning", "id": "rs_1", "summary": []})), None);
        let kept = resendable(
            &json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA", "status": null}),
        );
        assert_eq!(kept, Some(json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"})));
        assert_eq!(resendable(&json!({"type": "web_search_call", "id": "ws_1"})), None);
    }
}
