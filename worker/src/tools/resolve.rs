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

/// Resolves a tool host's name to its public addresses, or refuses it.
#[derive(Debug, Default)]
pub(super) struct PublicOnly;

impl Resolve for PublicOnly {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let checked = public_only(&host, found)?;
            Ok(Box::new(checked.into_iter()) as Addrs)
        })
    }
}

/// `found`, the addresses `host` resolved to, when every one is public; else
/// why not. One address that is not public refuses the name: a name that
/// mixes them is the shape of a rebinding attack, not of a tool server.
fn public_only(host: &str, found: Vec<SocketAddr>) -> Result<Vec<SocketAddr>, String> {
    if found.is_empty() {
        return Err(format!("the tool host {host} resolves to no address"));
    }
    if let Some((ip, kind)) = found.iter().find_map(|a| forbidden_address(a.ip()).map(|kind| (a.ip(), kind))) {
        return Err(format!(
            "the tool host {host} resolves to {ip} ({kind}), not a public address; a tool call goes to such \
             an address only when PACELINE_TOOL_ENDPOINTS names the address itself"
        ));
    }
    Ok(found)
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
            let why = public_only("tools.example", addrs(ips)).unwrap_err();
            assert!(why.contains(&format!("tools.example resolves to {named}")), "{ips:?}: {why}");
        }
        assert!(public_only("tools.example", vec![]).unwrap_err().contains("no address"));
    }

    #[test]
    fn a_name_resolving_to_public_addresses_keeps_them_all() {
        let found = addrs(&["8.8.8.8", "2606:4700:4700::1111"]);
        assert_eq!(public_only("tools.example", found.clone()), Ok(found));
    }
}
