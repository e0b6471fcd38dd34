//! The request body for a turn, in the provider's wire format (Responses,
//! Chat Completions, or Anthropic's Messages API in `request/anthropic.rs`).
//!
//! The transcript is kept in the Responses shape whatever the transport; this
//! module is the one place that turns the context (what
//! [`crate::context::prepare_context`] chose to send) into a body.
//! Turns are stateless — `store: false` unless the run asks otherwise, the
//! whole bounded history every time — so any server of the style can take any
//! turn of any run, and no provider-side state can disagree with the transcript.
//!
//! The run's generation parameters ([`Generation`]) go in each style's own
//! names; a parameter a style has no form for is left out (logged at debug),
//! never sent in a form the provider would refuse:
//!
//! | run spec | Responses | Chat | Anthropic |
//! | --- | --- | --- | --- |
//! | `temperature` | as is | as is | at most 1 (its range); left out with thinking |
//! | `top_p` | as is | as is | left out beside `temperature`, and with thinking unless ≥ 0.95 |
//! | `reasoning.effort` | `reasoning` (+ `include: reasoning.encrypted_content` when not stored) | `reasoning_effort` | `thinking` with a budget ([`thinking_budget`]) |
//! | `text.format` | `text.format` | `response_format` | a forced answer tool (`request/anthropic.rs`) |
//! | `tool_choice` | as is | `{"type":"function","function":{"name"}}` | `auto` / `any` / `none` / `tool` |
//! | `parallel_tool_calls` | as is (default true) | when set | `disable_parallel_tool_use` |
//! | `stop` | — | `stop` | `stop_sequences` |
//! | `seed` | — | `seed` | — |
//! | `service_tier` | as is | as is | `auto`; `default` as `standard_only` |
//! | `prompt_cache_key` | as is | as is | — |
//! | `prompt_cache` (`auto`) | a `prompt_cache_key` for the run | — (see `cache_key`) | `cache_control` breakpoints |
//! | `store` | as is (default false) | when set | — |
//! | `truncation` | as is | — | — |

mod anthropic;
mod cache;

use serde_json::{json, Map, Value};
use shared::runs::{ApiStyle, Format, Generation, PromptCache, ToolChoice};

pub use cache::{run_cache_key, CACHE_HOLDS_MS};

pub use anthropic::{
    answer_tool_name, anthropic_messages, thinking_budget, ANTHROPIC_DEFAULT_MAX_TOKENS, ANTHROPIC_VERSION,
    JSON_OBJECT_TOOL,
};

/// What a turn sends besides its context, as the run was submitted.
#[derive(Debug, Clone, Copy)]
pub struct TurnParams<'a> {
    /// The model name, as submitted.
    pub model: &'a str,
    /// The run's instructions (the system prompt); resent every turn, since a
    /// stateless call inherits nothing.
    pub instructions: Option<&'a str>,
    /// Function tools in the Responses shape, as submitted:
    /// `{"type":"function","name","description","parameters"}`.
    pub tools: &'a [Value],
    /// The output limit, as submitted.
    pub max_output_tokens: Option<u32>,
    /// The run's metadata; forwarded (Responses only) when the provider would
    /// accept it — see [`provider_metadata`].
    pub metadata: Option<&'a Value>,
    /// The run's generation parameters (`None`: all defaults).
    pub generation: Option<&'a Generation>,
}

impl TurnParams<'_> {
    fn generation(&self) -> Generation {
        self.generation.cloned().unwrap_or_default()
    }
}

/// The body for one turn: `params` plus `context` (Responses input items),
/// in the wire format `style` names. Always streaming.
pub fn build_body(style: ApiStyle, params: &TurnParams, context: &[Value]) -> Value {
    match style {
        ApiStyle::Responses => responses_body(params, context),
        ApiStyle::Chat => chat_body(params, context),
        ApiStyle::Anthropic => anthropic::body(params, context),
    }
}

/// The name of the tool that carries a structured answer, when `style` has no
/// native structured output and the run asks for one (Anthropic): the
/// provider client turns that tool's call into the answer's text.
pub fn answer_tool(style: ApiStyle, params: &TurnParams) -> Option<String> {
    match style {
        ApiStyle::Anthropic => answer_tool_name(params).map(str::to_owned),
        ApiStyle::Responses | ApiStyle::Chat => None,
    }
}

