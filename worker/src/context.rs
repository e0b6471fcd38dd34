//! The model's context, bounded (back-pressure; README, "Tool endpoints"): tool outputs clipped to a cap
//! with a note saying so, every browser view but the newest elided, and the
//! history bounded to the last turns without ever separating a function call
//! from its output.
//!
//! Pure functions over [`TranscriptEntry`]s. The worker clips a tool's output
//! once, when the tool answers, and stores the clipped text in the transcript
//! ([`clip_tool_output`]); it builds what the model is sent with
//! [`prepare_context`] (bound, then elide), which never changes the transcript
//! itself. So `GET /v1/runs/{id}/transcript` shows the clipped text the model
//! read — one constant, not two.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde_json::Value;

use shared::runs::TranscriptEntry;

/// Characters of one tool call's output fed back to the model.
pub const TOOL_OUTPUT_CAP: usize = 16_000;

/// The cap for `browser__*` tools, "whose snapshots are large".
pub const BROWSER_TOOL_OUTPUT_CAP: usize = 24_000;

/// Tools whose name starts with this are browser tools: a larger cap, and
/// their earlier outputs are elided from what the model is sent.
pub const BROWSER_TOOL_PREFIX: &str = "browser__";

/// What replaces an earlier browser view in what the model is sent. One line.
pub const BROWSER_PLACEHOLDER: &str = "[An earlier browser view was elided here to save context. \
     Take a fresh snapshot if you need the page's current state.]";

/// Turns of history sent after the task (`PACELINE_MAX_HISTORY`) — "deliberately
/// not split by transport": Responses and Chat send the same number.
pub const DEFAULT_MAX_HISTORY: usize = 24;

/// Whether `tool_name` is a browser tool (`browser__*`).
pub fn is_browser_tool(tool_name: &str) -> bool {
    tool_name.starts_with(BROWSER_TOOL_PREFIX)
}

/// The output cap for a tool, in characters.
pub fn output_cap(tool_name: &str) -> usize {
    if is_browser_tool(tool_name) {
        BROWSER_TOOL_OUTPUT_CAP
    } else {
        TOOL_OUTPUT_CAP
    }
}

/// A tool output after clipping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clipped {
    /// What the model reads (and the transcript stores): the output itself, or
    /// its first `kept` characters followed by a note saying so.
    pub text: String,
    /// Whether anything was cut.
    pub clipped: bool,
    /// Characters of the original output in `text`.
    pub kept: usize,
    /// Characters of the original output.
    pub total: usize,
}

/// Clips a tool's output to [`output_cap`]`(tool_name)` characters.
///
/// Characters are Unicode scalar values (`char`s), never bytes, so a clip never
/// splits a UTF-8 sequence. An output within the cap comes back unchanged.
///
/// A clipped output says so — "a silent truncation is worse than a short one" —
/// on a last line of its own:
///
/// ```text
/// …the first kept characters…
/// [output clipped: kept the first 15942 of 48213 characters]
/// ```
///
/// **The cap bounds the whole text, note included**: `kept` is as large as it
/// can be while `kept + note ≤ cap`, so what the model reads (and what the
/// transcript stores) is never longer than the cap, and clipping a clipped
/// text again changes nothing. The note costs ~60 characters of output.
pub fn clip_tool_output(tool_name: &str, output: &str) -> Clipped {
    clip_to(output, output_cap(tool_name))
}

/// [`clip_tool_output`] with an explicit cap. A cap too small to hold even
/// the note (never the case for the two constants) keeps no output and as much
/// of the note as fits, so the result still never exceeds the cap.
pub fn clip_to(output: &str, cap: usize) -> Clipped {
    // Bytes bound chars from above: most outputs skip the count.
    if output.len() <= cap {
        let n = output.chars().count();
        return Clipped { text: output.to_owned(), clipped: false, kept: n, total: n };
    }
    let total = output.chars().count();
    if total <= cap {
        return Clipped { text: output.to_owned(), clipped: false, kept: total, total };
    }

    let note_len = |kept: usize| clip_note(kept, total).chars().count();
    // The note's length grows with the digits of `kept`, so start from a
    // `kept` that surely fits and step up while the next one still does.
    let mut kept = cap.saturating_sub(note_len(cap));
    while kept < total && kept + 1 + note_len(kept + 1) <= cap {
        kept += 1;
    }
    if kept + note_len(kept) > cap {
        // Degenerate cap: not even the note fits.
        let text: String = clip_note(0, total).chars().take(cap).collect();
        return Clipped { text, clipped: true, kept: 0, total };
    }

    let end = output.char_indices().nth(kept).map_or(output.len(), |(i, _)| i);
    let mut text = String::with_capacity(end + 64);
    text.push_str(&output[..end]);
    text.push_str(&clip_note(kept, total));
    Clipped { text, clipped: true, kept, total }
}

