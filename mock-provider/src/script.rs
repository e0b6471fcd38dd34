//! The scripted model: what the mock answers, decided from the conversation
//! alone, so the same request always gets the same answer (a retried turn
//! sees the same call ids and the same words).
//!
//! The rule: a request that offers a function tool gets `calls_per_round`
//! function calls of the first offered tool until the conversation holds
//! `tool_rounds` tool outputs; otherwise, a text answer of `output_tokens`
//! tokens (cut to the request's output limit, and then marked incomplete).
//! A request that asks for structured output (a JSON schema) gets, instead
//! of words, a JSON object filling the schema's top-level properties. A
//! request whose tool choice forces a call even when the rounds are done
//! (Anthropic's `tool` / `any`) gets one call of that tool: a forced choice
//! cannot be answered in text.

use serde_json::{json, Map, Value};

/// What the scripted model needs to know about a request, whichever wire
/// format it came in.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// The `model` the request named (echoed in answers and error messages).
    pub model: String,
    /// Input tokens, counted by [`count_tokens`] over the request's text.
    pub input_tokens: u64,
    /// Tool outputs in the conversation (`function_call_output` items, or
    /// chat `role: "tool"` messages).
    pub tool_outputs: usize,
    /// The first function tool offered, unless `tool_choice` is `"none"`.
    pub tool: Option<Tool>,
    /// The request's output limit, if it set one.
    pub max_output_tokens: Option<u64>,
    /// A hash of the conversation, the seed of every id and word in the answer.
    pub fingerprint: u64,
    /// The schema of a structured answer (`text.format` / `response_format`
    /// `json_schema`; `json_object` is `{"type": "object"}`).
    pub answer_schema: Option<Value>,
    /// The tool still called once the rounds are done (a forced choice).
    pub forced: Option<Tool>,
}

/// A function tool offered by the request.
#[derive(Debug, Clone)]
pub struct Tool {
    /// Its name: the calls name it.
    pub name: String,
    /// Its JSON schema, used to fill the call's arguments with fitting values.
    pub parameters: Option<Value>,
}

/// The script's knobs (a slice of `MockConfig`).
#[derive(Debug, Clone, Copy)]
pub struct Script {
    /// Tool outputs the conversation must hold before the model answers in text.
    pub tool_rounds: usize,
    /// Function calls per tool round (parallel calls in one output).
    pub calls_per_round: usize,
    /// Length of the final text answer, in tokens.
    pub output_tokens: u64,
}

/// One function call the model asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionCall {
    /// Item id (`fc_…`), what Responses stream deltas reference as `item_id`.
    pub id: String,
    /// Call id (`call_…`), what the tool result references.
    pub call_id: String,
    /// The tool's name.
    pub name: String,
    /// Arguments, a compact JSON object as a string.
    pub arguments: String,
}

/// The model's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Function calls, one tool round.
    Calls(Vec<FunctionCall>),
    /// A text answer.
    Text {
        /// The words; one word is one token.
        text: String,
        /// Its length in tokens.
        tokens: u64,
        /// Cut short by the request's output limit (Responses `incomplete`,
        /// chat `finish_reason: "length"`).
        truncated: bool,
    },
}

impl Answer {
    /// Output tokens the usage reports for this answer.
    pub fn output_tokens(&self) -> u64 {
        match self {
            Answer::Calls(calls) => {
                calls.iter().map(|c| count_tokens(c.name.chars().count() + c.arguments.chars().count())).sum()
            }
            Answer::Text { tokens, .. } => *tokens,
        }
    }
}

/// The mock's token count: `ceil(chars / 4)`, at least 1 for non-empty text.
/// Cheap and deterministic; the real client uses a real tokenizer, and the
/// mock only has to be consistent with itself.
pub fn count_tokens(chars: usize) -> u64 {
    chars.div_ceil(4) as u64
}

/// 64-bit FNV-1a, for ids derived from the conversation (stable across runs
/// and platforms, unlike `std`'s `DefaultHasher`).
pub fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