/// Notes the parameters a style has no form for (they are left out).
pub(crate) fn dropped(style: ApiStyle, names: &[&str]) {
    if !names.is_empty() {
        tracing::debug!(message = "generation parameters this style has no form for are not sent",
            api.style = ?style, parameters = ?names);
    }
}

/// The `prompt_cache_key` a Responses call sends: the run's own, else with
/// caching on one stable for the run ([`run_cache_key`]). A Chat Completions
/// call sends only the run's own: that style is also the one for the servers
/// that copy it (vLLM, Mistral, Groq …), some of which refuse a field they do
/// not know, and OpenAI's own caches it without a key.
fn cache_key(params: &TurnParams, g: &Generation, context: &[Value]) -> Option<String> {
    match (&g.prompt_cache_key, g.prompt_cache) {
        (Some(key), _) => Some(key.clone()),
        (None, PromptCache::Auto) => {
            Some(run_cache_key(params.model, params.instructions, params.tools, context.first()))
        }
        (None, PromptCache::Off) => None,
    }
}

/// `tool_choice` in the Responses shape (also the run spec's).
fn responses_tool_choice(choice: &ToolChoice) -> Value {
    Value::from(choice.clone())
}

/// `POST /responses`: the context is sent as `input` unchanged (the worker
/// stored the model's output items in their resendable form).
fn responses_body(params: &TurnParams, context: &[Value]) -> Value {
    let g = params.generation();
    let mut body = Map::new();
    body.insert("model".into(), params.model.into());
    if let Some(instructions) = params.instructions.filter(|s| !s.is_empty()) {
        body.insert("instructions".into(), instructions.into());
    }
    body.insert("input".into(), Value::Array(context.to_vec()));
    if !params.tools.is_empty() {
        body.insert("tools".into(), Value::Array(params.tools.to_vec()));
        if let Some(choice) = &g.tool_choice {
            body.insert("tool_choice".into(), responses_tool_choice(choice));
        }
        // Several calls of one turn run in parallel on our side (the tool
        // endpoint is POSTed concurrently), so let the model ask for several
        // unless the run says no. Only with tools: a provider may refuse the
        // flag without any.
        body.insert("parallel_tool_calls".into(), g.parallel_tool_calls.unwrap_or(true).into());
    }
    if let Some(max) = params.max_output_tokens {
        body.insert("max_output_tokens".into(), max.into());
    }
    if let Some(t) = g.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(p) = g.top_p {
        body.insert("top_p".into(), json!(p));
    }
    let store = g.store.unwrap_or(false);
    if let Some(r) = g.reasoning {
        body.insert("reasoning".into(), json!({"effort": r.effort.as_str()}));
        if !store {
            // A stateless turn can hand the model its earlier reasoning back
            // only in the encrypted form (provider/responses.rs keeps it).
            body.insert("include".into(), json!(["reasoning.encrypted_content"]));
        }
    }
    if let Some(text) = &g.text {
        body.insert("text".into(), json!({"format": text.format}));
    }
    if let Some(tier) = g.service_tier {
        body.insert("service_tier".into(), tier.as_str().into());
    }
    if let Some(key) = cache_key(params, &g, context) {
        body.insert("prompt_cache_key".into(), key.into());
    }
    if let Some(t) = g.truncation {
        body.insert("truncation".into(), t.as_str().into());
    }
    body.insert("store".into(), store.into());
    body.insert("stream".into(), true.into());
    if let Some(metadata) = params.metadata.and_then(provider_metadata) {
        body.insert("metadata".into(), metadata);
    }
    let mut none = vec![];
    if g.stop.is_some() {
        none.push("stop");
    }
    if g.seed.is_some() {
        none.push("seed");
    }
    dropped(ApiStyle::Responses, &none);
    Value::Object(body)
}

