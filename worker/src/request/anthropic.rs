//! The body of `POST /v1/messages` (Anthropic's Messages API) for one turn,
//! from the Responses-shape context; `provider/anthropic.rs` reads the answer
//! back into that shape.
//!
//! The translation:
//! - the instructions, and any `system` / `developer` message of the
//!   context, become the top-level `system` (Anthropic has no system role
//!   inside `messages`);
//! - the model's items of one turn (its `reasoning`, its text, its
//!   `function_call`s) become one `assistant` message: `thinking`, `text` and
//!   `tool_use` blocks in that order; the tool outputs that follow become one
//!   `user` message of `tool_result` blocks (Anthropic wants every result of
//!   a turn in the message right after it, results first); consecutive items
//!   of one role are always one message;
//! - tools become `{"name","description","input_schema"}`.
//!
//! Choices where Anthropic has no direct equivalent:
//! - **Structured output** (`text.format`): a forced *answer tool* named
//!   after the schema (`json_object`: [`JSON_OBJECT_TOOL`]) whose
//!   `input_schema` is the schema; `tool_choice` becomes `tool` (no other
//!   tools) or `any` (the model either acts or answers), and the provider
//!   client turns the call into the answer's text (its input as JSON). This
//!   works on every Claude model, where Anthropic's own structured outputs
//!   are a beta on some.
//! - **Reasoning effort** becomes `thinking: {"type": "enabled",
//!   "budget_tokens": B}` ([`thinking_budget`]). Anthropic refuses thinking
//!   beside a forced tool choice (`any` / `tool`), beside `temperature`, and
//!   beside `top_p` under 0.95: a forced choice is a contract the caller's
//!   code relies on, thinking a quality knob, so thinking is left out when
//!   the choice is forced, and the sampling knobs when thinking is on.
//! - `temperature` above 1 (Anthropic's range is 0–1) is sent as 1; `top_p`
//!   beside `temperature` is left out (recent models refuse both).

use serde_json::{json, Map, Value};
use shared::runs::{ApiStyle, Effort, Format, PromptCache, ServiceTier, ToolChoice};

use super::{dropped, TurnParams};

/// `max_tokens` when a turn sets no output limit (Anthropic requires one).
pub const ANTHROPIC_DEFAULT_MAX_TOKENS: u32 = 4096;

/// The name of the answer tool of a `json_object` format (no schema name).
pub const JSON_OBJECT_TOOL: &str = "json_answer";

/// Anthropic's smallest thinking budget.
pub const MIN_THINKING_BUDGET: u32 = 1024;

/// The `anthropic-version` every request names.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The thinking budget for `effort` within an output limit of `max_tokens`:
/// 1 024 (minimal), 4 096 (low), 16 384 (medium), 32 768 (high) tokens, at
/// most three quarters of `max_tokens` (the budget is part of the output
/// limit and must be below it; a quarter is left for the answer). `None` when
/// that leaves less than Anthropic's minimum of 1 024: no thinking then.
pub fn thinking_budget(effort: Effort, max_tokens: u32) -> Option<u32> {
    let want: u32 = match effort {
        Effort::Minimal => 1_024,
        Effort::Low => 4_096,
        Effort::Medium => 16_384,
        Effort::High => 32_768,
    };
    let budget = want.min(max_tokens / 4 * 3);
    (budget >= MIN_THINKING_BUDGET).then_some(budget)
}

/// The answer tool's name when the run asks for structured output and no
/// run tool has that name (a `json_schema` name was checked at submit).
pub fn answer_tool_name<'a>(params: &TurnParams<'a>) -> Option<&'a str> {
    let name = match params.generation?.text.as_ref().map(|t| &t.format)? {
        Format::JsonSchema(s) => s.name.as_str(),
        Format::JsonObject => JSON_OBJECT_TOOL,
        Format::Text => return None,
    };
    let taken = params.tools.iter().any(|t| tool_name(t) == Some(name));
    (!taken).then_some(name)
}

fn tool_name(tool: &Value) -> Option<&str> {
    tool.get("function").unwrap_or(tool).get("name").and_then(Value::as_str)
}

