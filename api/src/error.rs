//! Every error a client can see, in one place: its HTTP status, its stable
//! `type` code, and the one error body `{"error": {"type", "message", "field"?}}`.
//!
//! The last variant, `Unexpected`, is a bug or an unforeseen failure: it is
//! logged with its whole cause chain and answered with a generic message,
//! never with the cause.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use shared::runs::SpecError;

/// An error at the HTTP edge.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON (400).
    #[error("the body is not valid JSON: {0}")]
    MalformedJson(String),
    /// A query parameter or header could not be read at all (400).
    #[error("{0}")]
    BadRequest(String),
    /// No bearer token, or not a known one (401).
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A valid token without the right to this route (403): a tenant on an
    /// operator's route, the operator on a tenant's runs, or a non-loopback
    /// `Host` in open mode.
    #[error("{0}")]
    Forbidden(String),
    /// No such run for this tenant, or no such route (404).
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the resource's state (409).
    #[error("{0}")]
    Conflict(String),
    /// A known route asked with a method it does not answer (405; the
    /// `Allow` header lists those it does).
    #[error("{0} is not allowed on this route; its Allow header lists the methods it answers")]
    MethodNotAllowed(String),
    /// A `POST` body that is not `application/json` (415).
    #[error("the body must be JSON sent with Content-Type: application/json")]
    UnsupportedMediaType,
    /// The body is larger than the limit (413).
    #[error("the body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    /// The body did not arrive in full within the body timeout (408).
    #[error("the body did not arrive in full within {0:?}")]
    RequestTimeout(std::time::Duration),
    /// A valid JSON body (or parameter) that breaks a rule (422), naming the field.
    #[error("{}", .0.message)]
    Invalid(SpecError),
    /// Too many open event streams, for the tenant or the process (429).
    #[error("{0}")]
    TooManyStreams(String),
    /// A submit over one of the tenant's quotas (429 with `Retry-After`).
    #[error("{}", .0.message)]
    Quota(shared::runs::QuotaExceeded),
    /// Redis answers but cannot hold paceline's state now (503): it was set to
    /// evict keys after the process started.
    #[error("{0}")]
    NotReady(String),
    /// Redis did not answer in time, or refused the connection (503).
    #[error("the run store (Redis) is unavailable; try again")]
    Unavailable(#[source] anyhow::Error),
    /// Anything else (500): logged with its cause chain, never shown.
    #[error("an unexpected error occurred")]
    Unexpected(#[from] anyhow::Error),
}

/// The error body's inner object.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// A stable code: `invalid_json`, `bad_request`, `unauthorized`,
    /// `forbidden`, `not_found`, `method_not_allowed`, `conflict`,
    /// `payload_too_large`, `request_timeout`, `unsupported_media_type`, `invalid_request`,
    /// `too_many_streams`, `quota_exceeded`, `not_ready`, `unavailable`, `internal_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What went wrong, for a human.
    pub message: String,
    /// The field at fault (422 only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

impl ApiError {
    /// A 422 naming `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid(SpecError { field: field.into(), message: message.into() })
    }

    /// The status and stable code of this error.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            Self::MalformedJson(_) => (StatusCode::BAD_REQUEST, "invalid_json"),
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Self::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            Self::UnsupportedMediaType => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
            Self::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            Self::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            Self::RequestTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            Self::Invalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request"),
            Self::TooManyStreams(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_streams"),
            Self::Quota(_) => (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
            Self::NotReady(_) => (StatusCode::SERVICE_UNAVAILABLE, "not_ready"),
            Self::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Self::Unexpected(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        }
    }

    /// A Redis failure: 503 when Redis is down, slow or refusing, 500 when it
    /// answered something this code did not expect (a bug).
    pub fn from_redis(error: redis::RedisError) -> Self {
        if redis_unavailable(&error) {
            Self::Unavailable(error.into())
        } else {
            Self::Unexpected(anyhow::Error::new(error).context("redis answered with an error"))
        }
    }
}

/// Whether a Redis error means "Redis is not there (now)" (a 503), not a bug.
pub use shared::redis_util::unavailable as redis_unavailable;

impl From<redis::RedisError> for ApiError {
    fn from(error: redis::RedisError) -> Self {
        Self::from_redis(error)
    }
}

impl From<shared::queue::QueueError> for ApiError {
    fn from(error: shared::queue::QueueError) -> Self {
        match error {
            shared::queue::QueueError::Redis(e) => Self::from_redis(e),
            other => Self::Unexpected(anyhow::Error::new(other).context("reading the queue")),
        }
    }
}

impl From<shared::pacer::PacerError> for ApiError {
    fn from(error: shared::pacer::PacerError) -> Self {
        match error {
            shared::pacer::PacerError::Redis(e) => Self::from_redis(e),
            other => Self::Unexpected(anyhow::Error::new(other).context("reading the pacer state")),
        }
    }
}

impl From<shared::runs::StoreError> for ApiError {
    fn from(error: shared::runs::StoreError) -> Self {
        use shared::runs::StoreError;
        match error {
            StoreError::NotFound => Self::NotFound("no such run".into()),
            StoreError::Conflict(status) => Self::Conflict(format!("the run is already {status}")),
            StoreError::IdempotencyMismatch => {
                Self::invalid("Idempotency-Key", "this Idempotency-Key was already used with another body")
            }
            StoreError::Redis(e) => Self::from_redis(e),
            StoreError::Quota(q) => Self::Quota(q),
            #[allow(unreachable_patterns)]
            other => Self::Unexpected(anyhow::Error::new(other).context("run store")),
        }
    }
}

impl From<SpecError> for ApiError {
    fn from(error: SpecError) -> Self {
        Self::Invalid(error)
    }
}

impl From<shared::runs::Refusal> for ApiError {
    fn from(refusal: shared::runs::Refusal) -> Self {
        match refusal {
            shared::runs::Refusal::Invalid(error) => Self::Invalid(error),
            shared::runs::Refusal::Forbidden(why) => Self::Forbidden(why),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status_and_code();
        match &self {
            Self::Unexpected(cause) => {
                tracing::error!(message = "request failed unexpectedly", error = ?cause, error.chain = %chain(cause));
            }
            Self::Unavailable(cause) => {
                tracing::warn!(message = "redis unavailable", error.chain = %chain(cause));
            }
            _ => {}
        }
        let field = match &self {
            Self::Invalid(e) => Some(e.field.clone()),
            _ => None,
        };
        let body = ErrorBody { error: ErrorDetail { kind, message: self.to_string(), field } };
        let mut response = (status, axum::Json(body)).into_response();
        if let Self::RequestTimeout(_) = &self {
            // The rest of a body that came too slowly is not waited for.
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        if let Self::Quota(q) = &self {
            // Whole seconds, rounded up: a client that waits this long passes.
            let seconds = q.retry_after_ms.div_ceil(1000).max(1);
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

/// `a: b: c` — an error and its sources on one line.
fn chain(e: &anyhow::Error) -> String {
    e.chain().map(ToString::to_string).collect::<Vec<_>>().join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(e: ApiError) -> (StatusCode, serde_json::Value) {
        let r = e.into_response();
        let status = r.status();
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn errors_have_the_specs_shape_and_hide_unexpected_causes() {
        let (s, b) = body_of(ApiError::invalid("max_turns", "must be an integer from 1 to 1000")).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(b["error"]["type"], "invalid_request");
        assert_eq!(b["error"]["field"], "max_turns");

        let (s, b) = body_of(ApiError::Unexpected(anyhow::anyhow!("secret internals"))).await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!b.to_string().contains("secret internals"));
        assert!(b["error"].get("field").is_none());

        let (s, _) = body_of(ApiError::Unavailable(anyhow::anyhow!("refused"))).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn redis_down_is_503_and_a_script_bug_is_not() {
        let io: redis::RedisError = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(redis_unavailable(&io));
        let parse: redis::RedisError = (redis::ErrorKind::UnexpectedReturnType, "bad").into();
        assert!(!redis_unavailable(&parse));
    }
}
