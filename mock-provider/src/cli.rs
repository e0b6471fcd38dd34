//! The command line of `paceline mock-provider`: every knob of [`MockConfig`]
//! as a flag with a `MOCK_*` environment fallback (flag > env > default).
//! It lives here, not in the binary, so the benchmark can start the same mock
//! from the same flags.

use crate::bucket::{BucketMode, ChargeMode};
use crate::config::MockConfig;
use crate::shape::{HeaderStyle, LimitsMode};
use std::net::SocketAddr;
use std::time::Duration;

/// Flags of the mock provider.
#[derive(Debug, Clone, clap::Args)]
pub struct MockArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "MOCK_LISTEN", default_value = "127.0.0.1:8089")]
    pub listen: SocketAddr,
    /// Token bucket capacity per window (tokens per minute with the default 60 s window).
    #[arg(long, env = "MOCK_TPM", default_value_t = MockConfig::default().tpm)]
    pub tpm: u64,
    /// Input token bucket per window, with --headers anthropic [default: --tpm].
    #[arg(long, env = "MOCK_ITPM")]
    pub itpm: Option<u64>,
    /// Output token bucket per window, with --headers anthropic [default: --tpm / 5].
    #[arg(long, env = "MOCK_OTPM")]
    pub otpm: Option<u64>,
    /// Request bucket capacity per window (requests per minute with the default window).
    #[arg(long, env = "MOCK_RPM", default_value_t = MockConfig::default().rpm)]
    pub rpm: u64,
    /// Bucket window in seconds: 60 like OpenAI, shorter to scale a minute down for fast tests.
    #[arg(long, env = "MOCK_WINDOW_S", default_value_t = MockConfig::default().window.as_secs_f64())]
    pub window_s: f64,
    /// How the buckets refill: continuously at capacity/window, or fully at each window boundary.
    #[arg(long, env = "MOCK_BUCKET", value_enum, default_value_t = MockConfig::default().bucket)]
    pub bucket: BucketMode,
    /// What happens to a call's unused output reservation: given back after the answer
    /// (`refund`), or kept (`keep`, OpenAI's documented admission rule).
    #[arg(long, env = "MOCK_CHARGE", value_enum, default_value_t = MockConfig::default().charge)]
    pub charge: ChargeMode,
    /// Whose rate-limit headers and 429 retry hints to speak; `anthropic` also splits the
    /// token bucket into --itpm and --otpm, `none` puts the delay only in the 429's body
    /// [default: openai].
    #[arg(long, env = "MOCK_HEADERS", value_enum)]
    pub headers: Option<HeaderStyle>,
    /// Enforce the buckets, or admit every request and send no rate-limit headers
    /// (`none`, like vLLM, Ollama or TGI).
    #[arg(long, env = "MOCK_LIMITS", value_enum, default_value_t = MockConfig::default().limits)]
    pub limits: LimitsMode,
    /// Delay before the first byte of an admitted answer, in ms (429s answer at once).
    #[arg(long, env = "MOCK_LATENCY_MS", default_value_t = MockConfig::default().latency.as_millis() as u64)]
    pub latency_ms: u64,
    /// Tool outputs a conversation must hold before the model answers in text (when it offers tools).
    #[arg(long, env = "MOCK_TOOL_ROUNDS", default_value_t = MockConfig::default().tool_rounds)]
    pub tool_rounds: usize,
    /// Function calls per tool round (parallel calls in one answer).
    #[arg(long, env = "MOCK_CALLS_PER_ROUND", default_value_t = MockConfig::default().calls_per_round)]
    pub calls_per_round: usize,
    /// Length of the final text answer in tokens (one word = one token).
    #[arg(long, env = "MOCK_OUTPUT_TOKENS", default_value_t = MockConfig::default().output_tokens)]
    pub output_tokens: u64,
    /// Output tokens charged at admission when a request sets no limit [default: --output-tokens].
    #[arg(long, env = "MOCK_DEFAULT_MAX_OUTPUT_TOKENS")]
    pub default_max_output_tokens: Option<u64>,
    /// Fraction (0..1) of requests that fail with 500, 503 or 529 before admission.
    #[arg(long, env = "MOCK_FAIL_RATE", default_value_t = MockConfig::default().fail_rate)]
    pub fail_rate: f64,
    /// Fraction (0..1) of streamed answers that break after some text with an error event.
    #[arg(long, env = "MOCK_MIDSTREAM_ERROR_RATE", default_value_t = MockConfig::default().midstream_error_rate)]
    pub midstream_error_rate: f64,
    /// The code of a mid-stream error.
    #[arg(long, env = "MOCK_MIDSTREAM_ERROR_CODE", default_value = "server_error",
          value_parser = ["server_error", "rate_limit_exceeded"])]
    pub midstream_error_code: String,
    /// After N admitted requests, answer every request with 429 insufficient_quota.
    #[arg(long, env = "MOCK_QUOTA_AFTER")]
    pub quota_after: Option<u64>,
    /// Make --tpm a daily cap: a fixed 24 h window, so resets and retry-afters are hours away.
    #[arg(long, env = "MOCK_DAILY_CAP")]
    pub daily_cap: bool,
    /// Pause every streamed answer this many ms mid-way, after some text.
    #[arg(long, env = "MOCK_STALL_MS", default_value_t = MockConfig::default().stall.as_millis() as u64)]
    pub stall_ms: u64,
    /// The old spelling of --headers none (hidden); --headers or MOCK_HEADERS wins over it.
    #[arg(long, env = "MOCK_NO_HEADERS", hide = true)]
    pub no_headers: bool,
    /// Seed of the fault dice (--fail-rate, --midstream-error-rate), so a run is repeatable.
    #[arg(long, env = "MOCK_SEED", default_value_t = MockConfig::default().seed)]
    pub seed: u64,
    /// How many of the latest request bodies GET /_mock/stats keeps.
    #[arg(long, env = "MOCK_KEEP_BODIES", default_value_t = MockConfig::default().keep_bodies)]
    pub keep_bodies: usize,
    /// How many of the latest requests the GET /_mock/stats log keeps.
    #[arg(long, env = "MOCK_LOG_LIMIT", default_value_t = MockConfig::default().log_limit)]
    pub log_limit: usize,
    /// The organization named in rate-limit messages.
    #[arg(long, env = "MOCK_ORGANIZATION", default_value = "org-mock")]
    pub organization: String,
    /// Cache prompts: Anthropic's cache_control breakpoints (reads not charged to the input
    /// bucket) and OpenAI's automatic prefixes of 1024+ tokens (charged in full).
    #[arg(long, env = "MOCK_CACHE")]
    pub cache: bool,
    /// Anthropic: the shortest prefix written to the cache, in tokens.
    #[arg(long, env = "MOCK_CACHE_MIN_TOKENS", default_value_t = MockConfig::default().cache_min_tokens)]
    pub cache_min_tokens: u64,
    /// OpenAI: seconds a cached prefix lives without a hit.
    #[arg(long, env = "MOCK_CACHE_TTL_S", default_value_t = MockConfig::default().cache_ttl.as_secs_f64())]
    pub cache_ttl_s: f64,
    /// The model's context window in tokens: a longer input gets the provider's
    /// context-length 400 [default: none].
    #[arg(long, env = "MOCK_CONTEXT_WINDOW")]
    pub context_window: Option<u64>,
}