/// The note appended to a clipped output (with its leading newline).
fn clip_note(kept: usize, total: usize) -> String {
    format!("\n[output clipped: kept the first {kept} of {total} characters]")
}

/// The `type` of a Responses item (`None` for a bare `{"role","content"}`).
fn item_type(item: &Value) -> Option<&str> {
    item.get("type").and_then(Value::as_str)
}

fn call_id(item: &Value) -> Option<&str> {
    item.get("call_id").and_then(Value::as_str)
}

fn is_call(item: &Value) -> bool {
    item_type(item) == Some("function_call")
}

fn is_output(item: &Value) -> bool {
    item_type(item) == Some("function_call_output")
}

/// Replaces every `browser__*` `function_call_output` but the newest (the last
/// in transcript order) with [`BROWSER_PLACEHOLDER`], "so a long browsing run
/// does not carry every intermediate DOM". Returns how many were replaced.
///
/// Apply it to what the model is *sent* (a copy — see [`prepare_context`]); the
/// transcript keeps every view. An output's tool is found through the
/// `function_call` item with its `call_id`; an output whose call is not among
/// `items` is not known to be a browser view and is left alone. When one turn
/// ran several browser tools, only the last output survives: it is the newest
/// view, and the placeholder tells the model how to get another.
pub fn elide_browser_outputs(items: &mut [TranscriptEntry]) -> usize {
    let browser_calls: HashSet<&str> = items
        .iter()
        .filter(|e| is_call(&e.item))
        .filter(|e| e.item.get("name").and_then(Value::as_str).is_some_and(is_browser_tool))
        .filter_map(|e| call_id(&e.item))
        .collect();
    let views: Vec<usize> = items
        .iter()
        .enumerate()
        .filter(|(_, e)| is_output(&e.item) && call_id(&e.item).is_some_and(|c| browser_calls.contains(c)))
        .map(|(i, _)| i)
        .collect();
    let Some((_newest, older)) = views.split_last() else { return 0 };
    for &i in older {
        if let Some(obj) = items[i].item.as_object_mut() {
            obj.insert("output".into(), Value::String(BROWSER_PLACEHOLDER.into()));
        }
    }
    older.len()
}

/// The history sent with a turn: the task (turn 0) always, plus the items of
/// the last `max_turns` turns — never a function call without its output, nor
/// an output without its call. Order is kept; the result is a subsequence of
/// `entries`.
///
/// The rule, in three steps:
///
/// 1. **Window.** Keep every turn-0 item and every item of the `max_turns`
///    highest turn numbers present (after 0). `max_turns = 0` keeps the task
///    alone.
/// 2. **An output keeps its call.** A `function_call_output` in the window
///    pulls in its `function_call` (the latest one with its `call_id` before
///    it), even from a turn outside the window. This is what makes the window
///    safe whichever turn index the worker tags tool results with: when the
///    calls of turn N are answered by outputs committed as turn N+1, a window
///    that starts at N+1 still shows the model the calls it made and what they
///    returned — dropping them instead would hide the results it just asked
///    for and send it round the same tools again. The overflow is bounded: at
///    most the calls of the one turn before the window (not its text).
/// 3. **No orphans.** Then every `function_call_output` without its
///    `function_call` earlier in the result, and every `function_call` without
///    an output later in the result, is dropped, as is a call or output with
///    no `call_id`. In a well-formed transcript that only removes the calls
///    whose outputs fell out of the window (impossible with outputs after
///    their calls) — but it also removes orphans a malformed input brought,
///    which the provider would reject anyway (Chat: a `tool` message must
///    follow its assistant `tool_calls`; Responses: "No tool output found").
pub fn bound_history(entries: &[TranscriptEntry], max_turns: usize) -> Vec<TranscriptEntry> {
    bound_history_in_steps(entries, max_turns, 1)
}

/// How many turns the window drops at once in [`prepare_context`]: a third
/// of the depth, so the history sent stays the same from one turn to the
/// next for that many turns (a provider's prompt cache holds a prefix only
/// as long as it is byte for byte the same; a window sliding one turn at a
/// time would change it on every turn past the depth).
pub fn history_step(max_turns: usize) -> usize {
    (max_turns / 3).max(1)
}

