//! The call's token estimate, which the worker asks the pacer to reserve
//! before it sends (docs/pacing.md): input tokens counted by a real tokenizer
//! (tiktoken's `o200k_base`, the encoding of GPT-4o, GPT-4.1, GPT-5 and the
//! o-series) over everything that is billed, plus `max_output_tokens` —
//! providers admit a call on input + its output limit, so that is what must
//! fit in the budget.
//!
//! The vocabulary ships inside the tiktoken-rs crate (`include_str!` of
//! `assets/o200k_base.tiktoken`): nothing is downloaded. It is parsed once per
//! process, behind tiktoken-rs's own `LazyLock` ([`tiktoken_rs::o200k_base_singleton`]);
//! [`warm_up`] pays that (a fraction of a second) at worker start rather than
//! on the first turn. Counting is then linear in the text (tiktoken-rs merges
//! long pieces with a heap, so a 100 KB run of one letter is not quadratic).
//!
//! An estimate, not a bill: it errs high where it must guess (framing,
//! images, encrypted reasoning), because a reservation that is too small
//! sends into a 429 and one that is a little large only waits a little. A
//! provider whose tokenizer is not ours (a vLLM or Ollama model, Anthropic,
//! the mock's `chars / 4`: ~1.33× ours on English) is met by the pacer: it
//! charges every ask's input at its learned *input ratio* (the provider's
//! count / this count), shared by every worker and the API's first asks.

use serde_json::Value;
use tiktoken_rs::CoreBPE;

/// Tokens of framing per message or input item (role and separators):
/// OpenAI's published count for chat models is 3 per message plus 1 for a
/// name; 4 covers both. Counted for every item, the instructions included.
pub const PER_ITEM_OVERHEAD: u64 = 4;

/// Tokens that prime the reply (`<|start|>assistant<|message|>`).
pub const REPLY_PRIMING: u64 = 3;

/// Tokens for one image at `detail: "high"` or `"auto"` — OpenAI's figure
/// for a 1024×1024 image (85 + 4 tiles × 170). We do not fetch images to
/// measure them.
pub const IMAGE_TOKENS: u64 = 765;

/// Tokens for one image at `detail: "low"`.
pub const LOW_DETAIL_IMAGE_TOKENS: u64 = 85;

/// Bytes of `encrypted_content` per token of the reasoning it carries: a
/// guess (the content is opaque); base64 of ciphertext of the reasoning text,
/// at ~4 characters a token, gives ~6.
pub const ENCRYPTED_BYTES_PER_TOKEN: u64 = 6;

/// Keys whose string values are not text the model reads as tokens: item
/// kinds and statuses (framing, in [`PER_ITEM_OVERHEAD`]), and payloads
/// costed another way (images, files, encrypted reasoning).
const NOT_TEXT: &[&str] = &["type", "status", "detail", "image_url", "url", "file_data", "encrypted_content"];

/// Keys of opaque, encrypted payloads, costed at [`ENCRYPTED_BYTES_PER_TOKEN`]:
/// OpenAI's `encrypted_content`, Anthropic's thinking `signature` and
/// `redacted_thinking` `data`.
const ENCRYPTED: &[&str] = &["encrypted_content", "signature"];

/// The tokenizer, parsed on first use and shared by every thread after.
fn bpe() -> &'static CoreBPE {
    tiktoken_rs::o200k_base_singleton()
}

/// Loads the tokenizer now, so the first turn does not pay for it.
pub fn warm_up() {
    let _ = bpe();
}

/// Tokens of `text` in `o200k_base`. Special-token text (`<|endoftext|>`) in a
/// tool output or a message is ordinary text to the provider, and is counted
/// as such. A long text is counted once per process and then remembered
/// (`Memo`, private): every turn of a run sends its history again, and counting it
/// again was a fifth of a worker's CPU.
pub fn count_text(text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    if text.len() < Memo::MIN_LEN {
        return bpe().encode_ordinary(text).len() as u64;
    }
    let key = Memo::key(text);
    if let Some(n) = MEMO.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
        return n;
    }
    let n = bpe().encode_ordinary(text).len() as u64;
    MEMO.lock().unwrap_or_else(|e| e.into_inner()).put(key, n);
    n
}

