//! What a prompt offers the prompt cache: its cacheable prefixes, each with
//! its token position and its identity (a hash of the prefix's content and
//! the model). Read from the request body, outside the lock; `cache.rs`
//! decides what is read and written.
//!
//! Positions use the mock's one token rule (`ceil(chars / 4)` over the same
//! characters `wire::parse` counts), so a prompt's last boundary is its input
//! tokens and a cached part is never larger than the input.
//!
//! - Anthropic (`cache_control` breakpoints): the prompt is the blocks —
//!   each tool definition, the `system` blocks, every content block of every
//!   message, in that order — and a boundary ends each block. A block's
//!   identity is its JSON with every `cache_control` removed, so moving a
//!   marker does not change what the prefix is.
//! - OpenAI (automatic): the prompt is one canonical text — the instructions
//!   (chat: the leading system and developer messages), the tools' JSON, then
//!   the input items (chat: the other messages), every string value in order —
//!   cut into prefixes of 1 024, 1 152, 1 280, … tokens (4 characters each),
//!   in a partition of the model and the `prompt_cache_key`.

use crate::script::fnv1a;
use crate::wire::{string_chars, Api};
use serde_json::{json, Value};
use std::time::Duration;

/// Anthropic refuses a request with more blocks marked `cache_control`.
pub const MAX_BREAKPOINTS: usize = 4;
/// How many block boundaries before a breakpoint Anthropic looks back for an
/// earlier entry.
pub const LOOKBACK_BLOCKS: usize = 20;
/// OpenAI caches no prompt shorter than this many tokens.
pub const OPENAI_MIN_TOKENS: u64 = 1024;
/// OpenAI caches prefixes in steps of this many tokens beyond the minimum.
pub const OPENAI_STEP_TOKENS: u64 = 128;
/// A `cache_control` without a `ttl` (or `"ttl": "5m"`) lives this long.
pub const TTL_5M: Duration = Duration::from_secs(300);
/// `"ttl": "1h"`.
pub const TTL_1H: Duration = Duration::from_secs(3600);

/// Characters per token: the mock's rule (`script::count_tokens`).
const CHARS_PER_TOKEN: u64 = 4;
/// Seeds that keep the two providers' entries apart in one store.
const ANTHROPIC_SEED: u64 = 0x616e_7468_726f_7069;
const OPENAI_SEED: u64 = 0x6f70_656e_6169_0000;
/// Separates the pieces a hash is fed, so `["ab","c"]` and `["a","bc"]` differ.
const SEPARATOR: u8 = 0x1f;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The end of one cacheable prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Boundary {
    /// The prefix's length in tokens: its token position.
    pub tokens: u64,
    /// The prefix's identity: a hash of its content and the model (and, for
    /// OpenAI, the `prompt_cache_key`).
    pub key: u64,
}

/// A block marked `cache_control`: its end is a breakpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breakpoint {
    /// The index of the block (and of its boundary).
    pub block: usize,
    /// How long an entry written here lives without a hit.
    pub ttl: Duration,
}

/// A prompt's cacheable prefixes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Prefix {
    /// Nothing to cache (the mock runs without `--cache`).
    #[default]
    None,
    /// Anthropic: a boundary after every block, and the marked ones.
    Marked {
        /// One per block, in prompt order.
        boundaries: Vec<Boundary>,
        /// The marked blocks, in prompt order (at most [`MAX_BREAKPOINTS`]).
        breakpoints: Vec<Breakpoint>,
    },
    /// OpenAI: every 128-token step from 1 024 tokens up to the prompt's length.
    Automatic {
        /// Shortest first.
        steps: Vec<Boundary>,
    },
}

/// Reads the prefixes of a request that `wire::parse` accepted.
pub fn read(api: Api, body: &Value) -> Prefix {
    match api {
        Api::Messages => anthropic(body),
        Api::Responses | Api::Chat => openai(api, body),
    }
}

// ---------------------------------------------------------------- Anthropic

/// Where a block sits, for error messages (`messages.2.content.0`).
enum Place {
    Tool(usize),
    System(usize),
    Message(usize, usize),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Tool(i) => write!(f, "tools.{i}"),
            Place::System(i) => write!(f, "system.{i}"),
            Place::Message(m, b) => write!(f, "messages.{m}.content.{b}"),
        }
    }
}

