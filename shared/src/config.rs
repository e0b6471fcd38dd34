//! Config pieces shared by the binaries: clap arguments with environment
//! fallbacks (flag > env > default), flattened into each subcommand.
//!
//! Secrets are the exception: the Redis URL (it may hold a password) and the
//! API's tokens are read from the environment only ([`env_only`]), never a
//! flag, because a command line is in every `ps`. Each may also come from a
//! file named by `<NAME>_FILE` (Docker and Kubernetes mount secrets as files).
//!
//! Tests build these values directly (`RedisArgs::new(url, prefix)`) and never
//! call `set_var`.

use std::fmt;
use std::str::FromStr;

/// What `--help` of `paceline api`, `worker` and `up` says of the secrets.
pub const SECRETS_HELP: &str = "Secrets are read from the environment only, never from a flag (a command line \
is in every `ps`): REDIS_URL, PACELINE_API_TOKENS and PACELINE_OPERATOR_TOKEN (each also from a file named \
by REDIS_URL_FILE, PACELINE_API_TOKENS_FILE, PACELINE_OPERATOR_TOKEN_FILE), OPENAI_API_KEY, ANTHROPIC_API_KEY \
and PACELINE_TOOL_SECRET.";

/// The default `REDIS_URL`.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// A secret's value from the environment only: `name`, else the contents
/// of the file `<name>_FILE` names (its trailing newline dropped); `None`
/// when neither is set (or set empty). A value that cannot be used — both
/// set, a file that cannot be read, a value `T` does not read — ends the
/// process with the reason, naming the variable and never the value, as
/// clap ends it for a bad flag. For `#[arg(skip = env_only(…))]` fields.
pub fn env_only<T: FromStr>(name: &str) -> Option<T>
where
    T::Err: fmt::Display,
{
    match env_value(name, |var| std::env::var(var).ok()).and_then(|value| parse_secret(name, value)) {
        Ok(value) => value,
        Err(why) => {
            eprintln!("error: {why}");
            std::process::exit(2);
        }
    }
}

/// [`env_only`]'s reading, over `get` (the environment, or a test's map).
fn env_value(name: &str, get: impl Fn(&str) -> Option<String>) -> Result<Option<String>, String> {
    let file_var = format!("{name}_FILE");
    let set = |var: &str| get(var).filter(|v| !v.trim().is_empty());
    match (set(name), set(&file_var)) {
        (Some(_), Some(_)) => Err(format!("{name} and {file_var} are both set: set one")),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => std::fs::read_to_string(path.trim())
            .map(|text| Some(text.trim_end_matches(['\n', '\r']).to_owned()))
            .map_err(|e| format!("{file_var} names a file that cannot be read ({e})")),
        (None, None) => Ok(None),
    }
}

/// `value` read as a `T`; the error names `name`, not the value.
fn parse_secret<T: FromStr>(name: &str, value: Option<String>) -> Result<Option<T>, String>
where
    T::Err: fmt::Display,
{
    value.map(|v| v.parse::<T>().map_err(|e| format!("{name}: {e}"))).transpose()
}

/// Where Redis is and which key prefix this deployment uses. Its `Debug`
/// hides the URL's password; the URL is never a flag.
#[derive(Clone, clap::Args)]
pub struct RedisArgs {
    /// Redis URL (`redis://`, `rediss://` or `redis+unix://`): `REDIS_URL` or
    /// `REDIS_URL_FILE` in the environment ([`env_only`]), else [`DEFAULT_REDIS_URL`].
    #[arg(skip = env_only::<String>("REDIS_URL").unwrap_or_else(|| DEFAULT_REDIS_URL.to_owned()))]
    pub url: String,
    /// Prefix of every Redis key paceline writes.
    #[arg(long = "prefix", env = "PACELINE_PREFIX", default_value = "paceline")]
    pub prefix: String,
    /// Seed nodes of a Redis Cluster (`PACELINE_REDIS_CLUSTER_NODES`,
    /// environment only: the URLs may hold a password): when any is given,
    /// every connection goes to the cluster and `url` is not used.
    #[arg(skip = env_only::<ClusterNodes>("PACELINE_REDIS_CLUSTER_NODES").unwrap_or_default())]
    pub cluster_nodes: ClusterNodes,
    /// Queue partitions (`PACELINE_QUEUE_PARTITIONS`): only 1 is built yet,
    /// on a single Redis and on a cluster ([`RedisArgs::check`] refuses others).
    #[arg(long = "queue-partitions", env = "PACELINE_QUEUE_PARTITIONS", default_value_t = 1)]
    pub partitions: u32,
}

