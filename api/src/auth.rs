//! Bearer tokens → tenants. Tokens are compared in constant time (as SHA-256
//! digests, so neither their bytes nor their lengths leak through timing), and
//! every configured token is compared on every request. A token is never logged.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::ApiTokens;
use crate::error::ApiError;
use crate::state::AppState;

/// The tenant of open development mode.
pub const DEFAULT_TENANT: &str = "default";

/// Who may call the API.
#[derive(Clone)]
pub enum Auth {
    /// No tokens configured: every request is tenant `default`.
    Open,
    /// Tenants and the digests of their tokens.
    Tokens(Vec<(String, [u8; 32])>),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Open => f.write_str("Auth::Open"),
            Self::Tokens(t) => f.debug_list().entries(t.iter().map(|(tenant, _)| tenant)).finish(),
        }
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Auth {
    /// From the configured tokens.
    pub fn new(tokens: &ApiTokens) -> Self {
        if tokens.is_empty() {
            Self::Open
        } else {
            Self::Tokens(tokens.0.iter().map(|(t, s)| (t.clone(), digest(s.expose().as_bytes()))).collect())
        }
    }

    /// The tenant an `Authorization` header value belongs to.
    pub fn tenant(&self, authorization: Option<&[u8]>) -> Result<String, ApiError> {
        let Self::Tokens(known) = self else { return Ok(DEFAULT_TENANT.to_owned()) };
        let value = authorization.ok_or(ApiError::Unauthorized)?;
        let token = strip_bearer(value).ok_or(ApiError::Unauthorized)?;
        let presented = digest(token);
        // No early exit: every token is compared, whichever matches.
        let mut found: Option<&str> = None;
        for (tenant, d) in known {
            if bool::from(d.ct_eq(&presented)) {
                found = Some(tenant);
            }
        }
        found.map(str::to_owned).ok_or(ApiError::Unauthorized)
    }
}

/// `Bearer TOKEN` (scheme case-insensitive) → `TOKEN`.
fn strip_bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// The authenticated tenant of a request (an extractor: 401 without a valid token).
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let header = parts.headers.get(axum::http::header::AUTHORIZATION).map(|v| v.as_bytes());
        state.auth.tenant(header).map(Tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_their_tenant() {
        let auth = Auth::new(&ApiTokens::default().with("acme", "tok-a").with("beta", "tok-b"));
        assert_eq!(auth.tenant(Some(b"Bearer tok-a")).unwrap(), "acme");
        assert_eq!(auth.tenant(Some(b"bearer tok-b")).unwrap(), "beta");
        for bad in [
            None,
            Some(&b"Bearer "[..]),
            Some(b"Bearer tok-c"),
            Some(b"tok-a"),
            Some(b"Basic tok-a"),
            Some(b"Bearer tok-a2"),
        ] {
            assert!(matches!(auth.tenant(bad), Err(ApiError::Unauthorized)), "{bad:?}");
        }
        assert!(!format!("{auth:?}").contains("tok"));
    }

    #[test]
    fn open_mode_is_the_default_tenant() {
        let auth = Auth::new(&ApiTokens::default());
        assert_eq!(auth.tenant(None).unwrap(), DEFAULT_TENANT);
        assert_eq!(auth.tenant(Some(b"Bearer whatever")).unwrap(), DEFAULT_TENANT);
    }
}
