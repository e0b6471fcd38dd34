//! What the two stream decoders share: the decoded answer, an in-band error,
//! and reading OpenAI's error objects (HTTP bodies and stream events alike).

use serde_json::Value;

use super::{CallUsage, ToolCall};

/// A decoder's verdict after one event, or at the end of the stream.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// No terminal event yet.
    Pending,
    /// The answer is complete.
    Finished(Decoded),
    /// The provider said, inside the stream, that the call failed.
    Failed(ProviderErrorBody),
}

/// A finished answer, already in the Responses shape.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Decoded {
    pub output: Vec<Value>,
    pub output_text: String,
    pub tool_calls: Vec<ToolCall>,
    pub usage: Option<CallUsage>,
    pub incomplete_reason: Option<String>,
    /// The model the provider says answered (traces' `gen_ai.response.model`).
    pub model: Option<String>,
}

/// OpenAI's error object `{"message","type","code","param"}`, as far as it
/// was readable.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ProviderErrorBody {
    pub code: Option<String>,
    pub error_type: Option<String>,
    pub message: String,
    /// `details[].retryDelay` (Google's `RetryInfo`: `"33s"`, `"1.500s"`), ms.
    pub retry_delay_ms: Option<u64>,
}

impl ProviderErrorBody {
    /// Reads an error object: `{"message","type","code","param"}`. A `code`
    /// may be a number (some proxies, vLLM); it is kept as text.
    pub fn from_object(obj: &Value) -> Self {
        let text = |key: &str| match obj.get(key) {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            _ => None,
        };
        Self {
            code: text("code"),
            error_type: text("type"),
            message: text("message").unwrap_or_else(|| "the provider reported an error without a message".to_string()),
            retry_delay_ms: retry_delay_ms(obj),
        }
    }

    /// Reads a non-2xx body: `{"error":{…}}`, `{"error":"text"}`, a bare
    /// error object (`{"message","type","code"}`, vLLM's `{"object":"error",…}`),
    /// or plain text (a proxy's HTML page, clipped).
    pub fn from_body(body: &[u8]) -> Self {
        if let Ok(json) = serde_json::from_slice::<Value>(body) {
            match json.get("error") {
                Some(inner @ Value::Object(_)) => return Self::from_object(inner),
                Some(Value::String(s)) => return Self { message: s.clone(), ..Self::default() },
                _ => {}
            }
            if json.get("message").is_some() {
                return Self::from_object(&json);
            }
        }
        let text = String::from_utf8_lossy(body);
        let text = text.trim();
        Self { message: clip(if text.is_empty() { "(empty body)" } else { text }, 2000), ..Self::default() }
    }
}

/// The delay of a `RetryInfo` among an error object's `details`: a protobuf
/// Duration in its JSON form, seconds with an `s` (`"33s"`, `"1.500s"`).
fn retry_delay_ms(obj: &Value) -> Option<u64> {
    let details = obj.get("details")?.as_array()?;
    details.iter().find_map(|d| {
        let secs: f64 = str_field(d, "retryDelay")?.trim().strip_suffix('s')?.parse().ok()?;
        (secs.is_finite() && secs >= 0.0).then(|| (secs * 1000.0).ceil() as u64)
    })
}

/// At most `max` characters of `s`, marked when cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}… ({} bytes in all)", &s[..at], s.len()),
        None => s.to_string(),
    }
}

/// A string field of a JSON object.
pub(crate) fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// A token count field, tolerating a missing or null value. A count past
/// [`MAX_TOKEN_COUNT`] is read as missing: no call uses that many, and such a
/// number must not reach the run store's script, whose counters it would
/// overflow halfway through its writes.
pub(crate) fn count(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64).filter(|n| *n <= MAX_TOKEN_COUNT)
}

/// More tokens than any one call uses (a hundred times the longest context).
const MAX_TOKEN_COUNT: u64 = 1_000_000_000;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_openai_error_bodies_in_their_shapes() {
        let body = json!({"error": {"message": "Rate limit reached", "type": "tokens", "param": null, "code": "rate_limit_exceeded"}});
        let e = ProviderErrorBody::from_body(body.to_string().as_bytes());
        assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
        assert_eq!(e.error_type.as_deref(), Some("tokens"));
        assert_eq!(e.message, "Rate limit reached");

        let e = ProviderErrorBody::from_body(br#"{"error": "model not loaded"}"#);
        assert_eq!((e.code, e.message.as_str()), (None, "model not loaded"));

        let e = ProviderErrorBody::from_body(
            br#"{"object":"error","message":"too long","type":"BadRequestError","code":400}"#,
        );
        assert_eq!(e.code.as_deref(), Some("400"));
        assert_eq!(e.error_type.as_deref(), Some("BadRequestError"));

        let e = ProviderErrorBody::from_body(b"<html>502 Bad Gateway</html>");
        assert_eq!(e.message, "<html>502 Bad Gateway</html>");
        assert_eq!(ProviderErrorBody::from_body(b"  ").message, "(empty body)");
        let usage = json!({"input_tokens": 1_200, "output_tokens": u64::MAX, "total_tokens": -3});
        assert_eq!(count(&usage, "input_tokens"), Some(1_200));
        assert_eq!(count(&usage, "output_tokens"), None, "an impossible count is not taken");
        assert_eq!(count(&usage, "total_tokens"), None);
        let gemini = br#"{"error":{"code":429,"message":"Resource has been exhausted","status":"RESOURCE_EXHAUSTED",
            "details":[{"@type":"type.googleapis.com/google.rpc.Help"},
                       {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.500s"}]}}"#;
        assert_eq!(ProviderErrorBody::from_body(gemini).retry_delay_ms, Some(1_500));
        let odd = br#"{"error":{"message":"x","details":[{"retryDelay":"soon"},{"retryDelay":"-3s"}]}}"#;
        assert_eq!(ProviderErrorBody::from_body(odd).retry_delay_ms, None);
        assert!(ProviderErrorBody::from_body("x".repeat(5000).as_bytes()).message.ends_with("(5000 bytes in all)"));
    }
}