/// [`bound_history`] whose window starts only at turn numbers k × `step` + 1:
/// with turns numbered one after another it keeps between `max_turns - step
/// + 1` and `max_turns` turns after the task once there are more, and moves
/// `step` turns at a time.
pub fn bound_history_in_steps(entries: &[TranscriptEntry], max_turns: usize, step: usize) -> Vec<TranscriptEntry> {
    // 1. The window.
    let turns: Vec<u32> =
        entries.iter().map(|e| e.turn).filter(|&t| t > 0).collect::<BTreeSet<u32>>().into_iter().collect();
    let cutoff = match turns.len().checked_sub(max_turns) {
        _ if max_turns == 0 => u32::MAX,
        // Within the depth: every turn.
        None | Some(0) => turns.first().copied().unwrap_or(u32::MAX),
        // The first turn kept: the sliding window's first, moved on to the
        // next turn number of the form k × step + 1 (turn numbers, not
        // positions: a transcript read from the window's start gives the
        // same cut as the whole), never past the newest turn.
        Some(first) => {
            let step = step.clamp(1, max_turns) as u32;
            let stepped = (turns[first] - 1).div_ceil(step) * step + 1;
            turns.iter().copied().find(|&t| t >= stepped).unwrap_or(turns[turns.len() - 1])
        }
    };
    let mut keep: Vec<bool> = entries.iter().map(|e| e.turn == 0 || e.turn >= cutoff).collect();

    // 2. An output keeps its call.
    let mut calls_by_id: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        if is_call(&e.item) {
            if let Some(c) = call_id(&e.item) {
                calls_by_id.entry(c).or_default().push(i);
            }
        }
    }
    for (i, e) in entries.iter().enumerate() {
        if !keep[i] || !is_output(&e.item) {
            continue;
        }
        let latest_before =
            call_id(&e.item).and_then(|c| calls_by_id.get(c)).and_then(|v| v.iter().rev().find(|&&j| j < i));
        if let Some(&j) = latest_before {
            keep[j] = true;
        }
    }

    // 3. No orphans: outputs need a kept call before them …
    let mut seen_calls: HashSet<&str> = HashSet::new();
    let mut last_answer: HashMap<&str, usize> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        if !keep[i] {
            continue;
        }
        if is_call(&e.item) {
            match call_id(&e.item) {
                Some(c) => {
                    seen_calls.insert(c);
                }
                None => keep[i] = false,
            }
        } else if is_output(&e.item) {
            match call_id(&e.item) {
                Some(c) if seen_calls.contains(c) => {
                    last_answer.insert(c, i);
                }
                _ => keep[i] = false,
            }
        }
    }
    // … and calls need a kept output after them.
    for (i, e) in entries.iter().enumerate() {
        if keep[i] && is_call(&e.item) {
            let answered = call_id(&e.item).and_then(|c| last_answer.get(c)).is_some_and(|&o| o > i);
            if !answered {
                keep[i] = false;
            }
        }
    }

    entries.iter().zip(keep).filter(|(_, k)| *k).map(|(e, _)| e.clone()).collect()
}

/// The items to send for a turn: [`bound_history_in_steps`] (by
/// [`history_step`]) then [`elide_browser_outputs`], on a copy — the
/// transcript is not changed.
///
/// Tool outputs are not clipped here: the worker stored them clipped when the
/// tools answered, so there is nothing left to clip, and clipping here as well
/// would make a second copy of the rule that could disagree with the first.
pub fn prepare_context(entries: &[TranscriptEntry], max_history: usize) -> Vec<Value> {
    context_entries(entries, max_history).into_iter().map(|e| e.item).collect()
}

/// [`prepare_context`] before the turn tags are dropped.
pub fn context_entries(entries: &[TranscriptEntry], max_history: usize) -> Vec<TranscriptEntry> {
    let mut items = bound_history_in_steps(entries, max_history, history_step(max_history));
    elide_browser_outputs(&mut items);
    items
}

/// The most input (our tokens) each model's window was found to hold, from
/// the context-length errors one provider of this process answered: a window
/// neither the run nor the built-in table gave is learned from the first such
/// error, so later turns fit before they are sent instead of paying a 400
/// each. One per provider ([`crate::routes::Route`]).
#[derive(Debug, Clone, Default)]
pub struct LearnedWindows(std::sync::Arc<std::sync::Mutex<HashMap<String, u64>>>);

impl LearnedWindows {
    /// What was learned of `model`.
    pub fn get(&self, model: &str) -> Option<u64> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).get(model).copied()
    }

    /// Learns from a context-length error (`message`) of a call of `model`
    /// whose input we counted at `input`: the provider's count and window,
    /// when it names them, scale it (2 % under); when it does not, the window
    /// is taken a tenth under what was refused. Only ever lowered, never
    /// under [`MIN_LEARNED_WINDOW`], and not from a count that cannot be this
    /// call's (more than 4× ours either way: a proxy's or a test's message).
    /// Returns what is known now.
    pub fn learn(&self, model: &str, input: u64, message: &str) -> Option<u64> {
        let fits = match shared::pacer::context_excess(message) {
            Some((counted, limit)) if counted > limit => {
                let ratio = counted as f64 / input.max(1) as f64;
                (0.25..=4.0).contains(&ratio).then(|| (limit as f64 / ratio * 0.98) as u64)
            }
            Some(_) => None,
            None => Some(input / 10 * 9),
        };
        let mut learned = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(fits) = fits.filter(|&f| f >= MIN_LEARNED_WINDOW) {
            let window = learned.entry(model.to_owned()).or_insert(fits);
            *window = (*window).min(fits);
        }
        learned.get(model).copied()
    }
}