static MEMO: std::sync::LazyLock<std::sync::Mutex<Memo>> = std::sync::LazyLock::new(Default::default);

/// The token counts of the long texts this process counted lately, by a
/// 64-bit hash of the text and its length: two generations of at most
/// [`Memo::GENERATION`] texts each, the older dropped when the newer fills (a
/// text counted again moves to the newer). Bounded, and no clock.
#[derive(Default)]
struct Memo {
    newer: std::collections::HashMap<(u64, usize), u64>,
    older: std::collections::HashMap<(u64, usize), u64>,
}

impl Memo {
    /// Texts shorter than this are counted each time. (Hashing a short text
    /// costs a tenth of counting it: ids, names and roles repeat at every turn too.)
    const MIN_LEN: usize = 8;
    /// Texts per generation.
    const GENERATION: usize = 8_192;

    fn key(text: &str) -> (u64, usize) {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        text.hash(&mut h);
        (h.finish(), text.len())
    }

    fn get(&mut self, key: (u64, usize)) -> Option<u64> {
        if let Some(n) = self.newer.get(&key) {
            return Some(*n);
        }
        let n = self.older.remove(&key)?;
        self.put(key, n);
        Some(n)
    }

    fn put(&mut self, key: (u64, usize), n: u64) {
        if self.newer.len() >= Self::GENERATION {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(key, n);
    }
}

/// The tokens a request body may cost: its billed input plus
/// `max_output_tokens`.
///
/// Works for every wire format: Responses (`instructions`, `input` as a string
/// or items, `tools`), Chat Completions (`messages`, `tools`) and Anthropic
/// Messages (`system`, `messages` of content blocks, `tools`). Counted:
/// - every message's or item's text — message content (strings or text
///   parts), function call names and arguments, tool outputs, ids (the
///   model reads call ids), roles — plus [`PER_ITEM_OVERHEAD`] per item;
/// - the instructions, as one more item;
/// - each tool's JSON text (its name, description and parameter schema are
///   rendered into the prompt; the JSON is a close, slightly high, proxy);
/// - images at [`IMAGE_TOKENS`] / [`LOW_DETAIL_IMAGE_TOKENS`], encrypted
///   reasoning at [`ENCRYPTED_BYTES_PER_TOKEN`];
/// - [`REPLY_PRIMING`].
pub fn estimate_tokens(body: &Value, max_output_tokens: u64) -> u64 {
    input_tokens(body).saturating_add(max_output_tokens)
}

/// The input half of [`estimate_tokens`].
pub fn input_tokens(body: &Value) -> u64 {
    let mut n = REPLY_PRIMING + instructions_and_tools(body);
    for key in ["input", "messages"] {
        match body.get(key) {
            Some(Value::String(s)) => n += PER_ITEM_OVERHEAD + count_text(s),
            Some(Value::Array(items)) => n += items.iter().map(item_tokens).sum::<u64>(),
            _ => {}
        }
    }
    n
}

/// Tokens of a body's instructions (`instructions`, or Anthropic's `system`,
/// a string or a list of text blocks) and its tools: what every turn of a
/// run starts with.
fn instructions_and_tools(body: &Value) -> u64 {
    let mut n = 0;
    for key in ["instructions", "system"] {
        match body.get(key) {
            Some(Value::String(s)) => n += PER_ITEM_OVERHEAD + count_text(s),
            Some(blocks @ Value::Array(_)) => n += PER_ITEM_OVERHEAD + value_tokens(blocks),
            _ => {}
        }
    }
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        n += tools.iter().map(|tool| count_text(&tool.to_string())).sum::<u64>();
    }
    n
}

