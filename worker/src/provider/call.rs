//! What a provider call gives its caller: the events it streamed, its answer
//! (text, tool calls, usage, rate-limit headers) or its failure, classified.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shared::pacer::{classify, FailedCall, FailureKind, HeaderSnapshot, Transport};
use shared::runs::Usage;

use super::decode::ProviderErrorBody;

/// Something the stream said before it finished, handed to the caller as it
/// arrives (the turn loop forwards it to the run's event stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// A piece of the answer's text.
    TextDelta(String),
    /// A complete function call (Responses: when its item is done; chat:
    /// when the stream finished, since its fragments may interleave).
    ToolCall {
        /// Ties the call to its output (`call_…`).
        call_id: String,
        /// The function's name.
        name: String,
        /// Its arguments, a JSON text.
        arguments: String,
    },
}

/// A function call the model asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Ties the call to its output (`call_…`).
    pub call_id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON text as the model wrote it.
    pub arguments: String,
}

/// Tokens the provider says one call used: the run's [`Usage`] counters and
/// what the provider's rate limit counted of the input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallUsage {
    /// Input (cached included: Anthropic's uncached `input_tokens` plus its
    /// cache writes and reads), output (reasoning included), their sum as
    /// the provider reports it, and the reasoning and cached parts.
    pub tokens: Usage,
    /// The input the provider's rate limit counts: all of it for OpenAI;
    /// for Anthropic, without the cache reads (its input limit skips them).
    pub charged_input_tokens: u64,
}

impl CallUsage {
    /// `input` + `output`, nothing cached or reasoned, all input charged.
    pub fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Self {
            tokens: Usage {
                input_tokens,
                output_tokens,
                total_tokens: input_tokens + output_tokens,
                ..Usage::default()
            },
            charged_input_tokens: input_tokens,
        }
    }
}

/// A call that finished with an answer.
#[derive(Debug, Clone)]
pub struct CallSuccess {
    /// Output items in the Responses shape, ready to append to the transcript
    /// as input items of the next turn: `{"type":"message","role":"assistant",
    /// "content":[{"type":"output_text","text"}]}`, `{"type":"function_call",
    /// "call_id","name","arguments"}`, and `reasoning` items only when they
    /// carry `encrypted_content`. Server-side ids and `status` are dropped:
    /// turns are stateless (`store: false`).
    pub output: Vec<Value>,
    /// The answer's text (every `output_text` part, joined).
    pub output_text: String,
    /// The function calls to run, in order.
    pub tool_calls: Vec<ToolCall>,
    /// What the provider reported (absent when it reported nothing, e.g. a
    /// chat server that ignores `stream_options`).
    pub usage: Option<CallUsage>,
    /// The answer's rate-limit headers.
    pub headers: HeaderSnapshot,
    /// When the headers arrived (their resets count from here).
    pub headers_received: Instant,
    /// The HTTP status (2xx).
    pub status: u16,
    /// Set when the answer was cut short but is still an answer:
    /// `max_output_tokens` (Responses `response.incomplete`, chat
    /// `finish_reason: "length"`) or `content_filter`. A function call the cut
    /// left with broken arguments is not in `output` or `tool_calls`.
    pub incomplete_reason: Option<String>,
    /// The model the provider says answered, when it said.
    pub response_model: Option<String>,
}

/// A call that failed: everything the pacer and the retry ladder need.
#[derive(Debug, Clone, thiserror::Error)]
#[error("provider call failed ({kind:?}{}): {message}", status.map(|s| format!(", HTTP {s}")).unwrap_or_default())]
pub struct CallFailure {
    /// The HTTP status when an answer came: the error status, or 200 for an
    /// error inside a 200 stream; `None` when no answer came at all.
    pub status: Option<u16>,
    /// The error's `code` (`rate_limit_exceeded`, `insufficient_quota`, …).
    pub code: Option<String>,
    /// The error's `type` (`tokens`, `server_error`, …).
    pub error_type: Option<String>,
    /// The provider's message, or what went wrong below HTTP, as it may be
    /// shown: without URLs or anything that looks like a key
    /// (`scrub.rs`; classification saw the raw text). A redirect's is ours,
    /// naming its target without user, password or query.
    pub message: String,
    /// Set when the failure was below HTTP (timeout, reset, refused).
    pub transport: Option<Transport>,
    /// The answer's rate-limit headers (empty when no answer came). A 429's
    /// `retry-after` is here.
    pub headers: HeaderSnapshot,
    /// When the headers arrived, if they did.
    pub headers_received: Option<Instant>,
    /// Some text delta was already handed to the caller: a companion run must
    /// not re-send (it would say the same words twice).
    pub streamed_text: bool,
    /// The classification (retryable or not, and the run's `error.kind`).
    pub kind: FailureKind,
}

impl CallFailure {
    /// A failure, classified by [`shared::pacer::classify`].
    pub(super) fn new(
        status: Option<u16>,
        error: ProviderErrorBody,
        transport: Option<Transport>,
        headers: HeaderSnapshot,
        headers_received: Option<Instant>,
    ) -> Self {
        let kind = classify(&FailedCall {
            status,
            code: error.code.as_deref(),
            error_type: error.error_type.as_deref(),
            message: &error.message,
            transport,
        });
        Self {
            status,
            code: error.code,
            error_type: error.error_type,
            message: super::scrub::public_message(&error.message),
            transport,
            headers,
            headers_received,
            streamed_text: false,
            kind,
        }
    }

    /// A failure below HTTP, before or after the headers.
    pub(super) fn transport(
        transport: Transport,
        message: String,
        answer: Option<(u16, HeaderSnapshot, Instant)>,
    ) -> Self {
        let (status, headers, at) = match answer {
            Some((status, headers, at)) => (Some(status), headers, Some(at)),
            None => (None, HeaderSnapshot::default(), None),
        };
        Self::new(status, ProviderErrorBody { message, ..ProviderErrorBody::default() }, Some(transport), headers, at)
    }
}
