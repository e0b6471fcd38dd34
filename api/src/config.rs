//! The API's configuration: clap arguments with environment fallbacks
//! (flag > env > default). Tests and the bench build it in code with
//! [`ApiConfig::new`], `paceline up` field by field from its own flags; none of
//! them sets environment variables.

use shared::config::{ProvidersArg, RedisArgs, Secret};
use shared::runs::RunArgs;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// Default body limit of `POST /v1/runs` (1 MiB).
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
/// Default of `--redis-timeout-ms`: how long one Redis round trip of a
/// request may take before it is a 503.
pub const DEFAULT_REDIS_TIMEOUT_MS: u64 = 2000;
/// Default of `--listen`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Everything `paceline api` needs.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiConfig {
    /// Where Redis is, and the key prefix.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Where it listens, who may call it, how much a request may carry.
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Tool endpoints and retention, as the workers read them.
    #[command(flatten)]
    pub runs: RunArgs,
    /// The fleet's named providers: the API reads only their names (a run's
    /// `provider` must be one), never a key.
    #[command(flatten)]
    pub providers: ProvidersArg,
    /// The operator's token and the open-mode safety catch.
    #[command(flatten)]
    pub access: AccessArgs,
    /// How many event streams may be open, and for how long.
    #[command(flatten)]
    pub streams: StreamArgs,
    /// Per-tenant quotas on submits: unfinished runs, submits a minute.
    #[command(flatten)]
    pub quotas: shared::runs::Quotas,
    /// How a run's first turn gets its pacer ask at submit (set in code by
    /// the binary: the worker's token count). None: the first turn asks when
    /// a worker starts it.
    #[arg(skip)]
    pub first_ask: Option<shared::runs::FirstAsk>,
}

/// The API's own HTTP knobs. Declared once, flattened into `paceline api`
/// and `paceline up`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, env = "PACELINE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Bearer tokens per tenant: `tenant:token,tenant:token`, from
    /// `PACELINE_API_TOKENS` or `PACELINE_API_TOKENS_FILE` in the environment
    /// only (`shared::config::env_only`). Unset or empty: open development
    /// mode (every request is tenant `default`).
    #[arg(skip = shared::config::env_only::<ApiTokens>("PACELINE_API_TOKENS").unwrap_or_default())]
    pub tokens: ApiTokens,
    /// Largest request body accepted, in bytes.
    #[arg(long = "body-limit", env = "PACELINE_BODY_LIMIT", default_value_t = DEFAULT_BODY_LIMIT)]
    pub body_limit: usize,
    /// How long one Redis command of a request may take before it answers 503 (ms).
    #[arg(long = "redis-timeout-ms", env = "PACELINE_REDIS_TIMEOUT_MS", default_value_t = DEFAULT_REDIS_TIMEOUT_MS)]
    pub redis_timeout_ms: u64,
    /// How long a connection has, from its opening and from each response,
    /// to send a request's complete headers (`10s`); then it is closed.
    #[arg(long = "header-timeout", env = "PACELINE_HEADER_TIMEOUT", default_value = crate::serve::DEFAULT_HEADER_TIMEOUT,
          value_parser = shared::config::parse_duration)]
    pub header_timeout: Duration,
    /// How long a write may wait for the client to read (`30s`): a client
    /// that stopped reading has its connection closed, and an event stream
    /// its place back.
    #[arg(long = "write-timeout", env = "PACELINE_WRITE_TIMEOUT", default_value = crate::serve::DEFAULT_WRITE_TIMEOUT,
          value_parser = shared::config::parse_duration)]
    pub write_timeout: Duration,
    /// How long a request's body may take to arrive in full, once its
    /// headers have (`30s`): a body sent a byte at a time is answered 408.
    #[arg(long = "body-timeout", env = "PACELINE_BODY_TIMEOUT", default_value = crate::serve::DEFAULT_BODY_TIMEOUT,
          value_parser = shared::config::parse_duration)]
    pub body_timeout: Duration,
    /// Connections open at once in this process (held under half its file
    /// descriptors); one more is answered 503 and closed.
    #[arg(long = "max-connections", env = "PACELINE_MAX_CONNECTIONS", default_value_t = crate::serve::DEFAULT_MAX_CONNECTIONS,
          value_parser = at_least_one)]
    pub max_connections: usize,
    /// Connections open at once from one client address (an IPv6 /64 counts
    /// as one); one more is answered 503 and closed. 0: no cap per client
    /// (behind a proxy, where every client comes from its address).
    #[arg(long = "max-client-connections", env = "PACELINE_MAX_CLIENT_CONNECTIONS",
          default_value_t = crate::serve::DEFAULT_MAX_CLIENT_CONNECTIONS)]
    pub max_client_connections: usize,
}

