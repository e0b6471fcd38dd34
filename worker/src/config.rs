//! What only a worker reads: its provider(s) and where their keys come from.
//! The API never sees a key; it reads only the providers' names
//! (`shared::config::ProvidersArg`).

use shared::config::{PacerArgs, ProvidersArg, Secret};

/// The provider(s) a worker calls. Keys are read from the environment by the
/// worker only (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`, or the variable a named
/// provider names), through [`KeySource`]: never a flag (a command line is in
/// every `ps`), never stored in Redis, never logged, never returned.
///
/// Either one provider (`--provider-url`, `--api-style`, its key) or the
/// named providers of `PACELINE_PROVIDERS` ([`shared::providers`]), which then
/// win: each names the variable its key is read from.
#[derive(Debug, Clone, clap::Args)]
pub struct ProviderArgs {
    /// Base URL of the provider [default: `https://api.openai.com/v1`; with
    /// `--api-style anthropic`: `https://api.anthropic.com`, the part before `/v1/messages`].
    #[arg(id = "provider_url", long = "provider-url", env = "PACELINE_PROVIDER_URL")]
    pub url: Option<String>,
    /// Wire format: `responses`, `chat` (Chat Completions) or `anthropic` (Messages).
    #[arg(long = "api-style", env = "PACELINE_API_STYLE", value_enum, default_value = "responses")]
    pub api_style: shared::runs::ApiStyle,
    /// Named providers (they replace the single provider above).
    #[command(flatten)]
    pub named: ProvidersArg,
    /// Longest silence a call may keep, in seconds: until its response
    /// headers, and between two pieces of its stream. A reasoning model may
    /// think for minutes before it writes, or answer a call that does not
    /// stream only when it is done. A call silent longer is retried as a
    /// transient error.
    #[arg(
        long = "provider-idle-timeout-s",
        env = "PACELINE_PROVIDER_IDLE_TIMEOUT_S",
        default_value_t = DEFAULT_IDLE_TIMEOUT_S,
        value_parser = clap::value_parser!(u64).range(1..=86_400)
    )]
    pub idle_timeout_s: u64,
}

/// `--provider-idle-timeout-s`'s default
/// ([`crate::provider::DEFAULT_BETWEEN_EVENTS_TIMEOUT`]).
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = crate::provider::DEFAULT_BETWEEN_EVENTS_TIMEOUT.as_secs();

/// The variable holding the secret that signs tool calls (read by workers
/// through [`KeySource`], like the providers' keys: never a flag, never logged).
pub const TOOL_SECRET_ENV: &str = "PACELINE_TOOL_SECRET";

/// Where a worker reads its providers' keys (and [`TOOL_SECRET_ENV`]).
#[derive(Debug, Clone, Default)]
pub enum KeySource {
    /// The process environment (`paceline worker`, `paceline up`).
    #[default]
    Environment,
    /// Keys given in code, by variable name (tests, embedding); the
    /// environment is not read at all.
    Given(std::collections::BTreeMap<String, Secret>),
}

impl KeySource {
    /// The value of `var`, if it is set and not empty.
    pub fn get(&self, var: &str) -> Option<Secret> {
        let value = match self {
            Self::Environment => std::env::var(var).ok().map(Secret::new),
            Self::Given(keys) => keys.get(var).cloned(),
        };
        value.filter(|s| !s.expose().trim().is_empty())
    }
}

/// One provider as a worker calls it.
#[derive(Debug, Clone)]
pub struct ResolvedProvider {
    /// Its name (`default` for a single-provider fleet).
    pub name: String,
    /// Its wire format.
    pub style: shared::runs::ApiStyle,
    /// Its base URL.
    pub url: String,
    /// Its key (empty: none).
    pub key: Secret,
    /// The variable the key came from, for the start-up log (`OPENAI_API_KEY`).
    pub key_source: String,
    /// Its budget in the pacer.
    pub budget: String,
    /// Configured limits, for a provider without rate-limit headers.
    pub tpm: Option<u64>,
    /// See above.
    pub rpm: Option<u64>,
}

impl ProviderArgs {
    /// A single provider at `url` in `style`, no key (tests, `paceline up`).
    pub fn single(url: impl Into<String>, style: shared::runs::ApiStyle) -> Self {
        Self {
            url: Some(url.into()),
            api_style: style,
            named: ProvidersArg::default(),
            idle_timeout_s: DEFAULT_IDLE_TIMEOUT_S,
        }
    }

