//! Which tool endpoints a run may name (`PACELINE_TOOL_ENDPOINTS`; README, "Tool endpoints"):
//! one parser and one check, read by the API at submit and by the worker
//! again before each tool call.
//!
//! An entry is a URL prefix for every tenant (`http://127.0.0.1:9000/tools`)
//! or for one tenant (`acme=https://tools.acme.internal/`); entries are
//! comma-separated. A prefix is compared on the parsed URL, never as raw text
//! ([`endpoint_allowed`]).
//!
//! Where a call may go (SPEC §5) is also a matter of the address a host
//! *name* resolves to: [`forbidden_address`] names the addresses that are not
//! the public internet (loopback, private, link-local — the cloud metadata
//! service —, and the like). A prefix that names such an address itself
//! (`http://127.0.0.1:9000/`) allows it; a name that resolves to one does not.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
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

/// What kind of address `ip` is when it is not a public one (`"loopback"`,
/// `"private"`, `"link-local"`, …), or `None` for a public address.
///
/// A tool host given by name must resolve to public addresses only: a name
/// anyone can point at 127.0.0.1, 10.x or 169.254.169.254 would otherwise
/// reach the worker's own services, its network or the cloud's metadata. An
/// IPv6 address that carries an IPv4 one (mapped `::ffff:a.b.c.d`, NAT64,
/// 6to4) is judged by the IPv4 address; IPv6 outside global unicast
/// (`2000::/3`) is refused.
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// [`forbidden_address`] for IPv4 (RFC 6890's special-purpose registry).
fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, ..) => "unspecified",
        (10, ..) | (172, 16..=31, _) | (192, 168, _) => "private",
        (100, 64..=127, _) => "carrier-grade NAT",
        (127, ..) => "loopback",
        (169, 254, _) => "link-local",
        (192, 0, 0) => "reserved",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (198, 18..=19, _) => "benchmarking",
        (224..=239, ..) => "multicast",
        (240..=255, ..) => "reserved",
        _ => return None,
    })
}

/// [`forbidden_address`] for IPv6 (RFC 6890, RFC 4291).
fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    Some(match s {
        [0, 0, 0, 0, 0, 0, 0, 0] => "unspecified",
        [0, 0, 0, 0, 0, 0, 0, 1] => "loopback",
        [0, 0, 0, 0, 0, 0, ..] => "IPv4-compatible",
        // NAT64 carries the IPv4 address it reaches in its last 32 bits.
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => return forbidden_v4(embedded(hi, lo)),
        [0x64, 0xff9b, 1, ..] => "local NAT64",
        // 6to4 carries the IPv4 address of its relay's other end in bits 16..48.
        [0x2002, hi, lo, ..] => return forbidden_v4(embedded(hi, lo)),
        [0x2001, 0xdb8, ..] => "documentation",
        [0x2001, 0..=0x1ff, ..] => "IETF protocol or Teredo",
        [first, ..] if first & 0xfe00 == 0xfc00 => "unique local",
        [first, ..] if first & 0xffc0 == 0xfe80 => "link-local",
        [first, ..] if first & 0xffc0 == 0xfec0 => "site-local",
        [first, ..] if first & 0xff00 == 0xff00 => "multicast",
        [first, ..] if first & 0xe000 != 0x2000 => "reserved",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass_in_ipv4_and_ipv6_including_the_ipv4_an_ipv6_address_carries() {
        for (ip, kind) in [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("10.0.0.5", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("100.64.0.1", "carrier-grade NAT"),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "reserved"),
            ("192.0.2.7", "documentation"),
            ("198.18.0.1", "benchmarking"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.5", "private"),
            ("::ffff:169.254.169.254", "link-local"),
            ("::127.0.0.1", "IPv4-compatible"),
            ("64:ff9b::a00:5", "private"),
            ("64:ff9b::7f00:1", "loopback"),
            ("64:ff9b:1::1", "local NAT64"),
            ("2002:a00:5::1", "private"),
            ("2002:a9fe:a9fe::", "link-local"),
            ("2001::1", "IETF protocol or Teredo"),
            ("2001:db8::1", "documentation"),
            ("fc00::1", "unique local"),
            ("fd12:3456::1", "unique local"),
            ("fe80::1", "link-local"),
            ("fec0::1", "site-local"),
            ("ff02::1", "multicast"),
            ("100::1", "reserved"),
            ("4000::1", "reserved"),
        ] {
            let parsed: IpAddr = ip.parse().unwrap();
            assert_eq!(forbidden_address(parsed), Some(kind), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "172.15.255.255",
            "172.32.0.1",
            "100.63.255.255",
            "169.253.0.1",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "2606:4700:4700::1111",
            "2a00:1450:4001::200e",
        ] {
            assert_eq!(forbidden_address(ip.parse().unwrap()), None, "{ip} is public");
        }
    }

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