/// OpenAI's limits on `metadata`: string → string, at most 16 pairs, keys of at
/// most 64 characters, values of at most 512.
const METADATA_MAX_PAIRS: usize = 16;
const METADATA_MAX_KEY: usize = 64;
const METADATA_MAX_VALUE: usize = 512;

/// The run's metadata as the provider accepts it, or `None`.
///
/// A run's metadata is any JSON and belongs to paceline; the
/// Responses API takes only string → string within limits and answers 400 to
/// anything else — a 400 that would fail the run for a label. So it is
/// forwarded whole when it fits, and not at all otherwise: never a silently
/// edited half.
pub fn provider_metadata(metadata: &Value) -> Option<Value> {
    let obj = metadata.as_object()?;
    let fits = !obj.is_empty()
        && obj.len() <= METADATA_MAX_PAIRS
        && obj.iter().all(|(k, v)| {
            k.chars().count() <= METADATA_MAX_KEY && v.as_str().is_some_and(|s| s.chars().count() <= METADATA_MAX_VALUE)
        });
    fits.then(|| metadata.clone())
}

/// `POST /chat/completions`: the instructions as a system message, the
/// context converted message by message, tools nested under `function`.
///
/// Choices where servers differ:
/// - the output limit is sent as `max_tokens`, not `max_completion_tokens`:
///   the chat style exists for vLLM, Ollama and LiteLLM, which all read
///   `max_tokens` (not every one reads the newer name); OpenAI's own newer
///   models, which refuse `max_tokens`, are served by the Responses default;
/// - `system`, not `developer`, for the instructions and for `developer`
///   messages: every compatible server knows `system`;
/// - `parallel_tool_calls` and `store` only when the run sets them, and never
///   `metadata`: defaults or unknown to many servers, and OpenAI's default
///   for parallel calls is already on.
fn chat_body(params: &TurnParams, context: &[Value]) -> Value {
    let g = params.generation();
    let mut body = Map::new();
    body.insert("model".into(), params.model.into());
    body.insert("messages".into(), Value::Array(chat_messages(params.instructions, context)));
    let tools: Vec<Value> = params.tools.iter().filter_map(chat_tool).collect();
    if !tools.is_empty() {
        body.insert("tools".into(), Value::Array(tools));
        if let Some(choice) = &g.tool_choice {
            let choice = match choice {
                ToolChoice::Function(name) => json!({"type": "function", "function": {"name": name}}),
                other => responses_tool_choice(other),
            };
            body.insert("tool_choice".into(), choice);
        }
        if let Some(parallel) = g.parallel_tool_calls {
            body.insert("parallel_tool_calls".into(), parallel.into());
        }
    }
    if let Some(max) = params.max_output_tokens {
        body.insert("max_tokens".into(), max.into());
    }
    if let Some(t) = g.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(p) = g.top_p {
        body.insert("top_p".into(), json!(p));
    }
    if let Some(r) = g.reasoning {
        body.insert("reasoning_effort".into(), r.effort.as_str().into());
    }
    if let Some(text) = &g.text {
        let format = match &text.format {
            Format::Text => json!({"type": "text"}),
            Format::JsonObject => json!({"type": "json_object"}),
            Format::JsonSchema(s) => {
                let mut schema = json!({"name": s.name, "schema": s.schema});
                if let Some(strict) = s.strict {
                    schema["strict"] = strict.into();
                }
                if let Some(d) = &s.description {
                    schema["description"] = d.as_str().into();
                }
                json!({"type": "json_schema", "json_schema": schema})
            }
        };
        body.insert("response_format".into(), format);
    }
    if let Some(stop) = &g.stop {
        body.insert("stop".into(), json!(stop));
    }
    if let Some(seed) = g.seed {
        body.insert("seed".into(), seed.into());
    }
    if let Some(tier) = g.service_tier {
        body.insert("service_tier".into(), tier.as_str().into());
    }
    if let Some(key) = &g.prompt_cache_key {
        body.insert("prompt_cache_key".into(), key.as_str().into());
    }
    if let Some(store) = g.store {
        body.insert("store".into(), store.into());
    }
    dropped(ApiStyle::Chat, if g.truncation.is_some() { &["truncation"] } else { &[] });
    body.insert("stream".into(), true.into());
    // The last chunk then carries `usage`, which settles the pacer's reservation.
    body.insert("stream_options".into(), json!({"include_usage": true}));
    Value::Object(body)
}

