//! The wire formats: reading a request into a [`Prompt`], and writing an
//! [`Answer`] back as a JSON body or as the exact frame sequence a streaming
//! client reads (Responses events with `sequence_number`; chat chunks ending
//! in `data: [DONE]`; Anthropic's Messages events, in `messages.rs`).

use crate::cache::CacheUsage;
use crate::prefix::Prefix;
use crate::script::{count_tokens, deltas, fnv1a, Answer, Prompt, Tool};
use serde_json::{json, Value};

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/messages` (Anthropic)
    Messages,
}

/// A parsed request: the prompt for the script plus how to answer it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The endpoint.
    pub api: Api,
    /// What the script reads.
    pub prompt: Prompt,
    /// `stream: true`.
    pub stream: bool,
    /// Chat `stream_options.include_usage`.
    pub include_usage: bool,
    /// Anthropic `thinking: {"type": "enabled"}`: the answer starts with a
    /// signed thinking block.
    pub thinking: bool,
    /// Reasoning tokens the answer reports (Responses `reasoning.effort`,
    /// chat `reasoning_effort`): part of the output, as with OpenAI.
    pub reasoning_tokens: u64,
    /// The prompt's cacheable prefixes: read by the server only under
    /// `--cache` (see `prefix::read`), else [`Prefix::None`].
    pub prefix: Prefix,
    /// What the prompt cache read and wrote for it, decided at admission
    /// (nothing without `--cache`).
    pub cache: CacheUsage,
}

/// The reasoning tokens the mock reports for an effort.
pub fn reasoning_tokens(effort: Option<&str>) -> u64 {
    match effort {
        Some("minimal") => 8,
        Some("low") => 16,
        Some("medium") => 32,
        Some("high") => 64,
        _ => 0,
    }
}

/// Words per text delta in a stream: several deltas for any answer longer
/// than a few tokens, without a frame per word.
pub(crate) const WORDS_PER_DELTA: usize = 4;
/// Characters per function-call arguments fragment in a stream.
pub(crate) const ARG_CHARS_PER_DELTA: usize = 12;

/// Reads a request body. The error is the message of a 400
/// `invalid_request_error`, in OpenAI's words where it has them.
///
/// Input tokens are `ceil(chars / 4)` where chars counts every string value
/// under `instructions` and `input` (chat: `messages`) — message text, tool
/// outputs, function-call arguments — plus the compact JSON of `tools`.
pub fn parse(api: Api, body: &Value) -> Result<Request, String> {
    if api == Api::Messages {
        return crate::messages::parse(body);
    }
    let obj = body.as_object().ok_or("The request body must be a JSON object.")?;
    let model = obj.get("model").and_then(Value::as_str).ok_or("you must provide a model parameter")?.to_string();
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let tool_choice = obj.get("tool_choice");
    let tools = obj.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
    // `tool_choice: "none"` offers nothing; a named function (Responses
    // `{"type":"function","name"}`, chat `{"function":{"name"}}`) is the one
    // called; otherwise the first function tool.
    let forced = tool_choice
        .and_then(|c| c.get("name").or_else(|| c.get("function").and_then(|f| f.get("name"))).and_then(Value::as_str));
    let tool = pick_tool(&tools, tool_choice.and_then(Value::as_str) == Some("none"), forced);
    let tools_chars = if tools.is_empty() { 0 } else { Value::Array(tools).to_string().chars().count() };

    let effort = match api {
        Api::Chat => obj.get("reasoning_effort"),
        _ => obj.get("reasoning").and_then(|r| r.get("effort")),
    };
    let reasoning = reasoning_tokens(effort.and_then(Value::as_str));
    let (text_chars, tool_outputs, fingerprint, max_output_tokens, include_usage) = match api {
        Api::Responses => {
            let input = obj.get("input").ok_or("Missing required parameter: 'input'.")?;
            let instructions = obj.get("instructions").cloned().unwrap_or(Value::Null);
            let outputs = input
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .filter(|i| i.get("type").and_then(Value::as_str) == Some("function_call_output"))
                        .count()
                })
                .unwrap_or(0);
            let chars = string_chars(&instructions) + string_chars(input);
            let fp = fnv1a(json!([instructions, input]).to_string().as_bytes(), 0);
            let max = obj.get("max_output_tokens").and_then(Value::as_u64);
            (chars, outputs, fp, max, false)
        }
        Api::Chat => {
            let messages =
                obj.get("messages").and_then(Value::as_array).ok_or("Missing required parameter: 'messages'.")?;
            let outputs = messages.iter().filter(|m| m.get("role").and_then(Value::as_str) == Some("tool")).count();
            let chars = messages.iter().map(string_chars).sum();
            let fp = fnv1a(Value::Array(messages.clone()).to_string().as_bytes(), 0);
            let max = obj
                .get("max_completion_tokens")
                .and_then(Value::as_u64)
                .or_else(|| obj.get("max_tokens").and_then(Value::as_u64));
            let usage = obj
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            (chars, outputs, fp, max, usage)
        }
        Api::Messages => unreachable!("read by messages::parse"),
    };
    let input_tokens = count_tokens(text_chars + tools_chars).max(1);
    let format = match api {
        Api::Chat => obj.get("response_format").map(|f| (f, f.get("json_schema").and_then(|s| s.get("schema")))),
        _ => obj.get("text").and_then(|t| t.get("format")).map(|f| (f, f.get("schema"))),
    };
    let answer_schema = format.and_then(|(f, schema)| match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => schema.cloned(),
        Some("json_object") => Some(json!({"type": "object"})),
        _ => None,
    });
    Ok(Request {
        api,
        prompt: Prompt {
            model,
            input_tokens,
            tool_outputs,
            tool,
            max_output_tokens,
            fingerprint,
            answer_schema,
            forced: None,
        },
        stream,
        include_usage,
        thinking: false,
        reasoning_tokens: reasoning,
        prefix: Prefix::None,
        cache: CacheUsage::default(),
    })
}

/// The tool the script calls: none when the request says so, the forced one
/// when it names one, else the first function tool.
pub(crate) fn pick_tool(tools: &[Value], none: bool, forced: Option<&str>) -> Option<Tool> {
    if none {
        None
    } else if let Some(name) = forced {
        tools.iter().filter_map(first_function_tool).find(|t| t.name == name)
    } else {
        tools.iter().find_map(first_function_tool)
    }
}

/// The first function tool: flat (Responses), nested under `function`
/// (chat), or Anthropic's `{"name", "input_schema"}` (no type, or `custom`).
fn first_function_tool(tool: &Value) -> Option<Tool> {
    if tool.get("type").and_then(Value::as_str).is_some_and(|t| t != "function" && t != "custom") {
        return None;
    }
    let def = tool.get("function").unwrap_or(tool);
    let name = def.get("name").and_then(Value::as_str)?;
    let parameters = def.get("parameters").or_else(|| def.get("input_schema")).cloned();
    Some(Tool { name: name.to_string(), parameters })
}

/// Characters of every string value under `v` (keys are not counted).
pub(crate) fn string_chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => items.iter().map(string_chars).sum(),
        Value::Object(map) => map.values().map(string_chars).sum(),
        _ => 0,
    }
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_body(kind: &str, code: Option<&str>, message: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// What a stream says when it fails mid-way.
#[derive(Debug, Clone)]
pub struct StreamError {
    /// `type` (e.g. `server_error`, `tokens`).
    pub kind: String,
    /// `code` (e.g. `server_error`, `rate_limit_exceeded`).
    pub code: String,
    /// The human message.
    pub message: String,
}

/// A stream's frames, ready to write, and where it stalls or breaks when told to.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    pub(crate) api: Api,
    /// Every frame, each a complete SSE event ending in a blank line.
    pub frames: Vec<String>,
    /// Frames written before a stall or a mid-stream error: always after some
    /// text (or the first arguments fragment) and before the terminal frame.
    pub midpoint: usize,
    /// Output tokens the client has received by the midpoint.
    pub tokens_by_midpoint: u64,
}

impl StreamPlan {
    /// The frame that ends the stream at the midpoint: an `error` event (in the
    /// nested shape OpenAI sends) or a chat `data: {"error": …}` chunk.
    pub fn error_frame(&self, err: &StreamError) -> String {
        let inner = json!({"type": err.kind, "code": err.code, "message": err.message, "param": null});
        match self.api {
            Api::Responses => {
                let data = json!({"type": "error", "sequence_number": self.midpoint, "error": inner});
                format!("event: error\ndata: {data}\n\n")
            }
            Api::Chat => format!("data: {}\n\n", json!({"error": inner})),
            Api::Messages => crate::messages::error_frame(err),
        }
    }
}

/// Everything needed to write one answer.
#[derive(Debug, Clone, Copy)]
pub struct Reply<'a> {
    /// The request.
    pub request: &'a Request,
    /// The body it came with (echoed fields: instructions, tools, metadata).
    pub body: &'a Value,
    /// The scripted answer.
    pub answer: &'a Answer,
    /// The mock's request number, which makes response ids unique.
    pub seq: u64,
    /// Unix seconds, for `created` / `created_at`.
    pub created: u64,
}

impl Reply<'_> {
    pub(crate) fn input_tokens(&self) -> u64 {
        self.request.prompt.input_tokens
    }
    /// The answer's output tokens, reasoning included.
    pub(crate) fn output_tokens(&self) -> u64 {
        self.answer.output_tokens() + self.request.reasoning_tokens
    }
    pub(crate) fn truncated(&self) -> bool {
        matches!(self.answer, Answer::Text { truncated: true, .. })
    }
    pub(crate) fn id_hex(&self) -> String {
        format!("{:016x}{:08x}", fnv1a(&self.seq.to_le_bytes(), 7), self.seq)
    }
    fn message_id(&self) -> String {
        format!("msg_{:016x}", fnv1a(b"msg", self.request.prompt.fingerprint))
    }
}

// ---------------------------------------------------------------- Responses

fn responses_usage(r: &Reply) -> Value {
    json!({
        "input_tokens": r.input_tokens(),
        "input_tokens_details": {"cached_tokens": r.request.cache.read},
        "output_tokens": r.output_tokens(),
        "output_tokens_details": {"reasoning_tokens": r.request.reasoning_tokens},
        "total_tokens": r.input_tokens() + r.output_tokens(),
    })
}

fn message_item(r: &Reply, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    };
    json!({"id": r.message_id(), "type": "message", "status": status, "role": "assistant", "content": content})
}

fn call_item(call: &crate::script::FunctionCall, status: &str) -> Value {
    let arguments = if status == "in_progress" { "" } else { call.arguments.as_str() };
    json!({"id": call.id, "type": "function_call", "status": status, "arguments": arguments,
           "call_id": call.call_id, "name": call.name})
}

/// The Responses `response` object; `done = false` gives the in-progress
/// shell that `response.created` carries.
fn response_object(r: &Reply, done: bool) -> Value {
    let body = r.body;
    let (status, output, usage, incomplete) = if !done {
        ("in_progress", json!([]), Value::Null, Value::Null)
    } else {
        let output = match r.answer {
            Answer::Calls(calls) => calls.iter().map(|c| call_item(c, "completed")).collect(),
            Answer::Text { text, .. } => vec![message_item(r, text, "completed")],
        };
        if r.truncated() {
            ("incomplete", Value::Array(output), responses_usage(r), json!({"reason": "max_output_tokens"}))
        } else {
            ("completed", Value::Array(output), responses_usage(r), Value::Null)
        }
    };
    json!({
        "id": format!("resp_{}", r.id_hex()),
        "object": "response",
        "created_at": r.created,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions").cloned().unwrap_or(Value::Null),
        "max_output_tokens": body.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        "model": r.request.prompt.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
        "previous_response_id": body.get("previous_response_id").cloned().unwrap_or(Value::Null),
        "store": body.get("store").cloned().unwrap_or(json!(true)),
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "tools": body.get("tools").cloned().unwrap_or(json!([])),
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.get("metadata").cloned().unwrap_or(json!({})),
    })
}

/// The non-streaming Responses body.
pub fn responses_json(r: &Reply) -> Value {
    response_object(r, true)
}

/// Splits a string into fragments of `n` characters (never inside a char).
pub(crate) fn fragments(s: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    if chars.is_empty() {
        return vec![String::new()];
    }
    chars.chunks(n.max(1)).map(|c| c.iter().collect()).collect()
}

/// The Responses event sequence, numbered from 0.
pub fn responses_stream(r: &Reply) -> StreamPlan {
    let mut events: Vec<Value> = vec![
        json!({"type": "response.created", "response": response_object(r, false)}),
        json!({"type": "response.in_progress", "response": response_object(r, false)}),
    ];
    let mut midpoint = None;
    let mut tokens_by_midpoint = 0;
    match r.answer {
        Answer::Text { text, tokens, .. } => {
            let item_id = r.message_id();
            events.push(json!({"type": "response.output_item.added", "output_index": 0,
                               "item": message_item(r, "", "in_progress")}));
            events.push(json!({"type": "response.content_part.added", "item_id": item_id,
                               "output_index": 0, "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": []}}));
            let parts = deltas(text, WORDS_PER_DELTA);
            let half = parts.len().div_ceil(2).max(1);
            for (i, delta) in parts.iter().enumerate() {
                events.push(json!({"type": "response.output_text.delta", "item_id": item_id,
                                   "output_index": 0, "content_index": 0, "delta": delta,
                                   "logprobs": []}));
                if i + 1 == half {
                    midpoint = Some(events.len());
                    tokens_by_midpoint = ((i + 1) * WORDS_PER_DELTA) as u64;
                }
            }
            tokens_by_midpoint = tokens_by_midpoint.min(*tokens);
            events.push(json!({"type": "response.output_text.done", "item_id": item_id,
                               "output_index": 0, "content_index": 0, "text": text, "logprobs": []}));
            events.push(json!({"type": "response.content_part.done", "item_id": item_id,
                               "output_index": 0, "content_index": 0,
                               "part": {"type": "output_text", "text": text, "annotations": []}}));
            events.push(json!({"type": "response.output_item.done", "output_index": 0,
                               "item": message_item(r, text, "completed")}));
        }
        Answer::Calls(calls) => {
            for (index, call) in calls.iter().enumerate() {
                events.push(json!({"type": "response.output_item.added", "output_index": index,
                                   "item": call_item(call, "in_progress")}));
                for frag in fragments(&call.arguments, ARG_CHARS_PER_DELTA) {
                    events.push(json!({"type": "response.function_call_arguments.delta",
                                       "item_id": call.id, "output_index": index, "delta": frag}));
                    if midpoint.is_none() {
                        midpoint = Some(events.len());
                        tokens_by_midpoint = count_tokens(frag.chars().count());
                    }
                }
                events.push(json!({"type": "response.function_call_arguments.done", "item_id": call.id,
                                   "output_index": index, "name": call.name,
                                   "arguments": call.arguments}));
                events.push(json!({"type": "response.output_item.done", "output_index": index,
                                   "item": call_item(call, "completed")}));
            }
        }
    }
    let terminal = if r.truncated() { "response.incomplete" } else { "response.completed" };
    events.push(json!({"type": terminal, "response": response_object(r, true)}));
    let last = events.len() - 1;
    let frames = events
        .into_iter()
        .enumerate()
        .map(|(seq, mut event)| {
            event["sequence_number"] = json!(seq);
            let kind = event["type"].as_str().unwrap_or_default().to_string();
            format!("event: {kind}\ndata: {event}\n\n")
        })
        .collect();
    StreamPlan { api: Api::Responses, frames, midpoint: midpoint.unwrap_or(last).min(last), tokens_by_midpoint }
}

// ---------------------------------------------------------------- Chat Completions

fn chat_usage(r: &Reply) -> Value {
    json!({
        "prompt_tokens": r.input_tokens(),
        "completion_tokens": r.output_tokens(),
        "total_tokens": r.input_tokens() + r.output_tokens(),
        "prompt_tokens_details": {"cached_tokens": r.request.cache.read},
        "completion_tokens_details": {"reasoning_tokens": r.request.reasoning_tokens},
    })
}

fn finish_reason(r: &Reply) -> &'static str {
    match r.answer {
        Answer::Calls(_) => "tool_calls",
        Answer::Text { truncated: true, .. } => "length",
        Answer::Text { .. } => "stop",
    }
}

/// The non-streaming chat completion body.
pub fn chat_json(r: &Reply) -> Value {
    let message = match r.answer {
        Answer::Calls(calls) => json!({
            "role": "assistant", "content": null, "refusal": null,
            "tool_calls": calls.iter().map(|c| json!({"id": c.call_id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}})).collect::<Vec<_>>(),
        }),
        Answer::Text { text, .. } => json!({"role": "assistant", "content": text, "refusal": null}),
    };
    json!({
        "id": format!("chatcmpl-{}", r.id_hex()),
        "object": "chat.completion",
        "created": r.created,
        "model": r.request.prompt.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason(r)}],
        "usage": chat_usage(r),
        "system_fingerprint": "fp_mock",
    })
}

/// The chat chunk sequence: role first, content or tool-call fragments by
/// index, a chunk with `finish_reason`, the usage chunk when asked, `[DONE]`.
pub fn chat_stream(r: &Reply) -> StreamPlan {
    let id = format!("chatcmpl-{}", r.id_hex());
    let chunk = |choices: Value| {
        let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": r.created,
                           "model": r.request.prompt.model, "system_fingerprint": "fp_mock",
                           "choices": choices});
        if r.request.include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    let choice =
        |delta: Value, finish: Value| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    let mut chunks = Vec::new();
    let mut midpoint = None;
    let mut tokens_by_midpoint = 0;
    match r.answer {
        Answer::Text { text, tokens, .. } => {
            chunks.push(chunk(choice(json!({"role": "assistant", "content": "", "refusal": null}), Value::Null)));
            let parts = deltas(text, WORDS_PER_DELTA);
            let half = parts.len().div_ceil(2).max(1);
            for (i, delta) in parts.iter().enumerate() {
                chunks.push(chunk(choice(json!({"content": delta}), Value::Null)));
                if i + 1 == half {
                    midpoint = Some(chunks.len());
                    tokens_by_midpoint = (((i + 1) * WORDS_PER_DELTA) as u64).min(*tokens);
                }
            }
        }
        Answer::Calls(calls) => {
            chunks.push(chunk(choice(json!({"role": "assistant", "content": null, "refusal": null}), Value::Null)));
            for (index, call) in calls.iter().enumerate() {
                chunks.push(chunk(choice(
                    json!({"tool_calls": [{"index": index, "id": call.call_id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]}),
                    Value::Null,
                )));
                for frag in fragments(&call.arguments, ARG_CHARS_PER_DELTA) {
                    chunks.push(chunk(choice(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": frag}}]}),
                        Value::Null,
                    )));
                    if midpoint.is_none() {
                        midpoint = Some(chunks.len());
                        tokens_by_midpoint = count_tokens(frag.chars().count());
                    }
                }
            }
        }
    }
    chunks.push(chunk(choice(json!({}), json!(finish_reason(r)))));
    if r.request.include_usage {
        let mut last = chunk(json!([]));
        last["usage"] = chat_usage(r);
        chunks.push(last);
    }
    let mut frames: Vec<String> = chunks.into_iter().map(|c| format!("data: {c}\n\n")).collect();
    frames.push("data: [DONE]\n\n".to_string());
    let last = frames.len() - 1;
    StreamPlan { api: Api::Chat, frames, midpoint: midpoint.unwrap_or(last).min(last), tokens_by_midpoint }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::script::{answer, Script};

    const SCRIPT: Script = Script { tool_rounds: 1, calls_per_round: 1, output_tokens: 20 };

    fn body_with_tools() -> Value {
        json!({"model": "gpt-test", "instructions": "abcd",
               "input": [{"role": "user", "content": "hello world!"}],
               "tools": [{"type": "function", "name": "search",
                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}],
               "max_output_tokens": 100, "stream": true})
    }

    #[test]
    fn parses_a_responses_request() {
        let body = body_with_tools();
        let req = parse(Api::Responses, &body).unwrap();
        assert!(req.stream);
        assert_eq!(req.prompt.model, "gpt-test");
        assert_eq!(req.prompt.max_output_tokens, Some(100));
        assert_eq!(req.prompt.tool.as_ref().unwrap().name, "search");
        let tools_chars = body["tools"].to_string().chars().count();
        // "abcd" + "user" + "hello world!" = 4 + 4 + 12 chars
        assert_eq!(req.prompt.input_tokens, count_tokens(20 + tools_chars));
    }

    #[test]
    fn counts_tool_outputs_in_both_formats() {
        let body = json!({"model": "m", "input": [
            {"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "call_1", "name": "s", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]});
        assert_eq!(parse(Api::Responses, &body).unwrap().prompt.tool_outputs, 1);
        let chat = json!({"model": "m", "max_tokens": 7, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
            {"role": "tool", "tool_call_id": "call_2", "content": "ok"}]});
        let req = parse(Api::Chat, &chat).unwrap();
        assert_eq!(req.prompt.tool_outputs, 2);
        assert_eq!(req.prompt.max_output_tokens, Some(7));
    }

    #[test]
    fn tool_choice_picks_the_tool_and_bad_bodies_are_refused() {
        let mut body = body_with_tools();
        body["tool_choice"] = json!("none");
        assert!(parse(Api::Responses, &body).unwrap().prompt.tool.is_none());
        body["tools"] = json!([{"type": "function", "name": "a"}, {"type": "function", "name": "b"}]);
        body["tool_choice"] = json!({"type": "function", "name": "b"});
        assert_eq!(parse(Api::Responses, &body).unwrap().prompt.tool.unwrap().name, "b");
        let chat = json!({"model": "m", "messages": [],
            "tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}],
            "tool_choice": {"type": "function", "function": {"name": "b"}}});
        assert_eq!(parse(Api::Chat, &chat).unwrap().prompt.tool.unwrap().name, "b");
        assert!(parse(Api::Responses, &json!({"input": "x"})).is_err());
        assert!(parse(Api::Chat, &json!({"model": "m"})).is_err());
        assert!(parse(Api::Chat, &json!([1])).is_err());
    }

    #[test]
    fn responses_stream_is_numbered_and_ends_with_completed() {
        let mut body = body_with_tools();
        body["tools"] = json!([]);
        let req = parse(Api::Responses, &body).unwrap();
        let ans = answer(&req.prompt, &SCRIPT);
        let plan = responses_stream(&Reply { request: &req, body: &body, answer: &ans, seq: 1, created: 0 });
        for (i, frame) in plan.frames.iter().enumerate() {
            let data: Value =
                serde_json::from_str(frame.lines().nth(1).unwrap().strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["sequence_number"], json!(i));
        }
        assert!(plan.frames.last().unwrap().starts_with("event: response.completed"));
        assert!(plan.frames[plan.midpoint - 1].contains("output_text.delta"));
        assert!(plan.tokens_by_midpoint > 0 && plan.tokens_by_midpoint < 20);
    }

    #[test]
    fn chat_stream_ends_with_usage_then_done() {
        let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
                          "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]});
        let req = parse(Api::Chat, &body).unwrap();
        let ans = answer(&req.prompt, &SCRIPT);
        let plan = chat_stream(&Reply { request: &req, body: &body, answer: &ans, seq: 1, created: 0 });
        let n = plan.frames.len();
        assert_eq!(plan.frames[n - 1], "data: [DONE]\n\n");
        assert!(plan.frames[n - 2].contains("\"choices\":[]"));
        assert!(plan.frames[n - 3].contains("\"finish_reason\":\"tool_calls\""));
    }
}
