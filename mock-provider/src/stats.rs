//! What `GET /_mock/stats` (and `MockServer::stats`) reports: counts, the
//! buckets' state, a log of requests and the latest bodies. One type both
//! ways, so tests read it in-process or over HTTP alike.

use crate::bucket::BucketMode;
use crate::shape::{HeaderStyle, LimitsMode};
use crate::wire::Api;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The mock's counters and logs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Stats {
    /// API requests received (`/v1/…`; `/_mock/…` not counted).
    pub requests: u64,
    /// Answers with a 2xx status (a stream that broke mid-way still counts: its status was 200).
    #[serde(rename = "2xx")]
    pub ok: u64,
    /// Answers by HTTP status.
    pub by_status: BTreeMap<u16, u64>,
    /// 429 answers, all codes.
    pub rate_limited: u64,
    /// 429 answers by `error.code` (`rate_limit_exceeded`, `insufficient_quota`).
    pub rate_limited_by_code: BTreeMap<String, u64>,
    /// Streams that ended in an error event.
    pub midstream_errors: u64,
    /// Streams that stalled.
    pub stalls: u64,
    /// Tokens charged at admission (input + output limit; with split input
    /// and output buckets, both together; Anthropic's cache reads are not
    /// charged). Under `--limits none` nothing is
    /// enforced, but the counts still say what the requests would have cost.
    pub tokens_charged: u64,
    /// Unused output tokens given back after the answer.
    pub tokens_refunded: u64,
    /// Charged minus refunded: what the admitted requests cost the bucket.
    pub tokens_admitted: u64,
    /// The input part of `tokens_admitted` (input is never given back): what
    /// the input bucket let through, when there is one.
    #[serde(default)]
    pub input_tokens_admitted: u64,
    /// The output part of `tokens_admitted` (output limits charged minus
    /// refunded): what the output bucket let through, when there is one.
    #[serde(default)]
    pub output_tokens_admitted: u64,
    /// Input tokens the admitted requests read from the prompt cache
    /// (Anthropic `cache_read_input_tokens`, OpenAI `cached_tokens`; `--cache`).
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Input tokens the admitted requests wrote to the prompt cache
    /// (Anthropic `cache_creation_input_tokens`; OpenAI reports none).
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// The largest overdraft any bucket ever reached, from its level; 0 unless admission is broken.
    pub largest_overdraft: u64,
    /// The buckets now.
    pub buckets: Buckets,
    /// The latest requests, oldest first (see `MockConfig::log_limit`).
    #[serde(default)]
    pub log: Vec<LogEntry>,
    /// The latest request bodies, oldest first (see `MockConfig::keep_bodies`).
    #[serde(default)]
    pub bodies: Vec<KeptBody>,
}

/// The buckets, and the shape that decides them.
///
/// Under `--limits none` there are no buckets: `tokens` and `requests` are
/// zero views (limit 0) that keep only the configured window and mode.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Buckets {
    /// The token bucket. With split input and output buckets (`--headers
    /// anthropic`), the one with the smaller share left, as Anthropic's
    /// `anthropic-ratelimit-tokens-*` headers describe it.
    pub tokens: BucketView,
    /// The request bucket.
    pub requests: BucketView,
    /// The input token bucket, when input and output are split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<BucketView>,
    /// The output token bucket, when input and output are split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<BucketView>,
    /// Whose headers the mock speaks.
    #[serde(default)]
    pub headers: HeaderStyle,
    /// Whether the buckets are enforced.
    #[serde(default)]
    pub limits: LimitsMode,
}

/// One bucket as the headers would describe it now.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BucketView {
    /// Capacity per window.
    pub limit: u64,
    /// Whole units available now.
    pub remaining: u64,
    /// Milliseconds until full again.
    pub reset_ms: u64,
    /// Window length in microseconds (log times use the same epoch and unit).
    pub window_us: u64,
    /// Refill mode.
    pub mode: BucketMode,
}

/// One API request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogEntry {
    /// The mock's request number (1-based, never reused, not reset).
    pub seq: u64,
    /// Arrival (and admission) time, microseconds since the server started.
    pub at_us: u64,
    /// Arrival time in whole milliseconds since the server started.
    pub at_ms: u64,
    /// The endpoint, when the body parsed.
    pub api: Option<Api>,
    /// The model named.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// The HTTP status answered.
    pub status: u16,
    /// `error.code` of an error answer, or `midstream_error` for a broken stream.
    pub code: Option<String>,
    /// Input tokens counted.
    pub input_tokens: u64,
    /// Tool outputs the conversation held.
    pub tool_outputs: usize,
    /// Tokens charged at admission (0 when not admitted).
    pub charged: u64,
    /// The input part of `charged`: the input tokens, less what Anthropic
    /// read from the prompt cache (which its input bucket does not count).
    #[serde(default)]
    pub charged_input: u64,
    /// Input tokens read from the prompt cache (when admitted).
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Input tokens written to the prompt cache (Anthropic; when admitted).
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// Tokens given back after the answer.
    pub refunded: u64,
    /// When they were given back (microseconds since start), once the answer is done.
    pub refunded_at_us: Option<u64>,
}

/// A request body as received (JSON, or the raw text when it did not parse).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeptBody {
    /// The request number, as in the log.
    pub seq: u64,
    /// The body.
    pub body: Value,
    /// Which header carried a key (`authorization` or `x-api-key`), if one
    /// did — never its value: the mock holds no secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
    /// The `anthropic-version` header, if one came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anthropic_version: Option<String>,
}
