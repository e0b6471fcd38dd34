//! Our thin client for the providers' wire formats (OpenAI's Responses and
//! Chat Completions, Anthropic's Messages): one streaming call, its
//! rate-limit headers, its answer in the Responses shape, or a classified
//! failure.
//!
//! **Architecture Invariant:** the client never retries and never sleeps. A
//! failed call comes back at once as a [`CallFailure`] with its headers and
//! its [`FailureKind`]; waiting is the pacer's business and re-sending is the
//! queue's (docs/pacing.md). This is why there is no SDK here: the SDKs retry 429s
//! inside the call, which blinds the shared pacer.
//!
//! - `sse.rs` — the incremental Server-Sent Events parser.
//! - `responses.rs` / `chat.rs` / `anthropic.rs` — decoding each wire
//!   format's stream into the Responses shape (sans-IO, unit-tested with
//!   event sequences).
//! - `decode.rs` — what they share (the decoded answer, error objects).
//! - `scrub.rs` — what a failure may say outside the process
//!   ([`CallFailure::message`] is scrubbed of URLs and key-like text).
//!
//! Timeouts: a connect timeout, and a timeout *between* stream events (and
//! until the response headers) — never a short total timeout, because a long
//! answer may stream for minutes while every gap stays short.

mod anthropic;
mod call;
mod chat;
mod decode;
mod responses;
mod scrub;
pub mod sse;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION};
use serde_json::{json, Value};
use shared::clock::{Clock, SystemClock};
use shared::config::Secret;
use shared::pacer::{DelaySource, FailureKind, HeaderSnapshot, Transport};
use shared::runs::ApiStyle;

use anthropic::AnthropicDecoder;
pub use call::{CallFailure, CallSuccess, CallUsage, StreamEvent, ToolCall};
use chat::ChatDecoder;
use decode::{clip, Decoded, ProviderErrorBody, Verdict};
use responses::ResponsesDecoder;
pub(crate) use scrub::shown_url;
use sse::SseParser;

/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest silence between two stream events (and until the
/// response headers). Reasoning models can think quietly for a while, and
/// OpenAI sends keepalives, so this is generous.
pub const DEFAULT_BETWEEN_EVENTS_TIMEOUT: Duration = Duration::from_secs(120);
/// The most of a non-2xx body that is read for its error message.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The most of a plain JSON (non-streamed) answer that is read.
const MAX_JSON_BODY: usize = sse::DEFAULT_MAX_EVENT_BYTES;

/// The provider client. Cheap to clone (the connection pool is shared).
#[derive(Clone)]
pub struct Provider {
    client: reqwest::Client,
    base_url: String,
    style: ApiStyle,
    /// `Bearer KEY` (OpenAI's styles, as `Authorization`) or the key itself
    /// (Anthropic's `x-api-key`), marked sensitive; `None` when no key was
    /// given (local servers).
    auth: Option<HeaderValue>,
    connect_timeout: Duration,
    between_events: Duration,
}

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key: only whether there is one.
        f.debug_struct("Provider")
            .field("base_url", &scrub::shown_url(&self.base_url))
            .field("style", &self.style)
            .field("api_key", &if self.auth.is_some() { "<redacted>" } else { "<none>" })
            .field("connect_timeout", &self.connect_timeout)
            .field("between_events", &self.between_events)
            .finish()
    }
}

/// The HTTP client of every provider call. It follows no redirect: reqwest
/// strips only `Authorization` on one, so a 3xx would carry Anthropic's
/// `x-api-key` and every prompt to whatever the `Location` names
/// ([`redirect_failure`] says so instead).
fn build_client(connect: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(connect)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("paceline/", env!("CARGO_PKG_VERSION")))
        .build()
}

