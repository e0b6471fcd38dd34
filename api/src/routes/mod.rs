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

/// 413 for a `Content-Length` over the limit, without reading the body.
/// A request's body arrives in full within `--body-timeout` of its headers, or
/// the request is answered 408 (and its connection closed): the header
/// timeout bounds a client that sends headers a byte at a time, this one a
/// client that does so with a body (a frame's idle timeout would not: a byte
/// every few seconds keeps it alive). Read here, at most the body limit, and
/// handed on whole; a request without a body passes as it came.
async fn body_within_deadline(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let bodiless = request.headers().get(CONTENT_LENGTH).is_some_and(|v| v.as_bytes() == b"0")
        || (!request.headers().contains_key(CONTENT_LENGTH)
            && !request.headers().contains_key(axum::http::header::TRANSFER_ENCODING));
    if bodiless {
        return next.run(request).await;
    }
    let limit = state.config.serve.body_limit;
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(state.config.serve.body_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Ok(Err(_)) => ApiError::PayloadTooLarge(limit).into_response(),
        Err(_) => {
            let mut response = ApiError::RequestTimeout(state.config.serve.body_timeout).into_response();
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            response
        }
    }
}

async fn reject_declared_oversize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let limit = state.config.serve.body_limit;
    let declared =
        request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return ApiError::PayloadTooLarge(limit).into_response();
    }
    next.run(request).await
}
