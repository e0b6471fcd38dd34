//! Faults injected for the next requests (`POST /_mock/faults`,
//! `MockServer::inject`): a worker test can script "the next call gets a 429
//! with retry-after 300 ms" without dice.

use serde::{Deserialize, Serialize};

/// One fault, consumed by the next API request (first in, first out).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum Fault {
    /// Fail with this 5xx status (500, 503, 529…) before admission.
    ServerError {
        /// The status.
        #[serde(default = "default_status")]
        status: u16,
    },
    /// A 429 `rate_limit_exceeded` with this retry-after, whatever the buckets say.
    RateLimited {
        /// The delay the answer asks for.
        retry_after_ms: u64,
    },
    /// A 429 `insufficient_quota` (Anthropic: its 400 "credit balance is too low").
    Quota,
    /// A 400 `invalid_request_error` before admission (default message:
    /// Anthropic's "prompt is too long").
    InvalidRequest {
        /// The message.
        #[serde(default)]
        message: Option<String>,
    },
    /// Admit, then break the stream after some text (a JSON answer is unaffected).
    MidstreamError {
        /// `server_error` (default) or `rate_limit_exceeded`.
        #[serde(default)]
        code: Option<String>,
    },
    /// Admit, then pause the stream this long after some text.
    Stall {
        /// The pause.
        ms: u64,
    },
}

fn default_status() -> u16 {
    500
}