impl Provider {
    /// A client for `url` in `style` with `key`, with the default timeouts.
    /// Fails on a URL that is not http(s) or a key that cannot be a header.
    pub fn new(style: ApiStyle, url: &str, key: &Secret) -> anyhow::Result<Self> {
        let base_url = url.trim().trim_end_matches('/').to_string();
        let parsed =
            reqwest::Url::parse(&base_url).with_context(|| format!("provider URL {base_url:?} is not a URL"))?;
        anyhow::ensure!(matches!(parsed.scheme(), "http" | "https"), "provider URL {base_url:?} is not http(s)");
        let auth = if key.is_empty() {
            None
        } else {
            let value = match style {
                ApiStyle::Responses | ApiStyle::Chat => format!("Bearer {}", key.expose().trim()),
                ApiStyle::Anthropic => key.expose().trim().to_owned(),
            };
            // The error must not quote the value: it is the key.
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| anyhow::anyhow!("the API key holds characters that cannot be sent in a header"))?;
            value.set_sensitive(true);
            Some(value)
        };
        let client = build_client(DEFAULT_CONNECT_TIMEOUT).context("building the HTTP client")?;
        Ok(Self {
            client,
            base_url,
            style,
            auth,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            between_events: DEFAULT_BETWEEN_EVENTS_TIMEOUT,
        })
    }

    /// The same client with other timeouts: `connect` for the TCP/TLS
    /// connect, `between_events` for the longest silence until the headers
    /// and between two pieces of the stream. The HTTP client is built again
    /// only for another connect timeout.
    pub fn with_timeouts(mut self, connect: Duration, between_events: Duration) -> Self {
        self.between_events = between_events;
        if connect == self.connect_timeout {
            return self;
        }
        match build_client(connect) {
            Ok(client) => {
                self.client = client;
                self.connect_timeout = connect;
            }
            // Cannot happen once `new` built one; keep the working client.
            Err(error) => tracing::warn!(message = "HTTP client not rebuilt; connect timeout unchanged", %error),
        }
        self
    }

    /// The wire format this client speaks.
    pub fn api_style(&self) -> ApiStyle {
        self.style
    }

    /// The URL calls are POSTed to. Anthropic's base is the part before
    /// `/v1/messages` (`https://api.anthropic.com`); a base that already ends
    /// in `/v1` is taken as meant.
    pub fn endpoint(&self) -> String {
        match self.style {
            ApiStyle::Responses => format!("{}/responses", self.base_url),
            ApiStyle::Chat => format!("{}/chat/completions", self.base_url),
            ApiStyle::Anthropic if self.base_url.ends_with("/v1") => format!("{}/messages", self.base_url),
            ApiStyle::Anthropic => format!("{}/v1/messages", self.base_url),
        }
    }

    /// Sends one request and reads its streamed answer.
    ///
    /// `body` is a complete request in this client's wire format; the client
    /// only sets `stream: true` (and, for chat, `stream_options.include_usage`).
    /// `on_event` sees text deltas and finished tool calls as they arrive.
    /// Headers are read on every answer (2xx, 429, other errors). Nothing is
    /// retried: every failure comes back at once, classified.
    pub async fn call(
        &self,
        body: Value,
        on_event: &mut (dyn FnMut(StreamEvent) + Send),
    ) -> Result<CallSuccess, CallFailure> {
        self.call_answering(body, None, on_event).await
    }

    /// [`Provider::call`] for a run whose structured answer comes as a call
    /// of `answer_tool` (Anthropic, see `request/anthropic.rs`): that call is
    /// the answer's text, not a tool to run.
    pub async fn call_answering(
        &self,
        mut body: Value,
        answer_tool: Option<&str>,
        on_event: &mut (dyn FnMut(StreamEvent) + Send),
    ) -> Result<CallSuccess, CallFailure> {
        let Some(obj) = body.as_object_mut() else {
            let error = ProviderErrorBody {
                message: "the request body is not a JSON object".into(),
                ..ProviderErrorBody::default()
            };
            // No request was sent: terminal, whatever classify would guess.
            let mut failure = CallFailure::new(None, error, None, HeaderSnapshot::default(), None);
            failure.kind = FailureKind::Terminal;
            return Err(failure);
        };
        obj.insert("stream".into(), json!(true));
        if self.style == ApiStyle::Chat {
            let options = obj.entry("stream_options").or_insert_with(|| json!({}));
            if !options.is_object() {
                *options = json!({});
            }
            options["include_usage"] = json!(true);
        }

        let url = self.endpoint();
        let mut request = self.client.post(&url).header(ACCEPT, "text/event-stream").json(&body);
        if self.style == ApiStyle::Anthropic {
            request = request.header("anthropic-version", crate::request::ANTHROPIC_VERSION);
        }
        if let Some(auth) = &self.auth {
            request = match self.style {
                ApiStyle::Responses | ApiStyle::Chat => request.header(AUTHORIZATION, auth.clone()),
                ApiStyle::Anthropic => request.header("x-api-key", auth.clone()),
            };
        }
        tracing::debug!(message = "provider call", api.style = ?self.style, url = %scrub::shown_url(&url));

        let response = match tokio::time::timeout(self.between_events, request.send()).await {
            Err(_) => {
                let message = format!("no response headers within {} ms", self.between_events.as_millis());
                return Err(self.failed(CallFailure::transport(Transport::Timeout, message, None)));
            }
            Ok(Err(error)) => {
                return Err(self.failed(CallFailure::transport(
                    transport_kind(&error),
                    transport_message(&error),
                    None,
                )))
            }
            Ok(Ok(response)) => response,
        };
        let headers_received = Instant::now();
        let status = response.status().as_u16();
        let headers = snapshot(response.headers());
        let answer = (status, headers.clone(), headers_received);

        if response.status().is_redirection() {
            let failure = redirect_failure(&url, status, response.headers(), headers, headers_received);
            return Err(self.failed(failure));
        }
        if !response.status().is_success() {
            let body = match self.read_body(response, MAX_ERROR_BODY).await {
                Ok(bytes) => ProviderErrorBody::from_body(&bytes),
                // The status alone still classifies the failure.
                Err(_) => ProviderErrorBody {
                    message: format!("HTTP {status} (the error body could not be read)"),
                    ..ProviderErrorBody::default()
                },
            };
            let mut headers = headers;
            if let (None, Some(ms)) = (headers.retry_after_ms, body.retry_delay_ms) {
                // No header said how long: the body's RetryInfo does (docs/pacing.md,
                // a delay stated in the error body).
                headers.retry_after_ms = Some(ms);
                headers.retry_after_source = Some(DelaySource::RetryDelay);
            }
            let mut failure = CallFailure::new(Some(status), body, None, headers, Some(headers_received));
            if self.style == ApiStyle::Anthropic {
                failure.kind = anthropic::refine(failure.kind, failure.error_type.as_deref(), &failure.message);
            }
            return Err(self.failed(failure));
        }

        let is_json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.trim_start().starts_with("application/json"));
        // An atomic, not a Cell: the call's future must stay Send.
        let streamed_text = AtomicBool::new(false);
        let mut emit = |event: StreamEvent| {
            if matches!(&event, StreamEvent::TextDelta(t) if !t.is_empty()) {
                streamed_text.store(true, Ordering::Relaxed);
            }
            on_event(event);
        };
        let answer_tool = answer_tool.map(str::to_owned);
        let outcome = if is_json {
            // A server that ignored `stream: true` answered with one JSON body.
            self.read_json_answer(response, answer_tool, &mut emit).await
        } else {
            self.read_stream(response, answer_tool, &mut emit).await
        };
        match outcome {
            Ok(decoded) => Ok(CallSuccess {
                output: decoded.output,
                output_text: decoded.output_text,
                tool_calls: decoded.tool_calls,
                usage: decoded.usage,
                headers,
                headers_received,
                status,
                incomplete_reason: decoded.incomplete_reason,
                response_model: decoded.model,
            }),
            Err(StreamFailure::InBand(error)) => {
                let mut failure = CallFailure::new(Some(status), error, None, headers, Some(headers_received));
                failure.streamed_text = streamed_text.load(Ordering::Relaxed);
                Err(self.failed(failure))
            }
            Err(StreamFailure::Transport(transport, message)) => {
                let mut failure = CallFailure::transport(transport, message, Some(answer));
                failure.streamed_text = streamed_text.load(Ordering::Relaxed);
                Err(self.failed(failure))
            }
        }
    }

    /// Reads the event stream until its terminal event.
    async fn read_stream(
        &self,
        response: reqwest::Response,
        answer_tool: Option<String>,
        emit: &mut (dyn FnMut(StreamEvent) + Send),
    ) -> Result<Decoded, StreamFailure> {
        let mut decoder = Decoder::new(self.style, answer_tool);
        let mut parser = SseParser::new();
        let mut stream = response.bytes_stream();
        loop {
            let chunk = match tokio::time::timeout(self.between_events, stream.next()).await {
                Err(_) => {
                    let message = format!("no stream event for {} ms", self.between_events.as_millis());
                    return Err(StreamFailure::Transport(Transport::Timeout, message));
                }
                Ok(Some(Err(error))) => {
                    return Err(StreamFailure::Transport(transport_kind(&error), transport_message(&error)))
                }
                Ok(Some(Ok(chunk))) => chunk,
                Ok(None) => {
                    if let Some(event) = parser.finish() {
                        if let Some(done) = decoder.event(&event, emit).settle() {
                            return done;
                        }
                    }
                    if let Some(done) = decoder.eof(emit).settle() {
                        return done;
                    }
                    // Nothing says the answer was complete: a cut connection
                    // (a proxy's idle timeout, a crash) looks exactly like this.
                    return Err(StreamFailure::Transport(
                        Transport::ConnectionReset,
                        "the stream closed before its terminal event".into(),
                    ));
                }
            };
            let events = parser
                .push(&chunk)
                .map_err(|e| StreamFailure::Transport(Transport::Other, format!("unreadable event stream: {e}")))?;
            for event in &events {
                if let Some(done) = decoder.event(event, emit).settle() {
                    return done;
                }
            }
        }
    }

    /// Reads a plain JSON answer (a server that does not stream) through the
    /// same decoder, as if it were one terminal event.
    async fn read_json_answer(
        &self,
        response: reqwest::Response,
        answer_tool: Option<String>,
        emit: &mut (dyn FnMut(StreamEvent) + Send),
    ) -> Result<Decoded, StreamFailure> {
        let bytes = self.read_body(response, MAX_JSON_BODY).await?;
        let body: Value = serde_json::from_slice(&bytes)
            .map_err(|e| StreamFailure::Transport(Transport::Other, format!("unreadable JSON answer: {e}")))?;
        if let Some(error) = body.get("error").filter(|e| e.is_object()) {
            if body.get("status").and_then(Value::as_str) != Some("completed") {
                return Err(StreamFailure::InBand(ProviderErrorBody::from_object(error)));
            }
        }
        let frames: Vec<Value> = match self.style {
            ApiStyle::Responses => {
                let kind = match body.get("status").and_then(Value::as_str) {
                    Some("incomplete") => "response.incomplete",
                    _ => "response.completed",
                };
                if let Some(text) =
                    body.get("output").and_then(Value::as_array).map(|items| responses::message_text(items))
                {
                    if !text.is_empty() {
                        emit(StreamEvent::TextDelta(text));
                    }
                }
                vec![json!({"type": kind, "response": body})]
            }
            ApiStyle::Chat => {
                // The message as one delta: its tool calls get the index a stream would give them.
                let choice = body.get("choices").and_then(|c| c.get(0)).cloned().unwrap_or(Value::Null);
                let mut delta = choice.get("message").cloned().unwrap_or(json!({}));
                if let Some(calls) = delta.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    for (index, call) in calls.iter_mut().enumerate() {
                        call["index"] = json!(index);
                    }
                }
                let finish = choice.get("finish_reason").cloned().unwrap_or(json!("stop"));
                vec![
                    json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": body.get("usage")}),
                    Value::String("[DONE]".into()),
                ]
            }
            // The message's blocks as the stream would have brought them.
            ApiStyle::Anthropic => anthropic::frames_of_message(&body),
        };
        let mut decoder = Decoder::new(self.style, answer_tool);
        for frame in frames {
            let data = match frame {
                Value::String(s) => s,
                other => other.to_string(),
            };
            if let Some(done) = decoder.event(&sse::SseEvent { data, ..Default::default() }, emit).settle() {
                return done;
            }
        }
        Err(StreamFailure::Transport(Transport::Other, "a JSON answer without a readable response".into()))
    }

    /// At most `limit` bytes of a body, each piece within the between-events timeout.
    async fn read_body(&self, response: reqwest::Response, limit: usize) -> Result<Vec<u8>, StreamFailure> {
        let mut stream = response.bytes_stream();
        let mut body = Vec::new();
        loop {
            match tokio::time::timeout(self.between_events, stream.next()).await {
                Err(_) => return Err(StreamFailure::Transport(Transport::Timeout, "the body stalled".into())),
                Ok(Some(Err(error))) => {
                    return Err(StreamFailure::Transport(transport_kind(&error), transport_message(&error)))
                }
                Ok(Some(Ok(chunk))) => {
                    let room = limit.saturating_sub(body.len());
                    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                    if body.len() >= limit {
                        return Ok(body);
                    }
                }
                Ok(None) => return Ok(body),
            }
        }
    }

    /// Logs a failure once, at the level its kind deserves, and hands it back.
    fn failed(&self, failure: CallFailure) -> CallFailure {
        tracing::debug!(
            message = "provider call failed",
            http.status = ?failure.status,
            error.code = ?failure.code,
            kind = ?failure.kind,
            transport = ?failure.transport,
            streamed_text = failure.streamed_text,
            error = %clip(&failure.message, 300),
        );
        failure
    }
}