impl fmt::Debug for RedisArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisArgs")
            .field("url", &redact_url(&self.url))
            .field("prefix", &self.prefix)
            .field("cluster_nodes", &self.cluster_nodes)
            .field("partitions", &self.partitions)
            .finish()
    }
}

/// The seed nodes of a Redis Cluster: comma-separated `redis://` or
/// `rediss://` URLs, each naming a host (any reachable one tells the
/// client the rest). Empty: one Redis.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClusterNodes(pub Vec<String>);

/// The nodes, comma-separated, their passwords hidden ([`redact_url`]).
impl fmt::Display for ClusterNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self.0.iter().map(|n| redact_url(n)).collect();
        f.write_str(&nodes.join(", "))
    }
}

impl fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{self}]")
    }
}

impl FromStr for ClusterNodes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let nodes: Vec<String> = s.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned).collect();
        if nodes.is_empty() {
            return Err("names no node: give the cluster's seed nodes as comma-separated redis:// URLs".to_owned());
        }
        for (i, node) in nodes.iter().enumerate() {
            let scheme_ok = node.starts_with("redis://") || node.starts_with("rediss://");
            let host = node.split_once("://").map_or("", |(_, rest)| rest.rsplit('@').next().unwrap_or(""));
            if !scheme_ok || host.is_empty() || host.starts_with(':') || host.starts_with('/') {
                // Never the URL itself: it may hold a password.
                return Err(format!(
                    "node {} is not a redis:// or rediss:// URL naming a host (redis+unix:// cannot reach a cluster)",
                    i + 1
                ));
            }
        }
        Ok(Self(nodes))
    }
}

/// `url` with its user and password (`redis://:pw@host`) shown as `***`:
/// what a log line or a start-up banner may print.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}***{}", &url[..s + 3], &url[at..]),
        _ => url.to_owned(),
    }
}

impl RedisArgs {
    /// A config value built in code (tests, `paceline up`): one Redis.
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self { url: url.into(), prefix: prefix.into(), cluster_nodes: ClusterNodes::default(), partitions: 1 }
    }

    /// The same deployment on the Redis Cluster whose seed nodes are `nodes`.
    pub fn on_cluster(mut self, nodes: Vec<String>) -> Self {
        self.cluster_nodes = ClusterNodes(nodes);
        self
    }

    /// Whether this deployment runs on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        !self.cluster_nodes.0.is_empty()
    }

    /// The key namespace: on a cluster, every key in the one slot of the
    /// prefix's hash tag (`Keys::one_slot`).
    pub fn keys(&self) -> crate::keys::Keys {
        if self.is_cluster() {
            crate::keys::Keys::one_slot(self.prefix.clone())
        } else {
            crate::keys::Keys::new(self.prefix.clone())
        }
    }

    /// What cannot run, said before anything starts ([`check_partitions`]).
    pub fn check(&self) -> Result<(), String> {
        check_partitions(self.partitions)
    }

    /// Where to say Redis is, its password hidden: the URL, or the cluster's seed nodes.
    pub fn describe(&self) -> String {
        if self.is_cluster() {
            format!("the Redis Cluster of {}", self.cluster_nodes)
        } else {
            redact_url(&self.url)
        }
    }
}