/// Reads a count that must be 1 or more.
fn at_least_one(s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| "must be a number, 1 or more".to_owned())
}

impl ServeArgs {
    /// Open mode on `listen`, the defaults elsewhere.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            tokens: ApiTokens::default(),
            body_limit: DEFAULT_BODY_LIMIT,
            redis_timeout_ms: DEFAULT_REDIS_TIMEOUT_MS,
            header_timeout: shared::config::parse_duration(crate::serve::DEFAULT_HEADER_TIMEOUT)
                .expect("the default header timeout reads"),
            write_timeout: shared::config::parse_duration(crate::serve::DEFAULT_WRITE_TIMEOUT)
                .expect("the default write timeout reads"),
            body_timeout: shared::config::parse_duration(crate::serve::DEFAULT_BODY_TIMEOUT)
                .expect("the default body timeout reads"),
            max_connections: crate::serve::DEFAULT_MAX_CONNECTIONS,
            max_client_connections: crate::serve::DEFAULT_MAX_CLIENT_CONNECTIONS,
        }
    }

    /// The bounds on this process's connections, as configured.
    pub fn connection_limits(&self) -> crate::serve::Limits {
        crate::serve::Limits {
            header_timeout: self.header_timeout,
            write_timeout: self.write_timeout,
            max_connections: self.max_connections,
            max_per_client: self.max_client_connections,
        }
    }

    /// The Redis timeout as a duration (at least 50 ms).
    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis_timeout_ms.max(50))
    }
}

/// Bounds on the event streams (`GET /v1/runs/{id}/events`) of one API
/// process: each holds a Redis connection while it follows a live run.
/// Declared once, flattened into `paceline api` and `paceline up`.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Event streams open at once in this process; one more answers 429.
    #[arg(long = "max-streams", env = "PACELINE_MAX_STREAMS", default_value_t = DEFAULT_MAX_STREAMS)]
    pub max_streams: usize,
    /// Event streams one tenant may have open at once; one more answers 429.
    #[arg(long = "max-tenant-streams", env = "PACELINE_MAX_TENANT_STREAMS", default_value_t = DEFAULT_MAX_TENANT_STREAMS)]
    pub max_tenant_streams: usize,
    /// The longest one event stream stays open (`90s`, `15m`, …); then it ends
    /// and the client resumes with `Last-Event-ID`, as SSE clients do.
    #[arg(long = "stream-lifetime", env = "PACELINE_STREAM_LIFETIME", default_value = DEFAULT_STREAM_LIFETIME, value_parser = shared::config::parse_duration)]
    pub lifetime: Duration,
}

/// Default of `--max-streams`.
pub const DEFAULT_MAX_STREAMS: usize = 1_000;
/// Default of `--max-tenant-streams`.
pub const DEFAULT_MAX_TENANT_STREAMS: usize = 100;
/// Default of `--stream-lifetime`.
pub const DEFAULT_STREAM_LIFETIME: &str = "15m";

impl Default for StreamArgs {
    fn default() -> Self {
        Self {
            max_streams: DEFAULT_MAX_STREAMS,
            max_tenant_streams: DEFAULT_MAX_TENANT_STREAMS,
            lifetime: shared::config::parse_duration(DEFAULT_STREAM_LIFETIME).expect("the default lifetime parses"),
        }
    }
}

/// Who may do more than a tenant, and when open mode may face a network
/// (README, "Who sees what"). Declared once, flattened into `paceline api` and `paceline up`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AccessArgs {
    /// The operator's bearer token: `/metrics`, `/v1/workers`, `/v1/dead`, the
    /// global `/v1/queue`, every tenant's lines in `/v1/pacer`, retrying any run.
    /// From `PACELINE_OPERATOR_TOKEN` or `PACELINE_OPERATOR_TOKEN_FILE` in the
    /// environment only.
    #[arg(skip = shared::config::env_only::<Secret>("PACELINE_OPERATOR_TOKEN"))]
    pub operator_token: Option<Secret>,
    /// Serve open mode (no tokens at all) on an address that is not loopback,
    /// and accept any `Host` header: anyone who reaches the port is tenant `default`.
    #[arg(long = "insecure-open", env = "PACELINE_INSECURE_OPEN")]
    pub insecure_open: bool,
    /// Tenants that may submit `mode: companion` runs (comma-separated);
    /// unset or empty: every tenant. Another tenant's companion run answers 403.
    #[arg(
        long = "companion-tenants",
        env = "PACELINE_COMPANION_TENANTS",
        value_delimiter = ',',
        value_name = "TENANTS"
    )]
    pub companion_tenants: Vec<String>,
}