/// A Responses (or Chat) function tool as an Anthropic tool; `None` for a
/// provider-side tool, which has no Anthropic form.
fn anthropic_tool(tool: &Value) -> Option<Value> {
    if tool.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
        return None;
    }
    let def = tool.get("function").unwrap_or(tool);
    let name = def.get("name").and_then(Value::as_str)?;
    let schema = def
        .get("parameters")
        .filter(|p| p.is_object())
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    let mut out = json!({"name": name, "input_schema": schema});
    if let Some(d) = def.get("description").and_then(Value::as_str).filter(|d| !d.is_empty()) {
        out["description"] = d.into();
    }
    Some(out)
}

/// The body of one turn.
pub(super) fn body(params: &TurnParams, context: &[Value]) -> Value {
    let g = params.generation();
    let max_tokens = params.max_output_tokens.unwrap_or(ANTHROPIC_DEFAULT_MAX_TOKENS).max(1);
    let mut not_sent: Vec<&str> = vec![];
    let mut tools: Vec<Value> = params.tools.iter().filter_map(anthropic_tool).collect();
    let has_run_tools = !tools.is_empty();

    // Structured output: the answer tool, and a choice that makes the model
    // either act or answer through it.
    let answer = answer_tool_name(params);
    if let Some(name) = answer {
        let (schema, description) = match g.text.as_ref().map(|t| &t.format) {
            Some(Format::JsonSchema(s)) => (s.schema.clone(), s.description.clone()),
            _ => (json!({"type": "object"}), None),
        };
        let description = description.unwrap_or_else(|| {
            "Give your final answer by calling this tool: its input is the answer, in this JSON schema.".into()
        });
        tools.push(json!({"name": name, "description": description, "input_schema": schema}));
    } else if g.text.as_ref().is_some_and(|t| !matches!(t.format, Format::Text)) {
        not_sent.push("text.format");
    }
    let tool = |name: &str| json!({"type": "tool", "name": name});
    let mut choice: Option<Value> = match (answer, &g.tool_choice) {
        // A function the run forces stays forced (as on OpenAI: every turn).
        (Some(_), Some(ToolChoice::Function(f))) => Some(tool(f)),
        // Nothing else to call, or calling tools is off: answer.
        (Some(name), Some(ToolChoice::None)) => Some(tool(name)),
        (Some(name), _) if !has_run_tools => Some(tool(name)),
        // Act or answer.
        (Some(_), _) => Some(json!({"type": "any"})),
        (None, _) if !has_run_tools => None,
        (None, None) => None,
        (None, Some(ToolChoice::Auto)) => Some(json!({"type": "auto"})),
        (None, Some(ToolChoice::Required)) => Some(json!({"type": "any"})),
        (None, Some(ToolChoice::None)) => Some(json!({"type": "none"})),
        (None, Some(ToolChoice::Function(f))) => Some(tool(f)),
    };
    if g.parallel_tool_calls == Some(false) && !tools.is_empty() {
        let c = choice.get_or_insert_with(|| json!({"type": "auto"}));
        if c["type"] != "none" {
            c["disable_parallel_tool_use"] = true.into();
        }
    }
    if g.tool_choice.is_some() && tools.is_empty() {
        not_sent.push("tool_choice");
    }
    let forced = choice.as_ref().is_some_and(|c| matches!(c["type"].as_str(), Some("any" | "tool")));

    let thinking = match g.reasoning {
        Some(_) if forced => {
            not_sent.push("reasoning (Anthropic refuses thinking with a forced tool choice)");
            None
        }
        Some(r) => match thinking_budget(r.effort, max_tokens) {
            Some(budget) => Some(budget),
            None => {
                not_sent.push("reasoning (max_output_tokens leaves no room for a thinking budget)");
                None
            }
        },
        None => None,
    };

    let (system, messages) = anthropic_messages(params.instructions, context, thinking.is_some());
    let mut body = Map::new();
    body.insert("model".into(), params.model.into());
    body.insert("max_tokens".into(), max_tokens.into());
    if let Some(system) = system {
        body.insert("system".into(), system.into());
    }
    body.insert("messages".into(), Value::Array(messages));
    if !tools.is_empty() {
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = choice {
        body.insert("tool_choice".into(), choice);
    }
    if let Some(budget) = thinking {
        body.insert("thinking".into(), json!({"type": "enabled", "budget_tokens": budget}));
    }
    match (thinking.is_some(), g.temperature, g.top_p) {
        (true, t, p) => {
            if t.is_some() {
                not_sent.push("temperature (not with thinking)");
            }
            match p {
                Some(p) if p >= 0.95 => {
                    body.insert("top_p".into(), json!(p));
                }
                Some(_) => not_sent.push("top_p (under 0.95, not with thinking)"),
                None => {}
            }
        }
        (false, Some(t), p) => {
            body.insert("temperature".into(), json!(t.min(1.0)));
            if p.is_some() {
                not_sent.push("top_p (beside temperature)");
            }
        }
        (false, None, Some(p)) => {
            body.insert("top_p".into(), json!(p));
        }
        (false, None, None) => {}
    }
    if let Some(stop) = &g.stop {
        body.insert("stop_sequences".into(), json!(stop));
    }
    match g.service_tier {
        Some(ServiceTier::Auto) => {
            body.insert("service_tier".into(), "auto".into());
        }
        Some(ServiceTier::Default) => {
            body.insert("service_tier".into(), "standard_only".into());
        }
        Some(_) => not_sent.push("service_tier (Anthropic has auto and standard_only)"),
        None => {}
    }
    for (set, name) in [
        (g.seed.is_some(), "seed"),
        (g.prompt_cache_key.is_some(), "prompt_cache_key"),
        (g.store.is_some(), "store"),
        (g.truncation.is_some(), "truncation"),
    ] {
        if set {
            not_sent.push(name);
        }
    }
    dropped(ApiStyle::Anthropic, &not_sent);
    if g.prompt_cache == PromptCache::Auto {
        super::cache::mark_anthropic(&mut body, params.model);
    }
    body.insert("stream".into(), true.into());
    Value::Object(body)
}

/// A tool-use id as Anthropic accepts it (`^[a-zA-Z0-9_-]+$`); the same
/// mapping for the call and its result keeps them paired.
fn tool_use_id(id: Option<&Value>) -> String {
    let id: String = id
        .and_then(Value::as_str)
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' })
        .collect();
    if id.is_empty() {
        "toolu_unnamed".into()
    } else {
        id
    }
}

/// A text block, unless the text is empty (Anthropic refuses empty text blocks).
fn text_block(text: &str) -> Option<Value> {
    (!text.is_empty()).then(|| json!({"type": "text", "text": text}))
}

/// The text of a content part, for the part types that carry text.
fn part_text(part: &Value) -> Option<&str> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") => part.get("text").and_then(Value::as_str),
        Some("refusal") => part.get("refusal").and_then(Value::as_str),
        _ => None,
    }
}

