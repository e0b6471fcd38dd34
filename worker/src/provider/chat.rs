//! Decoding a Chat Completions stream (`POST /chat/completions`,
//! `stream: true`) into the Responses shape, so the transcript is one shape
//! whatever the transport.
//!
//! `delta.content` is text; `delta.tool_calls[{index, id?, function:{name?,
//! arguments}}]` fragments are joined by `index`; the usage chunk has
//! `choices: []` (vLLM: `null` or missing); `data: [DONE]` ends the stream;
//! `data: {"error": …}` (or vLLM's `{"object":"error", …}`) fails it.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::decode::{count, str_field, Decoded, ProviderErrorBody, Verdict};
use super::responses::assistant_message;
use super::sse::SseEvent;
use super::{CallUsage, StreamEvent, ToolCall};
use shared::runs::Usage;

/// One tool call being assembled from its fragments.
#[derive(Debug, Default)]
struct PartialCall {
    id: Option<String>,
    name: String,
    arguments: String,
}

/// Decoder state for one chat stream.
///
/// Tool calls are emitted once the stream is finished (their arguments
/// arrive in fragments, possibly interleaved by index). A `finish_reason` of
/// `length` is decoded like Responses' `incomplete` — a success with
/// `incomplete_reason: "max_output_tokens"` — and a tool call whose
/// arguments the cut left as broken JSON is dropped, not run.
///
/// `[DONE]` is the terminal; a stream that closes without it but after a
/// `finish_reason` is accepted too (some compatible servers omit `[DONE]`),
/// just without usage if the usage chunk never came.
#[derive(Debug, Default)]
pub(crate) struct ChatDecoder {
    text: String,
    calls: BTreeMap<u64, PartialCall>,
    finish_reason: Option<String>,
    usage: Option<CallUsage>,
    /// The chunks' `model`.
    model: Option<String>,
}

impl ChatDecoder {
    /// Decodes one SSE event.
    pub fn event(&mut self, ev: &SseEvent, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        if ev.data.trim() == "[DONE]" {
            return Verdict::Finished(self.finish(emit));
        }
        let chunk: Value = match serde_json::from_str(&ev.data) {
            Ok(v) => v,
            Err(error) => {
                tracing::warn!(message = "unreadable chat stream chunk skipped", %error);
                return Verdict::Pending;
            }
        };
        match chunk.get("error") {
            Some(e @ Value::Object(_)) => return Verdict::Failed(ProviderErrorBody::from_object(e)),
            Some(Value::String(s)) => {
                return Verdict::Failed(ProviderErrorBody { message: s.clone(), ..ProviderErrorBody::default() })
            }
            _ => {}
        }
        if str_field(&chunk, "object") == Some("error") {
            return Verdict::Failed(ProviderErrorBody::from_object(&chunk));
        }
        if self.model.is_none() {
            self.model = str_field(&chunk, "model").map(str::to_owned);
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            let input_tokens = count(u, "prompt_tokens").unwrap_or(0);
            let output_tokens = count(u, "completion_tokens").unwrap_or(0);
            let detail = |outer: &str, inner: &str| u.get(outer).and_then(|d| count(d, inner)).unwrap_or(0);
            self.usage = Some(CallUsage {
                tokens: Usage {
                    input_tokens,
                    output_tokens,
                    total_tokens: count(u, "total_tokens").unwrap_or(input_tokens + output_tokens),
                    reasoning_tokens: detail("completion_tokens_details", "reasoning_tokens"),
                    cached_input_tokens: detail("prompt_tokens_details", "cached_tokens"),
                    cache_write_tokens: 0,
                },
                charged_input_tokens: input_tokens,
            });
        }
        // We never ask for n > 1; other choices, if a server sends them, are not ours.
        let choices = chunk.get("choices").and_then(Value::as_array).into_iter().flatten();
        for choice in choices.filter(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0) {
            if let Some(reason) = str_field(choice, "finish_reason") {
                self.finish_reason = Some(reason.to_string());
            }
            let Some(delta) = choice.get("delta") else { continue };
            if let Some(text) = str_field(delta, "content").filter(|t| !t.is_empty()) {
                self.text.push_str(text);
                emit(StreamEvent::TextDelta(text.to_string()));
            }
            for (position, frag) in delta.get("tool_calls").and_then(Value::as_array).into_iter().flatten().enumerate()
            {
                self.tool_call_fragment(position, frag);
            }
        }
        Verdict::Pending
    }