impl AccessArgs {
    /// The tenants that may submit companion runs (empty: every tenant).
    pub fn companion_tenants(&self) -> Vec<String> {
        self.companion_tenants.iter().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect()
    }

    /// The operator token, if one is set and not empty.
    pub fn operator(&self) -> Option<&Secret> {
        self.operator_token.as_ref().filter(|t| !t.expose().trim().is_empty())
    }
}

/// Whether the API may start with `tokens` and `access` on `listen`: every
/// token is distinct (two tenants sharing a token would each read the other's
/// runs, and a tenant holding the operator's token would be the operator), and
/// open mode — no token at all — listens on a loopback address unless
/// `--insecure-open` says otherwise. The error says what to change and never
/// shows a token.
pub fn check_access(listen: SocketAddr, tokens: &ApiTokens, access: &AccessArgs) -> Result<(), String> {
    for (i, (tenant, token)) in tokens.0.iter().enumerate() {
        if let Some((other, _)) = tokens.0[..i].iter().find(|(_, t)| t.expose() == token.expose()) {
            return Err(format!(
                "PACELINE_API_TOKENS: tenants {other} and {tenant} have the same token; each tenant needs its own"
            ));
        }
        if access.operator().is_some_and(|o| o.expose() == token.expose()) {
            return Err(format!(
                "PACELINE_OPERATOR_TOKEN is also the token of tenant {tenant}; the operator needs a token of its own"
            ));
        }
    }
    let open = tokens.is_empty() && access.operator().is_none();
    if open && !listen.ip().is_loopback() && !access.insecure_open {
        return Err(format!(
            "open mode (no PACELINE_API_TOKENS) is for one machine, and {listen} is not a loopback address: \
             set PACELINE_API_TOKENS (and PACELINE_OPERATOR_TOKEN), listen on 127.0.0.1, \
             or pass --insecure-open to serve every caller as tenant `default`"
        ));
    }
    Ok(())
}

impl ApiConfig {
    /// A config built in code: open mode, no tool endpoints, the defaults.
    pub fn new(listen: SocketAddr, redis: RedisArgs) -> Self {
        Self {
            redis,
            serve: ServeArgs::new(listen),
            runs: RunArgs::default(),
            providers: ProvidersArg::default(),
            access: AccessArgs::default(),
            streams: StreamArgs::default(),
            quotas: shared::runs::Quotas::default(),
            first_ask: None,
        }
    }
}

/// The configured tenants and their tokens (`PACELINE_API_TOKENS`). `Debug`
/// and `Display` name the tenants, never a token.
#[derive(Clone, Default)]
pub struct ApiTokens(pub Vec<(String, Secret)>);

impl ApiTokens {
    /// Whether no token is configured (open development mode).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds a tenant's token (tests, `paceline up`).
    pub fn with(mut self, tenant: impl Into<String>, token: impl Into<String>) -> Self {
        self.0.push((tenant.into(), Secret::new(token.into())));
        self
    }
}

impl fmt::Debug for ApiTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter().map(|(t, _)| format!("{t}:<redacted>"))).finish()
    }
}

impl fmt::Display for ApiTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Whether `s` may name a tenant: it becomes part of Redis keys.
pub use shared::runs::valid_tenant;

