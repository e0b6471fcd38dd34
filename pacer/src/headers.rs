//! Reading a response's rate-limit headers into one snapshot.
//!
//! Read after every call, streamed or not, 2xx or 429 (docs/pacing.md). Three
//! families are understood, by case-insensitive header name:
//!
//! - OpenAI (and Azure, LiteLLM, Groq, …): `x-ratelimit-{limit,remaining,reset}-{tokens,requests}`,
//!   resets as Go durations (`6m0s`, `1.146s`).
//! - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`,
//!   resets as RFC 3339 instants.
//! - Server delays: `retry-after-ms`, `x-ms-retry-after-ms` (Azure), `retry-after`
//!   (seconds or an HTTP date).
//!
//! A value we cannot read leaves its field `None`: a malformed header is
//! ignored, never fatal. With no headers at all (vLLM, Ollama) the snapshot is
//! empty and the pacer falls back to configured limits.

use serde::{Deserialize, Serialize};

use super::backoff::DelaySource;
use super::bucket::Observation;
use super::durations::{parse_millis, parse_reset_ms, parse_retry_after_ms};
use crate::Millis;

/// Everything a response's headers say about rate limits, relative to the
/// `now_ms` they were read at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderSnapshot {
    /// The token bucket.
    pub tokens: Observation,
    /// The request bucket.
    pub requests: Observation,
    /// A separate input token bucket (`anthropic-ratelimit-input-tokens-*`).
    #[serde(default)]
    pub input_tokens: Observation,
    /// A separate output token bucket (`anthropic-ratelimit-output-tokens-*`).
    #[serde(default)]
    pub output_tokens: Observation,
    /// The server's own delay: the first valid of `retry-after-ms`,
    /// `x-ms-retry-after-ms`, `retry-after` (the delay sources, in this order).
    pub retry_after_ms: Option<u64>,
    /// Which header `retry_after_ms` came from (for `turn.retry` and logs);
    /// `Some` exactly when `retry_after_ms` is.
    pub retry_after_source: Option<DelaySource>,
}

/// Which field of a limit family a header sets.
#[derive(Clone, Copy)]
enum Field {
    Limit,
    Remaining,
    Reset,
}

/// The families of limit headers, in the order they are collected.
#[derive(Clone, Copy)]
enum Family {
    OpenAiTokens,
    OpenAiRequests,
    AnthropicTokens,
    AnthropicInput,
    AnthropicOutput,
    AnthropicRequests,
}
const FAMILIES: usize = 6;

/// `(family, field)` for a lower-cased limit header name.
fn limit_header(name: &str) -> Option<(Family, Field)> {
    if let Some(rest) = name.strip_prefix("x-ratelimit-") {
        let (field, bucket) = rest.split_once('-')?;
        let family = match bucket {
            "tokens" => Family::OpenAiTokens,
            "requests" => Family::OpenAiRequests,
            _ => return None,
        };
        return Some((family, field_named(field)?));
    }
    let rest = name.strip_prefix("anthropic-ratelimit-")?;
    let (bucket, field) = rest.rsplit_once('-')?;
    let family = match bucket {
        "tokens" => Family::AnthropicTokens,
        "input-tokens" => Family::AnthropicInput,
        "output-tokens" => Family::AnthropicOutput,
        "requests" => Family::AnthropicRequests,
        _ => return None,
    };
    Some((family, field_named(field)?))
}

fn field_named(field: &str) -> Option<Field> {
    Some(match field {
        "limit" => Field::Limit,
        "remaining" => Field::Remaining,
        "reset" => Field::Reset,
        _ => return None,
    })
}

impl HeaderSnapshot {
    /// Reads the rate-limit headers of one response. Header names are matched
    /// case-insensitively; unknown headers are skipped. When a header comes
    /// twice, its first readable value counts. Resets and dates are turned into
    /// milliseconds from `now_ms`.
    pub fn from_headers<'a, I: IntoIterator<Item = (&'a str, &'a str)>>(headers: I, now_ms: Millis) -> Self {
        let mut families = [Observation::default(); FAMILIES];
        // retry-after-ms, x-ms-retry-after-ms, retry-after, in that order.
        let mut delays: [Option<u64>; 3] = [None; 3];

