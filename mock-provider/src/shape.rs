//! Provider shapes: which provider's rate-limit headers and retry hints the
//! mock speaks (`--headers`), and whether it limits at all (`--limits`). The
//! header values are plain functions of a bucket [`Snapshot`] and the wall
//! clock, so every shape's exact output is tested without a server.

use crate::duration::{ceil_ms, go_duration};
use crate::limits::{Level, Snapshot};
use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whose rate-limit headers the mock sends, and how a 429 says when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HeaderStyle {
    /// OpenAI: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets as
    /// Go durations); a 429 has `retry-after` (s) and `retry-after-ms`.
    #[default]
    #[value(name = "openai")]
    OpenAi,
    /// Anthropic: separate input and output token buckets, and
    /// `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-{limit,remaining,reset}`
    /// (resets as RFC 3339 instants); a 429 has `retry-after` (s) only.
    Anthropic,
    /// Azure OpenAI: only `x-ratelimit-remaining-{requests,tokens}`; a 429 has
    /// `retry-after` (s) and `retry-after-ms`.
    Azure,
    /// No rate-limit headers and no `retry-after`: a 429 says its delay only in
    /// the body (the message, and a Google-style `RetryInfo` detail).
    None,
}

impl HeaderStyle {
    /// Whether input and output tokens have buckets of their own (Anthropic's
    /// ITPM and OTPM) instead of one bucket of input plus output.
    pub fn splits_tokens(self) -> bool {
        self == Self::Anthropic
    }
}

impl std::fmt::Display for HeaderStyle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::OpenAi => "openai",
            Self::Anthropic => "anthropic",
            Self::Azure => "azure",
            Self::None => "none",
        })
    }
}

/// Whether the mock enforces rate limits at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LimitsMode {
    /// The buckets decide every admission.
    #[default]
    Enforced,
    /// No buckets: every request is admitted and no answer carries rate-limit
    /// headers, like a self-hosted vLLM, Ollama or TGI.
    None,
}

impl std::fmt::Display for LimitsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Enforced => "enforced",
            Self::None => "none",
        })
    }
}

/// The rate-limit headers of one answer (2xx or error) in `style`, describing
/// `snap`; `now` is the wall clock the Anthropic reset instants count from.
pub fn rate_headers(style: HeaderStyle, snap: &Snapshot, now: SystemTime) -> Vec<(String, String)> {
    let mut out = Vec::new();
    match style {
        HeaderStyle::OpenAi => {
            for (name, level) in [("requests", &snap.requests), ("tokens", &snap.tokens)] {
                out.push((format!("x-ratelimit-limit-{name}"), level.limit.to_string()));
                out.push((format!("x-ratelimit-remaining-{name}"), level.remaining.to_string()));
                out.push((format!("x-ratelimit-reset-{name}"), go_duration(ceil_ms(level.reset_us))));
            }
        }
        HeaderStyle::Azure => {
            out.push(("x-ratelimit-remaining-requests".into(), snap.requests.remaining.to_string()));
            out.push(("x-ratelimit-remaining-tokens".into(), snap.tokens.remaining.to_string()));
        }
        HeaderStyle::Anthropic => {
            let families: [(&str, Option<&Level>); 4] = [
                ("requests", Some(&snap.requests)),
                ("input-tokens", snap.input.as_ref()),
                ("output-tokens", snap.output.as_ref()),
                ("tokens", Some(&snap.tokens)),
            ];
            for (name, level) in families {
                let Some(level) = level else { continue };
                let reset = now + Duration::from_micros(level.reset_us);
                out.push((format!("anthropic-ratelimit-{name}-limit"), level.limit.to_string()));
                out.push((format!("anthropic-ratelimit-{name}-remaining"), level.remaining.to_string()));
                out.push((format!("anthropic-ratelimit-{name}-reset"), rfc3339_ms(reset)));
            }
        }
        HeaderStyle::None => {}
    }
    out
}

/// The headers of a 429 that asks for a wait of `wait_us`, in `style`. The
/// wait is rounded up, so a client that honours it is never early.
pub fn retry_headers(style: HeaderStyle, wait_us: u64) -> Vec<(String, String)> {
    let ms = ceil_ms(wait_us).max(1);
    let seconds = ("retry-after".to_string(), ms.div_ceil(1000).to_string());
    match style {
        HeaderStyle::OpenAi | HeaderStyle::Azure => vec![seconds, ("retry-after-ms".to_string(), ms.to_string())],
        HeaderStyle::Anthropic => vec![seconds],
        HeaderStyle::None => vec![],
    }
}

/// The `details` a headerless 429 carries so a client still learns the delay:
/// Google's `RetryInfo`, as Gemini's OpenAI-compatible errors have it.
pub fn retry_details(wait_ms: u64) -> Value {
    json!([{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay(wait_ms)}])
}