const WORDS: &[&str] = &[
    "the", "mock", "model", "answers", "with", "exactly", "counted", "tokens", "so", "pacing", "tests", "can", "check",
    "every", "number", "they", "see",
];

/// Decides the answer to `prompt` under `script`.
pub fn answer(prompt: &Prompt, script: &Script) -> Answer {
    if let Some(tool) = &prompt.tool {
        if prompt.tool_outputs < script.tool_rounds {
            let round = prompt.tool_outputs / script.calls_per_round.max(1) + 1;
            let calls =
                (0..script.calls_per_round.max(1)).map(|index| function_call(prompt, tool, round, index)).collect();
            return Answer::Calls(calls);
        }
    }
    if let Some(tool) = &prompt.forced {
        let round = prompt.tool_outputs / script.calls_per_round.max(1) + 1;
        return Answer::Calls(vec![function_call(prompt, tool, round, 0)]);
    }
    if let Some(schema) = &prompt.answer_schema {
        let text = Value::Object(fill(Some(schema), 1)).to_string();
        let tokens = count_tokens(text.chars().count());
        return Answer::Text { text, tokens, truncated: false };
    }
    let limit = prompt.max_output_tokens.unwrap_or(u64::MAX);
    let tokens = script.output_tokens.min(limit);
    let text = words(prompt.fingerprint, tokens);
    Answer::Text { text, tokens, truncated: tokens < script.output_tokens }
}

fn function_call(prompt: &Prompt, tool: &Tool, round: usize, index: usize) -> FunctionCall {
    let key = format!("{}:{}:{}", prompt.tool_outputs, round, index);
    let hash = fnv1a(key.as_bytes(), prompt.fingerprint);
    let hash2 = fnv1a(key.as_bytes(), prompt.fingerprint.rotate_left(17));
    FunctionCall {
        id: format!("fc_{hash:016x}{hash2:016x}"),
        call_id: format!("call_{hash2:016x}{hash:08x}"),
        name: tool.name.clone(),
        arguments: arguments(tool.parameters.as_ref(), round, index),
    }
}

/// A small arguments object: `round` and `index`, plus a fitting value for
/// each top-level property of the tool's schema, so a real tool endpoint gets
/// arguments of the types it asked for.
fn arguments(schema: Option<&Value>, round: usize, index: usize) -> String {
    let mut args = fill(schema, round);
    args.entry("round").or_insert(json!(round));
    if index > 0 {
        args.entry("index").or_insert(json!(index));
    }
    Value::Object(args).to_string()
}

/// A fitting value for each top-level property of `schema`.
fn fill(schema: Option<&Value>, round: usize) -> Map<String, Value> {
    let mut args = Map::new();
    if let Some(props) = schema.and_then(|s| s.get("properties")).and_then(Value::as_object) {
        for (name, prop) in props {
            let value = match prop.get("type").and_then(Value::as_str) {
                Some("string") => json!(format!("mock {name} {round}")),
                Some("integer") | Some("number") => json!(round),
                Some("boolean") => json!(true),
                Some("array") => json!([]),
                Some("object") => json!({}),
                _ => continue,
            };
            args.insert(name.clone(), value);
        }
    }
    args
}

/// `tokens` words, one token each, ending with a full stop.
fn words(seed: u64, tokens: u64) -> String {
    let mut text = String::new();
    for i in 0..tokens {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(WORDS[((seed.wrapping_add(i)) % WORDS.len() as u64) as usize]);
    }
    if tokens > 0 {
        text.push('.');
    }
    text
}

