//! Config pieces shared by the binaries: clap arguments with environment
//! fallbacks (flag > env > default), flattened into each subcommand.
//!
//! Tests build these values directly (`RedisArgs::new(url, prefix)`) and never
//! call `set_var`.

use std::fmt;

/// Where Redis is and which key prefix this deployment uses.
#[derive(Debug, Clone, clap::Args)]
pub struct RedisArgs {
    /// Redis URL (`redis://`, `rediss://` or `redis+unix://`).
    #[arg(id = "redis_url", long = "redis-url", env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub url: String,
    /// Prefix of every Redis key paceline writes.
    #[arg(long = "prefix", env = "PACELINE_PREFIX", default_value = "paceline")]
    pub prefix: String,
}

impl RedisArgs {
    /// A config value built in code (tests, `paceline up`).
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self { url: url.into(), prefix: prefix.into() }
    }

    /// The key namespace.
    pub fn keys(&self) -> crate::keys::Keys {
        crate::keys::Keys::new(self.prefix.clone())
    }
}

/// The provider a worker calls. The key is read from the environment by the
/// worker only: never stored in Redis, never logged, never returned.
#[derive(Debug, Clone, clap::Args)]
pub struct ProviderArgs {
    /// Base URL of an OpenAI-compatible API.
    #[arg(
        id = "provider_url",
        long = "provider-url",
        env = "PACELINE_PROVIDER_URL",
        default_value = "https://api.openai.com/v1"
    )]
    pub url: String,
    /// The provider's API key.
    #[arg(long = "api-key", env = "OPENAI_API_KEY", hide_env_values = true, default_value = "")]
    pub api_key: Secret,
    /// Wire format: `responses` or `chat` (Chat Completions).
    #[arg(long = "api-style", env = "PACELINE_API_STYLE", value_enum, default_value = "responses")]
    pub api_style: crate::runs::ApiStyle,
}

/// The pacer a worker uses, and its knobs (SPEC §4).
#[derive(Debug, Clone, clap::Args)]
pub struct PacerArgs {
    /// Where the budget state lives: `shared` (Redis, every worker), `local`
    /// (per process) or `off` (reactive backoff only); the last two are baselines.
    #[arg(long = "pacer", env = "PACELINE_PACER", value_enum, default_value = "shared")]
    pub kind: crate::pacer::PacerKind,
    /// The budget's name: processes that share a provider account share it.
    #[arg(long = "budget", env = "PACELINE_BUDGET", default_value = "default")]
    pub budget: String,
    /// Tokens per minute, for providers that send no rate-limit headers.
    #[arg(long = "tpm", env = "PACELINE_TPM")]
    pub tpm: Option<u64>,
    /// Requests per minute, for providers that send no rate-limit headers.
    #[arg(long = "rpm", env = "PACELINE_RPM")]
    pub rpm: Option<u64>,
    /// Headroom work turns leave in the bucket, percent of the limit.
    #[arg(long = "work-floor-pct", env = "PACELINE_WORK_FLOOR_PCT", default_value_t = 5.0)]
    pub work_floor_pct: f64,
    /// Headroom companion (live) turns leave, percent of the limit.
    #[arg(long = "floor-pct", env = "PACELINE_FLOOR_PCT", default_value_t = 2.0)]
    pub floor_pct: f64,
    /// A reset further out than this (ms) is not paced on.
    #[arg(long = "max-pace-ms", env = "PACELINE_MAX_PACE_MS", default_value_t = 90_000)]
    pub max_pace_ms: u64,
    /// Owed time up to this (ms) is waited in place; more is a requeue.
    #[arg(long = "in-place-wait-ms", env = "PACELINE_IN_PLACE_WAIT_MS", default_value_t = 250)]
    pub in_place_wait_ms: u64,
    /// Tenants' weights when the budget is scarce (`alpha:2,beta:1`; default 1 each).
    #[arg(long = "tenant-weights", env = "PACELINE_TENANT_WEIGHTS", default_value = "")]
    pub tenant_weights: String,
    /// Tenants' caps, a share of the budget even when others are idle (`alpha:50%`).
    #[arg(long = "tenant-caps", env = "PACELINE_TENANT_CAPS", default_value = "")]
    pub tenant_caps: String,
}

/// Tenants' weights and caps (fair admission, SPEC §4).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantPolicy {
    weights: std::collections::HashMap<String, f64>,
    caps: std::collections::HashMap<String, f64>,
}

