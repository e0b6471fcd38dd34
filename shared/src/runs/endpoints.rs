//! Which tool endpoints a run may name (`PACELINE_TOOL_ENDPOINTS`; README, "Tool endpoints"):
//! one parser and one check, read by the API at submit and by the worker
//! again before each tool call.
//!
//! An entry is a URL prefix for every tenant (`http://127.0.0.1:9000/tools`)
//! or for one tenant (`acme=https://tools.acme.internal/`); entries are
//! comma-separated. A prefix is compared on the parsed URL, never as raw text
//! ([`endpoint_allowed`]).

use std::fmt;
use std::str::FromStr;

/// Whether `s` may name a tenant: 1–64 characters of `a-z A-Z 0-9 _ - .`
/// (it becomes part of Redis keys). A URL never is one (`:` and `/` are not
/// allowed), which is how `tenant=prefix` is told from a plain prefix.
pub fn valid_tenant(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// One allowed prefix, for one tenant or (`tenant: None`) for all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolEndpoint {
    /// The tenant it is for; `None`: every tenant.
    pub tenant: Option<String>,
    /// The URL prefix (`http` or `https`).
    pub prefix: String,
}

/// The allow-list of tool endpoints. Empty allows none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolEndpoints(pub Vec<ToolEndpoint>);

impl ToolEndpoints {
    /// Prefixes every tenant may use (tests, `paceline up --demo`, the bench).
    pub fn every_tenant<I, S>(prefixes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self(prefixes.into_iter().map(|p| ToolEndpoint { tenant: None, prefix: p.into() }).collect())
    }

    /// Adds an entry (`tenant: None` for every tenant).
    pub fn with(mut self, tenant: Option<&str>, prefix: impl Into<String>) -> Self {
        self.0.push(ToolEndpoint { tenant: tenant.map(str::to_owned), prefix: prefix.into() });
        self
    }

    /// Whether no endpoint at all is allowed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `tenant`'s run may call `url`: it lies under a prefix for
    /// every tenant or under one of `tenant`'s own.
    pub fn allows(&self, tenant: &str, url: &str) -> bool {
        let prefixes: Vec<String> = self
            .0
            .iter()
            .filter(|e| e.tenant.as_deref().is_none_or(|t| t == tenant))
            .map(|e| e.prefix.clone())
            .collect();
        endpoint_allowed(url, &prefixes)
    }
}

impl FromStr for ToolEndpoints {
    type Err = String;

    /// `prefix,tenant=prefix,…`; blanks are skipped. A prefix must be an
    /// `http`/`https` URL: a typo is an error at start, not a list that
    /// silently refuses every run.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (tenant, prefix) = match entry.split_once('=') {
                Some((t, p)) if valid_tenant(t.trim()) => (Some(t.trim().to_owned()), p.trim()),
                _ => (None, entry),
            };
            let parsed = url::Url::parse(prefix).map_err(|e| format!("`{prefix}` is not a URL ({e})"))?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.cannot_be_a_base() {
                return Err(format!("`{prefix}` is not an http(s) URL prefix"));
            }
            out.push(ToolEndpoint { tenant, prefix: prefix.to_owned() });
        }
        Ok(Self(out))
    }
}

impl fmt::Display for ToolEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            match &e.tenant {
                Some(t) => write!(f, "{sep}{t}={}", e.prefix)?,
                None => write!(f, "{sep}{}", e.prefix)?,
            }
        }
        Ok(())
    }
}