/// A 3xx answer, as a failure that is never retried and names where the
/// redirect pointed: the same request would be redirected the same way, and
/// the fix is the operator's (`PACELINE_PROVIDER_URL` naming where the API
/// really answers). The target is shown as [`shown_url`] shows a URL (no
/// user, password or query), resolved against the call's URL when relative.
fn redirect_failure(
    url: &str,
    status: u16,
    answer: &HeaderMap,
    headers: HeaderSnapshot,
    received: Instant,
) -> CallFailure {
    let target = answer
        .get(reqwest::header::LOCATION)
        .and_then(|l| l.to_str().ok())
        .and_then(|l| reqwest::Url::parse(url).ok()?.join(l.trim()).ok())
        .map_or_else(|| "no readable Location".to_owned(), |to| shown_url(to.as_str()));
    let mut failure = CallFailure::new(Some(status), ProviderErrorBody::default(), None, headers, Some(received));
    failure.kind = FailureKind::Terminal;
    failure.message = format!(
        "the provider redirected the call (HTTP {status} to {target}); provider calls follow no redirect, \
         so the key and the prompt never went there: set the provider URL to where the API answers"
    );
    failure
}

/// Why reading an answer's body failed.
#[derive(Debug)]
enum StreamFailure {
    /// The provider said so inside the stream.
    InBand(ProviderErrorBody),
    /// The stream broke, stalled or closed early.
    Transport(Transport, String),
}