    /// The providers to call, in order (the first is the default), each with
    /// its key from `keys` and its budget:
    /// - without `PACELINE_PROVIDERS`: one provider, `default`, in the
    ///   fleet's budget `budget` as it always was; its key is
    ///   `OPENAI_API_KEY`, or `ANTHROPIC_API_KEY` for the `anthropic` style;
    /// - with it: each entry, in budget `<budget>:<name>`, its key from its
    ///   variable (an explicitly named variable must be set), its `tpm` /
    ///   `rpm` or else the fleet's.
    pub fn resolve(&self, budget: &str, pacer: &PacerArgs, keys: &KeySource) -> Result<Vec<ResolvedProvider>, String> {
        use shared::providers::{budget_name, default_key_env, default_url, DEFAULT_PROVIDER};
        let table = &self.named.providers;
        if table.is_empty() {
            let style = self.api_style;
            let key_source = default_key_env(style);
            let key = keys.get(key_source).unwrap_or_default();
            let url = self.url.clone().filter(|u| !u.trim().is_empty()).unwrap_or_else(|| default_url(style).into());
            return Ok(vec![ResolvedProvider {
                name: DEFAULT_PROVIDER.into(),
                style,
                url,
                key,
                key_source: key_source.into(),
                budget: budget.to_owned(),
                tpm: pacer.tpm,
                rpm: pacer.rpm,
            }]);
        }
        table
            .0
            .iter()
            .map(|p| {
                let var = p.key_env.clone().unwrap_or_else(|| default_key_env(p.style).to_owned());
                let key = keys.get(&var);
                if key.is_none() && p.key_env.is_some() {
                    return Err(format!("provider {}: its key variable {var} is not set (PACELINE_PROVIDERS)", p.name));
                }
                Ok(ResolvedProvider {
                    name: p.name.clone(),
                    style: p.style,
                    url: p.url.clone(),
                    key: key.unwrap_or_default(),
                    key_source: var,
                    budget: budget_name(budget, &p.name),
                    tpm: p.tpm.or(pacer.tpm),
                    rpm: p.rpm.or(pacer.rpm),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct WorkerCli {
        #[command(flatten)]
        provider: ProviderArgs,
        #[command(flatten)]
        pacer: PacerArgs,
    }

    fn keys(pairs: &[(&str, &str)]) -> KeySource {
        KeySource::Given(pairs.iter().map(|(k, v)| (k.to_string(), Secret::new(*v))).collect())
    }

    #[test]
    fn one_provider_keeps_the_old_variables_and_anthropic_its_own_key() {
        use clap::Parser;
        use shared::runs::ApiStyle;
        let cli = WorkerCli::try_parse_from(["x"]).unwrap();
        let p = cli.provider.resolve("default", &cli.pacer, &keys(&[])).unwrap();
        assert_eq!((p.len(), p[0].name.as_str(), p[0].budget.as_str()), (1, "default", "default"));
        assert_eq!(p[0].url, "https://api.openai.com/v1");
        let p = cli.provider.resolve("default", &cli.pacer, &keys(&[("OPENAI_API_KEY", "sk-openai")])).unwrap();
        assert_eq!((p[0].key.expose(), p[0].key_source.as_str()), ("sk-openai", "OPENAI_API_KEY"));
        let cli = WorkerCli::try_parse_from(["x", "--api-style", "anthropic"]).unwrap();
        let both = keys(&[("OPENAI_API_KEY", "sk-openai"), ("ANTHROPIC_API_KEY", "sk-ant-1")]);
        let p = cli.provider.resolve("b", &cli.pacer, &both).unwrap();
        assert_eq!((p[0].style, p[0].url.as_str()), (ApiStyle::Anthropic, "https://api.anthropic.com"));
        assert_eq!(p[0].key.expose(), "sk-ant-1", "the OpenAI key is never sent to Anthropic");
        // No key is a flag: a command line is in every `ps`.
        assert!(WorkerCli::try_parse_from(["x", "--api-key", "sk-openai"]).is_err());
        assert!(WorkerCli::try_parse_from(["x", "--anthropic-api-key", "k"]).is_err());
    }

    #[test]
    fn a_call_may_stay_silent_as_long_as_the_idle_timeout_says() {
        use clap::Parser;
        let cli = WorkerCli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.provider.idle_timeout_s, 120);
        let cli = WorkerCli::try_parse_from(["x", "--provider-idle-timeout-s", "900"]).unwrap();
        assert_eq!(cli.provider.idle_timeout_s, 900);
        for bad in ["0", "ten", "86401"] {
            let err = WorkerCli::try_parse_from(["x", "--provider-idle-timeout-s", bad]).unwrap_err();
            assert!(err.to_string().contains("provider-idle-timeout-s"), "{bad}: {err}");
        }
    }

    #[test]
    fn named_providers_each_get_their_key_and_budget() {
        use clap::Parser;
        let cli = WorkerCli::try_parse_from([
            "x",
            "--tpm",
            "9000",
            "--providers",
            "openai=responses@https://api.openai.com/v1#OPENAI_API_KEY,claude=anthropic@https://api.anthropic.com,local=chat@http://10.0.0.5:8000/v1;tpm=500",
        ])
        .unwrap();
        let p = cli.provider.resolve("team", &cli.pacer, &keys(&[("OPENAI_API_KEY", "sk-o")])).unwrap();
        let budgets: Vec<&str> = p.iter().map(|p| p.budget.as_str()).collect();
        assert_eq!(budgets, vec!["team:openai", "team:claude", "team:local"]);
        assert_eq!(p[0].key.expose(), "sk-o");
        assert!(p[1].key.is_empty(), "a default variable that is unset means no key");
        assert_eq!((p[1].tpm, p[2].tpm), (Some(9000), Some(500)));
        let err = cli.provider.resolve("team", &cli.pacer, &keys(&[])).unwrap_err();
        assert!(err.contains("provider openai") && err.contains("OPENAI_API_KEY is not set"), "{err}");
        assert!(WorkerCli::try_parse_from(["x", "--providers", "claude=anthropic"]).is_err());
    }
}