impl FromStr for ApiTokens {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = Vec::new();
        for (i, pair) in s.split(',').map(str::trim).enumerate().filter(|(_, p)| !p.is_empty()) {
            // The error names the position, never the text: it may hold a token.
            let Some((tenant, token)) = pair.split_once(':') else {
                return Err(format!("entry {} is not tenant:token", i + 1));
            };
            let (tenant, token) = (tenant.trim(), token.trim());
            if !valid_tenant(tenant) {
                return Err(format!("entry {}: a tenant is 1-64 characters of a-z, A-Z, 0-9, _ - .", i + 1));
            }
            if token.is_empty() || token.chars().any(char::is_whitespace) {
                return Err(format!("entry {} ({tenant}): the token is empty or has spaces", i + 1));
            }
            if out.iter().any(|(t, _): &(String, Secret)| t == tenant) {
                return Err(format!("entry {}: tenant {tenant} is listed twice", i + 1));
            }
            out.push((tenant.to_owned(), Secret::new(token)));
        }
        Ok(Self(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        api: ApiConfig,
    }

    #[test]
    fn tokens_parse_and_never_print() {
        let t: ApiTokens = "acme:s3cret, beta:tok2".parse().unwrap();
        assert_eq!(t.0.len(), 2);
        assert_eq!(t.0[1].0, "beta");
        assert_eq!(t.0[1].1.expose(), "tok2");
        assert!(!format!("{t:?}{t}").contains("s3cret"));
        assert!("".parse::<ApiTokens>().unwrap().is_empty());
        for bad in ["acme", "acme:", ":tok", "a b:tok", "a:x,a:y", "a:sek rit", "sekrit"] {
            let err = bad.parse::<ApiTokens>().unwrap_err();
            assert!(!err.contains("sek"), "an error shows the token: {err}");
        }
    }

    #[test]
    fn tokens_must_differ_and_open_mode_stays_on_loopback() {
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let open = ApiTokens::default();
        let none = AccessArgs::default();
        assert_eq!(check_access(local, &open, &none), Ok(()));
        assert_eq!(check_access("[::1]:0".parse().unwrap(), &open, &none), Ok(()));
        for addr in ["0.0.0.0:8080", "192.168.1.5:8080", "[::]:8080"] {
            let err = check_access(addr.parse().unwrap(), &open, &none).unwrap_err();
            assert!(err.contains("--insecure-open"), "{err}");
        }
        let insecure = AccessArgs { insecure_open: true, ..AccessArgs::default() };
        assert_eq!(check_access("0.0.0.0:8080".parse().unwrap(), &open, &insecure), Ok(()));
        let operator = AccessArgs { operator_token: Some(Secret::new("op-sekrit")), ..AccessArgs::default() };
        assert_eq!(check_access("0.0.0.0:8080".parse().unwrap(), &open, &operator), Ok(()), "a token is not open mode");
        let empty_operator = AccessArgs { operator_token: Some(Secret::new(" ")), ..AccessArgs::default() };
        assert!(check_access("0.0.0.0:8080".parse().unwrap(), &open, &empty_operator).is_err());

        let twice = ApiTokens::default().with("acme", "sekrit-1").with("beta", "sekrit-1");
        let err = check_access(local, &twice, &none).unwrap_err();
        assert!(err.contains("acme") && err.contains("beta") && !err.contains("sekrit"), "{err}");
        let tenants = ApiTokens::default().with("acme", "sekrit-1").with("beta", "sekrit-2");
        assert_eq!(check_access(local, &tenants, &none), Ok(()));
        let shared = AccessArgs { operator_token: Some(Secret::new("sekrit-2")), ..AccessArgs::default() };
        let err = check_access(local, &tenants, &shared).unwrap_err();
        assert!(err.contains("beta") && !err.contains("sekrit"), "{err}");
    }

    #[test]
    fn flags_and_defaults() {
        let cli =
            Cli::try_parse_from(["x", "--tool-endpoints", "http://a/tools,http://b/t", "--retention", "1h"]).unwrap();
        assert_eq!(cli.api.runs.tool_endpoints.0.len(), 2);
        assert_eq!(cli.api.runs.retention, Duration::from_secs(3600));
        assert_eq!(cli.api.serve.body_limit, DEFAULT_BODY_LIMIT);
        for flag in ["--api-tokens", "--operator-token", "--redis-url"] {
            let error = Cli::try_parse_from(["x", flag, "sekrit"]).unwrap_err().to_string();
            assert!(error.contains("unexpected argument"), "{flag} is a flag: {error}");
        }
        let cli = Cli::try_parse_from(["x", "--tool-endpoints", "http://a/tools,acme=http://b/t"]).unwrap();
        assert_eq!(cli.api.runs.tool_endpoints.0[1].tenant.as_deref(), Some("acme"));
        assert!(Cli::try_parse_from(["x", "--tool-endpoints", "not-a-url"]).is_err());
        let cli = Cli::try_parse_from(["x", "--companion-tenants", "acme, beta,"]).unwrap();
        assert_eq!(cli.api.access.companion_tenants(), vec!["acme", "beta"]);
        let cli = Cli::try_parse_from(["x", "--providers", "a=chat@http://h/v1,b=anthropic@https://api.anthropic.com"])
            .unwrap();
        assert_eq!(cli.api.providers.names(), vec!["a", "b"]);
        assert!(Cli::try_parse_from(["x", "--providers", "a=gemini@http://h"]).is_err());
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert!(!cli.api.access.insecure_open && cli.api.access.operator().is_none());
        let cli = Cli::try_parse_from(["x", "--insecure-open"]).unwrap();
        assert!(cli.api.access.insecure_open);
        let access = AccessArgs { operator_token: Some(Secret::new("op-sekrit")), ..cli.api.access };
        assert_eq!(access.operator().map(Secret::expose), Some("op-sekrit"));
        assert!(!format!("{access:?}").contains("op-sekrit"), "the operator token is redacted");
    }
}
