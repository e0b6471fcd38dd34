//! Bearer tokens → tenants. Tokens are compared in constant time (as SHA-256
//! digests, so neither their bytes nor their lengths leak through timing), and
//! every configured token is compared on every request. A token is never logged.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use shared::config::Secret;

use crate::config::ApiTokens;
use crate::error::ApiError;
use crate::state::AppState;

/// The tenant of open development mode.
pub const DEFAULT_TENANT: &str = "default";

/// Who may call the API.
#[derive(Clone)]
pub enum Auth {
    /// No tokens configured: every request is tenant `default`, with the
    /// operator's reads too (one machine, one user).
    Open,
    /// Tenants and the digests of their tokens, and the operator's digest.
    Tokens {
        /// Each tenant's token digest.
        tenants: Vec<(String, [u8; 32])>,
        /// `PACELINE_OPERATOR_TOKEN`'s digest, if set.
        operator: Option<[u8; 32]>,
    },
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Open => f.write_str("Auth::Open"),
            Self::Tokens { tenants, operator } => f
                .debug_struct("Auth::Tokens")
                .field("tenants", &tenants.iter().map(|(tenant, _)| tenant).collect::<Vec<_>>())
                .field("operator", &operator.is_some())
                .finish(),
        }
    }
}

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Open mode: tenant `default`, and the operator's reads.
    Open,
    /// The operator token: every tenant's queue and pacer lines, the
    /// workers, the dead turns, metrics, retrying any run — no runs of its own.
    Operator,
    /// A tenant's token: its own runs, queue counts and pacer lines.
    Tenant(String),
}

impl Caller {
    /// The tenant whose runs this caller acts on (`None`: the operator).
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Self::Open => Some(DEFAULT_TENANT),
            Self::Operator => None,
            Self::Tenant(t) => Some(t),
        }
    }

    /// Whether it may read the operator's views.
    pub fn is_operator(&self) -> bool {
        matches!(self, Self::Open | Self::Operator)
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Auth {
    /// From the configured tokens (open mode when there are none at all).
    pub fn new(tokens: &ApiTokens, operator: Option<&Secret>) -> Self {
        if tokens.is_empty() && operator.is_none() {
            Self::Open
        } else {
            Self::Tokens {
                tenants: tokens.0.iter().map(|(t, s)| (t.clone(), digest(s.expose().as_bytes()))).collect(),
                operator: operator.map(|o| digest(o.expose().as_bytes())),
            }
        }
    }

    /// Who an `Authorization` header value belongs to.
    pub fn caller(&self, authorization: Option<&[u8]>) -> Result<Caller, ApiError> {
        let Self::Tokens { tenants, operator } = self else { return Ok(Caller::Open) };
        let value = authorization.ok_or(ApiError::Unauthorized)?;
        let token = strip_bearer(value).ok_or(ApiError::Unauthorized)?;
        let presented = digest(token);
        // No early exit: every token is compared, whichever matches (tokens
        // are distinct, `config::check_access`).
        let mut found: Option<Caller> = None;
        for (tenant, d) in tenants {
            if bool::from(d.ct_eq(&presented)) {
                found = Some(Caller::Tenant(tenant.clone()));
            }
        }
        if let Some(d) = operator {
            if bool::from(d.ct_eq(&presented)) {
                found = Some(Caller::Operator);
            }
        }
        found.ok_or(ApiError::Unauthorized)
    }

    /// The tenant an `Authorization` header value belongs to; the operator
    /// token has no runs of its own (403).
    pub fn tenant(&self, authorization: Option<&[u8]>) -> Result<String, ApiError> {
        match self.caller(authorization)? {
            Caller::Operator => {
                Err(ApiError::Forbidden("the operator token acts on no tenant's runs; use a tenant's token".into()))
            }
            caller => Ok(caller.tenant().unwrap_or(DEFAULT_TENANT).to_owned()),
        }
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

fn authorization(parts: &Parts) -> Option<&[u8]> {
    parts.headers.get(axum::http::header::AUTHORIZATION).map(|v| v.as_bytes())
}

/// The authenticated tenant of a request (an extractor: 401 without a valid
/// token, 403 for the operator token, which has no runs).
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        state.auth.tenant(authorization(parts)).map(Tenant)
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        state.auth.caller(authorization(parts))
    }
}

/// The operator (or open mode), for the operator's routes: 401 without a
/// valid token, 403 for a tenant's.
#[derive(Debug, Clone, Copy)]
pub struct Operator;

impl FromRequestParts<AppState> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        match state.auth.caller(authorization(parts))? {
            c if c.is_operator() => Ok(Operator),
            _ => Err(ApiError::Forbidden("this route needs the operator token (PACELINE_OPERATOR_TOKEN)".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_map_to_their_tenant() {
        let auth = Auth::new(&ApiTokens::default().with("acme", "tok-a").with("beta", "tok-b"), None);
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
    fn the_operator_token_is_the_operator_and_no_tenant() {
        let op = Secret::new("tok-op");
        let auth = Auth::new(&ApiTokens::default().with("acme", "tok-a"), Some(&op));
        assert_eq!(auth.caller(Some(b"Bearer tok-op")).unwrap(), Caller::Operator);
        assert!(Caller::Operator.is_operator());
        assert_eq!(auth.caller(Some(b"Bearer tok-a")).unwrap(), Caller::Tenant("acme".into()));
        assert!(!Caller::Tenant("acme".into()).is_operator());
        assert!(matches!(auth.tenant(Some(b"Bearer tok-op")), Err(ApiError::Forbidden(_))));
        assert!(matches!(auth.caller(Some(b"Bearer tok-o")), Err(ApiError::Unauthorized)));
        // An operator token alone is not open mode: tenants have no way in.
        let alone = Auth::new(&ApiTokens::default(), Some(&op));
        assert!(!matches!(alone, Auth::Open));
        assert!(matches!(alone.caller(None), Err(ApiError::Unauthorized)));
        assert!(!format!("{alone:?}").contains("tok"));
    }

    #[test]
    fn open_mode_is_the_default_tenant() {
        let auth = Auth::new(&ApiTokens::default(), None);
        assert_eq!(auth.tenant(None).unwrap(), DEFAULT_TENANT);
        assert_eq!(auth.tenant(Some(b"Bearer whatever")).unwrap(), DEFAULT_TENANT);
        assert_eq!(auth.caller(None).unwrap(), Caller::Open);
        assert!(Caller::Open.is_operator());
    }
}
