//! The fleet's named providers (`PACELINE_PROVIDERS`): each a name, a wire
//! style, a base URL, the environment variable that holds its key, and
//! optionally the limits of a provider that sends no rate-limit headers.
//!
//! Why an environment variable, not a config file: every other knob of the
//! worker and the API is one (flag > env > default), a fleet is configured by
//! the same environment on every machine (compose files, Kubernetes, systemd
//! units), and the API and the workers both read it — the API for the names a
//! run may give, the workers for where to send. The table holds no secret:
//! it *names* the variable that holds each key, so it can be printed, logged
//! and committed, and the keys stay where secrets already live.
//!
//! Two spellings, one table. What a user types:
//!
//! ```text
//! PACELINE_PROVIDERS='openai=responses@https://api.openai.com/v1#OPENAI_API_KEY,claude=anthropic@https://api.anthropic.com#ANTHROPIC_API_KEY'
//! ```
//!
//! — entries separated by `,`, each `NAME=STYLE@URL`, then optionally
//! `#KEY_VAR` and `;tpm=N;rpm=N` — and what a tool writes, a JSON list
//! (a value that starts with `[`):
//!
//! ```text
//! [{"name": "local", "style": "chat", "url": "http://10.0.0.5:8000/v1", "tpm": 60000}]
//! ```
//!
//! Without `#KEY_VAR` the style's usual variable is read (`OPENAI_API_KEY`,
//! `ANTHROPIC_API_KEY`), and a missing one means no key (a local server); a
//! variable named explicitly must be set, or the worker refuses to start.
//! Each provider is its own budget in the pacer: `<PACELINE_BUDGET>:<name>`.
//! The first entry is the default for runs that name none.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Which wire format the provider speaks (`PACELINE_API_STYLE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiStyle {
    /// `POST /responses` (OpenAI's default).
    #[default]
    Responses,
    /// `POST /chat/completions` (vLLM, Ollama, LiteLLM often speak only this).
    Chat,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Anthropic,
}

impl ApiStyle {
    /// The name as written in `PACELINE_API_STYLE` and `PACELINE_PROVIDERS`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Responses => "responses",
            Self::Chat => "chat",
            Self::Anthropic => "anthropic",
        }
    }
}

/// The one provider of a fleet configured without `PACELINE_PROVIDERS`
/// (`PACELINE_PROVIDER_URL`, `PACELINE_API_STYLE`): a run may name it so.
pub const DEFAULT_PROVIDER: &str = "default";

/// The base URL a style defaults to when none is given.
pub fn default_url(style: ApiStyle) -> &'static str {
    match style {
        ApiStyle::Responses | ApiStyle::Chat => "https://api.openai.com/v1",
        // The base before `/v1/messages`, as Anthropic's SDKs take it.
        ApiStyle::Anthropic => "https://api.anthropic.com",
    }
}

/// The environment variable a style's key is read from by default.
pub fn default_key_env(style: ApiStyle) -> &'static str {
    match style {
        ApiStyle::Responses | ApiStyle::Chat => "OPENAI_API_KEY",
        ApiStyle::Anthropic => "ANTHROPIC_API_KEY",
    }
}

/// The budget a provider's calls are paced in: the fleet's budget name and
/// the provider's, so two providers never share a bucket (and `/v1/pacer`
/// shows one line per provider and model).
pub fn budget_name(budget: &str, provider: &str) -> String {
    format!("{budget}:{provider}")
}

/// One named provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderEntry {
    /// What runs call it (`provider` in a run spec).
    pub name: String,
    /// Its wire format.
    pub style: ApiStyle,
    /// Its base URL (Responses / Chat: the part before `/responses`;
    /// Anthropic: the part before `/v1/messages`).
    pub url: String,
    /// The environment variable holding its key; `None`: the style's default,
    /// optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_env: Option<String>,
    /// Tokens per minute, for a provider that sends no rate-limit headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Requests per minute, likewise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
}

/// `PACELINE_PROVIDERS`: the named providers, in order (the first is the
/// default). Empty: the fleet has one unnamed provider.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProviderTable(pub Vec<ProviderEntry>);

impl ProviderTable {
    /// Whether no provider is named (a single-provider fleet).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<String> {
        self.0.iter().map(|p| p.name.clone()).collect()
    }
}