impl MockArgs {
    /// The configuration these flags describe, or what is wrong with them.
    pub fn into_config(self) -> Result<MockConfig, String> {
        if !(self.window_s.is_finite() && self.window_s > 0.0) {
            return Err(format!("--window-s must be a positive number of seconds, not {}", self.window_s));
        }
        for (name, rate) in [("--fail-rate", self.fail_rate), ("--midstream-error-rate", self.midstream_error_rate)] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(format!("{name} must be between 0 and 1, not {rate}"));
            }
        }
        if [Some(self.tpm), Some(self.rpm), self.itpm, self.otpm].contains(&Some(0)) {
            return Err("--tpm, --rpm, --itpm and --otpm must be at least 1".to_string());
        }
        if self.cache_min_tokens == 0 {
            return Err("--cache-min-tokens must be at least 1".to_string());
        }
        if !(self.cache_ttl_s.is_finite() && self.cache_ttl_s > 0.0) {
            return Err(format!("--cache-ttl-s must be a positive number of seconds, not {}", self.cache_ttl_s));
        }
        if self.context_window == Some(0) {
            return Err("--context-window must be at least 1 token".to_string());
        }
        // `--no-headers` only changes the default, so an explicit style (flag
        // or env) still decides.
        let headers = self.headers.unwrap_or(if self.no_headers { HeaderStyle::None } else { HeaderStyle::default() });
        Ok(MockConfig {
            listen: self.listen,
            tpm: self.tpm,
            itpm: self.itpm,
            otpm: self.otpm,
            rpm: self.rpm,
            window: Duration::from_secs_f64(self.window_s),
            bucket: self.bucket,
            charge: self.charge,
            latency: Duration::from_millis(self.latency_ms),
            tool_rounds: self.tool_rounds,
            calls_per_round: self.calls_per_round.max(1),
            output_tokens: self.output_tokens,
            default_max_output_tokens: self.default_max_output_tokens,
            fail_rate: self.fail_rate,
            midstream_error_rate: self.midstream_error_rate,
            midstream_error_code: self.midstream_error_code,
            quota_after: self.quota_after,
            daily_cap: self.daily_cap,
            stall: Duration::from_millis(self.stall_ms),
            headers,
            limits: self.limits,
            seed: self.seed,
            keep_bodies: self.keep_bodies,
            log_limit: self.log_limit,
            organization: self.organization,
            cache: self.cache,
            cache_min_tokens: self.cache_min_tokens,
            cache_ttl: Duration::from_secs_f64(self.cache_ttl_s),
            context_window: self.context_window,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        mock: MockArgs,
    }

    #[test]
    fn every_flag_has_a_help_line() {
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        for arg in cmd.get_arguments() {
            if arg.get_id() == "help" {
                continue;
            }
            assert!(arg.get_help().is_some(), "--{} has no help", arg.get_id());
        }
    }

    #[test]
    fn flags_become_the_config() {
        let cli = Cli::try_parse_from([
            "mock",
            "--listen",
            "127.0.0.1:0",
            "--tpm",
            "1000",
            "--rpm",
            "10",
            "--window-s",
            "1.5",
            "--bucket",
            "window",
            "--charge",
            "keep",
            "--headers",
            "anthropic",
            "--itpm",
            "800",
            "--otpm",
            "90",
            "--limits",
            "none",
            "--latency-ms",
            "5",
            "--tool-rounds",
            "3",
            "--output-tokens",
            "7",
            "--fail-rate",
            "0.25",
            "--quota-after",
            "4",
            "--daily-cap",
            "--stall-ms",
            "9",
            "--seed",
            "11",
            "--midstream-error-rate",
            "0.5",
            "--midstream-error-code",
            "rate_limit_exceeded",
            "--cache",
            "--cache-min-tokens",
            "2048",
            "--cache-ttl-s",
            "0.5",
            "--context-window",
            "8000",
        ])
        .unwrap();
        let cfg = cli.mock.into_config().unwrap();
        assert_eq!(cfg.tpm, 1000);
        assert_eq!(cfg.rpm, 10);
        assert_eq!(cfg.window, Duration::from_millis(1500));
        assert_eq!(cfg.bucket, BucketMode::Window);
        assert_eq!(cfg.charge, ChargeMode::Keep);
        assert_eq!(cfg.latency, Duration::from_millis(5));
        assert_eq!(cfg.tool_rounds, 3);
        assert_eq!(cfg.output_tokens, 7);
        assert_eq!(cfg.fail_rate, 0.25);
        assert_eq!(cfg.quota_after, Some(4));
        assert!(cfg.daily_cap);
        assert_eq!(cfg.stall, Duration::from_millis(9));
        assert_eq!(cfg.headers, HeaderStyle::Anthropic);
        assert_eq!(cfg.limits, LimitsMode::None);
        assert_eq!((cfg.input_capacity(), cfg.output_capacity()), (800, 90));
        assert_eq!(cfg.seed, 11);
        assert_eq!(cfg.midstream_error_code, "rate_limit_exceeded");
        assert_eq!(cfg.default_max_output(), 7);
        assert!(cfg.cache);
        assert_eq!((cfg.cache_min_tokens, cfg.cache_ttl), (2048, Duration::from_millis(500)));
        assert_eq!(cfg.context_window, Some(8000));
    }

    /// The flags' defaults are `MockConfig::default()` (the listen address
    /// aside: the command serves on 8089, a config built in code on port 0).
    #[test]
    fn the_flags_default_to_the_configs_defaults() {
        let from_flags = Cli::try_parse_from(["mock"]).unwrap().mock.into_config().unwrap();
        let defaults = MockConfig::default();
        assert_eq!(format!("{:?}", MockConfig { listen: defaults.listen, ..from_flags }), format!("{defaults:?}"));
    }

    #[test]
    fn the_defaults_are_an_enforcing_openai_provider() {
        let cfg = Cli::try_parse_from(["mock", "--tpm", "1000"]).unwrap().mock.into_config().unwrap();
        assert_eq!((cfg.headers, cfg.limits), (HeaderStyle::OpenAi, LimitsMode::Enforced));
        assert_eq!((cfg.input_capacity(), cfg.output_capacity()), (1000, 200), "--itpm is --tpm, --otpm a fifth");
    }

    #[test]
    fn no_headers_is_headers_none_unless_a_style_is_named() {
        let style = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("mock").chain(args.iter().copied())).unwrap();
            cli.mock.into_config().unwrap().headers
        };
        assert_eq!(style(&["--no-headers"]), HeaderStyle::None);
        assert_eq!(style(&["--headers", "none"]), HeaderStyle::None);
        assert_eq!(style(&["--headers", "azure"]), HeaderStyle::Azure);
        assert_eq!(style(&["--no-headers", "--headers", "openai"]), HeaderStyle::OpenAi);
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("--no-headers"), "the old spelling is hidden");
    }

    #[test]
    fn nonsense_is_refused() {
        for bad in [
            ["--window-s", "0"],
            ["--fail-rate", "1.5"],
            ["--tpm", "0"],
            ["--itpm", "0"],
            ["--otpm", "0"],
            ["--cache-min-tokens", "0"],
            ["--cache-ttl-s", "0"],
            ["--cache-ttl-s", "inf"],
            ["--context-window", "0"],
        ] {
            let cli = Cli::try_parse_from(["mock", bad[0], bad[1]]).unwrap();
            assert!(cli.mock.into_config().is_err(), "{bad:?}");
        }
        for bad in [["--bucket", "leaky"], ["--headers", "gemini"], ["--limits", "some"], ["--itpm", "-1"]] {
            assert!(Cli::try_parse_from(["mock", bad[0], bad[1]]).is_err(), "{bad:?}");
        }
    }
}