/// Of an Anthropic body's input, the tokens its prompt cache is expected to
/// give back (`request/cache.rs`): the prefix up to the last message before
/// the newest one that carries a cache breakpoint — the history the run's
/// previous turn sent, and wrote, minutes ago at most. 0 without one (a
/// run's first turn: what it writes is not read until the next). Anthropic
/// does not count cache reads against its input limit, so the pacer is not
/// asked for them; a cache that expired in between is a settle's correction.
pub fn predicted_cache_reads(body: &Value) -> u64 {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else { return 0 };
    let marked = |m: &Value| {
        m.get("content").and_then(Value::as_array).is_some_and(|c| c.iter().any(|b| b.get("cache_control").is_some()))
    };
    let Some(last) = messages.len().checked_sub(1) else { return 0 };
    let Some(end) = messages[..last].iter().rposition(marked) else { return 0 };
    instructions_and_tools(body) + messages[..=end].iter().map(item_tokens).sum::<u64>()
}

/// The length of the text in `v`, roughly: its strings' and keys' bytes, 8
/// for any other value. What building or marking a body costs goes with it,
/// and a quarter of it is a token count good enough to decide by.
pub fn text_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().map(text_len).sum(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() + text_len(v)).sum(),
        _ => 8,
    }
}

/// Tokens of one input item (a Responses item or a message): its text and
/// its framing.
pub fn item_tokens(item: &Value) -> u64 {
    PER_ITEM_OVERHEAD + value_tokens(item)
}