        for (name, value) in headers {
            let name = name.trim().to_ascii_lowercase();
            let delay_slot = match name.as_str() {
                "retry-after-ms" => Some((0, parse_millis(value))),
                "x-ms-retry-after-ms" => Some((1, parse_millis(value))),
                "retry-after" => Some((2, parse_retry_after_ms(value, now_ms))),
                _ => None,
            };
            if let Some((slot, parsed)) = delay_slot {
                // Azure's `-1` (and any unreadable value) parses to None and so
                // falls through to the next source instead of meaning "now".
                delays[slot] = delays[slot].or(parsed);
                continue;
            }
            let Some((family, field)) = limit_header(&name) else { continue };
            let snap = &mut families[family as usize];
            match field {
                Field::Limit => snap.limit = snap.limit.or_else(|| parse_count(value)),
                Field::Remaining => snap.remaining = snap.remaining.or_else(|| parse_count(value)),
                Field::Reset => snap.reset_ms = snap.reset_ms.or_else(|| parse_reset_ms(value, now_ms)),
            }
        }

        let family = |f: Family| Some(families[f as usize]).filter(|s| !s.is_empty());
        // A response that carries both OpenAI-style and Anthropic headers (a
        // proxy) is read as OpenAI: one family is used whole, never mixed field
        // by field, so limit, remaining and reset always describe one bucket.
        let openai = family(Family::OpenAiTokens).is_some() || family(Family::OpenAiRequests).is_some();
        // Anthropic's separate input and output buckets are paced each on its
        // own; its combined `tokens-*` family then only repeats the scarcer of
        // the two (a bucket whose limit changes between answers), and is read
        // only where the separate ones are missing.
        let (input_tokens, output_tokens) =
            if openai { (None, None) } else { (family(Family::AnthropicInput), family(Family::AnthropicOutput)) };
        let split = input_tokens.is_some() || output_tokens.is_some();
        let tokens = family(Family::OpenAiTokens)
            .or_else(|| if split { None } else { family(Family::AnthropicTokens) })
            .unwrap_or_default();
        let requests = family(Family::OpenAiRequests).or_else(|| family(Family::AnthropicRequests)).unwrap_or_default();

        let sources = [DelaySource::RetryAfterMs, DelaySource::MsRetryAfterMs, DelaySource::RetryAfter];
        let retry = delays.iter().zip(sources).find_map(|(d, source)| d.map(|ms| (ms, source)));

        Self {
            tokens,
            requests,
            input_tokens: input_tokens.unwrap_or_default(),
            output_tokens: output_tokens.unwrap_or_default(),
            retry_after_ms: retry.map(|r| r.0),
            retry_after_source: retry.map(|r| r.1),
        }
    }

    /// No rate-limit header was read (vLLM, Ollama, or only unreadable values).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A count header (`limit`, `remaining`): a plain non-negative integer.