/// An `input_image` part as an image block: a `data:` URL as base64, an
/// http(s) URL as a URL source; anything else (a file id) has no form here.
fn image_block(part: &Value) -> Option<Value> {
    let url = part.get("image_url").and_then(Value::as_str)?;
    if let Some(rest) = url.strip_prefix("data:") {
        let (media_type, data) = rest.split_once(";base64,")?;
        return Some(json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}));
    }
    (url.starts_with("https://") || url.starts_with("http://"))
        .then(|| json!({"type": "image", "source": {"type": "url", "url": url}}))
}

/// A message's content as blocks: text (and, for a user, images).
fn content_blocks(role: &str, content: Option<&Value>) -> Vec<Value> {
    match content {
        Some(Value::String(s)) => text_block(s).into_iter().collect(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p.get("type").and_then(Value::as_str) {
                Some("input_image") if role == "user" => image_block(p),
                _ => part_text(p).and_then(text_block),
            })
            .collect(),
        _ => vec![],
    }
}

/// The plain text of a message's content (for `system`).
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(part_text).collect::<Vec<_>>().join("\n"),
        _ => String::new(),
    }
}

/// A tool output as a `tool_result`'s content.
fn output_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(part_text).collect::<Vec<_>>().join("\n"),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// A stored `reasoning` item as a thinking block, when it came from Anthropic
/// (no `id`: OpenAI's carry one): with its text, a signed `thinking` block;
/// without, a `redacted_thinking` block.
fn thinking_block(item: &Value) -> Option<Value> {
    if item.get("id").is_some() {
        return None;
    }
    let secret = item.get("encrypted_content").and_then(Value::as_str).filter(|s| !s.is_empty())?;
    match item.get("content").and_then(Value::as_array) {
        Some(parts) => {
            let text: String = parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
            Some(json!({"type": "thinking", "thinking": text, "signature": secret}))
        }
        None => Some(json!({"type": "redacted_thinking", "data": secret})),
    }
}