/// A protobuf JSON duration of whole milliseconds: `2s`, `1.500s`, `0.013s`
/// (seconds, with three decimals unless whole).
pub fn retry_delay(ms: u64) -> String {
    let (secs, frac) = (ms / 1000, ms % 1000);
    if frac == 0 {
        format!("{secs}s")
    } else {
        format!("{secs}.{frac:03}s")
    }
}

/// An RFC 3339 UTC instant with millisecond precision
/// (`2026-12-01T20:00:05.123Z`), rounded up to the millisecond so a reset is
/// never reported earlier than it is.
pub fn rfc3339_ms(t: SystemTime) -> String {
    let us = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros();
    let ms = us.div_ceil(1000) as i128;
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    time::OffsetDateTime::from_unix_timestamp_nanos(ms * 1_000_000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        // Only a clock past the year 9999 gets here.
        .unwrap_or_else(|| "9999-12-31T23:59:59.999Z".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(limit: u64, remaining: u64, reset_ms: u64) -> Level {
        Level { limit, remaining, reset_us: reset_ms * 1000 }
    }

    fn shared() -> Snapshot {
        Snapshot { requests: level(600, 599, 100), tokens: level(40_000, 39_000, 1500), input: None, output: None }
    }

    fn names(headers: &[(String, String)]) -> Vec<&str> {
        headers.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn value<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
        &headers.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no {name}")).1
    }

    #[test]
    fn openai_sends_six_headers_with_go_resets() {
        let h = rate_headers(HeaderStyle::OpenAi, &shared(), UNIX_EPOCH);
        assert_eq!(h.len(), 6);
        assert_eq!(value(&h, "x-ratelimit-remaining-tokens"), "39000");
        assert_eq!(value(&h, "x-ratelimit-reset-tokens"), "1.5s");
        assert_eq!(value(&h, "x-ratelimit-reset-requests"), "100ms");
    }

    #[test]
    fn azure_sends_only_what_remains() {
        let h = rate_headers(HeaderStyle::Azure, &shared(), UNIX_EPOCH);
        assert_eq!(names(&h), ["x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens"]);
    }

    #[test]
    fn anthropic_sends_four_families_with_instants() {
        let input = level(1000, 900, 6000);
        let output = level(200, 50, 45_000);
        let snap = Snapshot { requests: level(50, 49, 1200), tokens: output, input: Some(input), output: Some(output) };
        let now = UNIX_EPOCH + Duration::from_millis(1_700_000_000_000);
        let h = rate_headers(HeaderStyle::Anthropic, &snap, now);
        assert_eq!(h.len(), 12);
        assert!(h.iter().all(|(n, _)| n.starts_with("anthropic-ratelimit-")));
        assert_eq!(value(&h, "anthropic-ratelimit-input-tokens-remaining"), "900");
        assert_eq!(value(&h, "anthropic-ratelimit-output-tokens-limit"), "200");
        assert_eq!(value(&h, "anthropic-ratelimit-tokens-remaining"), "50");
        // 1 700 000 000 s is 2023-11-14T22:13:20Z.
        assert_eq!(value(&h, "anthropic-ratelimit-requests-reset"), "2023-11-14T22:13:21.200Z");
        assert_eq!(value(&h, "anthropic-ratelimit-output-tokens-reset"), "2023-11-14T22:14:05.000Z");
    }

    #[test]
    fn none_sends_nothing() {
        assert!(rate_headers(HeaderStyle::None, &shared(), UNIX_EPOCH).is_empty());
        assert!(retry_headers(HeaderStyle::None, 1_500_000).is_empty());
    }

    #[test]
    fn retry_headers_round_up() {
        let h = retry_headers(HeaderStyle::OpenAi, 1_400_001);
        assert_eq!((value(&h, "retry-after"), value(&h, "retry-after-ms")), ("2", "1401"));
        assert_eq!(retry_headers(HeaderStyle::Azure, 1), retry_headers(HeaderStyle::OpenAi, 1));
        assert_eq!(names(&retry_headers(HeaderStyle::Anthropic, 10)), ["retry-after"]);
        assert_eq!(value(&retry_headers(HeaderStyle::Anthropic, 10), "retry-after"), "1", "at least one second");
    }

    #[test]
    fn retry_delays_are_protobuf_durations() {
        assert_eq!(retry_delay(1500), "1.500s");
        assert_eq!(retry_delay(2000), "2s");
        assert_eq!(retry_delay(13), "0.013s");
        assert_eq!(retry_details(1500)[0]["@type"], "type.googleapis.com/google.rpc.RetryInfo");
    }

    #[test]
    fn instants_round_up_to_the_millisecond() {
        assert_eq!(rfc3339_ms(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(UNIX_EPOCH + Duration::from_micros(1)), "1970-01-01T00:00:00.001Z");
        assert_eq!(rfc3339_ms(UNIX_EPOCH + Duration::from_millis(1_796_155_205_123)), "2026-12-01T20:00:05.123Z");
    }
}
