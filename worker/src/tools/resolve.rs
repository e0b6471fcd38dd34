//! Where a tool call may connect (SPEC §5, "Where a tool call may go"): the
//! tool client's DNS resolver, which hands the connector only addresses that
//! are public.
//!
//! A tool host given by *name* is resolved here, once for the connection,
//! and every address it resolves to is checked
//! ([`shared::runs::forbidden_address`]). The connector dials exactly the
//! addresses checked, so a second DNS answer (a rebinding name that said
//! 8.8.8.8 to the check and 127.0.0.1 to the connect) cannot differ from the
//! checked one. A host given as an address (`http://127.0.0.1:9000/`) is
//! never resolved: the allow-list matched it against a prefix naming that
//! very address, which is how an operator allows a private address.

use std::net::SocketAddr;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use shared::runs::forbidden_address;

/// Resolves a host's name to its public addresses, or refuses it. Tool
/// calls and webhook deliveries each have one, naming their allow-list.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublicOnly {
    /// Whose host it is: `tool host`, `webhook host`.
    host: &'static str,
    /// What connects: `tool call`, `webhook`.
    what: &'static str,
    /// The allow-list that may name a private address itself.
    allow_list: &'static str,
}

impl PublicOnly {
    /// Tool calls' (`PACELINE_TOOL_ENDPOINTS`).
    pub(crate) const TOOLS: Self = Self { host: "tool host", what: "tool call", allow_list: "PACELINE_TOOL_ENDPOINTS" };
    /// Webhook deliveries' (`PACELINE_WEBHOOK_ENDPOINTS`).
    pub(crate) const WEBHOOKS: Self =
        Self { host: "webhook host", what: "webhook", allow_list: "PACELINE_WEBHOOK_ENDPOINTS" };
}

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        let this = *self;
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let checked = this.public_only(&host, found)?;
            Ok(Box::new(checked.into_iter()) as Addrs)
        })
    }
}

impl PublicOnly {
    /// `found`, the addresses `host` resolved to, when every one is public; else
    /// why not. One address that is not public refuses the name: a name that
    /// mixes them is the shape of a rebinding attack, not of a tool server.
    fn public_only(&self, host: &str, found: Vec<SocketAddr>) -> Result<Vec<SocketAddr>, String> {
        let Self { host: whose, what, allow_list } = self;
        if found.is_empty() {
            return Err(format!("the {whose} {host} resolves to no address"));
        }
        if let Some((ip, kind)) = found.iter().find_map(|a| forbidden_address(a.ip()).map(|kind| (a.ip(), kind))) {
            return Err(format!(
                "the {whose} {host} resolves to {ip} ({kind}), not a public address; a {what} goes to such \
                 an address only when {allow_list} names the address itself"
            ));
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(ips: &[&str]) -> Vec<SocketAddr> {
        ips.iter().map(|ip| SocketAddr::new(ip.parse().unwrap(), 0)).collect()
    }

    #[test]
    fn a_name_resolving_to_any_address_that_is_not_public_is_refused_naming_it() {
        for (ips, named) in [
            (&["10.0.0.5"][..], "10.0.0.5 (private)"),
            (&["169.254.169.254"], "169.254.169.254 (link-local)"),
            (&["8.8.8.8", "127.0.0.1"], "127.0.0.1 (loopback)"),
            (&["::ffff:192.168.0.1"], "::ffff:192.168.0.1 (private)"),
            (&["fd00::1"], "fd00::1 (unique local)"),
            (&["::"], ":: (unspecified)"),
        ] {
            let why = PublicOnly::TOOLS.public_only("tools.example", addrs(ips)).unwrap_err();
            assert!(why.contains(&format!("the tool host tools.example resolves to {named}")), "{ips:?}: {why}");
        }
        assert!(PublicOnly::TOOLS.public_only("tools.example", vec![]).unwrap_err().contains("no address"));
        let why = PublicOnly::WEBHOOKS.public_only("hooks.example", addrs(&["10.0.0.5"])).unwrap_err();
        assert!(why.contains("webhook host hooks.example") && why.contains("PACELINE_WEBHOOK_ENDPOINTS"), "{why}");
    }

    #[test]
    fn a_name_resolving_to_public_addresses_keeps_them_all() {
        let found = addrs(&["8.8.8.8", "2606:4700:4700::1111"]);
        assert_eq!(PublicOnly::TOOLS.public_only("tools.example", found.clone()), Ok(found));
    }
}