    /// The stream closed: finished if a `finish_reason` came, else nothing.
    pub fn eof(&mut self, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        if self.finish_reason.is_some() {
            Verdict::Finished(self.finish(emit))
        } else {
            Verdict::Pending
        }
    }

    fn tool_call_fragment(&mut self, position: usize, frag: &Value) {
        let id = str_field(frag, "id").filter(|id| !id.is_empty());
        // Without an index (some servers), a known id continues its call and
        // an unknown one starts the next.
        let index = frag.get("index").and_then(Value::as_u64).unwrap_or_else(|| {
            id.and_then(|id| self.calls.iter().find(|(_, c)| c.id.as_deref() == Some(id)).map(|(i, _)| *i))
                .unwrap_or_else(|| self.calls.keys().next_back().map_or(position as u64, |last| last + 1))
        });
        let call = self.calls.entry(index).or_default();
        if call.id.is_none() {
            call.id = id.map(str::to_string);
        }
        let Some(function) = frag.get("function") else { return };
        // The name comes once (OpenAI); a server that repeats it in every
        // fragment must not make it `searchsearch`.
        if let Some(name) = str_field(function, "name").filter(|n| !n.is_empty()) {
            if call.name.is_empty() {
                call.name = name.to_string();
            }
        }
        if let Some(args) = str_field(function, "arguments") {
            call.arguments.push_str(args);
        }
    }