/// The blocks that may carry `cache_control`: tool definitions, `system`
/// blocks, message content blocks (a string system or content is one block
/// that cannot carry one).
fn markable<'a>(tools: &'a [Value], system: &'a Value, messages: &'a [Value]) -> Vec<(Place, &'a Value)> {
    let mut out: Vec<(Place, &Value)> = tools.iter().enumerate().map(|(i, t)| (Place::Tool(i), t)).collect();
    if let Some(blocks) = system.as_array() {
        out.extend(blocks.iter().enumerate().map(|(i, b)| (Place::System(i), b)));
    }
    for (m, message) in messages.iter().enumerate() {
        if let Some(blocks) = message.get("content").and_then(Value::as_array) {
            out.extend(blocks.iter().enumerate().map(|(b, block)| (Place::Message(m, b), block)));
        }
    }
    out
}

/// A block's `cache_control`, when it has one (`null` is none).
fn marker(block: &Value) -> Option<&Value> {
    block.get("cache_control").filter(|c| !c.is_null())
}

/// The TTL of a valid marker.
fn ttl(marker: &Value) -> Duration {
    if marker.get("ttl").and_then(Value::as_str) == Some("1h") {
        TTL_1H
    } else {
        TTL_5M
    }
}

/// Checks the `cache_control` markers as the Messages API does, whether or not
/// the mock caches: each is `{"type": "ephemeral"}` with an optional `ttl` of
/// `"5m"` or `"1h"`, and there are at most [`MAX_BREAKPOINTS`]. The error is
/// the message of a 400 `invalid_request_error`.
pub fn check_markers(tools: &[Value], system: &Value, messages: &[Value]) -> Result<(), String> {
    let mut found = 0;
    for (place, block) in markable(tools, system, messages) {
        let Some(marker) = marker(block) else { continue };
        if marker.get("type").and_then(Value::as_str) != Some("ephemeral") {
            return Err(format!("{place}.cache_control.type: Input should be 'ephemeral'"));
        }
        if !matches!(marker.get("ttl").map(Value::as_str), None | Some(Some("5m" | "1h"))) {
            return Err(format!("{place}.cache_control.ttl: Input should be '5m' or '1h'"));
        }
        found += 1;
    }
    if found > MAX_BREAKPOINTS {
        return Err(format!(
            "A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {found}."
        ));
    }
    Ok(())
}

/// `v` without any `cache_control` field, at any depth.
fn unmarked(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter().filter(|(k, _)| *k != "cache_control").map(|(k, v)| (k.clone(), unmarked(v))).collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(unmarked).collect()),
        other => other.clone(),
    }
}

/// Walks the blocks, keeping the running character count and identity.
struct Blocks {
    chars: usize,
    hash: u64,
    boundaries: Vec<Boundary>,
    breakpoints: Vec<Breakpoint>,
}

impl Blocks {
    /// Characters counted in the prompt that belong to no block (a message's
    /// role): they sit before the next block.
    fn loose(&mut self, chars: usize) {
        self.chars += chars;
    }

    /// One block of `chars` counted characters; `tag` says what kind (a tool,
    /// the system, or the message's role), so equal text in two roles differs.
    fn block(&mut self, tag: &str, block: &Value, chars: usize) {
        self.chars += chars;
        // A string is the text block it stands for.
        let content = match block {
            Value::String(text) => json!({"type": "text", "text": text}),
            other => unmarked(other),
        };
        self.hash = feed(self.hash, tag.as_bytes());
        self.hash = feed(self.hash, &[SEPARATOR]);
        self.hash = feed(self.hash, content.to_string().as_bytes());
        self.hash = feed(self.hash, &[SEPARATOR]);
        if let Some(marker) = marker(block) {
            self.breakpoints.push(Breakpoint { block: self.boundaries.len(), ttl: ttl(marker) });
        }
        let tokens = (self.chars as u64).div_ceil(CHARS_PER_TOKEN);
        self.boundaries.push(Boundary { tokens, key: self.hash });
    }
}

