//! Probes and documents: `/healthz`, `/readyz` (no token), `/metrics` (the
//! operator's, or anyone's in open mode), `/v1/openapi.json` (any token).

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::error::ErrorBody;
use crate::state::AppState;

/// How long `/readyz` waits for Redis to answer PING.
const READY_TIMEOUT: Duration = Duration::from_millis(1000);
/// How long a scrape waits for the gauges it reads from Redis.
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(1000);

/// A probe's answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// `ok` or `ready`.
    pub status: &'static str,
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Redis answers.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Redis answers PING", body = Health),
        (status = 503, description = "Redis does not answer", body = ErrorBody),
    ))]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Health>, crate::ApiError> {
    let mut conn = state.conn.clone();
    let ping = async move { redis::cmd("PING").query_async::<String>(&mut conn).await };
    crate::state::bounded(READY_TIMEOUT, "readiness PING", ping).await?;
    Ok(Json(Health { status: "ready" }))
}

/// Prometheus metrics: the operator token's, or open to all in open mode.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
        (status = 401, description = "Tokens are configured and this is not a valid one", body = ErrorBody),
        (status = 403, description = "Not the operator token", body = ErrorBody),
    ),
    security((), ("bearer" = [])))]
pub async fn metrics(State(state): State<AppState>, _: crate::auth::Operator) -> Response {
    // The gauges the API owns are read fresh; a scrape never fails on Redis.
    if let Ok(Ok(c)) = tokio::time::timeout(SCRAPE_TIMEOUT, state.queue.counts()).await {
        crate::metrics::set_queue_depth(&c);
    }
    if let Ok(Ok(s)) = tokio::time::timeout(SCRAPE_TIMEOUT, state.pacer.snapshot()).await {
        crate::metrics::set_pacer(&s);
    }
    let handle = crate::metrics::handle();
    handle.run_upkeep();
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response()
}

/// This document.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object),
        (status = 401, description = "No or bad token", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub async fn openapi(_: crate::auth::Caller) -> Response {
    Json(crate::openapi::document()).into_response()
}