/// `PACELINE_QUEUE_PARTITIONS` other than one is refused: partitioned queues
/// are not built yet (`docs/redis-cluster-plan.md`, stage d).
pub fn check_partitions(partitions: u32) -> Result<(), String> {
    if partitions == 1 {
        return Ok(());
    }
    Err(format!(
        "PACELINE_QUEUE_PARTITIONS={partitions}: this version keeps every run in one partition (partitioned \
         queues are not built yet); unset it or set it to 1"
    ))
}

/// `PACELINE_PROVIDERS`, read by the workers (where to send) and by the API
/// (which names a run may give): declared once, flattened into both.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ProvidersArg {
    /// Named providers, each its own budget: `NAME=STYLE@URL[#KEY_VAR][;tpm=N][;rpm=N]`,
    /// comma-separated, or a JSON list. The first is the default. Unset: one provider.
    #[arg(long = "providers", env = "PACELINE_PROVIDERS", default_value = "", value_name = "TABLE")]
    pub providers: crate::providers::ProviderTable,
}

impl ProvidersArg {
    /// The provider names runs may give (`SubmitPolicy::providers`): empty
    /// for a single-provider fleet (whose one provider is `default`).
    pub fn names(&self) -> Vec<String> {
        self.providers.names()
    }
}

/// The pacer a worker uses, and its knobs (docs/pacing.md).
#[derive(Debug, Clone, clap::Args)]
pub struct PacerArgs {
    /// Where the budget state lives: `shared` (Redis, every worker), `local`
    /// (per process) or `off` (reactive backoff only); the last two are baselines.
    #[arg(long = "pacer", env = "PACELINE_PACER", value_enum, default_value = "shared")]
    pub kind: crate::pacer::PacerKind,
    /// The budget's name: processes that share a provider account share it.
    #[arg(long = "budget", env = "PACELINE_BUDGET", default_value = DEFAULT_BUDGET)]
    pub budget: String,
    /// Tokens per minute, for providers that send no rate-limit headers.
    #[arg(long = "tpm", env = "PACELINE_TPM")]
    pub tpm: Option<u64>,
    /// Requests per minute, for providers that send no rate-limit headers.
    #[arg(long = "rpm", env = "PACELINE_RPM")]
    pub rpm: Option<u64>,
    /// Headroom work turns leave in the bucket, percent of the limit.
    #[arg(long = "work-floor-pct", env = "PACELINE_WORK_FLOOR_PCT", default_value_t = DEFAULT_WORK_FLOOR_PCT)]
    pub work_floor_pct: f64,
    /// Headroom companion turns leave, percent of the limit (below the work
    /// floor: a person waiting may dig deeper).
    #[arg(
        long = "companion-floor-pct",
        alias = "floor-pct",
        env = "PACELINE_COMPANION_FLOOR_PCT",
        default_value_t = DEFAULT_COMPANION_FLOOR_PCT
    )]
    pub companion_floor_pct: f64,
    /// A reset further out than this (ms) is not paced on.
    #[arg(long = "max-pace-ms", env = "PACELINE_MAX_PACE_MS", default_value_t = DEFAULT_MAX_PACE_MS)]
    pub max_pace_ms: u64,
    /// Owed time up to this (ms) is waited in place; more is a requeue.
    #[arg(long = "in-place-wait-ms", env = "PACELINE_IN_PLACE_WAIT_MS", default_value_t = DEFAULT_IN_PLACE_WAIT_MS)]
    pub in_place_wait_ms: u64,
    /// Tenants' weights when the budget is scarce (`alpha:2,beta:1`; default 1 each).
    #[arg(long = "tenant-weights", env = "PACELINE_TENANT_WEIGHTS", default_value = "")]
    pub tenant_weights: String,
    /// Tenants' caps, a share of the budget even when others are idle (`alpha:50%`).
    #[arg(long = "tenant-caps", env = "PACELINE_TENANT_CAPS", default_value = "")]
    pub tenant_caps: String,
}

