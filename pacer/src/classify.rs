//! Classifying a failed provider call: rate limit, quota, too large, transient, terminal.
//!
//! A failure is classified once, here, into a [`FailureKind`] that says whether
//! the call may be retried and, if the run fails, which `error.kind` it reports.
//! The order of the rules is the order of [`classify`]'s body:
//!
//! 1. stops that no wait can cure, whatever the status: `insufficient_quota`
//!    ([`FailureKind::Quota`]), a spend or billing hard limit
//!    ([`FailureKind::SpendLimit`]), a request larger than the whole limit
//!    ([`FailureKind::RequestTooLarge`]). Each costs exactly one request; an
//!    input longer than the model's context window
//!    ([`FailureKind::ContextOverflow`]), which the worker trims by its excess
//!    ([`context_excess`]) and sends once more, never again;
//! 2. rate limits: HTTP 429, a rate-limit code, or rate-limit wording in the
//!    text ([`FailureKind::RateLimited`]);
//! 3. transient failures: timeouts, connection resets, 408, 409, 5xx, 529
//!    ([`FailureKind::Transient`]);
//! 4. every other 4xx is terminal ([`FailureKind::Terminal`]);
//! 5. no status and no transport error (an error event inside a 200 stream):
//!    transient only on positive evidence in the code or text, else terminal.

use std::sync::LazyLock;

use regex::Regex;

use super::durations::parse_duration_ms;

/// What kind of failure a provider call ended in; decides retry-or-stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// A rate limit (429, or rate-limit wording): retried on the ladder.
    RateLimited,
    /// `insufficient_quota`: a billing stop, not a rate limit. Never retried.
    Quota,
    /// The request is larger than the whole limit ("Limit L, Requested R",
    /// R > L) or than the provider accepts at all: it can never pass. Never retried.
    RequestTooLarge,
    /// A spend limit or billing hard limit was reached. Never retried.
    SpendLimit,
    /// The input does not fit the model's context window (OpenAI's
    /// `context_length_exceeded`, Anthropic's "prompt is too long"). Not
    /// retried as it was: the worker trims it and sends it once more.
    ContextOverflow,
    /// A server-side or network failure (408, 409, 5xx, 529, timeouts,
    /// connection resets): retried on the same ladder as rate limits.
    Transient,
    /// Any other client error (400, 401, 403, 404, 422, …): the same request
    /// would fail the same way. Never retried.
    Terminal,
}

impl FailureKind {
    /// Whether the call may be sent again (after a delay from the ladder).
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::RateLimited | Self::Transient)
    }
}

/// A failure below HTTP: the call never got (all of) an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// Connect, read or overall timeout.
    Timeout,
    /// The connection was reset or closed mid-call.
    ConnectionReset,
    /// Any other network failure (refused, DNS, TLS, a broken body).
    Other,
}

/// What the caller knows about a failed call. Every field is optional but the
/// message: an error event inside a 200 stream has a code but maybe no status
/// worth reading, a timeout has neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailedCall<'a> {
    /// The HTTP status, when an answer came (200 for an error inside a stream
    /// is fine, so is `None`).
    pub status: Option<u16>,
    /// The error body's `code` (`rate_limit_exceeded`, `insufficient_quota`, …).
    pub code: Option<&'a str>,
    /// The error body's `type` (`tokens`, `rate_limit_error`, `overloaded_error`, …).
    pub error_type: Option<&'a str>,
    /// The error message (or the transport error's text).
    pub message: &'a str,
    /// Set when the failure was below HTTP.
    pub transport: Option<Transport>,
}

/// Rate-limit wording. Short tokens are matched on word boundaries, because a
/// bare "429" used to match request ids and byte counts, "sending an ordinary
/// failure through six exponential backoffs (about a minute) before producing
/// the same error". `429` must not touch a letter, digit, `_` or
/// `-` on either side, nor be part of a decimal: `req_4291ab`, `req-429-x`,
/// `429.5` and `14290 bytes` are not rate limits; `429 Too Many Requests` and
/// `Error code: 429 - {…}` are.
static RATE_LIMIT_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?ix)
          (?:^|[^\w.-]) 429 (?:$|[^\w.-]|\.(?:$|\D))   # not 1.429, not 429.5; `429.` ends a sentence
        | \b rate[\s_-]?limit (?:s|ed|ing)? \b      # Rate limit reached / rate-limited / ratelimit
        | \b rate_limit_(?:exceeded|error) \b       # the codes, when quoted in a message
        | \b too[\s_]many[\s_]requests \b
        | \b resource[\s_]exhausted \b              # Google's RESOURCE_EXHAUSTED
        | \b resource\s+has\s+been\s+exhausted \b
        ",
    )
    .expect("valid regex")
});