impl std::fmt::Display for ProviderTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: Vec<String> = self
            .0
            .iter()
            .map(|p| {
                let mut s = format!("{}={}@{}", p.name, p.style.as_str(), p.url);
                if let Some(k) = &p.key_env {
                    s.push_str(&format!("#{k}"));
                }
                if let Some(t) = p.tpm {
                    s.push_str(&format!(";tpm={t}"));
                }
                if let Some(r) = p.rpm {
                    s.push_str(&format!(";rpm={r}"));
                }
                s
            })
            .collect();
        f.write_str(&entries.join(","))
    }
}

fn parse_style(s: &str) -> Option<ApiStyle> {
    Some(match s.trim().to_ascii_lowercase().as_str() {
        "responses" => ApiStyle::Responses,
        "chat" => ApiStyle::Chat,
        "anthropic" => ApiStyle::Anthropic,
        _ => return None,
    })
}

/// A provider name: it becomes part of a Redis key (the budget) and of a run spec.
fn valid_name(n: &str) -> bool {
    (1..=32).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// An environment variable's name, as a shell writes it.
fn valid_env_name(n: &str) -> bool {
    !n.is_empty()
        && !n.starts_with(|c: char| c.is_ascii_digit())
        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

const SHAPE: &str = "NAME=STYLE@URL[#KEY_VAR][;tpm=N][;rpm=N], e.g. \
                     claude=anthropic@https://api.anthropic.com#ANTHROPIC_API_KEY";

/// One compact entry: `NAME=STYLE@URL[#KEY_VAR][;tpm=N][;rpm=N]`.
fn parse_entry(n: usize, entry: &str) -> Result<ProviderEntry, String> {
    // The entry is named by its place and name, never quoted whole: a key
    // pasted by mistake must not reach a log.
    let label = entry.split_once('=').map(|(n, _)| n.trim()).filter(|n| valid_name(n)).unwrap_or("?");
    let at = |what: String| format!("PACELINE_PROVIDERS entry {n} ({label}): {what}");
    let (name, rest) = entry.split_once('=').ok_or_else(|| at(format!("is not {SHAPE}")))?;
    let (style, rest) = rest.split_once('@').ok_or_else(|| at(format!("has no @URL; the shape is {SHAPE}")))?;
    let style = parse_style(style)
        .ok_or_else(|| at(format!("the style `{}` is not responses, chat or anthropic", style.trim())))?;
    let mut parts = rest.split(';');
    let head = parts.next().unwrap_or_default();
    let (url, key_env) = match head.split_once('#') {
        Some((url, key)) => (url, Some(key.trim().to_owned())),
        None => (head, None),
    };
    let (mut tpm, mut rpm) = (None, None);
    for option in parts.map(str::trim).filter(|o| !o.is_empty()) {
        let (k, v) = option.split_once('=').ok_or_else(|| at(format!("`{option}` is not tpm=N or rpm=N")))?;
        let v: u64 =
            v.trim().parse().ok().filter(|v| *v > 0).ok_or_else(|| at(format!("`{option}`: not a positive number")))?;
        match k.trim() {
            "tpm" => tpm = Some(v),
            "rpm" => rpm = Some(v),
            other => return Err(at(format!("unknown option `{other}` (tpm or rpm)"))),
        }
    }
    let entry = ProviderEntry { name: name.trim().to_owned(), style, url: url.trim().to_owned(), key_env, tpm, rpm };
    check(n, &entry).map_err(at)?;
    Ok(entry)
}

/// The rules every entry keeps, however it was written.
fn check(_n: usize, p: &ProviderEntry) -> Result<(), String> {
    if !valid_name(&p.name) {
        return Err("a name is 1-32 characters of a-z, A-Z, 0-9, _ - .".into());
    }
    match url::Url::parse(&p.url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => {}
        _ => return Err(format!("`{}` is not an http(s) URL", p.url)),
    }
    if let Some(k) = &p.key_env {
        if !valid_env_name(k) {
            // Not quoted: it may be the key itself, pasted by mistake.
            return Err("what follows `#` is not the name of an environment variable \
                        (the key itself goes in that variable)"
                .into());
        }
    }
    Ok(())
}

impl FromStr for ProviderTable {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let entries: Vec<ProviderEntry> = if s.starts_with('[') {
            let list: Vec<ProviderEntry> = serde_json::from_str(s)
                .map_err(|e| format!("PACELINE_PROVIDERS is not a JSON list of providers: {e}"))?;
            for (i, p) in list.iter().enumerate() {
                check(i + 1, p).map_err(|e| format!("PACELINE_PROVIDERS entry {} ({}): {e}", i + 1, p.name))?;
            }
            list
        } else {
            s.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .enumerate()
                .map(|(i, e)| parse_entry(i + 1, e))
                .collect::<Result<_, _>>()?
        };
        for (i, p) in entries.iter().enumerate() {
            if entries[..i].iter().any(|q| q.name == p.name) {
                return Err(format!("PACELINE_PROVIDERS names `{}` twice", p.name));
            }
        }
        Ok(Self(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compact_form_reads_as_a_user_types_it() {
        let t: ProviderTable = "openai=responses@https://api.openai.com/v1#OPENAI_API_KEY, \
                                claude=anthropic@https://api.anthropic.com#ANTHROPIC_API_KEY,\
                                local=chat@http://10.0.0.5:8000/v1;tpm=60000;rpm=600"
            .parse()
            .unwrap();
        assert_eq!(t.names(), vec!["openai", "claude", "local"]);
        assert_eq!(t.0[1].style, ApiStyle::Anthropic);
        assert_eq!(t.0[1].url, "https://api.anthropic.com");
        assert_eq!(t.0[1].key_env.as_deref(), Some("ANTHROPIC_API_KEY"));
        assert_eq!((t.0[2].key_env.as_deref(), t.0[2].tpm, t.0[2].rpm), (None, Some(60_000), Some(600)));
        // Printed back, it reads the same.
        assert_eq!(t.to_string().parse::<ProviderTable>().unwrap(), t);
        assert!("".parse::<ProviderTable>().unwrap().is_empty());
    }

    #[test]
    fn the_json_form_is_the_same_table() {
        let t: ProviderTable = r#"[{"name": "local", "style": "chat", "url": "http://10.0.0.5:8000/v1", "tpm": 60000},
                                   {"name": "claude", "style": "anthropic", "url": "https://api.anthropic.com"}]"#
            .parse()
            .unwrap();
        assert_eq!(t.names(), vec!["local", "claude"]);
        assert_eq!(t.0[0].tpm, Some(60_000));
    }

    #[test]
    fn mistakes_say_which_entry_and_what_is_wrong() {
        for (bad, says) in [
            ("openai", "is not NAME=STYLE@URL"),
            ("openai=responses", "has no @URL"),
            ("openai=gemini@https://x", "`gemini` is not responses, chat or anthropic"),
            ("openai=responses@not a url", "is not an http(s) URL"),
            ("open ai=responses@https://x", "a name is"),
            ("a=chat@https://x;tpm=lots", "not a positive number"),
            ("a=chat@https://x;burst=3", "unknown option"),
            ("a=anthropic@https://x#sk-ant-123", "is not the name of an environment variable"),
            ("a=anthropic@https://x#sk ant", "is not the name of an environment variable"),
            ("a=chat@https://x,a=responses@https://y", "names `a` twice"),
            ("[{\"name\": \"a\"}]", "not a JSON list of providers"),
            ("[{\"name\": \"a\", \"style\": \"chat\", \"url\": \"ftp://x\"}]", "is not an http(s) URL"),
        ] {
            let err = bad.parse::<ProviderTable>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
            assert!(err.starts_with("PACELINE_PROVIDERS"), "{err}");
        }
        // A key pasted where the variable's name goes is never echoed back;
        // the message says where the key belongs.
        let err = "a=anthropic@https://x#sk-ant-123".parse::<ProviderTable>().unwrap_err();
        assert!(err.contains("the key itself goes in that variable") && !err.contains("sk-ant"), "{err}");
        let err = "sk-ant-123".parse::<ProviderTable>().unwrap_err();
        assert!(!err.contains("sk-ant"), "{err}");
    }

    #[test]
    fn budgets_and_defaults() {
        assert_eq!(budget_name("default", "claude"), "default:claude");
        assert_eq!(default_url(ApiStyle::Anthropic), "https://api.anthropic.com");
        assert_eq!(default_key_env(ApiStyle::Chat), "OPENAI_API_KEY");
    }
}