/// Tokens of the text inside one item, walked recursively.
fn value_tokens(value: &Value) -> u64 {
    match value {
        Value::String(s) => count_text(s),
        Value::Array(values) => values.iter().map(value_tokens).sum(),
        Value::Object(obj) => {
            let kind = obj.get("type").and_then(Value::as_str);
            if matches!(kind, Some("input_image" | "image_url" | "image")) {
                return image_tokens(value);
            }
            if kind == Some("redacted_thinking") {
                let bytes = obj.get("data").and_then(Value::as_str).map_or(0, str::len) as u64;
                return bytes.div_ceil(ENCRYPTED_BYTES_PER_TOKEN);
            }
            let mut n = 0;
            for (key, v) in obj {
                if ENCRYPTED.contains(&key.as_str()) {
                    let bytes = v.as_str().map_or(0, str::len) as u64;
                    n += bytes.div_ceil(ENCRYPTED_BYTES_PER_TOKEN);
                } else if !NOT_TEXT.contains(&key.as_str()) {
                    n += value_tokens(v);
                }
            }
            n
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

/// An image part (Responses `input_image` or Chat `image_url`).
fn image_tokens(part: &Value) -> u64 {
    let detail =
        part.get("detail").or_else(|| part.get("image_url").and_then(|u| u.get("detail"))).and_then(Value::as_str);
    if detail == Some("low") {
        LOW_DETAIL_IMAGE_TOKENS
    } else {
        IMAGE_TOKENS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{build_body, TurnParams};
    use serde_json::json;
    use shared::runs::ApiStyle;
    use std::time::Instant;

    #[test]
    fn an_anthropic_turn_is_expected_to_read_the_history_its_previous_turn_wrote() {
        let instructions = "Follow the rules. ".repeat(400);
        let p = TurnParams {
            model: "claude-sonnet-4-5",
            instructions: Some(&instructions),
            tools: &[],
            max_output_tokens: Some(100),
            metadata: None,
            generation: None,
        };
        let task = json!({"role": "user", "content": "find the answer"});
        let call = json!({"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"});
        let out = json!({"type": "function_call_output", "call_id": "c1", "output": "the answer is 42 ".repeat(300)});
        // The first turn reads nothing yet: what it writes is for the next.
        let first = build_body(ApiStyle::Anthropic, &p, std::slice::from_ref(&task));
        assert_eq!(predicted_cache_reads(&first), 0);
        // The second reads what the first sent: all but its own call and output.
        let second = build_body(ApiStyle::Anthropic, &p, &[task, call, out]);
        let reads = predicted_cache_reads(&second);
        let whole = input_tokens(&second);
        let first_input = input_tokens(&first);
        assert!(reads + 10 >= first_input && reads <= first_input, "{reads} read of {first_input} sent before");
        assert!(whole - reads > 900, "the tool output is new: {whole} - {reads}");
        // A Responses body has no breakpoints: nothing is predicted there.
        assert_eq!(predicted_cache_reads(&build_body(ApiStyle::Responses, &p, &[])), 0);
    }

    #[test]
    fn counts_known_strings() {
        // Reference values from tiktoken (Python) for o200k_base.
        assert_eq!(bpe().encode_ordinary("hello world"), vec![24912, 2375]);
        assert_eq!(count_text("hello world"), 2);
        assert_eq!(count_text(""), 0);
        // Special-token text is ordinary text, never a panic.
        assert!(count_text("<|endoftext|>") > 1);
    }

    fn body_with(messages: &[&str], max: Option<u32>) -> Value {
        let ctx: Vec<Value> = messages.iter().map(|m| json!({"role": "user", "content": m})).collect();
        let p = TurnParams {
            model: "m",
            instructions: Some("Be brief."),
            tools: &[],
            max_output_tokens: max,
            metadata: None,
            generation: None,
        };
        build_body(ApiStyle::Responses, &p, &ctx)
    }

    #[test]
    fn includes_max_output_tokens() {
        let body = body_with(&["hi"], Some(2048));
        assert_eq!(estimate_tokens(&body, 2048), input_tokens(&body) + 2048);
        assert_eq!(estimate_tokens(&body, 0), input_tokens(&body));
        assert_eq!(estimate_tokens(&body, u64::MAX), u64::MAX);
    }

    #[test]
    fn exact_for_a_small_body() {
        // instructions "Be brief." = 3 tokens ("Be", " brief", "."), one
        // message: role "user" (1) + "hello world" (2).
        let body = body_with(&["hello world"], None);
        assert_eq!(count_text("Be brief."), 3);
        assert_eq!(input_tokens(&body), REPLY_PRIMING + (PER_ITEM_OVERHEAD + 3) + (PER_ITEM_OVERHEAD + 1 + 2));
    }

    #[test]
    fn monotone_in_content() {
        let mut messages: Vec<String> = vec![];
        let mut last = input_tokens(&body_with(&[], None));
        for i in 0..30 {
            messages.push(format!("message number {i} says something"));
            let refs: Vec<&str> = messages.iter().map(String::as_str).collect();
            let n = input_tokens(&body_with(&refs, None));
            assert!(n > last, "{n} <= {last} after message {i}");
            last = n;
        }
        // A longer text in the same message.
        let mut text = String::new();
        let mut last = 0;
        for i in 0..50 {
            text.push_str(&format!(" word{i}"));
            let n = input_tokens(&body_with(&[&text], None));
            assert!(n > last);
            last = n;
        }
    }

    #[test]
    fn counts_everything_billed_in_both_shapes() {
        let tools = vec![json!({"type": "function", "name": "search", "description": "Search the web for pages",
                                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}})];
        let ctx = vec![
            json!({"role": "user", "content": "find the answer"}),
            json!({"type": "function_call", "call_id": "call_1", "name": "search", "arguments": "{\"q\":\"answer\"}"}),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "the answer is 42 ".repeat(50)}),
        ];
        let p = TurnParams {
            model: "m",
            instructions: Some("Be brief."),
            tools: &tools,
            max_output_tokens: Some(100),
            metadata: None,
            generation: None,
        };
        let responses = input_tokens(&build_body(ApiStyle::Responses, &p, &ctx));
        let chat = input_tokens(&build_body(ApiStyle::Chat, &p, &ctx));
        let anthropic = input_tokens(&build_body(ApiStyle::Anthropic, &p, &ctx));
        let text: u64 =
            ["Be brief.", "find the answer", "search", "{\"q\":\"answer\"}", &"the answer is 42 ".repeat(50)]
                .iter()
                .map(|s| count_text(s))
                .sum();
        let tool_json = count_text(&tools[0].to_string());
        // Anthropic's tool input is an object (its keys are framing), its ids come twice.
        assert!(anthropic + 10 >= text + tool_json && anthropic <= text + tool_json + 60, "{anthropic}");
        for n in [responses, chat] {
            assert!(n >= text + tool_json, "{n} < {}", text + tool_json);
            // Framing, roles, ids and the nested chat tool shape stay small.
            assert!(n <= text + tool_json + 60, "{n} vs {}", text + tool_json);
        }
        // Dropping the tools or the output lowers it.
        let no_tools = TurnParams { tools: &[], ..p };
        assert!(input_tokens(&build_body(ApiStyle::Responses, &no_tools, &ctx)) < responses);
        assert!(input_tokens(&build_body(ApiStyle::Chat, &p, &ctx[..2])) < chat);
    }

    #[test]
    fn images_and_encrypted_reasoning_are_costed_not_tokenized() {
        let big_url = format!("data:image/png;base64,{}", "A".repeat(200_000));
        let body = json!({"input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": big_url}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x", "detail": "low"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": "e".repeat(600)},
        ]});
        let role = count_text("user");
        let want = REPLY_PRIMING + 3 * PER_ITEM_OVERHEAD + 2 * role + IMAGE_TOKENS + LOW_DETAIL_IMAGE_TOKENS + 100;
        assert_eq!(input_tokens(&body), want);
        let chat = json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:...", "detail": "low"}}]}]});
        assert_eq!(input_tokens(&chat), REPLY_PRIMING + PER_ITEM_OVERHEAD + role + LOW_DETAIL_IMAGE_TOKENS);
    }

    #[test]
    fn a_string_input_counts() {
        let body = json!({"model": "m", "input": "hello world"});
        assert_eq!(input_tokens(&body), REPLY_PRIMING + PER_ITEM_OVERHEAD + 2);
        assert_eq!(input_tokens(&json!({})), REPLY_PRIMING);
    }

    /// Not a benchmark: a guard that estimating a large body stays cheap once
    /// the tokenizer is loaded (it is loaded once, not per call), including
    /// the inputs that make naive BPE quadratic. Timings are printed
    /// (`--nocapture`); the bound is loose because CI cores are shared.
    #[test]
    fn a_100_kb_body_is_cheap_once_loaded() {
        let t = Instant::now();
        warm_up();
        let load = t.elapsed();
        let prose = "The quick brown fox jumps over the lazy dog, again and again. ".repeat(1_600);
        for text in [prose, "a".repeat(100_000), " ".repeat(100_000), "€".repeat(34_000)] {
            let body = json!({"input": [{"role": "user", "content": text}]});
            let t = Instant::now();
            let n = estimate_tokens(&body, 0);
            let took = t.elapsed();
            eprintln!("estimate: {} KB -> {n} tokens in {took:?} (tokenizer load {load:?})", text.len() / 1000);
            assert!(n > 100);
            assert!(took.as_secs() < 10, "{took:?}");
        }
    }
    #[test]
    fn a_long_text_counted_again_is_remembered_and_the_memo_stays_bounded() {
        let long = "a tool's output, read again at every turn of its run. ".repeat(40);
        let exact = bpe().encode_ordinary(&long).len() as u64;
        assert_eq!(count_text(&long), exact);
        assert_eq!(count_text(&long), exact, "remembered, and the same");
        assert!(MEMO.lock().unwrap().get(Memo::key(&long)).is_some());
        // A text one character off is another text, counted on its own.
        let other = format!("{long}!");
        assert_eq!(count_text(&other), bpe().encode_ordinary(&other).len() as u64);
        // Two generations at most.
        let mut memo = Memo::default();
        for i in 0..(3 * Memo::GENERATION) {
            memo.put((i as u64, 300), i as u64);
        }
        assert!(memo.newer.len() + memo.older.len() <= 2 * Memo::GENERATION);
        assert_eq!(memo.get(((3 * Memo::GENERATION - 1) as u64, 300)), Some((3 * Memo::GENERATION - 1) as u64));
        assert_eq!(memo.get((0, 300)), None, "the oldest generation is gone");
    }
}