/// The decoder for one wire format.
enum Decoder {
    Responses(ResponsesDecoder),
    Chat(ChatDecoder),
    Anthropic(AnthropicDecoder),
}

impl Decoder {
    fn new(style: ApiStyle, answer_tool: Option<String>) -> Self {
        match style {
            ApiStyle::Responses => Self::Responses(ResponsesDecoder::default()),
            ApiStyle::Chat => Self::Chat(ChatDecoder::default()),
            ApiStyle::Anthropic => Self::Anthropic(AnthropicDecoder::new(answer_tool)),
        }
    }

    fn event(&mut self, event: &sse::SseEvent, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        match self {
            Self::Responses(d) => d.event(event, emit),
            Self::Chat(d) => d.event(event, emit),
            Self::Anthropic(d) => d.event(event, emit),
        }
    }

    fn eof(&mut self, emit: &mut dyn FnMut(StreamEvent)) -> Verdict {
        match self {
            Self::Responses(d) => d.eof(),
            Self::Chat(d) => d.eof(emit),
            Self::Anthropic(d) => d.eof(),
        }
    }
}

impl Verdict {
    /// `None` while pending, else the call's result.
    fn settle(self) -> Option<Result<Decoded, StreamFailure>> {
        match self {
            Verdict::Pending => None,
            Verdict::Finished(decoded) => Some(Ok(decoded)),
            Verdict::Failed(error) => Some(Err(StreamFailure::InBand(error))),
        }
    }
}