/// Splits a text answer into stream deltas of `per_delta` words each; joined,
/// they give back the text.
pub fn deltas(text: &str, per_delta: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut count = 0;
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            current.push(' ');
        }
        current.push_str(word);
        count += 1;
        if count == per_delta.max(1) {
            out.push(std::mem::take(&mut current));
            count = 0;
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(tool_outputs: usize, with_tool: bool) -> Prompt {
        Prompt {
            model: "m".into(),
            input_tokens: 10,
            tool_outputs,
            tool: with_tool.then(|| Tool {
                name: "search".into(),
                parameters: Some(json!({"type": "object", "properties": {
                    "query": {"type": "string"}, "limit": {"type": "integer"}}})),
            }),
            max_output_tokens: None,
            fingerprint: 42,
            answer_schema: None,
            forced: None,
        }
    }

    const SCRIPT: Script = Script { tool_rounds: 2, calls_per_round: 1, output_tokens: 10 };

    #[test]
    fn tools_get_calls_until_enough_outputs_then_text() {
        for outputs in 0..2 {
            match answer(&prompt(outputs, true), &SCRIPT) {
                Answer::Calls(calls) => {
                    assert_eq!(calls.len(), 1);
                    assert!(calls[0].id.starts_with("fc_"));
                    assert!(calls[0].call_id.starts_with("call_"));
                    assert_eq!(calls[0].name, "search");
                    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
                    assert_eq!(args["query"], json!(format!("mock query {}", outputs + 1)));
                    assert_eq!(args["limit"], json!(outputs + 1));
                }
                other => panic!("{other:?}"),
            }
        }
        match answer(&prompt(2, true), &SCRIPT) {
            Answer::Text { tokens, truncated, text } => {
                assert_eq!(tokens, 10);
                assert!(!truncated);
                assert_eq!(text.split(' ').count(), 10);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_same_conversation_gets_the_same_ids_and_another_gets_others() {
        let a = answer(&prompt(1, true), &SCRIPT);
        assert_eq!(a, answer(&prompt(1, true), &SCRIPT));
        assert_ne!(a, answer(&prompt(0, true), &SCRIPT));
        let mut other = prompt(1, true);
        other.fingerprint = 43;
        assert_ne!(a, answer(&other, &SCRIPT));
    }

    #[test]
    fn parallel_calls_have_distinct_ids() {
        let script = Script { calls_per_round: 3, tool_rounds: 3, ..SCRIPT };
        let Answer::Calls(calls) = answer(&prompt(0, true), &script) else { panic!() };
        assert_eq!(calls.len(), 3);
        assert_ne!(calls[0].call_id, calls[1].call_id);
        assert_ne!(calls[1].call_id, calls[2].call_id);
        // Three outputs complete the three rounds' worth: text next.
        assert!(matches!(answer(&prompt(3, true), &script), Answer::Text { .. }));
    }

    #[test]
    fn no_tools_means_text_and_the_limit_cuts_it() {
        let mut p = prompt(0, false);
        p.max_output_tokens = Some(4);
        assert_eq!(answer(&p, &SCRIPT), Answer::Text { text: words(42, 4), tokens: 4, truncated: true });
    }

    #[test]
    fn a_schema_gets_json_and_a_forced_tool_is_called_after_the_rounds() {
        let mut p = prompt(2, true);
        p.answer_schema =
            Some(json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "why": {"type": "string"}}}));
        let Answer::Text { text, .. } = answer(&p, &SCRIPT) else { panic!() };
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), json!({"ok": true, "why": "mock why 1"}));
        p.forced = Some(Tool { name: "verdict".into(), parameters: None });
        let Answer::Calls(calls) = answer(&p, &SCRIPT) else { panic!() };
        assert_eq!(calls[0].name, "verdict");
    }

    #[test]
    fn deltas_join_back_to_the_text() {
        let text = words(7, 10);
        let parts = deltas(&text, 4);
        assert_eq!(parts.len(), 3);
        assert_eq!(parts.concat(), text);
    }

    #[test]
    fn counts_a_quarter_token_per_char_rounded_up() {
        assert_eq!(count_tokens(0), 0);
        assert_eq!(count_tokens(1), 1);
        assert_eq!(count_tokens(8), 2);
        assert_eq!(count_tokens(9), 3);
    }
}
