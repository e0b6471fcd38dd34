//! What a turn sends, end to end across the modules that build it, without
//! Redis or a provider: a transcript as the worker stores it (tool outputs
//! clipped) → `prepare_context` (history bound, browser views elided) →
//! `build_body` in both wire formats → `estimate_tokens`.
//!
//! Checked over many seeded random transcripts: a Chat body never holds a
//! `tool` message that does not answer the assistant `tool_calls` message
//! before it, nor a call left unanswered (either is a 400 from the provider);
//! a Responses body never holds an output without its call; bounding never
//! raises the estimate; and a long browsing run's body stays bounded.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shared::runs::{ApiStyle, TranscriptEntry};
use worker::context::{
    clip_tool_output, prepare_context, BROWSER_PLACEHOLDER, BROWSER_TOOL_OUTPUT_CAP, DEFAULT_MAX_HISTORY,
};
use worker::estimate::estimate_tokens;
use worker::request::{build_body, TurnParams};

fn entry(turn: u32, item: Value) -> TranscriptEntry {
    TranscriptEntry { turn, item }
}

/// A random run as the worker would store it: per turn, maybe some text and
/// up to three parallel calls (browser or not), their outputs clipped and
/// committed with the same turn or with the next one.
fn random_transcript(rng: &mut StdRng) -> Vec<TranscriptEntry> {
    let mut v = vec![entry(0, json!({"role": "user", "content": "the task"}))];
    let turns = rng.random_range(0..45u32);
    let mut pending: Vec<(String, String)> = vec![];
    for t in 1..=turns {
        for (id, name) in pending.drain(..) {
            let raw = random_output(rng);
            v.push(entry(
                t,
                json!({"type": "function_call_output", "call_id": id, "output": clip_tool_output(&name, &raw).text}),
            ));
        }
        if rng.random_bool(0.5) {
            v.push(entry(
                t,
                json!({"type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": format!("turn {t}")}]}),
            ));
        }
        let calls: Vec<(String, String)> = (0..rng.random_range(0..4))
            .map(|i| {
                let name = if rng.random_bool(0.5) { "browser__snapshot" } else { "search" };
                (format!("call_{t}_{i}"), name.to_string())
            })
            .collect();
        for (id, name) in &calls {
            v.push(entry(t, json!({"type": "function_call", "call_id": id, "name": name, "arguments": "{}"})));
        }
        if rng.random_bool(0.5) {
            pending = calls;
        } else {
            for (id, name) in calls {
                let raw = random_output(rng);
                v.push(entry(
                    t,
                    json!({"type": "function_call_output", "call_id": id,
                                       "output": clip_tool_output(&name, &raw).text}),
                ));
            }
        }
    }
    for (id, _) in pending {
        v.push(entry(turns + 1, json!({"type": "function_call_output", "call_id": id, "output": "late"})));
    }
    v
}

/// A tool's raw output: mostly short, sometimes over either cap.
fn random_output(rng: &mut StdRng) -> String {
    let len = if rng.random_bool(0.05) { rng.random_range(15_000..30_000) } else { rng.random_range(0..2_000) };
    "lorem ipsum ".repeat(len / 12)
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "name": "search", "parameters": {"type": "object"}}),
        json!({"type": "function", "name": "browser__snapshot", "parameters": {"type": "object"}}),
    ]
}

/// Chat's rule: an assistant message with `tool_calls` is followed by one
/// `tool` message per call, and a `tool` message only ever follows that.
fn assert_chat_tool_messages_are_paired(messages: &[Value]) {
    let mut open: Vec<String> = vec![];
    let mut in_tool_run = false;
    for m in messages {
        match m["role"].as_str().unwrap() {
            "tool" => {
                let id = m["tool_call_id"].as_str().unwrap().to_string();
                assert!(in_tool_run, "a tool message ({id}) not right after an assistant tool_calls message");
                let at = open
                    .iter()
                    .position(|o| *o == id)
                    .unwrap_or_else(|| panic!("tool message {id} answers no open call"));
                open.remove(at);
            }
            role => {
                assert!(open.is_empty(), "calls {open:?} left unanswered before a {role} message");
                in_tool_run = false;
                if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                    assert_eq!(role, "assistant");
                    open = calls.iter().map(|c| c["id"].as_str().unwrap().to_string()).collect();
                    in_tool_run = true;
                }
            }
        }
    }
    assert!(open.is_empty(), "calls {open:?} left unanswered at the end");
}