impl TenantPolicy {
    /// Parses `alpha:2,beta:1` and `alpha:50%` (or `alpha:0.5`).
    pub fn parse(weights: &str, caps: &str) -> Result<Self, String> {
        fn pairs(s: &str, what: &str) -> Result<Vec<(String, String)>, String> {
            s.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (t, v) = p.split_once(':').ok_or_else(|| format!("{what}: `{p}` is not tenant:value"))?;
                    Ok((t.trim().to_owned(), v.trim().to_owned()))
                })
                .collect()
        }
        let mut policy = Self::default();
        for (t, v) in pairs(weights, "PACELINE_TENANT_WEIGHTS")? {
            let w: f64 = v.parse().map_err(|_| format!("PACELINE_TENANT_WEIGHTS: `{v}` is not a number"))?;
            if !(w > 0.0 && w.is_finite()) {
                return Err(format!("PACELINE_TENANT_WEIGHTS: {t}'s weight must be positive"));
            }
            policy.weights.insert(t, w);
        }
        for (t, v) in pairs(caps, "PACELINE_TENANT_CAPS")? {
            let cap = match v.strip_suffix('%') {
                Some(pct) => pct.trim().parse::<f64>().map(|p| p / 100.0),
                None => v.parse::<f64>(),
            }
            .map_err(|_| format!("PACELINE_TENANT_CAPS: `{v}` is not a share"))?;
            if !(cap > 0.0 && cap <= 1.0) {
                return Err(format!("PACELINE_TENANT_CAPS: {t}'s cap must be in (0, 100 %]"));
            }
            policy.caps.insert(t, cap);
        }
        Ok(policy)
    }

    /// `tenant` as the pacer sees it.
    pub fn who<'a>(&self, tenant: &'a str) -> crate::pacer::Who<'a> {
        crate::pacer::Who {
            tenant,
            weight: self.weights.get(tenant).copied().unwrap_or(1.0),
            cap: self.caps.get(tenant).copied().unwrap_or(0.0),
        }
    }
}

impl PacerArgs {
    /// Tenants' weights and caps from these arguments.
    pub fn tenant_policy(&self) -> Result<TenantPolicy, String> {
        TenantPolicy::parse(&self.tenant_weights, &self.tenant_caps)
    }

    /// The pacing policy's knobs from these arguments.
    pub fn pacing_config(&self) -> crate::pacer::PacingConfig {
        crate::pacer::PacingConfig {
            floor_work: (self.work_floor_pct / 100.0).clamp(0.0, 0.9),
            floor_companion: (self.floor_pct / 100.0).clamp(0.0, 0.9),
            max_pace_ms: self.max_pace_ms,
            configured_tpm: self.tpm,
            configured_rpm: self.rpm,
            ..crate::pacer::PacingConfig::default()
        }
    }

    /// The pacer these arguments describe, over `conn` for the shared one.
    pub fn build(&self, conn: redis::aio::ConnectionManager, keys: crate::keys::Keys) -> crate::pacer::Pacer {
        use crate::pacer::{LocalPacer, Pacer, PacerKind, SharedPacer};
        match self.kind {
            PacerKind::Shared => Pacer::Shared(SharedPacer::new(conn, keys, self.budget.clone(), self.pacing_config())),
            PacerKind::Local => {
                // Bookings are per process here; a requeued turn comes back elsewhere.
                let config = crate::pacer::PacingConfig { booking_grace_ms: 2_000, ..self.pacing_config() };
                Pacer::Local(LocalPacer::new(self.budget.clone(), config))
            }
            PacerKind::Off => Pacer::Off,
        }
    }
}

/// Parses `90s`, `30m`, `12h`, `7d`, `1500ms` or a bare number of seconds
/// (`PACELINE_RETENTION` and other long durations; one parser for every process).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration like 7d, 12h, 30m, 90s"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => return Ok(std::time::Duration::from_millis(n)),
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return Err(format!("{s:?} is not a duration like 7d, 12h, 30m, 90s")),
    };
    Ok(std::time::Duration::from_secs(secs))
}

/// A secret string whose `Debug` and `Display` never show it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself; call only where it is sent (an HTTP header).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether no secret was given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "Secret(<empty>)" } else { "Secret(<redacted>)" })
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        pacer: PacerArgs,
    }

    #[test]
    fn pacer_flags_become_the_policy() {
        use clap::Parser;
        let cli = Cli::try_parse_from(["x", "--pacer", "local", "--tpm", "6000", "--work-floor-pct", "5"]).unwrap();
        assert_eq!(cli.pacer.kind, crate::pacer::PacerKind::Local);
        let c = cli.pacer.pacing_config();
        assert_eq!(c.configured_tpm, Some(6000));
        assert!((c.floor_work - 0.05).abs() < 1e-9);
        assert!((c.floor_companion - 0.02).abs() < 1e-9, "the SPEC's default floor is 2 %");
        assert!(Cli::try_parse_from(["x", "--pacer", "fast"]).is_err());
    }

    #[test]
    fn tenant_weights_and_caps_parse_and_refuse_nonsense() {
        let p = TenantPolicy::parse("alpha:2, beta:1", "alpha:50%,gamma:0.25").unwrap();
        assert_eq!(p.who("alpha").weight, 2.0);
        assert_eq!(p.who("alpha").cap, 0.5);
        assert_eq!(p.who("gamma").cap, 0.25);
        assert_eq!(p.who("nobody").weight, 1.0, "default weight");
        assert_eq!(p.who("nobody").cap, 0.0, "no cap by default");
        for (w, c) in [("alpha", ""), ("alpha:x", ""), ("alpha:0", ""), ("", "beta:150%"), ("", "beta:-1")] {
            assert!(TenantPolicy::parse(w, c).is_err(), "{w} / {c}");
        }
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-live-123");
        assert!(!format!("{s:?}").contains("sk-live"));
        assert!(!format!("{s}").contains("sk-live"));
        assert_eq!(s.expose(), "sk-live-123");
    }
}