/// `insufficient_quota` wording, for when only the message survived.
static QUOTA_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\binsufficient_quota\b|\bexceeded\s+your\s+current\s+quota\b").expect("valid regex")
});

/// Spend-limit wording: Anthropic's `enforced_spend_limit_reached`, OpenAI's
/// billing hard limit.
static SPEND_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\benforced_spend_limit_reached\b|\bspend(?:ing)?[\s_]limit\b|\bbilling[\s_]hard[\s_]limit\b|\bhard[\s_]limit\s+(?:has\s+been\s+)?reached\b",
    )
    .expect("valid regex")
});

/// Server-side trouble named inside a 200 stream or a status-less error.
static TRANSIENT_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\bserver[\s_]error\b|\binternal[\s_](?:server[\s_])?error\b|\boverloaded(?:_error)?\b|\bservice[\s_]unavailable\b|\bbad[\s_]gateway\b|\btimed[\s_]out\b|\btimeout\b|\bconnection\s+(?:reset|closed)\b|\bretry\s+your\s+request\b",
    )
    .expect("valid regex")
});

/// "Limit L, Requested R", optionally with "Used U," between (the rate-limit
/// message's shape). Numbers may carry thousands separators.
static TOO_LARGE: LazyLock<Regex> = LazyLock::new(|| {
    const NUM: &str = r"(\d{1,3}(?:,\d{3})+|\d+)";
    Regex::new(&format!(
        r"(?i)\blimit:?\s*{NUM}\s*,\s*(?:used:?\s*(?:\d{{1,3}}(?:,\d{{3}})+|\d+)\s*,\s*)?requested:?\s*{NUM}\b"
    ))
    .expect("valid regex")
});

/// "Please try again in 1.146s", "try again in 84ms", "retry after 6 seconds".
static TRY_AGAIN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?ix)
          \b (?:try\s+again|retry) \s+ (?:in|after) \s+
          (?:
              (?P<go> (?: (?:\d+(?:\.\d*)?|\.\d+) (?:ns|us|µs|μs|ms|s|m|h) )+ ) \b
            | (?P<num> \d+(?:\.\d+)? ) \s* (?P<word> milliseconds?|msecs?|seconds?|secs?|minutes?|mins?|hours?|hrs?)? \b
          )",
    )
    .expect("valid regex")
});

/// Context-window wording: OpenAI's Chat Completions ("This model's maximum
/// context length is N tokens. However, your messages resulted in M
/// tokens"), Responses ("Your input exceeds the context window of this
/// model"), Anthropic ("prompt is too long: M tokens > N maximum"), and the
/// servers that copy them (vLLM: "… maximum context length is N tokens.
/// However, you requested M tokens …").
static CONTEXT_TEXT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\bmaximum\s+context\s+length\s+is\b|\bprompt\s+is\s+too\s+long\b|\bexceeds\s+the\s+context\s+window\b|\bcontext[\s_]length[\s_]exceeded\b|\binput\s+is\s+too\s+long\s+for\s+(?:the\s+)?requested\s+model\b",
    )
    .expect("valid regex")
});

/// The two numbers of a context-length message: "maximum context length is N
/// tokens … resulted in / requested M tokens", or "M tokens > N maximum".
static CONTEXT_NUMBERS: LazyLock<Regex> = LazyLock::new(|| {
    const NUM: &str = r"(\d{1,3}(?:,\d{3})+|\d+)";
    Regex::new(&format!(
        r"(?is)maximum\s+context\s+length\s+is\s+{NUM}\s+tokens.*?(?:resulted\s+in|requested)\s+{NUM}\s+tokens|{NUM}\s+tokens\s*>\s*{NUM}\s+maximum"
    ))
    .expect("valid regex")
});

/// What a context-length error says of the refused input, when it says:
/// the provider's count of it and the window it did not fit, in that order.
pub fn context_excess(message: &str) -> Option<(u64, u64)> {
    let caps = CONTEXT_NUMBERS.captures(message)?;
    let num = |i: usize| caps.get(i).and_then(|m| m.as_str().replace(',', "").parse::<u64>().ok());
    match (num(1), num(2)) {
        (Some(limit), Some(counted)) => Some((counted, limit)),
        _ => Some((num(3)?, num(4)?)),
    }
}