/// A Responses function tool as a Chat tool (`{"type":"function","function":{…}}`).
/// A tool already in the Chat shape passes as it is; a non-function tool
/// (a provider-side tool such as `web_search`) has no Chat form and is left out.
fn chat_tool(tool: &Value) -> Option<Value> {
    if tool.get("function").is_some_and(Value::is_object) {
        return Some(tool.clone());
    }
    if tool.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
        return None;
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(v) = tool.get(key) {
            function.insert(key.into(), v.clone());
        }
    }
    Some(json!({"type": "function", "function": function}))
}

/// The Chat `messages` for `instructions` and a Responses `context`.
///
/// - a message keeps its role (`developer` becomes `system`); its content
///   becomes a string (text parts joined by newlines), or Chat content parts
///   when it carries an image;
/// - `function_call` items become `tool_calls` of one assistant message: the
///   calls of one model turn are adjacent in the transcript, so consecutive
///   calls — and the assistant message just before them, the text the model
///   wrote with them — become that one message, as the model produced it;
/// - `function_call_output` becomes `{"role":"tool","tool_call_id","content"}`;
/// - `reasoning` and other items Chat has no form for are left out.
pub fn chat_messages(instructions: Option<&str>, context: &[Value]) -> Vec<Value> {
    let mut messages = Vec::with_capacity(context.len() + 1);
    if let Some(instructions) = instructions.filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    // Whether the last message pushed is an assistant message that the next
    // function_call may join (it came from the item just before).
    let mut open_assistant = false;
    for item in context {
        match item.get("type").and_then(Value::as_str) {
            Some("function_call") => {
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": item.get("arguments").cloned().unwrap_or_else(|| "{}".into()),
                    },
                });
                let open = messages.last_mut().filter(|_| open_assistant).and_then(Value::as_object_mut);
                match open {
                    Some(last) => {
                        let calls = last.entry("tool_calls").or_insert_with(|| Value::Array(vec![]));
                        if let Value::Array(calls) = calls {
                            calls.push(call);
                        }
                    }
                    None => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
                open_assistant = true;
            }
            Some("function_call_output") => {
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "content": output_text(item.get("output")),
                }));
                open_assistant = false;
            }
            Some("message") | None if item.get("role").is_some() => {
                let role = match item["role"].as_str() {
                    Some("developer") => "system",
                    Some(role) => role,
                    None => "user",
                };
                let content = chat_content(role, item.get("content"));
                messages.push(json!({"role": role, "content": content}));
                open_assistant = role == "assistant";
            }
            // reasoning, provider-side tool items: no Chat form. They do not
            // close an open assistant message (reasoning may sit between a
            // turn's text and its calls).
            _ => {}
        }
    }
    messages
}

/// The text of a content part, for the part types that carry text.
fn part_text(part: &Value) -> Option<&str> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") => part.get("text").and_then(Value::as_str),
        Some("refusal") => part.get("refusal").and_then(Value::as_str),
        _ => None,
    }
}

/// A message's content for Chat: a string, `null` for an assistant message
/// with no text, or — only for a user message that carries an image — Chat
/// content parts (`text` and `image_url`).
fn chat_content(role: &str, content: Option<&Value>) -> Value {
    match content {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let has_image = parts.iter().any(|p| p.get("type").and_then(Value::as_str) == Some("input_image"));
            if has_image && role == "user" {
                let parts: Vec<Value> = parts
                    .iter()
                    .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                        Some("input_image") => {
                            let url = p.get("image_url").and_then(Value::as_str)?;
                            let mut image = json!({"url": url});
                            if let Some(detail) = p.get("detail") {
                                image["detail"] = detail.clone();
                            }
                            Some(json!({"type": "image_url", "image_url": image}))
                        }
                        _ => part_text(p).map(|t| json!({"type": "text", "text": t})),
                    })
                    .collect();
                return Value::Array(parts);
            }
            let text: Vec<&str> = parts.iter().filter_map(part_text).collect();
            if text.is_empty() && role == "assistant" {
                Value::Null
            } else {
                Value::String(text.join("\n"))
            }
        }
        _ if role == "assistant" => Value::Null,
        _ => Value::String(String::new()),
    }
}

