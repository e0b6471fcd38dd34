//! What a request must be before a handler reads it:
//!
//! - in open mode (no tokens) the API answers only requests addressed to a
//!   loopback name — `localhost`, `127.x.y.z`, `[::1]`, any port — so a web
//!   page whose name was rebound to 127.0.0.1 cannot drive a developer's local
//!   API (DNS rebinding); `--insecure-open` lifts it with the loopback rule;
//! - a `POST` body is `Content-Type: application/json` ([`JsonContent`], 415
//!   otherwise), so a web page cannot send one as a form or plain text, which a
//!   browser does without asking the API first.

use std::net::{Ipv4Addr, Ipv6Addr};

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, TRANSFER_ENCODING};
use axum::http::request::Parts;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::Auth;
use crate::error::ApiError;
use crate::state::AppState;

/// Whether `host` (a `Host` header: a name or address and an optional port)
/// names this machine's loopback: `localhost`, `127.0.0.0/8`, `[::1]`.
pub fn loopback_host(host: &str) -> bool {
    let host = host.trim();
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, port)) => return port_ok(port) && ip.parse::<Ipv6Addr>().is_ok_and(|ip| ip.is_loopback()),
            None => return false,
        },
        None => match host.split_once(':') {
            Some((name, port)) => (name, format!(":{port}")),
            None => (host, String::new()),
        },
    };
    if !port_ok(&port) {
        return false;
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost") || name.parse::<Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Empty, or `:` and 1 to 5 digits.
fn port_ok(port: &str) -> bool {
    match port.strip_prefix(':') {
        None => port.is_empty(),
        Some(p) => (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Refuses (403) a request addressed to anything but a loopback name while
/// the API runs in open mode without `--insecure-open`. A request without a
/// `Host` (not a browser's) passes.
pub async fn loopback_host_in_open_mode(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if matches!(state.auth, Auth::Open) && !state.config.access.insecure_open {
        // The `Host` header and, in an absolute-form request line (or HTTP/2),
        // the URI's authority: each one given must be loopback.
        let header = request.headers().get(HOST).map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
        let authority = request.uri().authority().map(|a| a.as_str().to_owned());
        if header.iter().chain(authority.iter()).any(|h| !loopback_host(h)) {
            return ApiError::Forbidden(
                "open mode (no tokens) answers only requests addressed to localhost, 127.x or [::1]".into(),
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// Whether a `Content-Type` value is JSON (`application/json`, any parameters).
pub fn is_json(content_type: &str) -> bool {
    content_type.split(';').next().is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// Checks a `POST`'s headers: a body (or a declared type) must be
/// `application/json`; a `POST` without a body and without a type passes
/// (cancel, retry).
pub fn check_json_content(headers: &HeaderMap) -> Result<(), ApiError> {
    let has_body = headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().parse::<u64>().map_or(true, |n| n > 0));
    match headers.get(CONTENT_TYPE) {
        Some(ct) if ct.to_str().is_ok_and(is_json) => Ok(()),
        Some(_) => Err(ApiError::UnsupportedMediaType),
        None if has_body => Err(ApiError::UnsupportedMediaType),
        None => Ok(()),
    }
}

/// An extractor for `POST` handlers: 415 unless the body is JSON (see
/// [`check_json_content`]). Put it after the caller's extractor, so a
/// request without a token is a 401 first.
#[derive(Debug, Clone, Copy)]
pub struct JsonContent;

impl<S: Send + Sync> FromRequestParts<S> for JsonContent {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        check_json_content(&parts.headers).map(|()| JsonContent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn loopback_names_with_any_port_and_nothing_else() {
        for ok in [
            "localhost",
            "localhost:8080",
            "LOCALHOST.",
            "127.0.0.1",
            "127.0.0.1:80",
            "127.9.8.7:65535",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:8080",
            "0.0.0.0:8080",
            "[::]:8080",
            "[::ffff:127.0.0.1]",
            "[::1",
            "localhost:80:80",
            "localhost:http",
            "127.0.0.1:123456",
            "",
        ] {
            assert!(!loopback_host(bad), "{bad}");
        }
    }

    #[test]
    fn a_post_body_must_be_json() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(check_json_content(&headers(&[("content-type", "application/json")])).is_ok());
        assert!(check_json_content(&headers(&[("content-type", "Application/JSON; charset=utf-8")])).is_ok());
        assert!(check_json_content(&headers(&[])).is_ok(), "no body, no type: cancel, retry");
        assert!(check_json_content(&headers(&[("content-length", "0")])).is_ok());
        for bad in [
            &[("content-type", "text/plain"), ("content-length", "2")][..],
            &[("content-type", "application/x-www-form-urlencoded")],
            &[("content-type", "multipart/form-data; boundary=x")],
            &[("content-type", "application/jsonx")],
            &[("content-length", "2")],
            &[("transfer-encoding", "chunked")],
        ] {
            assert!(matches!(check_json_content(&headers(bad)), Err(ApiError::UnsupportedMediaType)), "{bad:?}");
        }
    }
}