/// Reads an answer's rate-limit headers.
fn snapshot(headers: &HeaderMap) -> HeaderSnapshot {
    let pairs = headers.iter().filter_map(|(name, value)| value.to_str().ok().map(|v| (name.as_str(), v)));
    HeaderSnapshot::from_headers(pairs, SystemClock.now_ms())
}

/// Which kind of transport failure a reqwest error is.
fn transport_kind(error: &reqwest::Error) -> Transport {
    if error.is_timeout() {
        return Transport::Timeout;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            match io.kind() {
                TimedOut => return Transport::Timeout,
                ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => return Transport::ConnectionReset,
                _ => {}
            }
        }
        source = e.source();
    }
    if error.is_body() || error.is_decode() {
        // The body broke after the headers: the connection went away mid-answer.
        Transport::ConnectionReset
    } else {
        Transport::Other
    }
}

/// A transport failure as a stable sentence: what failed, then its innermost
/// cause (`could not connect to the provider: Connection refused (os error
/// 111)`). Never reqwest's own text, which names the URL.
fn transport_message(error: &reqwest::Error) -> String {
    let what = if error.is_timeout() {
        "the provider did not answer in time"
    } else if error.is_connect() {
        "could not connect to the provider"
    } else if error.is_body() || error.is_decode() {
        "the provider's answer broke off"
    } else {
        "the request to the provider failed"
    };
    let Some(mut innermost) = std::error::Error::source(error) else { return what.to_owned() };
    while let Some(next) = innermost.source() {
        innermost = next;
    }
    format!("{what}: {}", clip(&scrub::public_message(&innermost.to_string()), 200))
}