/// Whether `url` lies under one of the allowed `prefixes`
/// (`PACELINE_TOOL_ENDPOINTS`). No prefixes allow nothing.
///
/// Both sides are parsed (so `..` segments, `%2e%2e`, default ports and host
/// case are normalised first) and compared by scheme, user info, host and
/// port exactly, then by path on segment boundaries: the prefix
/// `http://127.0.0.1:9000/tools` allows `…:9000/tools` and `…:9000/tools/x`,
/// not `…:9000/toolsx`, `…:90001/…`, `…:9000.evil.com/…` or
/// `…:9000@evil.com/…`. A prefix ending in `/` allows what is below it. The
/// prefix's query and fragment are ignored.
pub fn endpoint_allowed(url: &str, prefixes: &[String]) -> bool {
    let Ok(url) = url::Url::parse(url.trim()) else { return false };
    if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
        return false;
    }
    prefixes.iter().any(|prefix| {
        let Ok(prefix) = url::Url::parse(prefix.trim()) else { return false };
        let same_origin = url.scheme() == prefix.scheme()
            && url.host_str() == prefix.host_str()
            && url.port_or_known_default() == prefix.port_or_known_default()
            && url.username() == prefix.username()
            && url.password() == prefix.password();
        if !same_origin {
            return false;
        }
        let (path, base) = (url.path(), prefix.path());
        if base.ends_with('/') {
            path.starts_with(base)
        } else {
            path == base || path.strip_prefix(base).is_some_and(|rest| rest.starts_with('/'))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_tenant_prefixes_parse_and_apply_to_their_tenants() {
        let list: ToolEndpoints =
            " http://127.0.0.1:9000/tools , acme=https://tools.acme.internal/v1,beta.team = http://10.0.0.9/x?a=b ,"
                .parse()
                .unwrap();
        assert_eq!(
            list,
            ToolEndpoints::every_tenant(["http://127.0.0.1:9000/tools"])
                .with(Some("acme"), "https://tools.acme.internal/v1")
                .with(Some("beta.team"), "http://10.0.0.9/x?a=b")
        );
        assert!(list.allows("anyone", "http://127.0.0.1:9000/tools/search"), "a plain prefix is every tenant's");
        assert!(list.allows("acme", "https://tools.acme.internal/v1/run"));
        assert!(!list.allows("beta", "https://tools.acme.internal/v1/run"), "acme's prefix is acme's alone");
        assert!(!list.allows("acme.x", "https://tools.acme.internal/v1/run"));
        assert!(list.allows("beta.team", "http://10.0.0.9/x/y"));
        assert_eq!(list.to_string().parse::<ToolEndpoints>().unwrap(), list, "Display reads back");
        // A `=` inside a URL is not a tenant.
        let q: ToolEndpoints = "http://h/t?k=v".parse().unwrap();
        assert_eq!(q.0[0].tenant, None);
        assert!("".parse::<ToolEndpoints>().unwrap().is_empty());
        assert!(!ToolEndpoints::default().allows("acme", "http://127.0.0.1:9000/tools"), "empty allows none");
    }

    #[test]
    fn bad_entries_are_errors_at_start() {
        for bad in ["garbage", "acme=", "acme=not a url", "ftp://h/tools", "acme=file:///etc", "a b=http://h/"] {
            assert!(bad.parse::<ToolEndpoints>().is_err(), "{bad}");
        }
    }

    fn allowed(url: &str, prefixes: &[&str]) -> bool {
        endpoint_allowed(url, &prefixes.iter().map(|p| p.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn a_prefix_allows_itself_and_what_is_below_it() {
        let p = ["http://127.0.0.1:9000/tools"];
        assert!(allowed("http://127.0.0.1:9000/tools", &p));
        assert!(allowed("http://127.0.0.1:9000/tools/", &p));
        assert!(allowed("http://127.0.0.1:9000/tools/search?x=1", &p));
        assert!(allowed("HTTP://127.0.0.1:9000/tools/a/b", &p));
    }

    #[test]
    fn lookalikes_are_refused() {
        let p = ["http://127.0.0.1:9000/tools"];
        for url in [
            "http://127.0.0.1:90001/tools",
            "http://127.0.0.1:9000.evil.com/tools",
            "http://127.0.0.1:9000@evil.com/tools",
            "http://evil.com/http://127.0.0.1:9000/tools",
            "http://127.0.0.1:9000/toolsx",
            "http://127.0.0.1:9000/tool",
            "http://127.0.0.1:9000/tools/../admin",
            "http://127.0.0.1:9000/tools/%2e%2e/admin",
            "http://127.0.0.1:900/tools",
            "http://127.0.0.1/tools",
            "https://127.0.0.1:9000/tools",
            "http://user@127.0.0.1:9000/tools",
            "http://localhost:9000/tools",
            "file:///tools",
            "not a url",
            "",
        ] {
            assert!(!allowed(url, &p), "{url} must not be allowed");
        }
        assert!(!allowed("http://127.0.0.1:9000/tools", &[]));
        assert!(!allowed("http://127.0.0.1:9000/tools", &["garbage"]));
    }

    #[test]
    fn default_ports_trailing_slashes_and_several_prefixes() {
        assert!(allowed("https://tools.example.com:443/v1/run", &["https://tools.example.com/v1"]));
        assert!(allowed("http://tools.example.com/v1/run", &["http://TOOLS.example.com:80/v1/"]));
        assert!(!allowed("http://tools.example.com/v10", &["http://tools.example.com/v1"]));
        assert!(!allowed("http://tools.example.com/v1", &["http://tools.example.com/v1/"]));
        // A bare origin allows every path on it.
        assert!(allowed("http://10.0.0.5:7000/anything/at/all", &["http://10.0.0.5:7000"]));
        let several = ["http://a.internal/tools", "http://127.0.0.1:9000/"];
        assert!(allowed("http://127.0.0.1:9000/x", &several));
        assert!(allowed("http://a.internal/tools/y", &several));
        assert!(!allowed("http://b.internal/tools/y", &several));
    }
}