/// Codes and types that name a rate limit outright.
const RATE_LIMIT_CODES: &[&str] =
    &["rate_limit_exceeded", "rate_limit_error", "too_many_requests", "resource_exhausted"];
/// Codes and types that name a server-side failure (in a 200 stream, say).
const TRANSIENT_CODES: &[&str] =
    &["server_error", "internal_error", "api_error", "overloaded_error", "service_unavailable", "timeout"];
/// Codes and types of a spend or billing hard limit.
const SPEND_CODES: &[&str] = &["enforced_spend_limit_reached", "billing_hard_limit_reached"];

/// Classifies a failed call (the reactive layer: docs/pacing.md, "Two layers"). See the module doc
/// for the order of the rules.
pub fn classify(call: &FailedCall<'_>) -> FailureKind {
    let code_is = |names: &[&str]| {
        [call.code, call.error_type]
            .into_iter()
            .flatten()
            .any(|c| names.iter().any(|n| c.trim().eq_ignore_ascii_case(n)))
    };
    let text = call.message;

    // 1. No wait cures these, so they win over the status: a 429 whose code is
    //    `insufficient_quota` is a billing stop, and retrying it six times only
    //    spends five more requests before the same answer.
    if code_is(&["insufficient_quota"]) || QUOTA_TEXT.is_match(text) {
        return FailureKind::Quota;
    }
    if code_is(SPEND_CODES) || SPEND_TEXT.is_match(text) {
        return FailureKind::SpendLimit;
    }
    if code_is(&["request_too_large"])
        || call.status == Some(413)
        || too_large(text).is_some_and(|(limit, requested)| requested > limit)
    {
        return FailureKind::RequestTooLarge;
    }
    if code_is(&["context_length_exceeded"]) || CONTEXT_TEXT.is_match(text) {
        return FailureKind::ContextOverflow;
    }

    // 2. Rate limits. Wording counts whatever the status: an error event inside
    //    a 200 stream (`rate_limit_exceeded`) is a rate limit, and so is a proxy
    //    that reports one as 400/403/503.
    if call.status == Some(429) || code_is(RATE_LIMIT_CODES) || RATE_LIMIT_TEXT.is_match(text) {
        return FailureKind::RateLimited;
    }

    // 3. Transient: below HTTP, or a status the SDKs retry.
    match call.transport {
        // `Other` (refused, DNS, TLS, a broken body) costs no provider request
        // to retry, and a provider that is restarting looks exactly like this.
        Some(Transport::Timeout | Transport::ConnectionReset | Transport::Other) => return FailureKind::Transient,
        None => {}
    }
    match call.status {
        // 529 is Anthropic's `overloaded_error`; 5xx includes it, named for the reader.
        Some(408 | 409 | 529) | Some(500..=599) => FailureKind::Transient,
        // 4. Every other 4xx: the same request fails the same way.
        Some(400..=499) => FailureKind::Terminal,
        // 5. No usable status (None, or an error event inside a 2xx stream).
        //    Transient only on positive evidence: an unknown in-band error after
        //    the provider accepted the request is most often about the request
        //    itself (invalid prompt, content filter), and re-sending a whole turn
        //    to meet it again costs requests and tokens for nothing.
        _ if code_is(TRANSIENT_CODES) || TRANSIENT_TEXT.is_match(text) => FailureKind::Transient,
        _ => FailureKind::Terminal,
    }
}

/// The "try again in …" hint of a rate-limit message, in ms rounded up:
/// `Please try again in 1.146s` → 1146, `try again in 84ms` → 84, `in 2m0s`
/// → 120 000, `retry after 6 seconds` (Azure) → 6000. The first hint wins.
pub fn try_again_hint_ms(message: &str) -> Option<u64> {
    let caps = TRY_AGAIN.captures(message)?;
    if let Some(go) = caps.name("go") {
        // The regex is case-insensitive; Go units are lower case.
        return parse_duration_ms(&go.as_str().to_lowercase());
    }
    let num = caps.name("num")?.as_str();
    let word = caps.name("word").map(|w| w.as_str().to_ascii_lowercase());
    // A bare number is seconds ("try again in 20"), but not when a word we do
    // not know follows it ("in 5 fortnights"): better no hint than a wrong one.
    let after = message[caps.get(0)?.end()..].trim_start();
    if word.is_none() && after.starts_with(char::is_alphabetic) {
        return None;
    }
    let unit = match word.as_deref() {
        None => "s",
        Some(w) if w.starts_with("ms") || w.starts_with("milli") => "ms",
        Some(w) if w.starts_with("s") => "s",
        Some(w) if w.starts_with("min") => "m",
        Some(w) if w.starts_with("h") => "h",
        Some(_) => return None,
    };
    parse_duration_ms(&format!("{num}{unit}"))
}