/// The least context window [`LearnedWindows`] learns (no model has less).
pub const MIN_LEARNED_WINDOW: u64 = 1_024;

/// What replaces a tool output trimmed to fit the model's context window.
pub const TRIMMED_PLACEHOLDER: &str = "[An earlier tool output was removed here to fit the model's context window.]";

/// Makes `items` (a context, [`context_entries`]) `excess` tokens shorter,
/// as `tokens` counts an item, for a model whose window it overflows (SPEC
/// §4a, `context_overflow: "trim"`): the oldest tool outputs first (each
/// replaced by [`TRIMMED_PLACEHOLDER`]), then the oldest turns whole — never
/// the task, never the newest turn, never a call without its output. `Err`
/// with what is still over when nothing more can go.
pub fn trim_to_fit(
    mut items: Vec<TranscriptEntry>,
    mut excess: u64,
    tokens: impl Fn(&Value) -> u64,
) -> Result<Vec<TranscriptEntry>, u64> {
    let newest = items.iter().map(|e| e.turn).max().unwrap_or(0);
    let placeholder = Value::String(TRIMMED_PLACEHOLDER.into());
    // 1. The oldest tool outputs.
    for e in items.iter_mut().filter(|e| e.turn != newest && is_output(&e.item)) {
        if excess == 0 {
            break;
        }
        let Some(output) = e.item.get_mut("output") else { continue };
        let before = tokens(output);
        let after = tokens(&placeholder);
        if before > after {
            *output = placeholder.clone();
            excess = excess.saturating_sub(before - after);
        }
    }
    // 2. The oldest turns, whole; a call whose output went with them goes too.
    if excess == 0 {
        return Ok(items);
    }
    let turns: BTreeSet<u32> = items.iter().map(|e| e.turn).filter(|&t| t != 0 && t != newest).collect();
    for turn in turns {
        if excess == 0 {
            break;
        }
        let dropped: u64 = items.iter().filter(|e| e.turn == turn).map(|e| tokens(&e.item)).sum();
        items.retain(|e| e.turn != turn);
        excess = excess.saturating_sub(dropped);
    }
    let items = bound_history(&items, usize::MAX);
    if excess == 0 {
        Ok(items)
    } else {
        Err(excess)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn e(turn: u32, item: Value) -> TranscriptEntry {
        TranscriptEntry { turn, item }
    }
    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }
    fn assistant(text: &str) -> Value {
        json!({"role": "assistant", "content": text})
    }
    fn call(id: &str, name: &str) -> Value {
        json!({"type": "function_call", "call_id": id, "name": name, "arguments": "{}"})
    }
    fn out(id: &str, output: &str) -> Value {
        json!({"type": "function_call_output", "call_id": id, "output": output})
    }

    // ---- clipping ----

    #[test]
    fn caps_by_tool_name() {
        for (name, cap) in [
            ("search", TOOL_OUTPUT_CAP),
            ("browser__snapshot", BROWSER_TOOL_OUTPUT_CAP),
            ("browser_snapshot", TOOL_OUTPUT_CAP),
            ("my_browser__x", TOOL_OUTPUT_CAP),
            ("browser__", BROWSER_TOOL_OUTPUT_CAP),
            ("", TOOL_OUTPUT_CAP),
        ] {
            assert_eq!(output_cap(name), cap, "{name}");
        }
    }

    #[test]
    fn clip_table() {
        // (output chars, tool, clipped?)
        let cases = [
            (0, "search", false),
            (100, "search", false),
            (TOOL_OUTPUT_CAP, "search", false),
            (TOOL_OUTPUT_CAP + 1, "search", true),
            (48_213, "search", true),
            (TOOL_OUTPUT_CAP + 1, "browser__snapshot", false),
            (BROWSER_TOOL_OUTPUT_CAP, "browser__snapshot", false),
            (BROWSER_TOOL_OUTPUT_CAP + 1, "browser__snapshot", true),
            (1_000_000, "browser__snapshot", true),
        ];
        for (n, tool, clipped) in cases {
            let output = "x".repeat(n);
            let c = clip_tool_output(tool, &output);
            let cap = output_cap(tool);
            assert_eq!(c.clipped, clipped, "{n} {tool}");
            assert_eq!(c.total, n);
            assert!(c.text.chars().count() <= cap, "{n} {tool}: {}", c.text.chars().count());
            if clipped {
                assert!(c.kept < cap && c.kept > cap - 80, "kept {}", c.kept);
                let note = format!("\n[output clipped: kept the first {} of {n} characters]", c.kept);
                assert!(c.text.ends_with(&note), "{:?}", &c.text[c.text.len() - 80..]);
                assert_eq!(c.text, format!("{}{note}", "x".repeat(c.kept)));
                // As long as it may be: one more kept char would break the cap.
                assert_eq!(c.text.chars().count(), cap, "{n} {tool}");
            } else {
                assert_eq!(c.text, output);
                assert_eq!(c.kept, n);
            }
        }
    }

    #[test]
    fn clip_counts_characters_not_bytes() {
        // 16 000 three-byte chars fit (48 000 bytes); 16 001 do not.
        let fits = "€".repeat(TOOL_OUTPUT_CAP);
        assert!(!clip_tool_output("t", &fits).clipped);
        let over = "€".repeat(TOOL_OUTPUT_CAP + 1);
        let c = clip_tool_output("t", &over);
        assert!(c.clipped);
        assert_eq!(c.total, TOOL_OUTPUT_CAP + 1);
        assert!(c.text.starts_with(&"€".repeat(c.kept)));
        assert_eq!(c.text.chars().count(), TOOL_OUTPUT_CAP);
    }

    #[test]
    fn clipping_twice_changes_nothing() {
        let once = clip_tool_output("search", &"y".repeat(50_000));
        let twice = clip_tool_output("search", &once.text);
        assert_eq!(twice.text, once.text);
        assert!(!twice.clipped);
    }

    #[test]
    fn degenerate_caps_never_exceed() {
        for cap in 0..80 {
            let c = clip_to(&"z".repeat(200), cap);
            assert!(c.text.chars().count() <= cap, "cap {cap}");
            assert!(c.clipped);
        }
    }

    proptest! {
        #[test]
        fn clip_never_exceeds_the_cap(s in "\\PC{0,400}", cap in 0usize..300) {
            let c = clip_to(&s, cap);
            let n = s.chars().count();
            prop_assert_eq!(c.total, n);
            prop_assert!(c.text.chars().count() <= cap);
            prop_assert_eq!(c.clipped, n > cap);
            if c.clipped {
                let prefix: String = s.chars().take(c.kept).collect();
                prop_assert!(c.text.starts_with(&prefix));
            } else {
                prop_assert_eq!(&c.text, &s);
            }
        }

        #[test]
        fn clip_handles_any_unicode(s in any::<String>(), browser in any::<bool>()) {
            let tool = if browser { "browser__x" } else { "x" };
            let c = clip_tool_output(tool, &s);
            prop_assert!(c.text.chars().count() <= output_cap(tool));
        }

        #[test]
        fn clip_large_unicode(ch in any::<char>(), extra in 1usize..3000) {
            let s: String = std::iter::repeat_n(ch, TOOL_OUTPUT_CAP + extra).collect();
            let c = clip_tool_output("t", &s);
            prop_assert!(c.clipped);
            prop_assert_eq!(c.text.chars().count(), TOOL_OUTPUT_CAP);
            prop_assert_eq!(c.total, TOOL_OUTPUT_CAP + extra);
        }
    }

    // ---- browser elision ----

    #[test]
    fn elides_all_browser_views_but_the_newest() {
        let mut items = vec![
            e(0, user("task")),
            e(1, call("b1", "browser__snapshot")),
            e(1, out("b1", "<dom 1>")),
            e(2, call("s1", "search")),
            e(2, out("s1", "search result")),
            e(3, call("b2", "browser__click")),
            e(3, out("b2", "<dom 2>")),
            e(4, call("b3", "browser__snapshot")),
            e(4, out("b3", "<dom 3>")),
            e(5, assistant("done")),
        ];
        assert_eq!(elide_browser_outputs(&mut items), 2);
        let outputs: Vec<&str> =
            items.iter().filter(|e| is_output(&e.item)).map(|e| e.item["output"].as_str().unwrap()).collect();
        assert_eq!(outputs, [BROWSER_PLACEHOLDER, "search result", BROWSER_PLACEHOLDER, "<dom 3>"]);
        assert!(!BROWSER_PLACEHOLDER.contains('\n'), "one line");
        // Idempotent.
        let before = items.clone();
        assert_eq!(elide_browser_outputs(&mut items), 2);
        assert_eq!(items, before);
    }

    #[test]
    fn elision_table() {
        // (items, outputs after)
        let cases: Vec<(Vec<TranscriptEntry>, Vec<&str>)> = vec![
            (vec![], vec![]),
            (vec![e(1, call("a", "search")), e(1, out("a", "1"))], vec!["1"]),
            (vec![e(1, call("a", "browser__x")), e(1, out("a", "1"))], vec!["1"]),
            // Parallel browser calls in one turn: the last output is the newest.
            (
                vec![
                    e(1, call("a", "browser__x")),
                    e(1, call("b", "browser__y")),
                    e(1, out("a", "1")),
                    e(1, out("b", "2")),
                ],
                vec![BROWSER_PLACEHOLDER, "2"],
            ),
            // An output whose call is not in view is not known to be a browser view.
            (vec![e(1, out("zz", "1")), e(1, call("a", "browser__x")), e(1, out("a", "2"))], vec!["1", "2"]),
        ];
        for (mut items, want) in cases {
            elide_browser_outputs(&mut items);
            let got: Vec<&str> =
                items.iter().filter(|e| is_output(&e.item)).map(|e| e.item["output"].as_str().unwrap()).collect();
            assert_eq!(got, want);
        }
    }

    // ---- bounding history ----

    /// A transcript of `n` turns, each one call and its output (tagged
    /// `deferred`: with the next turn), plus a message.
    fn chain(n: u32, deferred: bool) -> Vec<TranscriptEntry> {
        let mut v = vec![e(0, user("task"))];
        for t in 1..=n {
            let id = format!("c{t}");
            v.push(e(t, assistant(&format!("thinking {t}"))));
            v.push(e(t, call(&id, "search")));
            v.push(e(if deferred { t + 1 } else { t }, out(&id, &format!("out {t}"))));
        }
        v
    }

    fn texts(v: &[TranscriptEntry]) -> Vec<String> {
        v.iter()
            .map(|e| {
                let i = &e.item;
                match item_type(i) {
                    Some("function_call") => format!("{}:call {}", e.turn, i["call_id"].as_str().unwrap()),
                    Some("function_call_output") => format!("{}:out {}", e.turn, i["call_id"].as_str().unwrap()),
                    _ => format!("{}:{}", e.turn, i["content"].as_str().unwrap()),
                }
            })
            .collect()
    }

    #[test]
    fn keeps_the_task_and_the_last_turns() {
        let v = chain(30, false);
        let b = bound_history(&v, 2);
        assert_eq!(
            texts(&b),
            ["0:task", "29:thinking 29", "29:call c29", "29:out c29", "30:thinking 30", "30:call c30", "30:out c30"]
        );
        assert_eq!(bound_history(&v, 24).len(), 1 + 24 * 3);
        assert_eq!(bound_history(&v, 30), v);
        assert_eq!(bound_history(&v, 1000), v);
        assert_eq!(texts(&bound_history(&v, 0)), ["0:task"]);
    }

    #[test]
    fn outputs_committed_with_the_next_turn_keep_their_calls() {
        // Turn t's call is answered by an output tagged t+1.
        let v = chain(10, true);
        let b = bound_history(&v, 2);
        assert_eq!(
            texts(&b),
            // Window = turns 10 and 11; out c9 (turn 10) pulls in call c9 (turn 9),
            // but not turn 9's text.
            ["0:task", "9:call c9", "10:out c9", "10:thinking 10", "10:call c10", "11:out c10"]
        );
        // max_turns = 1: the newest turn holds only outputs; they keep their calls.
        assert_eq!(texts(&bound_history(&v, 1)), ["0:task", "10:call c10", "11:out c10"]);
    }

    #[test]
    fn the_window_moves_in_steps_so_the_history_sent_stays_the_same_for_a_while() {
        assert_eq!(history_step(24), 8);
        assert_eq!(history_step(2), 1);
        let mut first_kept = vec![];
        for n in 1..=60u32 {
            let v = chain(n, false);
            let sent = bound_history_in_steps(&v, 24, 8);
            let turns: BTreeSet<u32> = sent.iter().map(|e| e.turn).filter(|&t| t > 0).collect();
            assert!(turns.len() <= 24, "{n} turns: {} sent", turns.len());
            assert!(turns.len() >= (n as usize).min(17), "{n} turns: {} sent", turns.len());
            assert_eq!(turns.last(), Some(&n), "the newest turn is always sent");
            first_kept.push(*turns.first().unwrap());
            // Each step is the one-at-a-time window's, or later.
            let sliding = bound_history(&v, 24);
            assert!(sliding.iter().filter(|e| e.turn > 0).count() >= sent.iter().filter(|e| e.turn > 0).count());
        }
        // The first turn sent moves 8 at a time: 1 until 24 turns, then 9, 17, …
        let moves: Vec<(usize, u32)> =
            first_kept.windows(2).enumerate().filter(|(_, w)| w[0] != w[1]).map(|(i, w)| (i + 2, w[1])).collect();
        assert_eq!(moves, [(25, 9), (33, 17), (41, 25), (49, 33), (57, 41)]);
        // A step of one is the sliding window.
        let v = chain(40, true);
        assert_eq!(bound_history_in_steps(&v, 24, 1), bound_history(&v, 24));
    }

    #[test]
    fn trimming_takes_the_oldest_outputs_then_the_oldest_turns_and_never_the_task_or_the_newest() {
        let tokens = |v: &Value| crate::estimate::item_tokens(v);
        let mut v = vec![e(0, user("the task"))];
        for t in 1..=6u32 {
            let id = format!("c{t}");
            v.push(e(t, call(&id, "search")));
            v.push(e(t, out(&id, &format!("result {t} ").repeat(200))));
        }
        let whole: u64 = v.iter().map(|e| tokens(&e.item)).sum();
        // A little over: the oldest output goes, nothing else.
        let fit = trim_to_fit(v.clone(), 10, tokens).unwrap();
        let outputs: Vec<&str> =
            fit.iter().filter(|e| is_output(&e.item)).map(|e| e.item["output"].as_str().unwrap()).collect();
        assert_eq!(outputs[0], TRIMMED_PLACEHOLDER);
        assert!(outputs[1..].iter().all(|o| *o != TRIMMED_PLACEHOLDER));
        assert_eq!(fit.len(), v.len(), "no turn dropped");
        // More than all the outputs but the newest: turns go too, oldest first.
        let fit = trim_to_fit(v.clone(), whole * 2 / 3, tokens).unwrap();
        let left: u64 = fit.iter().map(|e| tokens(&e.item)).sum();
        assert!(left + whole * 2 / 3 <= whole, "{left} of {whole} left");
        assert_eq!(fit[0].item, user("the task"));
        assert_eq!(fit.last().unwrap().item["output"].as_str().unwrap(), "result 6 ".repeat(200), "the newest intact");
        assert_eq!(bound_history(&fit, usize::MAX), fit, "no orphan");
        // More than everything but the task and the newest turn: it cannot fit.
        assert!(trim_to_fit(v.clone(), whole, tokens).is_err());
        assert_eq!(trim_to_fit(v.clone(), 0, tokens).unwrap(), v);
    }

    #[test]
    fn a_window_is_learned_from_the_providers_error_and_only_lowered() {
        let w = LearnedWindows::default();
        assert_eq!(w.get("m"), None);
        // Anthropic names both numbers: our 180 000 were its 210 000 over 200 000.
        let fits = w.learn("m", 180_000, "prompt is too long: 210000 tokens > 200000 maximum");
        assert_eq!(fits, Some(168_000));
        // No numbers: a tenth under what was refused — higher here, so kept lower.
        let responses = "Your input exceeds the context window of this model.";
        assert_eq!(w.learn("m", 200_000, responses), Some(168_000));
        assert_eq!(w.learn("m", 150_000, responses), Some(135_000));
        assert_eq!(w.get("m"), Some(135_000));
        assert_eq!(w.get("other"), None, "per model");
        // A count that cannot be this call's teaches nothing; nor does a window under 1 024.
        assert_eq!(w.learn("x", 10, "prompt is too long: 210000 tokens > 200000 maximum"), None);
        assert_eq!(w.learn("x", 100, responses), None);
    }

    #[test]
    fn bound_table() {
        // (entries, max_turns, expected)
        let cases: Vec<(Vec<TranscriptEntry>, usize, Vec<&str>)> = vec![
            (vec![], 24, vec![]),
            (vec![e(0, user("task"))], 0, vec!["0:task"]),
            // Parallel calls in one turn, outputs in the next: all pairs stay.
            (
                vec![
                    e(0, user("task")),
                    e(1, call("a", "t")),
                    e(1, call("b", "t")),
                    e(2, out("a", "")),
                    e(2, out("b", "")),
                    e(2, assistant("ok")),
                ],
                1,
                vec!["0:task", "1:call a", "1:call b", "2:out a", "2:out b", "2:ok"],
            ),
            // A call with no output anywhere (malformed) is dropped; so is an output with no call.
            (
                vec![e(0, user("task")), e(1, call("a", "t")), e(1, out("zz", "")), e(1, assistant("x"))],
                24,
                vec!["0:task", "1:x"],
            ),
            // An output before its call does not count as an answer.
            (vec![e(0, user("task")), e(1, out("a", "")), e(1, call("a", "t"))], 24, vec!["0:task"]),
            // Turn 0 input with its own call/output pair is kept whole.
            (
                vec![e(0, user("task")), e(0, call("u", "t")), e(0, out("u", "")), e(5, assistant("x"))],
                1,
                vec!["0:task", "0:call u", "0:out u", "5:x"],
            ),
            // Gaps in turn numbers: the window counts turns present.
            (
                vec![e(0, user("task")), e(3, assistant("a")), e(7, assistant("b")), e(9, assistant("c"))],
                2,
                vec!["0:task", "7:b", "9:c"],
            ),
        ];
        for (entries, max_turns, want) in cases {
            assert_eq!(texts(&bound_history(&entries, max_turns)), want, "{entries:?}");
        }
    }

    #[test]
    fn prepare_context_bounds_then_elides_without_touching_the_transcript() {
        let mut v = vec![e(0, user("task"))];
        for t in 1..=30u32 {
            let id = format!("b{t}");
            v.push(e(t, call(&id, "browser__snapshot")));
            v.push(e(t, out(&id, &format!("<dom {t}>"))));
        }
        let original = v.clone();
        let ctx = prepare_context(&v, DEFAULT_MAX_HISTORY);
        assert_eq!(v, original);
        // 30 turns: the window has moved one step (8) past the first 24.
        let kept = 30 - history_step(DEFAULT_MAX_HISTORY);
        assert_eq!(ctx.len(), 1 + 2 * kept);
        assert_eq!(ctx[0], user("task"));
        let outputs: Vec<&str> = ctx.iter().filter(|i| is_output(i)).map(|i| i["output"].as_str().unwrap()).collect();
        assert_eq!(outputs.len(), kept);
        assert!(outputs[..kept - 1].iter().all(|o| *o == BROWSER_PLACEHOLDER));
        assert_eq!(outputs[kept - 1], "<dom 30>");
    }

    /// Random transcripts: turns of text, parallel calls answered in the same
    /// turn or the next, optional pairs in the input, and some noise orphans.
    fn transcript() -> impl Strategy<Value = Vec<TranscriptEntry>> {
        let turn = (any::<bool>(), 0usize..4, any::<bool>(), 0u8..10);
        (any::<bool>(), proptest::collection::vec(turn, 0..40)).prop_map(|(input_pair, turns)| {
            let mut v = vec![e(0, user("task"))];
            if input_pair {
                v.push(e(0, call("u0", "t")));
                v.push(e(0, out("u0", "")));
            }
            let mut deferred: Vec<String> = vec![];
            let n = turns.len() as u32;
            for (k, (text, calls, defer, noise)) in turns.into_iter().enumerate() {
                let t = k as u32 + 1;
                for id in deferred.drain(..) {
                    v.push(e(t, out(&id, "")));
                }
                if text {
                    v.push(e(t, assistant("x")));
                }
                let ids: Vec<String> = (0..calls).map(|i| format!("c{t}_{i}")).collect();
                for id in &ids {
                    v.push(e(t, call(id, if noise % 2 == 0 { "browser__s" } else { "s" })));
                }
                match noise {
                    0 => v.push(e(t, out(&format!("orphan{t}"), ""))),
                    1 => v.push(e(t, call(&format!("unanswered{t}"), "s"))),
                    _ => {}
                }
                if defer {
                    deferred = ids;
                } else {
                    for id in &ids {
                        v.push(e(t, out(id, "")));
                    }
                }
            }
            for id in deferred.drain(..) {
                v.push(e(n + 1, out(&id, "")));
            }
            v
        })
    }

    proptest! {
        #[test]
        fn no_orphans_after_bounding(v in transcript(), max_turns in 0usize..30) {
            let b = bound_history(&v, max_turns);
            // Every output has its call earlier; every call has an output later.
            for (i, x) in b.iter().enumerate() {
                if is_output(&x.item) {
                    let c = call_id(&x.item).unwrap();
                    prop_assert!(b[..i].iter().any(|y| is_call(&y.item) && call_id(&y.item) == Some(c)), "orphan output {c}");
                }
                if is_call(&x.item) {
                    let c = call_id(&x.item).unwrap();
                    prop_assert!(b[i + 1..].iter().any(|y| is_output(&y.item) && call_id(&y.item) == Some(c)), "orphan call {c}");
                }
            }
            // A subsequence of the transcript, in order.
            let mut it = v.iter();
            for x in &b {
                prop_assert!(it.any(|y| y == x), "not a subsequence");
            }
            // The task is always there, and messages of the window are never dropped.
            prop_assert_eq!(&b[0], &v[0]);
            let turns: BTreeSet<u32> = v.iter().map(|e| e.turn).filter(|&t| t > 0).collect();
            let window: BTreeSet<u32> = turns.iter().rev().take(max_turns).copied().collect();
            for x in &v {
                if !is_call(&x.item) && !is_output(&x.item) && (x.turn == 0 || window.contains(&x.turn)) {
                    prop_assert!(b.contains(x));
                }
            }
            // Nothing from before the window but calls pulled in by their outputs.
            for x in &b {
                if x.turn != 0 && !window.contains(&x.turn) {
                    prop_assert!(is_call(&x.item));
                }
            }
            // Every well-formed pair with its output in the window is kept.
            for x in &v {
                if is_output(&x.item) && window.contains(&x.turn) {
                    let c = call_id(&x.item).unwrap();
                    if v.iter().any(|y| is_call(&y.item) && call_id(&y.item) == Some(c)) {
                        prop_assert!(b.contains(x), "dropped the answer to {c}");
                    }
                }
            }
            // Elision then leaves at most one browser view, the newest.
            let ctx = prepare_context(&v, max_turns);
            let browser: HashSet<&str> = ctx.iter()
                .filter(|i| is_call(i) && i["name"].as_str().is_some_and(is_browser_tool))
                .filter_map(|i| call_id(i)).collect();
            let views: Vec<&Value> = ctx.iter()
                .filter(|i| is_output(i) && call_id(i).is_some_and(|c| browser.contains(c))).collect();
            if let Some((newest, older)) = views.split_last() {
                prop_assert_ne!(&newest["output"], BROWSER_PLACEHOLDER);
                prop_assert!(older.iter().all(|o| o["output"] == BROWSER_PLACEHOLDER));
            }
        }
    }
}