/// Default of `--budget`.
pub const DEFAULT_BUDGET: &str = "default";
/// Default of `--work-floor-pct`.
pub const DEFAULT_WORK_FLOOR_PCT: f64 = 5.0;
/// Default of `--companion-floor-pct`.
pub const DEFAULT_COMPANION_FLOOR_PCT: f64 = 2.0;
/// Default of `--max-pace-ms`.
pub const DEFAULT_MAX_PACE_MS: u64 = 90_000;
/// Default of `--in-place-wait-ms`.
pub const DEFAULT_IN_PLACE_WAIT_MS: u64 = 250;

impl Default for PacerArgs {
    /// The flags' defaults: the shared pacer on budget `default`, no configured limits.
    fn default() -> Self {
        Self {
            kind: crate::pacer::PacerKind::Shared,
            budget: DEFAULT_BUDGET.into(),
            tpm: None,
            rpm: None,
            work_floor_pct: DEFAULT_WORK_FLOOR_PCT,
            companion_floor_pct: DEFAULT_COMPANION_FLOOR_PCT,
            max_pace_ms: DEFAULT_MAX_PACE_MS,
            in_place_wait_ms: DEFAULT_IN_PLACE_WAIT_MS,
            tenant_weights: String::new(),
            tenant_caps: String::new(),
        }
    }
}

/// Tenants' weights and caps (fair admission: docs/pacing.md).
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

    /// The tenants given a weight, and their weights.
    pub fn weights(&self) -> impl Iterator<Item = (&str, f64)> {
        self.weights.iter().map(|(t, w)| (t.as_str(), *w))
    }

    /// The tenants given a cap, and their caps.
    pub fn caps(&self) -> impl Iterator<Item = (&str, f64)> {
        self.caps.iter().map(|(t, c)| (t.as_str(), *c))
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
            floor_companion: (self.companion_floor_pct / 100.0).clamp(0.0, 0.9),
            max_pace_ms: self.max_pace_ms,
            configured_tpm: self.tpm,
            configured_rpm: self.rpm,
            ..crate::pacer::PacingConfig::default()
        }
    }

    /// The pacer these arguments describe, over `conn` for the shared one.
    pub fn build(&self, conn: crate::redis_util::RedisConn, keys: crate::keys::Keys) -> crate::pacer::Pacer {
        self.build_for(conn, keys, &self.budget, self.tpm, self.rpm)
    }

    /// The pacer of one budget (a named provider's), with its own configured
    /// limits, the other knobs from these arguments.
    pub fn build_for(
        &self,
        conn: crate::redis_util::RedisConn,
        keys: crate::keys::Keys,
        budget: &str,
        tpm: Option<u64>,
        rpm: Option<u64>,
    ) -> crate::pacer::Pacer {
        use crate::pacer::{LocalPacer, Pacer, PacerKind, SharedPacer};
        let pacing = crate::pacer::PacingConfig { configured_tpm: tpm, configured_rpm: rpm, ..self.pacing_config() };
        match self.kind {
            PacerKind::Shared => Pacer::Shared(SharedPacer::new(conn, keys, budget.to_owned(), pacing)),
            PacerKind::Local => {
                // Bookings are per process here; a requeued turn comes back elsewhere.
                // (No fetch moves its waiters up: it re-times long waits itself.)
                let config = crate::pacer::PacingConfig { booking_grace_ms: 2_000, parks: false, ..pacing };
                Pacer::Local(LocalPacer::new(budget.to_owned(), config))
            }
            PacerKind::Off => Pacer::Off,
        }
    }
}

