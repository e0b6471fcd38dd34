//! What a provider failure may say outside this process: a run's
//! `error.message`, its `turn.retry` event and the worker's log lines carry
//! [`public_message`] of what the provider (or the transport) said, never
//! the raw text. A provider's own words ("Rate limit reached for …") are
//! kept; URLs and anything that looks like a credential are not (OpenAI's
//! 401 quotes part of the key, a proxy's page may echo a header, a transport
//! error names the URL it failed to reach).

use std::sync::LazyLock;

use regex::{Captures, Regex};

/// Stands where a secret-looking part was.
const REDACTED: &str = "[redacted]";

/// URLs, whatever the scheme (`https://…`, `redis://:pw@…`); a sentence's
/// closing punctuation stays outside.
static URL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?i)\b[a-z][a-z0-9+.\-]*://[^\s"'<>()\[\]{}]*[^\s"'<>()\[\]{}.,;:!?]"#).expect("valid regex")
});

/// An `Authorization` value (`Bearer …`, `Basic …`).
static AUTH_SCHEME: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-*]+").expect("valid regex"));

/// `api_key=…`, `token: …`, `password=…`: the value after a credential's name.
static NAMED_SECRET: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"(?i)\b(api[_\-]?key|x-api-key|access[_\-]?token|auth[_\-]?token|token|secret|password|passwd|key)(\s*[=:]\s*)["']?[^\s"'&,;]+"#,
    )
    .expect("valid regex")
});

/// Keys by their well-known prefixes: OpenAI `sk-…` / `sk-proj-…` (also
/// as OpenAI's 401 shows it, `sk-proj-****abcd`), Anthropic `sk-ant-…`,
/// Stripe-style `pk_`/`rk_`, Google `AIza…`.
static PREFIXED_KEY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?:(?:sk|pk|rk)[-_][A-Za-z0-9_\-*]{6,}|AIza[A-Za-z0-9_\-]{20,})").expect("valid regex")
});

/// Runs of base64/hex characters long enough to be a token; judged in
/// [`looks_like_token`]. A hyphen or a dot ends a run, so model names
/// (`claude-3-5-sonnet-20241022`) and numbers are not runs.
static LONG_RUN: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"[A-Za-z0-9+/=_]{24,}").expect("valid regex"));

/// `raw` as it may be stored in a run, sent in an event or logged: URLs
/// become `[url]`, credential-looking text `[redacted]`, whitespace runs
/// one space; the rest is the provider's own message.
pub(crate) fn public_message(raw: &str) -> String {
    let text = URL.replace_all(raw, "[url]");
    let text = AUTH_SCHEME.replace_all(&text, |c: &Captures| format!("{} {REDACTED}", &c[1]));
    let text = NAMED_SECRET.replace_all(&text, |c: &Captures| format!("{}{}{REDACTED}", &c[1], &c[2]));
    let text = PREFIXED_KEY.replace_all(&text, REDACTED);
    let text = LONG_RUN.replace_all(
        &text,
        |c: &Captures| {
            if looks_like_token(&c[0]) {
                REDACTED.to_owned()
            } else {
                c[0].to_owned()
            }
        },
    );
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A run of 24+ base64/hex characters with both letters and digits: a key,
/// a token, a signature. Words joined by underscores (`rate_limit_exceeded`)
/// and long numbers are not.
fn looks_like_token(run: &str) -> bool {
    run.bytes().any(|b| b.is_ascii_digit()) && run.bytes().any(|b| b.is_ascii_alphabetic())
}

/// `url` for a log line: its scheme, host, port and path, without user,
/// password or query (where a key may ride).
pub(crate) fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string().trim_end_matches('/').to_owned()
        }
        Err(_) => "[unparsable url]".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_urls_and_tokens_never_pass_but_the_providers_words_do() {
        // OpenAI's 401, quoting part of the key and a URL.
        let m = public_message(
            "Incorrect API key provided: sk-proj-abc1********************************wxyz. \
             You can find your API key at https://platform.openai.com/account/api-keys.",
        );
        assert_eq!(m, "Incorrect API key provided: [redacted]. You can find your API key at [url].");

        // A rate limit's wording, numbers and model survive (the retry ladder reads them).
        let rate = "Rate limit reached for gpt-4o-mini-2024-07-18 in organization org-4Xz on tokens per min (TPM): \
                    Limit 200000, Used 199000, Requested 5000. Please try again in 1.5s. Visit https://x.y/z to learn more.";
        let m = public_message(rate);
        assert!(m.starts_with("Rate limit reached for gpt-4o-mini-2024-07-18 in organization org-4Xz"), "{m}");
        assert!(m.contains("Limit 200000, Used 199000, Requested 5000. Please try again in 1.5s."), "{m}");
        assert!(!m.contains("https://"), "{m}");
        let m = public_message("model claude-3-5-sonnet-20241022 is overloaded: rate_limit_exceeded_for_requests");
        assert_eq!(m, "model claude-3-5-sonnet-20241022 is overloaded: rate_limit_exceeded_for_requests");

        for (raw, secret) in [
            ("invalid x-api-key sk-ant-api03-Zx9_abcDEF-1234567890", "sk-ant"),
            ("upstream said: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc", "eyJhbGci"),
            ("auth failed (Basic dXNlcjpodW50ZXIy)", "dXNlcjpo"),
            ("bad request ?api_key=hunter2hunter2&x=1", "hunter2"),
            ("password: hunter2", "hunter2"),
            ("token=abc", "abc"),
            ("signature 3f1a9c0d2b7e4f6a8c1d3e5f7a9b0c2d4e6f8a1b mismatch", "3f1a9c0d"),
            ("key AIzaSyA-1234567890abcdefghijklmno is invalid", "AIzaSy"),
            ("session ZXhhbXBsZS10b2tlbi0xMjM0NTY3ODkw rejected", "ZXhhbXBs"),
            ("error sending request for url (http://user:pw@10.0.0.5:8000/v1/responses?key=k)", "10.0.0.5"),
            ("redis://:hunter2@cache:6379 refused", "hunter2"),
        ] {
            let m = public_message(raw);
            assert!(!m.contains(secret), "{raw:?} became {m:?}");
        }
        assert_eq!(public_message("  a\n\tb  "), "a b", "one line, trimmed");
        assert_eq!(public_message("Overloaded"), "Overloaded");
    }

    #[test]
    fn a_logged_url_has_no_user_password_or_query() {
        assert_eq!(shown_url("https://u:p@api.example.com/v1?key=k#f"), "https://api.example.com/v1");
        assert_eq!(shown_url("http://127.0.0.1:8000/v1/"), "http://127.0.0.1:8000/v1");
        assert_eq!(shown_url("not a url"), "[unparsable url]");
    }
}