/// Anthropic's blocks and breakpoints. The characters are those
/// `messages::parse` counts: the tools' compact JSON (the array's brackets and
/// commas go to its first and last tools), every string of `system` and of
/// each message (its role goes before its first block).
fn anthropic(body: &Value) -> Prefix {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    let mut walk =
        Blocks { chars: 0, hash: fnv1a(model.as_bytes(), ANTHROPIC_SEED), boundaries: vec![], breakpoints: vec![] };
    let tools = body.get("tools").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    for (i, tool) in tools.iter().enumerate() {
        // `[` or `,` before it, and `]` after the last.
        let punctuation = 1 + usize::from(i + 1 == tools.len());
        walk.block("tool", tool, tool.to_string().chars().count() + punctuation);
    }
    match body.get("system") {
        Some(string @ Value::String(text)) => walk.block("system", string, text.chars().count()),
        Some(Value::Array(blocks)) => blocks.iter().for_each(|b| walk.block("system", b, string_chars(b))),
        Some(other) => walk.loose(string_chars(other)),
        None => {}
    }
    let messages = body.get("messages").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    for message in messages {
        let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
        let content = message.get("content");
        let blocks: Vec<&Value> = match content {
            Some(Value::Array(blocks)) => blocks.iter().collect(),
            Some(text @ Value::String(_)) => vec![text],
            _ => vec![],
        };
        let in_blocks: usize = blocks.iter().map(|b| string_chars(b)).sum();
        walk.loose(string_chars(message) - in_blocks);
        for block in blocks {
            walk.block(role, block, string_chars(block));
        }
    }
    Prefix::Marked { boundaries: walk.boundaries, breakpoints: walk.breakpoints }
}

// ---------------------------------------------------------------- OpenAI

/// Feeds the canonical text one piece at a time and notes the identity at
/// every 128-token step from 1 024 tokens.
struct Steps {
    chars: u64,
    hash: u64,
    steps: Vec<Boundary>,
}

impl Steps {
    fn piece(&mut self, text: &str) {
        let mut buf = [0u8; 4];
        for c in text.chars() {
            self.hash = feed(self.hash, c.encode_utf8(&mut buf).as_bytes());
            self.chars += 1;
            let tokens = self.chars / CHARS_PER_TOKEN;
            if self.chars.is_multiple_of(CHARS_PER_TOKEN)
                && tokens >= OPENAI_MIN_TOKENS
                && (tokens - OPENAI_MIN_TOKENS).is_multiple_of(OPENAI_STEP_TOKENS)
            {
                self.steps.push(Boundary { tokens, key: self.hash });
            }
        }
        // Not a character of the prompt: it only keeps pieces apart.
        self.hash = feed(self.hash, &[SEPARATOR]);
    }

    /// Every string value under `v`, in the order `wire::string_chars` counts them.
    fn strings(&mut self, v: &Value) {
        match v {
            Value::String(s) => self.piece(s),
            Value::Array(items) => items.iter().for_each(|i| self.strings(i)),
            Value::Object(map) => map.values().for_each(|i| self.strings(i)),
            _ => {}
        }
    }
}

/// OpenAI's steps, in the partition of the model and the `prompt_cache_key`
/// (a request without one has its own partition).
fn openai(api: Api, body: &Value) -> Prefix {
    let model = body.get("model").and_then(Value::as_str).unwrap_or_default();
    let partition = match body.get("prompt_cache_key").and_then(Value::as_str) {
        Some(key) => format!("{model}\u{1f}key\u{1f}{key}"),
        None => format!("{model}\u{1f}none"),
    };
    let mut steps = Steps { chars: 0, hash: fnv1a(partition.as_bytes(), OPENAI_SEED), steps: vec![] };
    let tools = body.get("tools").and_then(Value::as_array).filter(|t| !t.is_empty());
    let tools_json = tools.map(|t| Value::Array(t.clone()).to_string());
    match api {
        Api::Chat => {
            let messages = body.get("messages").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
            let lead = messages
                .iter()
                .take_while(|m| matches!(m.get("role").and_then(Value::as_str), Some("system" | "developer")))
                .count();
            messages[..lead].iter().for_each(|m| steps.strings(m));
            if let Some(json) = &tools_json {
                steps.piece(json);
            }
            messages[lead..].iter().for_each(|m| steps.strings(m));
        }
        _ => {
            steps.strings(body.get("instructions").unwrap_or(&Value::Null));
            if let Some(json) = &tools_json {
                steps.piece(json);
            }
            steps.strings(body.get("input").unwrap_or(&Value::Null));
        }
    }
    Prefix::Automatic { steps: steps.steps }
}