fn parse_count(value: &str) -> Option<u64> {
    value.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 2026-11-30T10:00:00Z in ms since the epoch.
    const NOW: Millis = 1_796_032_800_000;

    fn read(headers: &[(&str, &str)]) -> HeaderSnapshot {
        HeaderSnapshot::from_headers(headers.iter().copied(), NOW)
    }

    fn limit(limit: u64, remaining: u64, reset_ms: u64) -> Observation {
        Observation { limit: Some(limit), remaining: Some(remaining), reset_ms: Some(reset_ms) }
    }

    #[test]
    fn openai_headers() {
        let snap = read(&[
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-limit-tokens", "30000000"),
            ("x-ratelimit-remaining-requests", "9999"),
            ("x-ratelimit-remaining-tokens", "29999568"),
            ("x-ratelimit-reset-requests", "6ms"),
            ("x-ratelimit-reset-tokens", "1.146s"),
            ("content-type", "text/event-stream"),
        ]);
        assert_eq!(snap.tokens, limit(30_000_000, 29_999_568, 1_146));
        assert_eq!(snap.requests, limit(10_000, 9_999, 6));
        assert_eq!((snap.retry_after_ms, snap.retry_after_source), (None, None));
        assert!(!snap.is_empty());
    }

    #[test]
    fn header_names_are_case_insensitive() {
        let snap = read(&[
            ("X-RateLimit-Remaining-Tokens", "5"),
            ("X-RATELIMIT-RESET-TOKENS", "6m0s"),
            ("Retry-After", "7"),
            ("Anthropic-RateLimit-Requests-Limit", "50"),
        ]);
        assert_eq!(snap.tokens.remaining, Some(5));
        assert_eq!(snap.tokens.reset_ms, Some(360_000));
        assert_eq!(snap.retry_after_ms, Some(7_000));
        assert_eq!(snap.requests.limit, Some(50));
    }

    #[test]
    fn unreadable_values_are_ignored_not_fatal() {
        let snap = read(&[
            ("x-ratelimit-limit-tokens", "lots"),
            ("x-ratelimit-remaining-tokens", "-5"),
            ("x-ratelimit-reset-tokens", "soon"),
            ("x-ratelimit-limit-requests", "100"),
            ("x-ratelimit-remaining-requests", "1.5"),
            ("x-ratelimit-reset-requests", "1d"),
            ("retry-after", "later"),
            ("x-ratelimit-frobs-tokens", "1"),
            ("anthropic-ratelimit-widgets-limit", "1"),
        ]);
        assert_eq!(snap.tokens, Observation::default());
        assert_eq!(snap.requests, Observation { limit: Some(100), ..Default::default() });
        assert_eq!(snap.retry_after_ms, None);
    }

    #[test]
    fn first_readable_value_of_a_repeated_header_counts() {
        let snap = read(&[
            ("x-ratelimit-remaining-tokens", "garbage"),
            ("x-ratelimit-remaining-tokens", "100"),
            ("x-ratelimit-remaining-tokens", "200"),
        ]);
        assert_eq!(snap.tokens.remaining, Some(100));
    }

    #[test]
    fn no_headers_is_an_empty_snapshot() {
        assert!(read(&[]).is_empty());
        assert!(read(&[("content-type", "application/json"), ("server", "vllm")]).is_empty());
        assert!(read(&[("x-ratelimit-remaining-tokens", "n/a"), ("retry-after-ms", "-1")]).is_empty());
    }

    #[test]
    fn retry_after_sources_in_spec_order() {
        use DelaySource::*;
        type Headers<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Headers<'_>, Option<(u64, DelaySource)>)] = &[
            (
                &[("retry-after", "20"), ("x-ms-retry-after-ms", "1500"), ("retry-after-ms", "1200")],
                Some((1_200, RetryAfterMs)),
            ),
            (&[("retry-after", "20"), ("x-ms-retry-after-ms", "1500")], Some((1_500, MsRetryAfterMs))),
            (&[("retry-after", "20")], Some((20_000, RetryAfter))),
            (&[("retry-after", "1.5")], Some((1_500, RetryAfter))),
            (&[("retry-after", "Mon, 30 Nov 2026 10:00:07 GMT")], Some((7_000, RetryAfter))),
            (&[("retry-after", "Mon, 30 Nov 2026 09:00:00 GMT")], Some((0, RetryAfter))),
            (&[("retry-after-ms", "1500.2")], Some((1_501, RetryAfterMs))),
            // Azure's -1 is ignored: the next source counts...
            (
                &[("retry-after-ms", "-1"), ("x-ms-retry-after-ms", "-1"), ("retry-after", "4")],
                Some((4_000, RetryAfter)),
            ),
            (&[("retry-after-ms", "-1"), ("x-ms-retry-after-ms", "800")], Some((800, MsRetryAfterMs))),
            // ...and when every one is -1, there is no server delay at all.
            (&[("retry-after-ms", "-1"), ("x-ms-retry-after-ms", "-1"), ("retry-after", "-1")], None),
            (&[], None),
        ];
        for (headers, want) in cases {
            let snap = read(headers);
            assert_eq!(snap.retry_after_ms.zip(snap.retry_after_source), *want, "{headers:?}");
            assert_eq!(snap.retry_after_ms.is_some(), snap.retry_after_source.is_some());
        }
    }

    #[test]
    fn azure_minus_one_limits_are_ignored() {
        let snap = read(&[("x-ratelimit-remaining-tokens", "-1"), ("x-ratelimit-remaining-requests", "9")]);
        assert_eq!(snap.tokens.remaining, None);
        assert_eq!(snap.requests.remaining, Some(9));
    }

    #[test]
    fn anthropic_headers_with_rfc3339_resets() {
        let snap = read(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2026-11-30T10:00:01Z"),
            ("anthropic-ratelimit-tokens-limit", "80000"),
            ("anthropic-ratelimit-tokens-remaining", "1000"),
            ("anthropic-ratelimit-tokens-reset", "2026-11-30T10:00:05.250Z"),
        ]);
        // Without separate input and output families the combined one is the bucket.
        assert_eq!(snap.tokens, limit(80_000, 1_000, 5_250));
        assert_eq!(snap.requests, limit(50, 49, 1_000));
        assert!(snap.input_tokens.is_empty() && snap.output_tokens.is_empty());
    }

    #[test]
    fn anthropic_input_and_output_are_separate_buckets() {
        let snap = read(&[
            ("anthropic-ratelimit-input-tokens-limit", "400000"),
            ("anthropic-ratelimit-input-tokens-remaining", "40000"),
            ("anthropic-ratelimit-input-tokens-reset", "2026-11-30T10:00:06Z"),
            ("anthropic-ratelimit-output-tokens-limit", "80000"),
            ("anthropic-ratelimit-output-tokens-remaining", "20000"),
            ("anthropic-ratelimit-output-tokens-reset", "2026-11-30T10:00:02Z"),
            // The combined family repeats the scarcer of the two: not a bucket of its own.
            ("anthropic-ratelimit-tokens-limit", "400000"),
            ("anthropic-ratelimit-tokens-remaining", "40000"),
            ("anthropic-ratelimit-tokens-reset", "2026-11-30T10:00:06Z"),
        ]);
        assert_eq!(snap.input_tokens, limit(400_000, 40_000, 6_000));
        assert_eq!(snap.output_tokens, limit(80_000, 20_000, 2_000));
        assert!(snap.tokens.is_empty(), "{:?}", snap.tokens);
        // One of them alone is still read as a separate bucket.
        let output = read(&[("anthropic-ratelimit-output-tokens-remaining", "7")]);
        assert_eq!(output.output_tokens.remaining, Some(7));
        assert!(output.tokens.is_empty());
    }

    #[test]
    fn openai_family_wins_over_anthropic_when_a_proxy_sends_both() {
        let snap = read(&[("anthropic-ratelimit-tokens-remaining", "1"), ("x-ratelimit-remaining-tokens", "500")]);
        assert_eq!(snap.tokens, Observation { remaining: Some(500), ..Default::default() });
    }

    #[test]
    fn round_trips_through_json() {
        let snap = read(&[("x-ratelimit-remaining-tokens", "5"), ("retry-after-ms", "10")]);
        let back: HeaderSnapshot = serde_json::from_str(&serde_json::to_string(&snap).unwrap()).unwrap();
        assert_eq!(back, snap);
    }

    proptest! {
        #[test]
        fn never_panics(headers in proptest::collection::vec((".*", ".*"), 0..8), now in any::<i64>()) {
            let _ = HeaderSnapshot::from_headers(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())), now);
        }

        #[test]
        fn never_panics_on_known_names(
            values in proptest::collection::vec((0usize..12, ".*"), 0..12),
            now in any::<i64>(),
        ) {
            const NAMES: [&str; 12] = [
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
                "x-ratelimit-reset-requests", "retry-after-ms", "x-ms-retry-after-ms", "retry-after",
                "anthropic-ratelimit-tokens-reset", "anthropic-ratelimit-input-tokens-remaining",
                "anthropic-ratelimit-output-tokens-limit", "anthropic-ratelimit-requests-reset",
                "anthropic-ratelimit-output-tokens-remaining",
            ];
            let snap = HeaderSnapshot::from_headers(values.iter().map(|(i, v)| (NAMES[*i], v.as_str())), now);
            prop_assert_eq!(snap.retry_after_ms.is_some(), snap.retry_after_source.is_some());
        }

        /// Whatever the order of the headers, the delay comes from the
        /// highest-priority source present.
        #[test]
        fn delay_priority_ignores_header_order(a in 0u64..100_000, b in 0u64..100_000, c in 0u64..1_000, order in Just([0usize, 1, 2]).prop_shuffle()) {
            let (a_s, b_s, c_s) = (a.to_string(), b.to_string(), c.to_string());
            let all = [("retry-after", c_s.as_str()), ("x-ms-retry-after-ms", b_s.as_str()), ("retry-after-ms", a_s.as_str())];
            let headers: Vec<_> = order.iter().map(|&i| all[i]).collect();
            let snap = read(&headers);
            prop_assert_eq!(snap.retry_after_ms, Some(a));
            prop_assert_eq!(snap.retry_after_source, Some(DelaySource::RetryAfterMs));
        }
    }
}
