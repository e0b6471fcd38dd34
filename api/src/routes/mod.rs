//! The router: every route of the API, the body limit, request tracing, a
//! JSON 404 for anything else and a JSON 405 for a known route's wrong method;
//! in open mode, requests addressed to a loopback name only (`guard.rs`).

pub mod dashboard;
pub mod events;
pub mod guard;
pub mod health;
pub mod ops;
pub mod runs;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::CONTENT_LENGTH;
use axum::http::Method;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::trace::TraceLayer;

use crate::error::ApiError;
use crate::state::AppState;

/// All routes over `state`.
pub fn router(state: AppState) -> Router {
    let limit = state.config.serve.body_limit;
    Router::new()
        .route("/", get(dashboard::index))
        .route("/assets/{name}", get(dashboard::asset))
        .route("/v1/runs", post(runs::submit).get(runs::list))
        .route("/v1/runs/{id}", get(runs::get))
        .route("/v1/runs/{id}/transcript", get(runs::transcript))
        .route("/v1/runs/{id}/events", get(events::events))
        .route("/v1/runs/{id}/cancel", post(runs::cancel))
        .route("/v1/runs/{id}/retry", post(runs::retry))
        .route("/v1/pacer", get(ops::pacer))
        .route("/v1/pacer/history", get(ops::pacer_history))
        .route("/v1/queue", get(ops::queue))
        .route("/v1/workers", get(ops::workers))
        .route("/v1/dead", get(ops::dead))
        .route("/v1/webhooks/dead", get(ops::dead_webhooks))
        .route("/v1/webhooks/{event_id}/retry", post(ops::redrive_webhook))
        .route("/v1/usage", get(ops::usage))
        .route("/v1/openapi.json", get(health::openapi))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .fallback(not_found)
        // After every route: a known path asked with a method it does not
        // answer gets the error body (axum adds the `Allow` header).
        .method_not_allowed_fallback(method_not_allowed)
        // A chunked body is cut off at the limit while it is read...
        .layer(DefaultBodyLimit::max(limit))
        // ...a slow one gets a deadline for the whole of it...
        .layer(middleware::from_fn_with_state(state.clone(), body_within_deadline))
        // ...and a declared one over it is refused before a byte is read.
        .layer(middleware::from_fn_with_state(state.clone(), reject_declared_oversize))
        // Open mode answers only requests addressed to a loopback name (DNS rebinding).
        .layer(middleware::from_fn_with_state(state.clone(), guard::loopback_host_in_open_mode))
        // The default span has the method and URI, never headers (no tokens).
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such route".into())
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::MethodNotAllowed(method.to_string())
}

/// A request's body arrives in full within `--body-timeout` of its headers:
/// its reader (a handler, after it has checked the caller) meets
/// [`BodyDeadline`] past it, answered 408 with the connection closed. The
/// header timeout bounds a client that sends headers a byte at a time, this
/// one a client that does so with a body (a frame's idle timeout would not: a
/// byte every few seconds keeps it alive). Nothing is read here: a caller
/// without a valid token is refused before its body is.
async fn body_within_deadline(State(state): State<AppState>, request: Request, next: Next) -> Response {
    use futures::StreamExt as _;
    let deadline = tokio::time::Instant::now() + state.config.serve.body_timeout;
    let (parts, body) = request.into_parts();
    let timed = futures::stream::unfold(Some(body.into_data_stream()), move |stream| async move {
        let mut stream = stream?;
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(bytes))) => Some((Ok(bytes), Some(stream))),
            Ok(Some(Err(e))) => Some((Err(axum::BoxError::from(e)), None)),
            Ok(None) => None,
            Err(_) => Some((Err(axum::BoxError::from(BodyDeadline)), None)),
        }
    });
    next.run(Request::from_parts(parts, axum::body::Body::from_stream(timed))).await
}

/// A request body that did not arrive in full within `--body-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the body did not arrive in full within the body timeout")]
pub struct BodyDeadline;

/// 413 for a `Content-Length` over the limit, without reading the body.
async fn reject_declared_oversize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let limit = state.config.serve.body_limit;
    let declared =
        request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return ApiError::PayloadTooLarge(limit).into_response();
    }
    next.run(request).await
}