/// Continues a 64-bit FNV-1a hash over `bytes`.
fn feed(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::parse;

    fn text(n: usize, c: char) -> String {
        std::iter::repeat_n(c, n).collect()
    }

    fn marked(body: &Value) -> (Vec<Boundary>, Vec<Breakpoint>) {
        match read(Api::Messages, body) {
            Prefix::Marked { boundaries, breakpoints } => (boundaries, breakpoints),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_last_anthropic_boundary_is_the_input_tokens() {
        let body = json!({"model": "claude", "max_tokens": 10,
            "tools": [{"name": "a", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
                      {"name": "bb", "input_schema": {"type": "object"}}],
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": "hello there"},
                         {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]}]});
        let (boundaries, breakpoints) = marked(&body);
        assert_eq!(boundaries.len(), 6, "two tools, one system block, three message blocks");
        assert_eq!(boundaries.last().unwrap().tokens, parse(Api::Messages, &body).unwrap().prompt.input_tokens);
        assert!(boundaries.windows(2).all(|w| w[0].tokens <= w[1].tokens));
        let at: Vec<(usize, Duration)> = breakpoints.iter().map(|b| (b.block, b.ttl)).collect();
        assert_eq!(at, [(0, TTL_5M), (2, TTL_1H), (5, TTL_5M)]);
    }

    #[test]
    fn a_marker_is_not_part_of_the_prefix() {
        let plain = json!({"model": "claude", "system": "x",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]});
        let mut moved = plain.clone();
        moved["messages"][0]["content"][0]["cache_control"] = json!({"type": "ephemeral"});
        let (a, _) = marked(&plain);
        let (b, _) = marked(&moved);
        assert_eq!(a.iter().map(|b| b.key).collect::<Vec<_>>(), b.iter().map(|b| b.key).collect::<Vec<_>>());
        let mut other_model = plain.clone();
        other_model["model"] = json!("claude-other");
        assert_ne!(marked(&other_model).0[0].key, a[0].key, "the model is part of the identity");
        let mut other_role = plain;
        other_role["messages"][0]["role"] = json!("assistant");
        assert_ne!(marked(&other_role).0[1].key, a[1].key, "so is the role");
    }

    #[test]
    fn markers_are_checked_like_the_api() {
        let block = |cc: Value| json!({"type": "text", "text": "t", "cache_control": cc});
        let eph = json!({"type": "ephemeral"});
        let five: Vec<Value> = (0..5).map(|_| block(eph.clone())).collect();
        let messages = [json!({"role": "user", "content": five})];
        assert_eq!(
            check_markers(&[], &Value::Null, &messages).unwrap_err(),
            "A maximum of 4 blocks with cache_control may be provided. Found 5."
        );
        assert!(check_markers(&[], &json!(five[..4]), &[]).is_ok());
        let err = check_markers(&[], &json!([block(json!({"type": "ephemeral", "ttl": "2h"}))]), &[]).unwrap_err();
        assert!(err.starts_with("system.0.cache_control.ttl"), "{err}");
        assert!(check_markers(&[block(json!({"type": "persistent"}))], &Value::Null, &[]).is_err());
        assert!(check_markers(&[block(Value::Null)], &Value::Null, &[]).is_ok(), "null is no marker");
    }

    fn steps(api: Api, body: &Value) -> Vec<Boundary> {
        match read(api, body) {
            Prefix::Automatic { steps } => steps,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn openai_steps_are_128_tokens_from_1024() {
        // "user" (4 chars) + 5 000 chars = 1 251 tokens: steps 1024 and 1152 only.
        let body = json!({"model": "gpt", "input": [{"role": "user", "content": text(5000, 'a')}]});
        let tokens: Vec<u64> = steps(Api::Responses, &body).iter().map(|s| s.tokens).collect();
        assert_eq!(tokens, [1024, 1152]);
        assert_eq!(parse(Api::Responses, &body).unwrap().prompt.input_tokens, 1251);
        let short = json!({"model": "gpt", "input": text(4095, 'a')});
        assert!(steps(Api::Responses, &short).is_empty(), "1 023.75 tokens is under the minimum");
        let chat = json!({"model": "gpt", "messages": [{"role": "user", "content": text(4092, 'a')}]});
        assert_eq!(steps(Api::Chat, &chat).len(), 1, "4 + 4 092 chars = 1 024 tokens");
    }

    #[test]
    fn openai_identity_is_the_prefix_the_model_and_the_key() {
        let body = |tail: &str, key: Option<&str>| {
            let mut b = json!({"model": "gpt", "instructions": text(4200, 'i'), "input": tail});
            if let Some(key) = key {
                b["prompt_cache_key"] = json!(key);
            }
            b
        };
        let a = steps(Api::Responses, &body("one ending", None));
        let b = steps(Api::Responses, &body("another ending", None));
        assert_eq!(a[0], b[0], "the same first 1 024 tokens");
        assert_ne!(steps(Api::Responses, &body("one ending", Some("k")))[0], a[0], "a key is its own partition");
        let other = steps(Api::Responses, &body("one ending", Some("j")))[0];
        assert_ne!(other, steps(Api::Responses, &body("one ending", Some("k")))[0]);
    }
}