/// Parses a duration for a flag: `90s`, `30m`, `12h`, `7d`, `1500ms`, `1h 30m`
/// (humantime's grammar) or a bare number of seconds. One parser for every
/// long duration of every process (`PACELINE_RETENTION`, `--stream-lifetime`).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map(std::time::Duration::from_secs).map_err(|_| format!("{s:?} is too many seconds"));
    }
    humantime::parse_duration(s).map_err(|e| format!("{s:?} is not a duration like 7d, 12h, 30m, 90s ({e})"))
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
        assert!((c.floor_companion - 0.02).abs() < 1e-9, "the default companion floor is 2 %");
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
    fn a_redis_password_never_prints() {
        let args = RedisArgs::new("redis://:hunter2@cache:6379/0", "p");
        let shown = format!("{args:?}");
        assert!(!shown.contains("hunter2") && shown.contains("redis://***@cache:6379/0"), "{shown}");
        assert_eq!(redact_url("redis://user:pw@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis+unix:///tmp/r.sock"), "redis+unix:///tmp/r.sock");
    }

    #[test]
    fn cluster_nodes_are_redis_urls_and_their_passwords_never_print() {
        let nodes: ClusterNodes = "redis://:hunter2@a:7000, rediss://b:7001,".parse().unwrap();
        assert_eq!(nodes.0, ["redis://:hunter2@a:7000", "rediss://b:7001"]);
        let args = RedisArgs::new("", "p").on_cluster(nodes.0.clone());
        assert!(args.is_cluster() && args.keys().is_one_slot());
        for shown in [format!("{args:?}"), args.describe()] {
            assert!(!shown.contains("hunter2") && shown.contains("redis://***@a:7000"), "{shown}");
        }
        for bad in ["redis+unix:///tmp/r.sock", "http://a:1", "redis://", "redis://:pw@"] {
            let why = bad.parse::<ClusterNodes>().unwrap_err();
            assert!(why.contains("node 1") && !why.contains("pw"), "{bad}: {why}");
        }
        assert!(" , ".parse::<ClusterNodes>().unwrap_err().contains("names no node"));
        assert!(!RedisArgs::new("redis://h", "p").keys().is_one_slot());
    }

    #[test]
    fn partitions_other_than_one_are_refused_naming_the_variable() {
        let mut args = RedisArgs::new("redis://h", "p");
        assert_eq!(args.check(), Ok(()));
        args.partitions = 16;
        assert!(args.check().unwrap_err().contains("PACELINE_QUEUE_PARTITIONS=16"));
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("sk-live-123");
        assert!(!format!("{s:?}").contains("sk-live"));
        assert!(!format!("{s}").contains("sk-live"));
        assert_eq!(s.expose(), "sk-live-123");
    }
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |var| vars.iter().find(|(k, _)| *k == var).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn a_secret_comes_from_its_variable_or_the_file_its_file_variable_names() {
        let dir = tempfile_dir();
        let file = dir.join("redis_url");
        std::fs::write(&file, "redis://:hunter2@cache:6379\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(env_value("REDIS_URL", env(&[("REDIS_URL", "redis://a")])), Ok(Some("redis://a".into())));
        assert_eq!(
            env_value("REDIS_URL", env(&[("REDIS_URL_FILE", path)])),
            Ok(Some("redis://:hunter2@cache:6379".into())),
            "the file's text, its newline dropped"
        );
        assert_eq!(env_value("REDIS_URL", env(&[("REDIS_URL", " ")])), Ok(None), "set empty is unset");
        assert_eq!(env_value("REDIS_URL", env(&[])), Ok(None));
        let both = env_value("REDIS_URL", env(&[("REDIS_URL", "redis://a"), ("REDIS_URL_FILE", path)])).unwrap_err();
        assert!(both.contains("both set"), "{both}");
        let missing = env_value("REDIS_URL", env(&[("REDIS_URL_FILE", "/nonexistent/secret")])).unwrap_err();
        assert!(missing.starts_with("REDIS_URL_FILE names a file that cannot be read"), "{missing}");
        let bad = parse_secret::<u32>("PACELINE_X", Some("sekrit".into())).unwrap_err();
        assert!(bad.starts_with("PACELINE_X: ") && !bad.contains("sekrit"), "{bad}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A fresh directory under the system's temp dir.
    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("paceline-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