/// A tool output for a Chat `tool` message: the string itself, the text of
/// its parts, or (for anything else) its JSON text.
fn output_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(part_text).collect::<Vec<_>>().join("\n"),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![json!({"type": "function", "name": "search", "description": "Search the web",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}})]
    }

    fn params<'a>(tools: &'a [Value], metadata: Option<&'a Value>) -> TurnParams<'a> {
        TurnParams {
            model: "gpt-4.1-mini",
            instructions: Some("Be brief."),
            tools,
            max_output_tokens: Some(2048),
            metadata,
            generation: None,
        }
    }

    /// One tool turn, as stored: the task, the model's text and two parallel
    /// calls, their outputs, then the final answer.
    fn tool_turn() -> Vec<Value> {
        vec![
            json!({"role": "user", "content": "find x"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Looking."}]}),
            json!({"type": "function_call", "call_id": "call_a", "name": "search", "arguments": "{\"q\":\"x\"}"}),
            json!({"type": "function_call", "call_id": "call_b", "name": "search", "arguments": "{\"q\":\"y\"}"}),
            json!({"type": "function_call_output", "call_id": "call_a", "output": "x is 1"}),
            json!({"type": "function_call_output", "call_id": "call_b", "output": "y is 2"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "x is 1."}]}),
        ]
    }

    #[test]
    fn responses_shape() {
        let tools = tools();
        let meta = json!({"team": "search"});
        let ctx = tool_turn();
        let body = build_body(ApiStyle::Responses, &params(&tools, Some(&meta)), &ctx);
        assert_eq!(
            body,
            json!({
                "model": "gpt-4.1-mini",
                "instructions": "Be brief.",
                "input": ctx,
                "tools": tools,
                "parallel_tool_calls": true,
                "max_output_tokens": 2048,
                "prompt_cache_key": run_cache_key("gpt-4.1-mini", Some("Be brief."), &tools, ctx.first()),
                "store": false,
                "stream": true,
                "metadata": {"team": "search"},
            })
        );
    }

    #[test]
    fn responses_omits_what_is_absent() {
        let p = TurnParams {
            model: "m",
            instructions: None,
            tools: &[],
            max_output_tokens: None,
            metadata: None,
            generation: None,
        };
        let ctx = vec![json!({"role": "user", "content": "hi"})];
        let body = build_body(ApiStyle::Responses, &p, &ctx);
        let key = run_cache_key("m", None, &[], ctx.first());
        assert_eq!(body, json!({"model": "m", "input": ctx, "prompt_cache_key": key, "store": false, "stream": true}));
        // With caching off, no key but the run's own.
        let off = Generation { prompt_cache: PromptCache::Off, ..Generation::default() };
        let body = build_body(ApiStyle::Responses, &TurnParams { generation: Some(&off), ..p }, &ctx);
        assert!(body.get("prompt_cache_key").is_none());
        let empty = TurnParams { instructions: Some(""), ..p };
        assert!(build_body(ApiStyle::Responses, &empty, &ctx).get("instructions").is_none());
    }

    #[test]
    fn metadata_is_forwarded_only_when_the_provider_takes_it() {
        let long_value = "v".repeat(513);
        let long_key = "k".repeat(65);
        let many: Map<String, Value> = (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        let sixteen: Map<String, Value> = (0..16).map(|i| (format!("k{i}"), json!("v"))).collect();
        let cases = [
            (json!({"a": "b"}), true),
            (json!({"a": "v".repeat(512)}), true),
            (Value::Object(sixteen), true),
            (json!({}), false),
            (json!({"any": "json", "n": 1}), false),
            (json!({"nested": {"a": "b"}}), false),
            (json!({"a": long_value}), false),
            (json!({long_key: "b"}), false),
            (Value::Object(many), false),
            (json!("text"), false),
            (Value::Null, false),
        ];
        for (meta, forwarded) in cases {
            assert_eq!(provider_metadata(&meta).is_some(), forwarded, "{meta}");
            let tools = tools();
            let body = build_body(ApiStyle::Responses, &params(&tools, Some(&meta)), &[]);
            assert_eq!(body.get("metadata").is_some(), forwarded);
            // Chat never carries it.
            assert!(build_body(ApiStyle::Chat, &params(&tools, Some(&meta)), &[]).get("metadata").is_none());
        }
    }

    fn generation(v: Value, tools: &[&str]) -> Generation {
        Generation::from_json(v.as_object().unwrap(), tools).unwrap()
    }

    /// Every parameter, as a user of each SDK would write it.
    fn every_parameter() -> Generation {
        generation(
            json!({"temperature": 0.4, "top_p": 0.9, "reasoning": {"effort": "high"},
                   "text": {"format": {"type": "json_schema", "name": "verdict", "strict": true,
                                       "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}},
                   "tool_choice": {"type": "function", "name": "search"}, "parallel_tool_calls": false,
                   "stop": ["END"], "seed": 42, "service_tier": "flex", "prompt_cache_key": "run-7",
                   "store": true, "truncation": "auto"}),
            &["search"],
        )
    }

    #[test]
    fn responses_takes_the_parameters_in_its_own_names() {
        let tools = tools();
        let g = every_parameter();
        let p = TurnParams { generation: Some(&g), ..params(&tools, None) };
        let body = build_body(ApiStyle::Responses, &p, &tool_turn());
        assert_eq!(body["temperature"], json!(0.4));
        assert_eq!(body["top_p"], json!(0.9));
        assert_eq!(body["reasoning"], json!({"effort": "high"}));
        assert_eq!(
            body["text"],
            json!({"format": {"type": "json_schema", "name": "verdict", "strict": true,
                              "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}})
        );
        assert_eq!(body["tool_choice"], json!({"type": "function", "name": "search"}));
        assert_eq!(body["parallel_tool_calls"], json!(false));
        assert_eq!(body["service_tier"], "flex");
        assert_eq!(body["prompt_cache_key"], "run-7");
        assert_eq!(body["store"], json!(true));
        assert_eq!(body["truncation"], "auto");
        assert!(body.get("include").is_none(), "a stored response needs no encrypted reasoning");
        assert!(body.get("stop").is_none() && body.get("seed").is_none(), "Responses has neither");
        // Not stored (the default), reasoning comes back encrypted for the next turn.
        let g = generation(json!({"reasoning": {"effort": "minimal"}, "tool_choice": "required"}), &["search"]);
        let body = build_body(ApiStyle::Responses, &TurnParams { generation: Some(&g), ..params(&tools, None) }, &[]);
        assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
        assert_eq!((body["store"].clone(), body["tool_choice"].clone()), (json!(false), json!("required")));
        // A tool choice without tools is not sent.
        let g = generation(json!({"tool_choice": "none"}), &[]);
        let body = build_body(ApiStyle::Responses, &TurnParams { generation: Some(&g), ..params(&[], None) }, &[]);
        assert!(body.get("tool_choice").is_none() && body.get("parallel_tool_calls").is_none());
    }

    #[test]
    fn chat_takes_the_parameters_in_its_own_names() {
        let tools = tools();
        let g = every_parameter();
        let p = TurnParams { generation: Some(&g), ..params(&tools, None) };
        let body = build_body(ApiStyle::Chat, &p, &tool_turn());
        assert_eq!(body["temperature"], json!(0.4));
        assert_eq!(body["top_p"], json!(0.9));
        assert_eq!(body["reasoning_effort"], "high");
        assert_eq!(
            body["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "verdict", "strict": true,
                   "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}})
        );
        assert_eq!(body["tool_choice"], json!({"type": "function", "function": {"name": "search"}}));
        assert_eq!(body["parallel_tool_calls"], json!(false));
        assert_eq!(body["stop"], json!(["END"]));
        assert_eq!(body["seed"], json!(42));
        assert_eq!(body["service_tier"], "flex");
        assert_eq!(body["prompt_cache_key"], "run-7");
        assert_eq!(body["store"], json!(true));
        assert!(body.get("truncation").is_none() && body.get("reasoning").is_none() && body.get("text").is_none());
        for (choice, want) in [("auto", json!("auto")), ("required", json!("required")), ("none", json!("none"))] {
            let g = generation(json!({"tool_choice": choice, "text": {"format": {"type": "json_object"}}}), &["s"]);
            let body = build_body(ApiStyle::Chat, &TurnParams { generation: Some(&g), ..params(&tools, None) }, &[]);
            assert_eq!(body["tool_choice"], want);
            assert_eq!(body["response_format"], json!({"type": "json_object"}));
        }
        // Unset, nothing new is sent: a vLLM server sees the body it saw before.
        let body = build_body(ApiStyle::Chat, &params(&tools, None), &[]);
        for absent in ["tool_choice", "parallel_tool_calls", "store", "temperature", "response_format", "stop"] {
            assert!(body.get(absent).is_none(), "{absent}");
        }
    }

    #[test]
    fn only_anthropic_has_an_answer_tool() {
        let g = every_parameter();
        let tools = tools();
        let p = TurnParams { generation: Some(&g), ..params(&tools, None) };
        assert_eq!(answer_tool(ApiStyle::Anthropic, &p).as_deref(), Some("verdict"));
        assert_eq!(answer_tool(ApiStyle::Responses, &p), None);
        assert_eq!(answer_tool(ApiStyle::Chat, &p), None);
    }

    #[test]
    fn chat_shape_groups_a_turns_text_and_calls() {
        let tools = tools();
        let body = build_body(ApiStyle::Chat, &params(&tools, None), &tool_turn());
        assert_eq!(
            body,
            json!({
                "model": "gpt-4.1-mini",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "find x"},
                    {"role": "assistant", "content": "Looking.", "tool_calls": [
                        {"id": "call_a", "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"x\"}"}},
                        {"id": "call_b", "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"y\"}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "call_a", "content": "x is 1"},
                    {"role": "tool", "tool_call_id": "call_b", "content": "y is 2"},
                    {"role": "assistant", "content": "x is 1."},
                ],
                "tools": [{"type": "function", "function": {
                    "name": "search", "description": "Search the web",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
                "max_tokens": 2048,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
        );
    }

    #[test]
    fn chat_grouping_table() {
        let call = |id: &str| json!({"type": "function_call", "call_id": id, "name": "f", "arguments": "{}"});
        let out = |id: &str| json!({"type": "function_call_output", "call_id": id, "output": "ok"});
        // Shape of each message: role plus the ids of its tool calls.
        let shape = |msgs: Vec<Value>| -> Vec<String> {
            msgs.iter()
                .map(|m| {
                    let ids: Vec<&str> = m
                        .get("tool_calls")
                        .and_then(Value::as_array)
                        .map(|c| c.iter().map(|c| c["id"].as_str().unwrap()).collect())
                        .unwrap_or_default();
                    let content = if m["content"].is_null() { "null".to_string() } else { m["content"].to_string() };
                    format!("{}{content}{ids:?}", m["role"].as_str().unwrap())
                })
                .collect()
        };
        let cases: Vec<(Vec<Value>, Vec<&str>)> = vec![
            // Calls without text: content null.
            (vec![call("a"), out("a")], vec!["assistantnull[\"a\"]", "tool\"ok\"[]"]),
            // Two turns of calls: two assistant messages.
            (
                vec![call("a"), call("b"), out("a"), out("b"), call("c"), out("c")],
                vec![
                    "assistantnull[\"a\", \"b\"]",
                    "tool\"ok\"[]",
                    "tool\"ok\"[]",
                    "assistantnull[\"c\"]",
                    "tool\"ok\"[]",
                ],
            ),
            // A user message between closes the group; a reasoning item does not.
            (
                vec![
                    json!({"role": "assistant", "content": "t"}),
                    json!({"type": "reasoning", "encrypted_content": "e", "summary": []}),
                    call("a"),
                    out("a"),
                    json!({"role": "user", "content": "u"}),
                    call("b"),
                    out("b"),
                ],
                vec!["assistant\"t\"[\"a\"]", "tool\"ok\"[]", "user\"u\"[]", "assistantnull[\"b\"]", "tool\"ok\"[]"],
            ),
            // A user message's text is never merged with calls.
            (
                vec![json!({"role": "user", "content": "u"}), call("a"), out("a")],
                vec!["user\"u\"[]", "assistantnull[\"a\"]", "tool\"ok\"[]"],
            ),
        ];
        for (ctx, want) in cases {
            assert_eq!(shape(chat_messages(None, &ctx)), want, "{ctx:?}");
        }
    }

    #[test]
    fn chat_tool_turn_round_trips() {
        // What a chat model sent (an assistant message with tool_calls) is
        // stored as Responses items (as provider/chat.rs decodes it) and sent
        // back on the next turn as the same assistant message.
        let sent = json!({"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{\"q\":1}"}},
            {"id": "call_2", "type": "function", "function": {"name": "fetch", "arguments": "{\"u\":2}"}}]});
        let mut stored = vec![json!({"type": "message", "role": "assistant",
                                     "content": [{"type": "output_text", "text": "Checking."}]})];
        for c in sent["tool_calls"].as_array().unwrap() {
            stored.push(json!({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                               "arguments": c["function"]["arguments"]}));
        }
        stored.push(json!({"type": "function_call_output", "call_id": "call_1", "output": "r1"}));
        stored.push(json!({"type": "function_call_output", "call_id": "call_2", "output": "r2"}));
        let messages = chat_messages(None, &stored);
        assert_eq!(messages[0], sent);
        assert_eq!(messages[1], json!({"role": "tool", "tool_call_id": "call_1", "content": "r1"}));
        assert_eq!(messages[2], json!({"role": "tool", "tool_call_id": "call_2", "content": "r2"}));
    }

    #[test]
    fn chat_without_tools_or_instructions() {
        let p = TurnParams {
            model: "llama",
            instructions: None,
            tools: &[],
            max_output_tokens: None,
            metadata: None,
            generation: None,
        };
        let ctx = vec![json!({"role": "user", "content": "hi"})];
        let body = build_body(ApiStyle::Chat, &p, &ctx);
        assert_eq!(
            body,
            json!({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                   "stream": true, "stream_options": {"include_usage": true}})
        );
    }

    #[test]
    fn chat_content_conversions() {
        let ctx = vec![
            json!({"role": "developer", "content": "rules"}),
            json!({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}),
            json!({"role": "user", "content": [{"type": "input_text", "text": "see"},
                {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}),
            json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "c",
                   "output": [{"type": "input_text", "text": "part 1"}, {"type": "input_text", "text": "part 2"}]}),
            json!({"type": "web_search_call", "id": "ws_1"}),
        ];
        assert_eq!(
            chat_messages(None, &ctx),
            vec![
                json!({"role": "system", "content": "rules"}),
                json!({"role": "user", "content": "a\nb"}),
                json!({"role": "user", "content": [{"type": "text", "text": "see"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}]}),
                json!({"role": "assistant", "content": "no", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
                json!({"role": "tool", "tool_call_id": "c", "content": "part 1\npart 2"}),
            ]
        );
    }

    #[test]
    fn chat_tools_are_nested_and_non_function_tools_dropped() {
        let tools = vec![
            json!({"type": "function", "name": "a", "parameters": {"type": "object"}, "strict": true}),
            json!({"type": "function", "function": {"name": "b"}}),
            json!({"type": "web_search"}),
        ];
        let p = TurnParams {
            model: "m",
            instructions: None,
            tools: &tools,
            max_output_tokens: Some(5),
            metadata: None,
            generation: None,
        };
        let body = build_body(ApiStyle::Chat, &p, &[]);
        assert_eq!(
            body["tools"],
            json!([
                {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}, "strict": true}},
                {"type": "function", "function": {"name": "b"}},
            ])
        );
        assert_eq!(body["max_tokens"], 5);
        assert!(body.get("max_completion_tokens").is_none());
        // Responses passes tools as submitted.
        assert_eq!(build_body(ApiStyle::Responses, &p, &[])["tools"], json!(tools));
    }
}