/// Anthropic's rules for tool use: roles alternate, and the message after an
/// assistant's `tool_use` blocks is a user message whose `tool_result`
/// blocks answer exactly those ids, first.
fn assert_anthropic_tool_blocks_are_paired(messages: &[Value]) {
    let ids = |m: &Value, kind: &str, key: &str| -> Vec<String> {
        m["content"]
            .as_array()
            .map(|c| c.iter().filter(|b| b["type"] == kind).map(|b| b[key].as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    assert_eq!(messages.first().map(|m| &m["role"]), Some(&json!("user")), "the first message is the user's");
    for (i, m) in messages.iter().enumerate() {
        assert!(!m["content"].as_array().unwrap().is_empty(), "message {i} is empty");
        if i > 0 {
            assert_ne!(m["role"], messages[i - 1]["role"], "messages {} and {i} have one role", i - 1);
        }
        let results = ids(m, "tool_result", "tool_use_id");
        if !results.is_empty() {
            assert_eq!(m["role"], "user");
            let asked = ids(&messages[i - 1], "tool_use", "id");
            assert_eq!(results, asked, "message {i} answers other calls than the one before it asked");
            let first_other = m["content"].as_array().unwrap().iter().position(|b| b["type"] != "tool_result");
            assert!(first_other.is_none_or(|p| p >= results.len()), "tool results come first in message {i}");
        }
        let uses = ids(m, "tool_use", "id");
        if !uses.is_empty() {
            if let Some(next) = messages.get(i + 1) {
                assert_eq!(ids(next, "tool_result", "tool_use_id"), uses, "message {i}'s calls are not answered next");
            }
        }
    }
}

#[test]
fn bounded_contexts_make_valid_bodies_in_both_formats() {
    let tools = tools();
    let params = TurnParams {
        model: "m",
        instructions: Some("Work."),
        tools: &tools,
        max_output_tokens: Some(512),
        metadata: None,
        generation: None,
    };
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let transcript = random_transcript(&mut rng);
        let max_history = [0, 1, 2, 5, DEFAULT_MAX_HISTORY, 1000][rng.random_range(0..6)];
        let context = prepare_context(&transcript, max_history);

        let chat = build_body(ApiStyle::Chat, &params, &context);
        assert_chat_tool_messages_are_paired(chat["messages"].as_array().unwrap());

        let anthropic = build_body(ApiStyle::Anthropic, &params, &context);
        assert_anthropic_tool_blocks_are_paired(anthropic["messages"].as_array().unwrap());
        // And the mock, which refuses what Anthropic refuses, takes it.
        mock_provider::wire::parse(mock_provider::wire::Api::Messages, &anthropic)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));

        let responses = build_body(ApiStyle::Responses, &params, &context);
        let input = responses["input"].as_array().unwrap();
        for (i, item) in input.iter().enumerate() {
            if item["type"] == "function_call_output" {
                let id = &item["call_id"];
                assert!(
                    input[..i].iter().any(|c| c["type"] == "function_call" && &c["call_id"] == id),
                    "seed {seed}: orphan {id}"
                );
            }
        }

        // Bounding (and eliding) never makes a turn dearer than the whole
        // transcript. (On every tenth seed: tokenizing is the slow part.)
        if seed % 10 != 0 {
            continue;
        }
        let everything: Vec<Value> = transcript.iter().map(|e| e.item.clone()).collect();
        for style in [ApiStyle::Responses, ApiStyle::Chat, ApiStyle::Anthropic] {
            let full = estimate_tokens(&build_body(style, &params, &everything), 512);
            let bounded = estimate_tokens(&build_body(style, &params, &context), 512);
            assert!(bounded <= full, "seed {seed} {style:?}: {bounded} > {full}");
        }
    }
}

#[test]
fn a_long_browsing_run_sends_one_view_and_a_bounded_history() {
    // 60 turns, each a browser snapshot of 100 000 characters.
    let mut transcript = vec![entry(0, json!({"role": "user", "content": "browse"}))];
    for t in 1..=60u32 {
        let id = format!("call_{t}");
        let page = format!("<page {t}> {}", "word ".repeat(20_000));
        let stored = clip_tool_output("browser__snapshot", &page);
        assert!(stored.clipped);
        transcript.push(entry(
            t,
            json!({"type": "function_call", "call_id": id, "name": "browser__snapshot", "arguments": "{}"}),
        ));
        transcript.push(entry(t, json!({"type": "function_call_output", "call_id": id, "output": stored.text})));
    }
    let context = prepare_context(&transcript, DEFAULT_MAX_HISTORY);
    let outputs: Vec<&str> = context.iter().filter_map(|i| i.get("output").and_then(Value::as_str)).collect();
    // The window moves 8 turns at a time (so a cached prefix holds): at 60
    // turns it starts at turn 41, 20 turns.
    assert_eq!(outputs.len(), 20);
    assert_eq!(outputs.iter().filter(|o| **o != BROWSER_PLACEHOLDER).count(), 1);
    let newest = outputs.last().unwrap();
    assert!(newest.starts_with("<page 60>"));
    assert!(newest.ends_with("of 100010 characters]"), "{}", &newest[newest.len() - 60..]);
    assert!(newest.chars().count() <= BROWSER_TOOL_OUTPUT_CAP);

    let tools = tools();
    let params = TurnParams {
        model: "m",
        instructions: None,
        tools: &tools,
        max_output_tokens: Some(1000),
        metadata: None,
        generation: None,
    };
    let chat = build_body(ApiStyle::Chat, &params, &context);
    let last_tool = chat["messages"].as_array().unwrap().iter().rev().find(|m| m["role"] == "tool").unwrap();
    assert_eq!(last_tool["content"].as_str(), Some(*newest), "Chat sends the same clipped text");

    // One view of ≤ 24 000 characters (~4 800 tokens of "word ") plus 23
    // placeholders and 24 calls: a few thousand tokens, where sending every
    // view would cost ~ 60 × 4 800.
    for style in [ApiStyle::Responses, ApiStyle::Chat] {
        let estimate = estimate_tokens(&build_body(style, &params, &context), 1000);
        assert!(estimate < 8_000, "{style:?}: {estimate}");
    }
}

#[test]
#[should_panic(expected = "not right after")]
fn the_chat_checker_catches_a_stray_tool_message() {
    assert_chat_tool_messages_are_paired(&[
        json!({"role": "user", "content": "x"}),
        json!({"role": "tool", "tool_call_id": "call_1", "content": "y"}),
    ]);
}

#[test]
#[should_panic(expected = "left unanswered")]
fn the_chat_checker_catches_an_unanswered_call() {
    assert_chat_tool_messages_are_paired(&[
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
               "function": {"name": "f", "arguments": "{}"}}]}),
        json!({"role": "user", "content": "x"}),
    ]);
}