    fn finish(&mut self, emit: &mut dyn FnMut(StreamEvent)) -> Decoded {
        let cut = self.finish_reason.as_deref() == Some("length");
        let mut tool_calls = Vec::new();
        for (index, call) in std::mem::take(&mut self.calls) {
            if call.name.is_empty() {
                tracing::warn!(message = "chat tool call without a name dropped", index);
                continue;
            }
            // No arguments at all means "no arguments"; `""` is not JSON and
            // a Responses request would refuse it when the transcript is resent.
            let arguments = if call.arguments.trim().is_empty() { "{}".to_string() } else { call.arguments };
            if cut && serde_json::from_str::<Value>(&arguments).is_err() {
                tracing::warn!(message = "tool call cut by the output limit dropped", index, tool.name = %call.name);
                continue;
            }
            let call_id = call.id.unwrap_or_else(|| format!("call_{:016x}", rand::random::<u64>()));
            tool_calls.push(ToolCall { call_id, name: call.name, arguments });
        }
        let output_text = std::mem::take(&mut self.text);
        let mut output = Vec::new();
        if !output_text.is_empty() {
            output.push(assistant_message(&output_text));
        }
        for call in &tool_calls {
            output.push(json!({"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}));
            emit(StreamEvent::ToolCall {
                call_id: call.call_id.clone(),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            });
        }
        let incomplete_reason = match self.finish_reason.as_deref() {
            Some("length") => Some("max_output_tokens".to_string()),
            Some("content_filter") => Some("content_filter".to_string()),
            _ => None,
        };
        Decoded {
            output,
            output_text,
            tool_calls,
            usage: self.usage.take(),
            incomplete_reason,
            model: self.model.take(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(frames: &[&str], close: bool) -> (Vec<StreamEvent>, Verdict) {
        let mut dec = ChatDecoder::default();
        let mut seen = Vec::new();
        for f in frames {
            let ev = SseEvent { event: None, data: f.to_string(), id: None };
            match dec.event(&ev, &mut |e| seen.push(e)) {
                Verdict::Pending => {}
                done => return (seen, done),
            }
        }
        let out = if close { dec.eof(&mut |e| seen.push(e)) } else { Verdict::Pending };
        (seen, out)
    }

    fn chunk(delta: Value, finish: Value) -> String {
        json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": null})
            .to_string()
    }

    #[test]
    fn reasoning_and_cached_tokens_are_read_from_the_details() {
        let frames = [
            chunk(json!({"content": "Hi"}), json!("stop")),
            json!({"choices": [], "usage": {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500,
                   "prompt_tokens_details": {"cached_tokens": 1024}, "completion_tokens_details": {"reasoning_tokens": 256}}})
                .to_string(),
            "[DONE]".to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let Verdict::Finished(d) = run(&frames, false).1 else { panic!() };
        let u = d.usage.unwrap();
        assert_eq!((u.tokens.input_tokens, u.tokens.cached_input_tokens, u.tokens.reasoning_tokens), (1200, 1024, 256));
        assert_eq!(u.charged_input_tokens, 1200, "OpenAI counts cached input against the limit");
    }

    #[test]
    fn text_then_usage_then_done() {
        let frames = [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Hello"}), Value::Null),
            chunk(json!({"content": " there"}), Value::Null),
            chunk(json!({}), json!("stop")),
            json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}})
                .to_string(),
            "[DONE]".to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (seen, out) = run(&frames, false);
        assert_eq!(seen, vec![StreamEvent::TextDelta("Hello".into()), StreamEvent::TextDelta(" there".into())]);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.output, vec![assistant_message("Hello there")]);
        assert_eq!(d.usage, Some(CallUsage::new(9, 2)));
        assert_eq!(d.incomplete_reason, None);
    }

    #[test]
    fn tool_call_fragments_are_joined_by_index_even_interleaved() {
        let frames = [
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "search", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "fetch", "arguments": "{\"u"}}]}),
                Value::Null,
            ),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\":"}}]}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}, {"index": 1, "function": {"arguments": "\":2}"}}]}),
                Value::Null,
            ),
            chunk(json!({}), json!("tool_calls")),
            // vLLM's usage chunk: choices null.
            json!({"choices": null, "usage": {"prompt_tokens": 3, "completion_tokens": 4}}).to_string(),
            "[DONE]".to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (seen, out) = run(&frames, false);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(
            d.output,
            vec![
                json!({"type": "function_call", "call_id": "call_a", "name": "search", "arguments": "{\"q\":1}"}),
                json!({"type": "function_call", "call_id": "call_b", "name": "fetch", "arguments": "{\"u\":2}"}),
            ]
        );
        assert_eq!(seen.len(), 2);
        assert!(matches!(&seen[0], StreamEvent::ToolCall { call_id, .. } if call_id == "call_a"));
        assert_eq!(d.usage, Some(CallUsage::new(3, 4)));
        assert_eq!(d.output_text, "");
    }

    #[test]
    fn a_mid_stream_error_fails_the_call() {
        let frames = [
            chunk(json!({"content": "Hi"}), Value::Null),
            json!({"error": {"message": "Rate limit reached", "type": "tokens", "code": "rate_limit_exceeded", "param": null}}).to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (seen, out) = run(&frames, false);
        assert_eq!(seen.len(), 1);
        let Verdict::Failed(e) = out else { panic!("{out:?}") };
        assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
        let (_, out) = run(&[r#"{"object":"error","message":"boom","type":"InternalServerError","code":500}"#], false);
        assert!(matches!(out, Verdict::Failed(e) if e.message == "boom"));
    }

    #[test]
    fn close_without_done_is_pending_unless_finished() {
        let text = chunk(json!({"content": "Hi"}), Value::Null);
        assert_eq!(run(&[&text], true).1, Verdict::Pending);
        let fin = chunk(json!({}), json!("stop"));
        assert!(
            matches!(run(&[&text, &fin], true).1, Verdict::Finished(d) if d.output_text == "Hi" && d.usage.is_none())
        );
    }

    #[test]
    fn a_length_cut_drops_broken_arguments_and_missing_ids_are_made_up() {
        let frames = [
            chunk(json!({"tool_calls": [{"index": 0, "function": {"name": "ok", "arguments": ""}}]}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "cut", "arguments": "{\"q\": \"ab"}}]}),
                Value::Null,
            ),
            chunk(json!({}), json!("length")),
            "[DONE]".to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (_, out) = run(&frames, false);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        assert_eq!(d.incomplete_reason.as_deref(), Some("max_output_tokens"));
        assert_eq!(d.tool_calls.len(), 1);
        assert_eq!(d.tool_calls[0].name, "ok");
        assert_eq!(d.tool_calls[0].arguments, "{}");
        assert!(d.tool_calls[0].call_id.starts_with("call_"));
    }

    #[test]
    fn fragments_without_index_and_a_repeated_name() {
        let frames = [
            chunk(
                json!({"tool_calls": [{"id": "call_x", "function": {"name": "f", "arguments": "{\"a\""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"id": "call_x", "function": {"name": "f", "arguments": ":1}"}}]}),
                Value::Null,
            ),
            chunk(json!({"tool_calls": [{"id": "call_y", "function": {"name": "g", "arguments": "{}"}}]}), Value::Null),
            "[DONE]".to_string(),
        ];
        let frames: Vec<&str> = frames.iter().map(String::as_str).collect();
        let (_, out) = run(&frames, false);
        let Verdict::Finished(d) = out else { panic!("{out:?}") };
        let got: Vec<_> =
            d.tool_calls.iter().map(|c| (c.call_id.as_str(), c.name.as_str(), c.arguments.as_str())).collect();
        assert_eq!(got, vec![("call_x", "f", "{\"a\":1}"), ("call_y", "g", "{}")]);
    }
}
