//! Signing tool calls (README, "Tool endpoints"): each tool server holds a
//! key of its own, so one tool server cannot sign calls to another.
//!
//! `PACELINE_TOOL_SECRET` stays on the workers. The key of the tool server at
//! an origin is derived from it ([`endpoint_key`]: hex HMAC-SHA256 of the
//! origin, `https://tools.acme.internal` or `http://127.0.0.1:9000`), and a
//! call is signed with that key Stripe-style ([`sign`]):
//! `X-Paceline-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
//! The body names the run's tenant, so the signature binds the tenant, the
//! destination (through the key) and the time, which a tool server checks
//! against a tolerance to refuse a replay ([`verify`]).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use shared::config::Secret;

/// The header carrying the call's signature (with `PACELINE_TOOL_SECRET`).
pub const SIGNATURE_HEADER: &str = "x-paceline-signature";

/// The key the tool server at `endpoint`'s origin verifies its calls with:
/// the hex HMAC-SHA256 of the origin (`scheme://host[:port]`, the port only
/// when it is not the scheme's default, as the URL standard serialises it)
/// under `secret`. `None` for a URL that has no such origin.
pub fn endpoint_key(secret: &Secret, endpoint: &str) -> Option<Secret> {
    let url = reqwest::Url::parse(endpoint.trim()).ok()?;
    let origin = url.origin();
    if !origin.is_tuple() {
        return None;
    }
    let mut mac = keyed(secret.expose().as_bytes());
    mac.update(origin.ascii_serialization().as_bytes());
    Some(Secret::new(hex(&mac.finalize().into_bytes())))
}

/// The signature header's value for `body` sent at `unix_secs`:
/// `t=<unix_secs>,v1=<hex HMAC-SHA256 over "<unix_secs>.<body>">` under `key`
/// (the tool server's, [`endpoint_key`]).
pub fn sign(key: &Secret, unix_secs: u64, body: &[u8]) -> String {
    let mut mac = mac(key, unix_secs);
    mac.update(body);
    format!("t={unix_secs},v1={}", hex(&mac.finalize().into_bytes()))
}

/// Whether `header` (an `X-Paceline-Signature` value) signs `body` with
/// `key`, made no more than `tolerance_secs` from `now_secs` either way:
/// what a tool server written in Rust checks (README has the same in Python).
/// The comparison is constant-time.
pub fn verify(key: &Secret, header: &str, body: &[u8], now_secs: u64, tolerance_secs: u64) -> bool {
    let mut t = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<u64>().ok(),
            Some(("v1", v)) => signatures.push(v),
            _ => {}
        }
    }
    let Some(t) = t else { return false };
    if t.abs_diff(now_secs) > tolerance_secs {
        return false;
    }
    signatures.into_iter().any(|hex| {
        let Some(expected) = unhex(hex) else { return false };
        let mut mac = mac(key, t);
        mac.update(body);
        mac.verify_slice(&expected).is_ok()
    })
}

/// The MAC over `"<t>."`, ready for the body.
fn mac(key: &Secret, t: u64) -> Hmac<Sha256> {
    let mut mac = keyed(key.expose().as_bytes());
    mac.update(format!("{t}.").as_bytes());
    mac
}

fn keyed(key: &[u8]) -> Hmac<Sha256> {
    Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    s.as_bytes()
        .chunks(2)
        .map(|pair| match pair {
            [hi, lo] => std::str::from_utf8(&[*hi, *lo]).ok().and_then(|p| u8::from_str_radix(p, 16).ok()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_origin_has_its_own_key_derived_from_the_secret() {
        let secret = Secret::new("whsec_test");
        // Computed apart: printf '%s' 'https://tools.acme.internal' | openssl dgst -sha256 -hmac whsec_test
        let key = endpoint_key(&secret, "https://tools.acme.internal/v1/tools?x=1").unwrap();
        assert_eq!(key.expose(), "28a117001d36ca18d39513c1b7cfd23da55b500f2bbe9bab5d9cd3c41df38769");
        let same = ["https://TOOLS.acme.internal:443/other", "https://tools.acme.internal"];
        for url in same {
            assert_eq!(endpoint_key(&secret, url).unwrap().expose(), key.expose(), "{url}: the same origin");
        }
        for other in
            ["http://tools.acme.internal/v1/tools", "https://tools.acme.internal:8443/", "https://tools.beta.internal/"]
        {
            assert_ne!(endpoint_key(&secret, other).unwrap().expose(), key.expose(), "{other}: another origin");
        }
        assert_ne!(
            endpoint_key(&Secret::new("whsec_other"), "https://tools.acme.internal").unwrap().expose(),
            key.expose()
        );
        assert!(endpoint_key(&secret, "not a url").is_none());
    }

    #[test]
    fn the_signature_is_hmac_sha256_over_time_dot_body_and_verifies_with_the_key_only() {
        let secret = Secret::new("whsec_test");
        let key = endpoint_key(&secret, "https://tools.acme.internal").unwrap();
        let body = br#"{"run_id":"run_1","tenant":"acme"}"#;
        // Computed apart: python3 -c 'import hmac,hashlib;
        //   print(hmac.new(KEY.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest())'
        let header = sign(&key, 1_700_000_000, body);
        assert_eq!(header, "t=1700000000,v1=27bffe11b4ed05d8aad1bfafeaf264e832c7a4cb18f85a4c923dc08c0b54d162");
        assert!(verify(&key, &header, body, 1_700_000_100, 300));
        assert!(!verify(&secret, &header, body, 1_700_000_100, 300), "the fleet's secret is not the key");
        let other = endpoint_key(&secret, "https://tools.beta.internal").unwrap();
        assert!(!verify(&other, &header, body, 1_700_000_100, 300), "another tool server's key");
        assert!(!verify(&key, &header, br#"{"run_id":"run_1","tenant":"beta"}"#, 1_700_000_100, 300), "another tenant");
        assert!(!verify(&key, &header, body, 1_700_000_301, 300), "too old: a replay");
        let moved = header.replace("t=1700000000", "t=1700000001");
        assert!(!verify(&key, &moved, body, 1_700_000_000, 300), "the time is signed too");
        for bad in ["", "t=1700000000", "v1=00", "t=x,v1=00", "t=1700000000,v1=zz", "t=1700000000,v1=+0"] {
            assert!(!verify(&key, bad, body, 1_700_000_000, 300), "{bad}");
        }
    }
}