/// The `system` text and the `messages` for `instructions` and a Responses
/// `context`. Thinking blocks are sent back only when `thinking` is on (the
/// model's own earlier thinking must precede its tool use then).
pub fn anthropic_messages(
    instructions: Option<&str>,
    context: &[Value],
    thinking: bool,
) -> (Option<String>, Vec<Value>) {
    let mut system: Vec<String> = instructions.filter(|s| !s.is_empty()).map(str::to_owned).into_iter().collect();
    let mut messages: Vec<(&'static str, Vec<Value>)> = vec![];
    let mut push = |role: &'static str, blocks: Vec<Value>| {
        if blocks.is_empty() {
            return;
        }
        match messages.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => messages.push((role, blocks)),
        }
    };
    for item in context {
        match item.get("type").and_then(Value::as_str) {
            Some("function_call") => {
                let arguments = item.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                let input = serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object).unwrap_or(json!({}));
                push(
                    "assistant",
                    vec![json!({"type": "tool_use", "id": tool_use_id(item.get("call_id")),
                                "name": item.get("name").cloned().unwrap_or(Value::Null), "input": input})],
                );
            }
            Some("function_call_output") => {
                let mut result = json!({"type": "tool_result", "tool_use_id": tool_use_id(item.get("call_id"))});
                let text = output_text(item.get("output"));
                if !text.is_empty() {
                    result["content"] = text.into();
                }
                push("user", vec![result]);
            }
            Some("reasoning") if thinking => push("assistant", thinking_block(item).into_iter().collect()),
            Some("message") | None if item.get("role").is_some() => match item["role"].as_str() {
                Some("system" | "developer") => {
                    let text = content_text(item.get("content"));
                    if !text.is_empty() {
                        system.push(text);
                    }
                }
                Some("assistant") => push("assistant", content_blocks("assistant", item.get("content"))),
                _ => push("user", content_blocks("user", item.get("content"))),
            },
            // reasoning without thinking, provider-side tool items: no form here.
            _ => {}
        }
    }
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    let messages = messages.into_iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    (system, messages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::build_body;
    use shared::runs::Generation;

    fn tools() -> Vec<Value> {
        vec![json!({"type": "function", "name": "search", "description": "Search the web",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}})]
    }

    fn generation(v: Value, tools: &[&str]) -> Generation {
        Generation::from_json(v.as_object().unwrap(), tools).unwrap()
    }

    fn params<'a>(tools: &'a [Value], g: Option<&'a Generation>) -> TurnParams<'a> {
        TurnParams {
            model: "claude-sonnet-4-5",
            instructions: Some("Be brief."),
            tools,
            max_output_tokens: Some(2048),
            metadata: None,
            generation: g,
        }
    }

    /// A tool turn as stored (the Responses shape): the task, the model's
    /// thinking, text and two parallel calls, their outputs, the answer.
    fn tool_turn() -> Vec<Value> {
        vec![
            json!({"role": "user", "content": "find x"}),
            json!({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Search twice."}],
                   "encrypted_content": "sig-1"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Looking."}]}),
            json!({"type": "function_call", "call_id": "toolu_a", "name": "search", "arguments": "{\"q\":\"x\"}"}),
            json!({"type": "function_call", "call_id": "toolu_b", "name": "search", "arguments": "{\"q\":\"y\"}"}),
            json!({"type": "function_call_output", "call_id": "toolu_a", "output": "x is 1"}),
            json!({"type": "function_call_output", "call_id": "toolu_b", "output": "y is 2"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "x is 1."}]}),
        ]
    }

    #[test]
    fn a_tool_turn_in_anthropic_shape() {
        let tools = tools();
        let body = build_body(ApiStyle::Anthropic, &params(&tools, None), &tool_turn());
        assert_eq!(
            body,
            json!({
                "model": "claude-sonnet-4-5",
                "max_tokens": 2048,
                "system": "Be brief.",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "find x"}]},
                    {"role": "assistant", "content": [
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "toolu_a", "name": "search", "input": {"q": "x"}},
                        {"type": "tool_use", "id": "toolu_b", "name": "search", "input": {"q": "y"}},
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "x is 1"},
                        {"type": "tool_result", "tool_use_id": "toolu_b", "content": "y is 2"},
                    ]},
                    {"role": "assistant", "content": [{"type": "text", "text": "x is 1."}]},
                ],
                "tools": [{"name": "search", "description": "Search the web",
                           "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
                "stream": true,
            })
        );
    }

    #[test]
    fn with_thinking_the_signed_thinking_goes_back_first() {
        let tools = tools();
        let g = generation(json!({"reasoning": {"effort": "low"}}), &["search"]);
        let p = TurnParams { max_output_tokens: Some(8000), ..params(&tools, Some(&g)) };
        let body = build_body(ApiStyle::Anthropic, &p, &tool_turn());
        assert_eq!(body["thinking"], json!({"type": "enabled", "budget_tokens": 4096}));
        assert_eq!(
            body["messages"][1]["content"][0],
            json!({"type": "thinking", "thinking": "Search twice.", "signature": "sig-1"})
        );
        let redacted = json!({"type": "reasoning", "summary": [], "encrypted_content": "opaque"});
        let (_, m) = anthropic_messages(None, &[json!({"role": "user", "content": "q"}), redacted.clone()], true);
        assert_eq!(m[1]["content"][0], json!({"type": "redacted_thinking", "data": "opaque"}));
        // OpenAI's encrypted reasoning (it has an id) has no Anthropic form.
        let openai = json!({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"});
        assert_eq!(anthropic_messages(None, &[openai], true).1, Vec::<Value>::new());
    }

    #[test]
    fn thinking_budgets_fit_under_the_output_limit() {
        assert_eq!(thinking_budget(Effort::High, 64_000), Some(32_768));
        assert_eq!(thinking_budget(Effort::High, 8_000), Some(6_000));
        assert_eq!(thinking_budget(Effort::Minimal, 2_048), Some(1_024));
        assert_eq!(thinking_budget(Effort::Medium, 2_048), Some(1_536));
        assert_eq!(thinking_budget(Effort::Low, 1_000), None);
        for effort in [Effort::Minimal, Effort::Low, Effort::Medium, Effort::High] {
            for max in [1_366, 2_048, 4_096, 100_000] {
                if let Some(b) = thinking_budget(effort, max) {
                    assert!(b >= MIN_THINKING_BUDGET && b < max, "{effort:?} {max}: {b}");
                }
            }
        }
    }

    #[test]
    fn structured_output_is_a_forced_answer_tool_and_forced_choice_drops_thinking() {
        let tools = tools();
        let g = generation(
            json!({"reasoning": {"effort": "high"}, "tool_choice": "required", "parallel_tool_calls": false,
                   "text": {"format": {"type": "json_schema", "name": "verdict", "strict": true,
                                       "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}}),
            &["search"],
        );
        let body = build_body(ApiStyle::Anthropic, &params(&tools, Some(&g)), &tool_turn()[..1]);
        assert_eq!(body["tool_choice"], json!({"type": "any", "disable_parallel_tool_use": true}));
        assert_eq!(body["tools"][1]["name"], "verdict");
        assert_eq!(
            body["tools"][1]["input_schema"],
            json!({"type": "object", "properties": {"ok": {"type": "boolean"}}})
        );
        assert!(body.get("thinking").is_none(), "Anthropic refuses thinking with a forced tool choice");
        assert_eq!(answer_tool_name(&params(&tools, Some(&g))), Some("verdict"));

        // No run tools: the answer tool itself is the choice.
        let g = generation(json!({"text": {"format": {"type": "json_object"}}}), &[]);
        let body = build_body(ApiStyle::Anthropic, &params(&[], Some(&g)), &tool_turn()[..1]);
        assert_eq!(body["tool_choice"], json!({"type": "tool", "name": JSON_OBJECT_TOOL}));
        assert_eq!(
            body["tools"],
            json!([{"name": JSON_OBJECT_TOOL, "input_schema": {"type": "object"},
            "description": "Give your final answer by calling this tool: its input is the answer, in this JSON schema."}])
        );
    }

    #[test]
    fn each_parameter_in_anthropic_names() {
        let tools = tools();
        let g = generation(
            json!({"temperature": 1.5, "top_p": 0.5, "stop": ["END", "STOP"], "seed": 3, "store": true,
                   "service_tier": "default", "prompt_cache_key": "k", "truncation": "auto",
                   "tool_choice": {"type": "function", "name": "search"}}),
            &["search"],
        );
        let body = build_body(ApiStyle::Anthropic, &params(&tools, Some(&g)), &tool_turn()[..1]);
        assert_eq!(body["temperature"], json!(1.0), "Anthropic's range is 0-1");
        assert!(body.get("top_p").is_none(), "not beside temperature");
        assert_eq!(body["stop_sequences"], json!(["END", "STOP"]));
        assert_eq!(body["service_tier"], "standard_only");
        assert_eq!(body["tool_choice"], json!({"type": "tool", "name": "search"}));
        for absent in ["seed", "store", "prompt_cache_key", "truncation", "stop", "metadata"] {
            assert!(body.get(absent).is_none(), "{absent} has no Anthropic form");
        }
        // Thinking on: no temperature, top_p only from 0.95.
        let g = generation(json!({"reasoning": {"effort": "minimal"}, "temperature": 0.3, "top_p": 0.97}), &[]);
        let body = build_body(ApiStyle::Anthropic, &params(&[], Some(&g)), &tool_turn()[..1]);
        assert_eq!(body["thinking"]["budget_tokens"], 1024);
        assert!(body.get("temperature").is_none());
        assert_eq!(body["top_p"], json!(0.97));
        // Without tools no tool_choice is sent; the modes map one to one.
        let g = generation(json!({"tool_choice": "none"}), &[]);
        assert!(build_body(ApiStyle::Anthropic, &params(&[], Some(&g)), &[]).get("tool_choice").is_none());
        for (choice, want) in [("auto", "auto"), ("required", "any"), ("none", "none")] {
            let g = generation(json!({"tool_choice": choice}), &["search"]);
            let body = build_body(ApiStyle::Anthropic, &params(&tools, Some(&g)), &[]);
            assert_eq!(body["tool_choice"], json!({"type": want}));
        }
    }

    #[test]
    fn system_messages_images_and_odd_ids() {
        let ctx = vec![
            json!({"role": "developer", "content": "rules"}),
            json!({"role": "user", "content": [{"type": "input_text", "text": "see"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBOR"},
                {"type": "input_image", "image_url": "https://x/y.png"}]}),
            json!({"type": "function_call", "call_id": "call.1", "name": "f", "arguments": "not json"}),
            json!({"type": "function_call_output", "call_id": "call.1", "output": ""}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]}),
            json!({"type": "web_search_call", "id": "ws_1"}),
        ];
        let (system, messages) = anthropic_messages(Some("Be brief."), &ctx, false);
        assert_eq!(system.as_deref(), Some("Be brief.\n\nrules"));
        assert_eq!(
            messages,
            vec![
                json!({"role": "user", "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}),
                json!({"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}]}),
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1"}]}),
            ]
        );
    }
}
