//! Prompt caching (`prompt_cache: "auto"`, SPEC §4a): what a turn's body
//! carries so the provider reads the run's earlier turns from its cache
//! instead of charging them again.
//!
//! - **OpenAI** caches prefixes of 1 024 tokens and more by itself; a
//!   `prompt_cache_key` keeps a run's calls on the machines that hold its
//!   prefix. A run that gives none gets [`run_cache_key`]: the same for
//!   every turn of the run (and for runs that start alike, which share a
//!   prefix), different for runs that do not.
//! - **Anthropic** caches only up to the blocks a request marks with
//!   `cache_control` (at most 4), each of which finds an earlier entry at
//!   most 20 blocks back. [`mark_anthropic`] marks up to three: the end of
//!   the stable prefix (tools, then system), the end of the history the
//!   previous turn sent (the block the previous call marked as its newest:
//!   found exactly, whatever the turn added since), and the newest block
//!   (written for the next turn). A mark on a prefix shorter than the model's
//!   minimum caches nothing, so none is placed there.
//!
//! The cache lives 5 minutes from its last hit (the default `ttl`: writes
//! cost 1.25× the input price; a 1-hour cache costs 2×). A run's turns come
//! back after their tools run, seconds apart, and every hit renews the five
//! minutes; a turn that waits longer for budget pays one write again, which
//! is cheaper than paying 2× on every turn's writes of every run.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// How long after a call its prompt cache is counted on by the next turn's
/// estimate: the 5-minute TTL less a margin for the call's own time.
pub const CACHE_HOLDS_MS: u64 = 270_000;

/// The `cache_control` of a breakpoint: the default 5-minute cache.
fn breakpoint() -> Value {
    json!({"type": "ephemeral"})
}

/// The least a prefix must hold to be cached, in tokens, by model (Anthropic's
/// documented minimums: 4 096 for Claude Opus 4.5 and Haiku 4.5, 2 048 for
/// the Haiku 3 models, 1 024 for the others).
pub fn anthropic_min_cacheable(model: &str) -> u64 {
    let m = model.to_ascii_lowercase();
    if m.contains("haiku-4") || m.contains("opus-4-5") {
        4_096
    } else if m.contains("3-5-haiku") || m.contains("3-haiku") {
        2_048
    } else {
        1_024
    }
}

/// Tokens of `v`, roughly: its strings' characters over four (what a prefix
/// holds only decides whether it is worth a mark).
fn rough_tokens(v: &Value) -> u64 {
    crate::estimate::text_len(v).div_ceil(4) as u64
}

/// A block the cache may be marked on: thinking blocks and empty text refuse it.
fn markable(block: &Value) -> bool {
    !matches!(block.get("type").and_then(Value::as_str), Some("thinking" | "redacted_thinking"))
        && block.get("text").and_then(Value::as_str) != Some("")
}

/// Marks the last markable block of `message`'s content; whether it could.
fn mark_last_block(message: &mut Value) -> bool {
    let Some(blocks) = message.get_mut("content").and_then(Value::as_array_mut) else {
        return false;
    };
    match blocks.iter_mut().rev().find(|b| markable(b)) {
        Some(block) => {
            block["cache_control"] = breakpoint();
            true
        }
        None => false,
    }
}

/// Places the cache breakpoints of an Anthropic body (see the module's
/// docs): `system` becomes a list of one text block when it carries one.
pub fn mark_anthropic(body: &mut Map<String, Value>, model: &str) {
    let min = anthropic_min_cacheable(model);
    let mut prefix = 0;
    if let Some(tools) = body.get("tools") {
        prefix += rough_tokens(tools);
    }
    if let Some(system) = body.get("system") {
        prefix += rough_tokens(system);
    }
    // 1. The stable prefix: tools, then system.
    if prefix >= min {
        if let Some(Value::String(text)) = body.get("system") {
            let block = json!([{"type": "text", "text": text, "cache_control": breakpoint()}]);
            body.insert("system".into(), block);
        } else if let Some(last) = body.get_mut("tools").and_then(Value::as_array_mut).and_then(|t| t.last_mut()) {
            last["cache_control"] = breakpoint();
        }
    }
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return;
    };
    // Each message's end, in tokens from the start of the prompt.
    let ends: Vec<u64> = messages
        .iter()
        .scan(prefix, |at, m| {
            *at += rough_tokens(m);
            Some(*at)
        })
        .collect();
    // 2. Where the previous turn's history ended: before the model's last answer.
    let last_answer = messages.iter().rposition(|m| m["role"] == "assistant");
    if let Some(previous) = last_answer.and_then(|a| a.checked_sub(1)) {
        if ends[previous] >= min {
            mark_last_block(&mut messages[previous]);
        }
    }
    // 3. The newest block, for the next turn to read.
    if let (Some(newest), Some(&end)) = (messages.last_mut(), ends.last()) {
        if end >= min {
            mark_last_block(newest);
        }
    }
}