/// The `(limit, requested)` pair of a "… Limit L, Requested R" message (also
/// "Limit L, Used U, Requested R"); numbers may carry thousands separators.
/// The caller compares: R > L means the request can never fit.
pub fn too_large(message: &str) -> Option<(u64, u64)> {
    let caps = TOO_LARGE.captures(message)?;
    let number = |i: usize| caps.get(i)?.as_str().replace(',', "").parse::<u64>().ok();
    Some((number(1)?, number(2)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn call(status: Option<u16>, code: Option<&'static str>, message: &'static str) -> FailedCall<'static> {
        FailedCall { status, code, message, ..FailedCall::default() }
    }

    use FailureKind::*;

    #[test]
    fn rate_limits() {
        let cases: &[(FailedCall<'_>, &str)] = &[
            (call(Some(429), None, ""), "a bare 429"),
            (call(Some(429), Some("rate_limit_exceeded"), "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 25000, Requested 8000. Please try again in 6.1s."), "OpenAI 429"),
            (call(None, None, "429 Too Many Requests"), "status line in the text"),
            (call(None, None, "Error code: 429 - {'error': {...}}"), "SDK-formatted text"),
            (call(None, None, "upstream answered HTTP 429."), "429 ending a sentence"),
            (call(None, None, "(429)"), "429 in brackets"),
            (call(None, None, "Rate limit reached for gpt-4o"), "wording"),
            (call(None, None, "rate_limit_exceeded"), "the code quoted in text"),
            (call(None, None, "too many requests, slow down"), "too many requests"),
            (call(None, None, "You are being rate-limited"), "rate-limited"),
            (call(Some(200), Some("rate_limit_exceeded"), "stream error"), "error event inside a 200 stream"),
            (call(None, Some("rate_limit_exceeded"), ""), "error event, no status"),
            (FailedCall { status: Some(429), error_type: Some("rate_limit_error"), message: "Number of request tokens has exceeded your per-minute rate limit", ..Default::default() }, "Anthropic 429"),
            (call(Some(503), None, "Rate limit exceeded upstream"), "wording beats a 5xx"),
            (call(Some(400), None, "Requests to the ChatCompletions_Create Operation have exceeded token rate limit of your current OpenAI S0 pricing tier."), "Azure wording on a 400"),
            (call(Some(429), None, "Resource has been exhausted (e.g. check quota)."), "Gemini's 429 is a rate limit, not a quota"),
            (call(None, Some("RESOURCE_EXHAUSTED"), ""), "Gemini code"),
            (call(Some(429), None, "Rate limit reached. Limit 30000, Requested 20000"), "R < L is only a rate limit"),
        ];
        for (c, why) in cases {
            assert_eq!(classify(c), RateLimited, "{why}: {c:?}");
        }
    }

    #[test]
    fn short_tokens_need_word_boundaries() {
        let cases: &[&str] = &[
            "invalid request id req_4291ab",
            "body too long: 14290 bytes",
            "request req-429-x failed validation",
            "trace 4429 missing",
            "value 429.5 is not an integer",
            "api version 1.429 is deprecated",
            "Invalid schema for function 'check_rate_limits_v2'",
            "'rate_limiter' is not a valid parameter",
        ];
        for &text in cases {
            assert_eq!(classify(&call(Some(400), None, text)), Terminal, "{text:?} is not a rate limit");
            assert_eq!(classify(&call(None, None, text)), Terminal, "{text:?} is not a rate limit (no status)");
        }
    }

    #[test]
    fn stops_that_no_wait_cures_win_over_the_status() {
        let cases: &[(FailedCall<'_>, FailureKind)] = &[
            (call(Some(429), Some("insufficient_quota"), "You exceeded your current quota, please check your plan and billing details."), Quota),
            (call(Some(429), Some("INSUFFICIENT_QUOTA"), ""), Quota),
            (call(Some(200), Some("insufficient_quota"), ""), Quota),
            (call(None, None, "You exceeded your current quota, please check your plan"), Quota),
            (call(Some(429), None, "insufficient_quota"), Quota),
            (FailedCall { status: Some(400), error_type: Some("invalid_request_error"), code: Some("enforced_spend_limit_reached"), message: "", transport: None }, SpendLimit),
            (call(Some(429), None, "You have reached your spend limit"), SpendLimit),
            (call(Some(400), Some("billing_hard_limit_reached"), "Billing hard limit has been reached"), SpendLimit),
            (call(Some(429), Some("rate_limit_exceeded"), "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 45000. The input or output tokens must be reduced in order to run successfully."), RequestTooLarge),
            (call(Some(400), None, "Request too large for gpt-4 on tokens per min: Limit 10,000, Requested 1,234,567."), RequestTooLarge),
            (call(None, None, "Limit 100, Used 0, Requested 101"), RequestTooLarge),
            (call(Some(413), None, "Payload Too Large"), RequestTooLarge),
            (FailedCall { status: Some(413), error_type: Some("request_too_large"), message: "Request exceeds the maximum size", ..Default::default() }, RequestTooLarge),
        ];
        for (c, want) in cases {
            assert_eq!(classify(c), *want, "{c:?}");
            assert!(!want.is_retryable());
        }
    }

    #[test]
    fn a_context_window_overflow_is_its_own_kind_and_says_by_how_much() {
        let chat = "This model's maximum context length is 128000 tokens. However, your messages resulted in 130,512 tokens. Please reduce the length of the messages.";
        let anthropic = "prompt is too long: 210000 tokens > 200000 maximum";
        let vllm = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4900 in the messages, 100 in the completion). Please reduce the length of the messages or completion.";
        let responses = "Your input exceeds the context window of this model. Please adjust your input and try again.";
        let cases: &[(FailedCall<'_>, Option<(u64, u64)>)] = &[
            (call(Some(400), Some("context_length_exceeded"), chat), Some((130_512, 128_000))),
            (
                FailedCall {
                    status: Some(400),
                    error_type: Some("invalid_request_error"),
                    message: anthropic,
                    ..Default::default()
                },
                Some((210_000, 200_000)),
            ),
            (call(Some(400), None, vllm), Some((5_000, 4_096))),
            (call(Some(400), Some("context_length_exceeded"), responses), None),
            (call(Some(200), Some("context_length_exceeded"), ""), None),
        ];
        for (c, excess) in cases {
            assert_eq!(classify(c), ContextOverflow, "{c:?}");
            assert!(!ContextOverflow.is_retryable(), "not on the ladder: the worker trims it once");
            assert_eq!(context_excess(c.message), *excess, "{}", c.message);
        }
        // A rate limit's "Request too large" is not about the window.
        assert_eq!(context_excess("Limit 30000, Requested 45000"), None);
    }

    #[test]
    fn transient_failures() {
        let cases: &[FailedCall<'_>] = &[
            call(Some(408), None, "Request Timeout"),
            call(Some(409), None, "Conflict"),
            call(Some(500), None, "Internal Server Error"),
            call(Some(502), None, ""),
            call(Some(503), None, "Service Unavailable"),
            call(Some(504), None, ""),
            FailedCall {
                status: Some(529),
                error_type: Some("overloaded_error"),
                message: "Overloaded",
                ..Default::default()
            },
            FailedCall { transport: Some(Transport::Timeout), ..Default::default() },
            FailedCall { transport: Some(Transport::ConnectionReset), ..Default::default() },
            FailedCall { transport: Some(Transport::Other), message: "connection refused", ..Default::default() },
            // A timeout while reading a 200's body.
            FailedCall { status: Some(200), transport: Some(Transport::Timeout), ..Default::default() },
            // In-band server errors, by code or by wording.
            call(Some(200), Some("server_error"), "The server had an error while processing your request."),
            call(None, None, "An error occurred while processing your request. You can retry your request."),
            call(None, None, "upstream connect error: connection reset by peer"),
            call(None, None, "Overloaded"),
        ];
        for c in cases {
            assert_eq!(classify(c), Transient, "{c:?}");
        }
    }

    #[test]
    fn terminal_failures() {
        let cases: &[FailedCall<'_>] = &[
            call(Some(401), Some("invalid_api_key"), "Incorrect API key provided"),
            call(Some(403), None, "Forbidden"),
            call(Some(404), Some("model_not_found"), "The model does not exist"),
            call(Some(422), None, "Unprocessable"),
            // No status, no transport error, nothing that says "server trouble".
            call(None, None, "Invalid prompt: flagged"),
            call(Some(200), Some("invalid_prompt"), "Invalid prompt"),
            call(None, None, ""),
        ];
        for c in cases {
            assert_eq!(classify(c), Terminal, "{c:?}");
        }
    }

    #[test]
    fn retryability() {
        let cases = [
            (RateLimited, true),
            (Quota, false),
            (RequestTooLarge, false),
            (SpendLimit, false),
            (Transient, true),
            (Terminal, false),
        ];
        for (kind, retryable) in cases {
            assert_eq!(kind.is_retryable(), retryable, "{kind:?}");
        }
        assert_eq!(serde_json::to_string(&RequestTooLarge).unwrap(), "\"request_too_large\"");
        assert_eq!(serde_json::from_str::<FailureKind>("\"rate_limited\"").unwrap(), RateLimited);
    }

    #[test]
    fn try_again_hints() {
        let cases: &[(&str, Option<u64>)] = &[
            ("Rate limit reached ... Please try again in 1.146s. Visit https://platform.openai.com", Some(1_146)),
            ("Please try again in 84ms.", Some(84)),
            ("try again in 2m0s", Some(120_000)),
            ("Try again in 20s", Some(20_000)),
            ("Please try again in 6m0s.", Some(360_000)),
            ("try again in 1.0001ms", Some(2)),
            ("Please retry after 6 seconds.", Some(6_000)),
            ("Try again in 1 second", Some(1_000)),
            ("try again in 500 milliseconds", Some(500)),
            ("try again in 2 minutes", Some(120_000)),
            ("try again in 1.5 secs", Some(1_500)),
            ("Please try again in 20", Some(20_000)),
            ("please TRY AGAIN IN 3S", Some(3_000)),
            ("first try again in 1s, then try again in 9s", Some(1_000)),
            ("Please try again later.", None),
            ("try again in a moment", None),
            ("try again in 5 fortnights", None),
            ("try again in 20abc", None),
            ("", None),
        ];
        for &(text, want) in cases {
            assert_eq!(try_again_hint_ms(text), want, "try_again_hint_ms({text:?})");
        }
    }

    #[test]
    fn too_large_pairs() {
        let cases: &[(&str, Option<(u64, u64)>)] = &[
            (
                "Request too large for gpt-4o on tokens per min (TPM): Limit 30000, Requested 45000.",
                Some((30_000, 45_000)),
            ),
            ("Limit 30,000, Requested 1,045,000.", Some((30_000, 1_045_000))),
            ("Limit: 10000, Requested: 9000", Some((10_000, 9_000))),
            ("Limit 30000, Used 25000, Requested 8000.", Some((30_000, 8_000))),
            ("Limit 30,000, Used 2,000, Requested 8,000.", Some((30_000, 8_000))),
            ("limit 5,requested 6", Some((5, 6))),
            ("Requested 45000, Limit 30000", None),
            ("Limit 30000.", None),
            ("", None),
        ];
        for &(text, want) in cases {
            assert_eq!(too_large(text), want, "too_large({text:?})");
        }
    }

    proptest! {
        #[test]
        fn never_panics(s in ".*", status in proptest::option::of(any::<u16>()), code in proptest::option::of(".*")) {
            let c = FailedCall { status, code: code.as_deref(), error_type: code.as_deref(), message: &s, transport: None };
            let _ = classify(&c);
            let _ = try_again_hint_ms(&s);
            let _ = too_large(&s);
        }

        /// A number with "429" inside a longer token is never a rate limit.
        #[test]
        fn embedded_429_is_not_a_rate_limit(pre in "[a-z0-9_]{0,6}", post in "[a-z0-9_]{0,6}") {
            prop_assume!(!(pre.is_empty() && post.is_empty()));
            let text = format!("failed: id {pre}429{post} was rejected");
            prop_assert_eq!(classify(&FailedCall { status: Some(400), message: &text, ..Default::default() }), Terminal, "{}", text);
        }

        /// The hint round-trips any h/m/s/ms value and rounds fractions up.
        #[test]
        fn hint_matches_the_duration(s in 0u64..3_600, frac in 0u64..1_000) {
            let text = format!("Please try again in {s}.{frac:03}s.");
            prop_assert_eq!(try_again_hint_ms(&text), Some(s * 1000 + frac));
        }

        /// `insufficient_quota` is a quota stop whatever the status and text.
        #[test]
        fn insufficient_quota_is_never_retried(status in proptest::option::of(any::<u16>()), text in ".*") {
            let c = FailedCall { status, code: Some("insufficient_quota"), message: &text, ..Default::default() };
            prop_assert_eq!(classify(&c), Quota);
        }
    }
}
