//! Every knob of the mock, as one plain value with defaults; the CLI
//! (`cli.rs`) and the tests build it, the server reads it.

use crate::bucket::BucketMode;
use crate::shape::{HeaderStyle, LimitsMode};
use std::net::SocketAddr;
use std::time::Duration;

/// The default output bucket of the Anthropic shape is `tpm / OUTPUT_SHARE`:
/// Anthropic's tiers give output about a fifth of the input budget.
pub const OUTPUT_SHARE: u64 = 5;

/// How the mock behaves. `Default` is a quiet OpenAI-shaped provider on a free
/// port: 40 000 TPM, 600 RPM, continuous buckets, no faults, no latency.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Address to bind; port 0 picks a free one (see `MockServer::local_addr`).
    pub listen: SocketAddr,
    /// Token bucket capacity per window (tokens per minute when the window is 60 s).
    pub tpm: u64,
    /// The Anthropic shape's input token bucket per window; `None` means `tpm`.
    pub itpm: Option<u64>,
    /// The Anthropic shape's output token bucket per window; `None` means
    /// `tpm / OUTPUT_SHARE`.
    pub otpm: Option<u64>,
    /// Request bucket capacity per window.
    pub rpm: u64,
    /// The bucket window: 60 s like OpenAI, or shorter to scale a minute down for tests.
    pub window: Duration,
    /// How the buckets refill.
    pub bucket: BucketMode,
    /// Delay before the first byte of an admitted answer (429s are immediate).
    pub latency: Duration,
    /// Tool outputs the conversation must hold before the model answers in text.
    pub tool_rounds: usize,
    /// Function calls per tool round.
    pub calls_per_round: usize,
    /// Length of the final text answer in tokens (one word = one token).
    pub output_tokens: u64,
    /// Output tokens charged at admission when the request sets no limit
    /// (`max_output_tokens`, `max_completion_tokens`, `max_tokens`);
    /// `None` means `output_tokens`.
    pub default_max_output_tokens: Option<u64>,
    /// Fraction of requests that fail with 500, 503 or 529 before admission.
    pub fail_rate: f64,
    /// Fraction of streamed answers that break after some text with an error event.
    pub midstream_error_rate: f64,
    /// The code of a mid-stream error: `server_error` or `rate_limit_exceeded`.
    pub midstream_error_code: String,
    /// After this many admitted requests, every request gets 429 `insufficient_quota`.
    pub quota_after: Option<u64>,
    /// The token budget is a daily cap: a 24 h fixed window, so resets are hours away.
    pub daily_cap: bool,
    /// A streamed answer pauses this long mid-way, after some text.
    pub stall: Duration,
    /// Whose rate-limit headers and retry hints to send; Anthropic's also splits
    /// the token bucket into input and output buckets.
    pub headers: HeaderStyle,
    /// Whether the buckets are enforced at all (`None`: like vLLM or Ollama).
    pub limits: LimitsMode,
    /// Whether the unused output reservation is given back after the answer.
    pub charge: crate::bucket::ChargeMode,
    /// Seed of the fault dice, so a faulty run is repeatable.
    pub seed: u64,
    /// How many of the latest request bodies `/_mock/stats` keeps.
    pub keep_bodies: usize,
    /// How many of the latest requests the stats log keeps.
    pub log_limit: usize,
    /// The organization named in rate-limit messages.
    pub organization: String,
    /// Prompt caching: Anthropic's `cache_control` breakpoints (reads not
    /// charged to the input bucket) and OpenAI's automatic prefixes of 1 024
    /// tokens and more (charged in full). Off: nothing is ever cached.
    pub cache: bool,
    /// Anthropic: the shortest prefix written to the cache, in tokens (a
    /// shorter one is simply not cached).
    pub cache_min_tokens: u64,
    /// OpenAI: how long a cached prefix lives without a hit.
    pub cache_ttl: Duration,
    /// The model's context window in tokens: a request of more input tokens
    /// gets the provider's context-length 400. `None`: no window.
    pub context_window: Option<u64>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tpm: 40_000,
            itpm: None,
            otpm: None,
            rpm: 600,
            window: Duration::from_secs(60),
            bucket: BucketMode::Continuous,
            latency: Duration::ZERO,
            tool_rounds: 2,
            calls_per_round: 1,
            output_tokens: 200,
            default_max_output_tokens: None,
            charge: crate::bucket::ChargeMode::Refund,
            fail_rate: 0.0,
            midstream_error_rate: 0.0,
            midstream_error_code: "server_error".to_string(),
            quota_after: None,
            daily_cap: false,
            stall: Duration::ZERO,
            headers: HeaderStyle::OpenAi,
            limits: LimitsMode::Enforced,
            seed: 0,
            keep_bodies: 32,
            log_limit: 100_000,
            organization: "org-mock".to_string(),
            cache: false,
            cache_min_tokens: 1024,
            cache_ttl: Duration::from_secs(300),
            context_window: None,
        }
    }
}

impl MockConfig {
    /// The prompt cache's rules.
    pub fn cache_rules(&self) -> crate::cache::Rules {
        crate::cache::Rules { min_tokens: self.cache_min_tokens, ttl: self.cache_ttl }
    }

    /// Output tokens charged when a request sets no limit.
    pub fn default_max_output(&self) -> u64 {
        self.default_max_output_tokens.unwrap_or(self.output_tokens)
    }

    /// The Anthropic shape's input bucket capacity per window.
    pub fn input_capacity(&self) -> u64 {
        self.itpm.unwrap_or(self.tpm)
    }

    /// The Anthropic shape's output bucket capacity per window (at least 1).
    pub fn output_capacity(&self) -> u64 {
        self.otpm.unwrap_or((self.tpm / OUTPUT_SHARE).max(1))
    }
}