/// The `prompt_cache_key` of a run that gives none: a hash of what every
/// turn of it starts with (the model, the instructions, the tools and the
/// first input item), so it is the same on every turn without being stored.
pub fn run_cache_key(model: &str, instructions: Option<&str>, tools: &[Value], first: Option<&Value>) -> String {
    let mut h = Sha256::new();
    for part in [model, instructions.unwrap_or("")] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.update(Value::Array(tools.to_vec()).to_string().as_bytes());
    h.update([0]);
    if let Some(first) = first {
        h.update(first.to_string().as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("paceline-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(word: &str, tokens: usize) -> String {
        format!("{word} ").repeat(tokens * 4 / (word.len() + 1))
    }

    fn marks(body: &Value) -> Vec<String> {
        let mut at = vec![];
        if let Some(tools) = body["tools"].as_array() {
            for (i, t) in tools.iter().enumerate() {
                if t.get("cache_control").is_some() {
                    at.push(format!("tools[{i}]"));
                }
            }
        }
        if let Some(system) = body["system"].as_array() {
            if system.iter().any(|b| b.get("cache_control").is_some()) {
                at.push("system".into());
            }
        }
        for (i, m) in body["messages"].as_array().into_iter().flatten().enumerate() {
            for (j, b) in m["content"].as_array().into_iter().flatten().enumerate() {
                if b.get("cache_control").is_some() {
                    at.push(format!("messages[{i}][{j}]"));
                }
            }
        }
        at
    }

    fn turn_body(system: &str, tools: Value, messages: Value) -> Map<String, Value> {
        let mut body = Map::new();
        body.insert("model".into(), "claude-sonnet-4-5".into());
        if !system.is_empty() {
            body.insert("system".into(), system.into());
        }
        if tools.as_array().is_some_and(|t| !t.is_empty()) {
            body.insert("tools".into(), tools);
        }
        body.insert("messages".into(), messages);
        body
    }

    #[test]
    fn a_tool_turn_marks_the_prefix_the_previous_history_and_the_newest_block() {
        let system = long("rules", 1_500);
        let messages = json!([
            {"role": "user", "content": [{"type": "text", "text": "task"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "s", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "out"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"},
                {"type": "tool_use", "id": "b", "name": "s", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "b", "content": "one"},
                {"type": "tool_result", "tool_use_id": "c", "content": "two"}]},
        ]);
        let mut body = turn_body(&system, json!([{"name": "s", "input_schema": {}}]), messages);
        mark_anthropic(&mut body, "claude-sonnet-4-5");
        let body = Value::Object(body);
        assert_eq!(marks(&body), ["system", "messages[2][0]", "messages[4][1]"]);
        assert_eq!(body["system"][0]["text"], system.as_str(), "the instructions unchanged");
    }

    #[test]
    fn the_previous_turns_newest_mark_is_this_turns_middle_one() {
        let system = long("rules", 1_500);
        let first = json!([{"role": "user", "content": [{"type": "text", "text": "task"}]}]);
        let mut one = turn_body(&system, json!([]), first.clone());
        mark_anthropic(&mut one, "claude-sonnet-4-5");
        let mut then = first.as_array().unwrap().clone();
        then.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "s", "input": {}}]}));
        then.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x"}]}));
        let mut two = turn_body(&system, json!([]), Value::Array(then));
        mark_anthropic(&mut two, "claude-sonnet-4-5");
        assert_eq!(marks(&Value::Object(one.clone())), ["system", "messages[0][0]"]);
        assert_eq!(marks(&Value::Object(two.clone())), ["system", "messages[0][0]", "messages[2][0]"]);
        // The prefix the first turn wrote is byte for byte the second's.
        assert_eq!(one["messages"][0], two["messages"][0]);
    }

    #[test]
    fn no_mark_goes_where_the_prefix_is_under_the_models_minimum() {
        let messages = json!([{"role": "user", "content": [{"type": "text", "text": "a short task"}]}]);
        let mut short = turn_body("Be brief.", json!([]), messages.clone());
        mark_anthropic(&mut short, "claude-sonnet-4-5");
        assert!(marks(&Value::Object(short.clone())).is_empty());
        assert_eq!(short["system"], "Be brief.", "left a string");
        // 1 500 tokens are enough for Sonnet, not for Haiku 4.5 (4 096).
        let system = long("rules", 1_500);
        let mut sonnet = turn_body(&system, json!([]), messages.clone());
        mark_anthropic(&mut sonnet, "claude-sonnet-4-5");
        assert_eq!(marks(&Value::Object(sonnet)), ["system", "messages[0][0]"]);
        let mut haiku = turn_body(&system, json!([]), messages);
        mark_anthropic(&mut haiku, "claude-haiku-4-5");
        assert!(marks(&Value::Object(haiku)).is_empty());
    }

    #[test]
    fn without_instructions_the_last_tool_ends_the_prefix() {
        let tools = json!([{"name": "a", "input_schema": {}}, {"name": "b", "description": long("doc", 1_200), "input_schema": {}}]);
        let messages = json!([{"role": "user", "content": [{"type": "text", "text": "task"}]}]);
        let mut body = turn_body("", tools, messages);
        mark_anthropic(&mut body, "claude-sonnet-4-5");
        assert_eq!(marks(&Value::Object(body)), ["tools[1]", "messages[0][0]"]);
    }

    #[test]
    fn a_runs_key_is_stable_and_differs_between_runs() {
        let tools = [json!({"type": "function", "name": "s"})];
        let first = json!({"role": "user", "content": "task one"});
        let key = run_cache_key("gpt-4.1", Some("rules"), &tools, Some(&first));
        assert_eq!(key, run_cache_key("gpt-4.1", Some("rules"), &tools, Some(&first)));
        assert!(key.starts_with("paceline-") && key.len() == "paceline-".len() + 24, "{key}");
        let other = json!({"role": "user", "content": "task two"});
        assert_ne!(key, run_cache_key("gpt-4.1", Some("rules"), &tools, Some(&other)));
        assert_ne!(key, run_cache_key("gpt-4.1", None, &tools, Some(&first)));
    }
}
