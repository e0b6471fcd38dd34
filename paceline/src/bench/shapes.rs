//! The provider shapes `paceline bench --shape` measures the pacers against
//! (docs/pacing.md, "Provider shapes"): how a real provider's bucket refills, whether it gives back
//! the unused output reservation, and what its headers tell. Each shape is a
//! mock configuration (and, for `configured`, worker flags) at its own
//! default limits; the pacing trial is the same for every shape.

use mock_provider::{BucketMode, ChargeMode, HeaderStyle, LimitsMode, MockConfig};
use std::time::Duration;

/// One provider shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// A continuous bucket that gives the unused output back (the mock's default).
    Continuous,
    /// A continuous bucket that keeps the whole reservation (OpenAI's documented admission rule).
    Keep,
    /// A bucket that refills whole at fixed window boundaries (Azure-style windows, many gateways).
    Window,
    /// Separate input and output buckets with a tight output bucket and RFC 3339 resets (Anthropic).
    Anthropic,
    /// `remaining` headers alone, the charge kept, per-minute limits (Azure OpenAI), at a real minute.
    Azure,
    /// No rate-limit headers at all; 429s carry their delay in the body (Gemini-style APIs, gateways), per-minute limits at a real minute.
    Headerless,
    /// No headers, but the workers are given the limits (`--tpm`, `--rpm`), at a real minute.
    Configured,
    /// No limits at all (vLLM, Ollama, TGI): the workers' slots and the latency bound the run.
    Unlimited,
}

impl Shape {
    /// Every shape, in the order `--shape all` runs them.
    pub const ALL: [Shape; 8] = [
        Shape::Continuous,
        Shape::Keep,
        Shape::Window,
        Shape::Anthropic,
        Shape::Azure,
        Shape::Headerless,
        Shape::Configured,
        Shape::Unlimited,
    ];

    /// Its name on the command line and in the JSON.
    pub fn name(self) -> String {
        use clap::ValueEnum as _;
        self.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default()
    }

    /// Whether the proactive layer has anything to pace on (headers or
    /// configured limits): the shapes held to the 429 bar.
    pub fn paced(self) -> bool {
        !matches!(self, Shape::Headerless | Shape::Unlimited)
    }

    /// The mock of this shape, from the bench's own (`base`: its tpm, rpm,
    /// window, latency), and the extra worker flags it needs. The shapes
    /// that take limits per minute run at a real minute, with the same
    /// refill rate as the base where they can.
    pub fn mock(self, base: &MockConfig) -> (MockConfig, Vec<String>) {
        let scaled = |per_window: u64| -> u64 {
            // The same refill rate over a real minute.
            (per_window as f64 * 60.0 / base.window.as_secs_f64().max(0.001) / REAL_MINUTE_SHARE).round() as u64
        };
        let mut mock = base.clone();
        let mut worker_args = vec![];
        match self {
            Shape::Continuous => {}
            Shape::Keep => mock.charge = ChargeMode::Keep,
            Shape::Window => mock.bucket = BucketMode::Window,
            Shape::Anthropic => {
                mock.headers = HeaderStyle::Anthropic;
                mock.itpm = Some(base.tpm);
                mock.otpm = Some((base.tpm / ANTHROPIC_OUTPUT_SHARE).max(1));
            }
            Shape::Azure => {
                mock.headers = HeaderStyle::Azure;
                mock.charge = ChargeMode::Keep;
                mock.window = Duration::from_secs(60);
                mock.tpm = scaled(base.tpm);
                mock.rpm = scaled(base.rpm);
            }
            Shape::Headerless => {
                // Providers without headers state their limits per minute
                // (Gemini's RPM and TPM): a scaled window would hide what
                // the pacer learns at the real refill rate.
                mock.headers = HeaderStyle::None;
                mock.window = Duration::from_secs(60);
                mock.tpm = scaled(base.tpm);
                mock.rpm = scaled(base.rpm);
            }
            Shape::Configured => {
                mock.headers = HeaderStyle::None;
                mock.window = Duration::from_secs(60);
                mock.tpm = scaled(base.tpm);
                mock.rpm = scaled(base.rpm);
                worker_args = vec!["--tpm".into(), mock.tpm.to_string(), "--rpm".into(), mock.rpm.to_string()];
            }
            Shape::Unlimited => mock.limits = LimitsMode::None,
        }
        (mock, worker_args)
    }

    /// How much longer than the base trial's timeout its trials may take.
    pub fn timeout(self, base: Duration) -> Duration {
        match self {
            Shape::Azure | Shape::Configured | Shape::Headerless => base.max(Duration::from_secs(300)),
            _ => base,
        }
    }
}

/// Anthropic's output bucket is this many times smaller than its input bucket
/// (its tiers: 40 000 input and 8 000 output tokens a minute at tier 1), here
/// a little tighter so that it binds.
const ANTHROPIC_OUTPUT_SHARE: u64 = 12;

/// The real-minute shapes run at this share of the base refill rate (so that
/// their trial, a bucket refilling once a minute, stays about as long as the
/// others': the larger first bucket absorbs more of the work).
const REAL_MINUTE_SHARE: f64 = 2.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_has_a_name_and_a_mock() {
        let base = MockConfig { tpm: 60_000, rpm: 600, window: Duration::from_secs(10), ..MockConfig::default() };
        for shape in Shape::ALL {
            assert!(!shape.name().is_empty());
            let (mock, args) = shape.mock(&base);
            match shape {
                Shape::Azure | Shape::Configured | Shape::Headerless => {
                    assert_eq!(mock.window, Duration::from_secs(60));
                    assert_eq!(mock.tpm, 180_000, "{shape:?}: half the base rate over a real minute");
                }
                _ => assert_eq!(mock.window, base.window),
            }
            assert_eq!(args.is_empty(), shape != Shape::Configured, "{shape:?}");
        }
        assert_eq!(Shape::Anthropic.mock(&base).0.otpm, Some(5_000));
    }
}