/// An error and its causes, `a: b: c` (reqwest's own text is often just
/// "error sending request"). The tool caller's; a provider failure's text is
/// [`transport_message`].
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(url: &str, key: &str, style: ApiStyle) -> anyhow::Result<Provider> {
        Provider::new(style, url, &Secret::new(key))
    }

    #[test]
    fn debug_never_shows_the_key() {
        let p = provider("http://127.0.0.1:1/v1/", "sk-very-secret", ApiStyle::Responses).unwrap();
        let shown = format!("{p:?}");
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("<redacted>"));
        assert_eq!(p.endpoint(), "http://127.0.0.1:1/v1/responses");
        let p = provider("http://localhost:8000/v1", "", ApiStyle::Chat).unwrap();
        assert!(format!("{p:?}").contains("<none>"));
        assert_eq!(p.endpoint(), "http://localhost:8000/v1/chat/completions");
        let p = provider("https://api.anthropic.com/", "sk-ant-secret", ApiStyle::Anthropic).unwrap();
        assert!(!format!("{p:?}").contains("sk-ant-secret"));
        assert_eq!(p.endpoint(), "https://api.anthropic.com/v1/messages");
        let p = provider("http://127.0.0.1:9/v1", "", ApiStyle::Anthropic).unwrap();
        assert_eq!(p.endpoint(), "http://127.0.0.1:9/v1/messages", "a base ending in /v1 is taken as meant");
    }

    #[test]
    fn bad_urls_and_keys_are_refused_without_quoting_the_key() {
        assert!(provider("not a url", "", ApiStyle::Responses).is_err());
        assert!(provider("ftp://x/v1", "", ApiStyle::Responses).is_err());
        let err = provider("http://x/v1", "sk-bad\nkey", ApiStyle::Responses).unwrap_err();
        assert!(!format!("{err:#}").contains("sk-bad"));
        let err = provider("http://x", "sk-ant-bad\nkey", ApiStyle::Anthropic).unwrap_err();
        assert!(!format!("{err:#}").contains("sk-ant-bad"));
    }

    #[test]
    fn the_call_future_is_send() {
        fn assert_send<T: Send>(_: T) {}
        let p = provider("http://127.0.0.1:1/v1", "", ApiStyle::Responses).unwrap();
        let mut sink = |_: StreamEvent| {};
        assert_send(p.call(json!({}), &mut sink));
    }

    #[test]
    fn a_failure_is_classified_once() {
        let quota = ProviderErrorBody {
            code: Some("insufficient_quota".into()),
            error_type: None,
            message: "You exceeded your current quota".into(),
            retry_delay_ms: None,
        };
        let f = CallFailure::new(Some(429), quota, None, HeaderSnapshot::default(), None);
        assert_eq!(f.kind, FailureKind::Quota);
        assert!(f.to_string().contains("HTTP 429"));
        let f = CallFailure::transport(Transport::Timeout, "no stream event".into(), None);
        assert_eq!(f.kind, FailureKind::Transient);
    }

    #[test]
    fn a_failure_is_classified_on_the_raw_text_and_shown_scrubbed() {
        let bad_key = ProviderErrorBody {
            code: None,
            error_type: None,
            message: "Rate limit reached for key sk-proj-abcdef0123456789; see https://platform.openai.com/x".into(),
            retry_delay_ms: None,
        };
        let f = CallFailure::new(Some(400), bad_key, None, HeaderSnapshot::default(), None);
        assert_eq!(f.kind, FailureKind::RateLimited, "classified on what the provider said");
        assert_eq!(f.message, "Rate limit reached for key [redacted]; see [url]");
        assert!(!f.to_string().contains("sk-proj"));
        let f =
            CallFailure::transport(Transport::Other, "error sending request for url (http://10.1.2.3/v1)".into(), None);
        assert!(!f.message.contains("10.1.2.3"), "{}", f.message);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_stable_sentence_without_the_url() {
        let p = provider("http://user:hunter2@127.0.0.1:1/v1?key=sekrit", "sk-secret-key-123", ApiStyle::Responses)
            .unwrap();
        let failure = p.call(json!({"model": "m", "input": "x"}), &mut |_: StreamEvent| {}).await.unwrap_err();
        assert_eq!(failure.kind, FailureKind::Transient);
        assert!(failure.message.starts_with("could not connect to the provider"), "{}", failure.message);
        for secret in ["127.0.0.1", "hunter2", "sekrit", "sk-secret", "http"] {
            assert!(!failure.message.contains(secret), "{secret} in {:?}", failure.message);
        }
        assert!(!format!("{p:?}").contains("hunter2"));
    }
}
