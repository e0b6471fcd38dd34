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
    /// `/readyz`: Redis's memory, when it has a `maxmemory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_memory: Option<RedisMemory>,
}

/// Redis's memory against its `maxmemory`: with `noeviction` (the only
/// policy paceline runs on), a Redis at its limit refuses every write — every
/// tenant's submits and every turn's commit — so pressure is reported before.
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct RedisMemory {
    /// `used_memory`, bytes.
    pub used_bytes: u64,
    /// `maxmemory`, bytes.
    pub max_bytes: u64,
    /// Whether it is at [`MEMORY_PRESSURE`] of its limit or over.
    pub pressure: bool,
}

/// The share of `maxmemory` from which `/readyz` and the metric
/// `paceline_redis_memory_pressure` report pressure.
pub const MEMORY_PRESSURE: f64 = 0.9;

impl RedisMemory {
    /// Read off `INFO memory`; `None` when Redis has no `maxmemory` (0).
    pub fn from_info(info: &str) -> Option<Self> {
        let field = |name: &str| shared::redis_util::info_field(info, name)?.trim().parse::<u64>().ok();
        let (used_bytes, max_bytes) = (field("used_memory")?, field("maxmemory")?);
        (max_bytes > 0).then_some(Self {
            used_bytes,
            max_bytes,
            pressure: used_bytes as f64 >= MEMORY_PRESSURE * max_bytes as f64,
        })
    }
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok", redis_memory: None })
}

/// Redis answers; and how full it is.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Redis answers (`redis_memory`: its memory against its maxmemory, with `pressure` from 90 %)", body = Health),
        (status = 503, description = "Redis does not answer, or evicts keys (`not_ready`, naming its maxmemory-policy)", body = ErrorBody),
    ))]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Health>, crate::ApiError> {
    let mut conn = state.conn.clone();
    let info = async move {
        match redis::cmd("INFO").arg("memory").query_async::<String>(&mut conn).await {
            Ok(info) => Ok(Some(info)),
            // A Redis user without INFO (an ACL's -@dangerous) still answers PING:
            // ready, its memory unknown.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) => {
                redis::cmd("PING").query_async::<String>(&mut conn).await.map(|_| None)
            }
            Err(e) => Err(e),
        }
    };
    let info = crate::state::bounded(READY_TIMEOUT, "readiness INFO memory", info).await?;
    // A policy set to evict after this process started (it refuses one at start).
    let policy = info.as_deref().and_then(|i| shared::redis_util::info_field(i, "maxmemory_policy")).map(str::trim);
    if let Some(why) = policy.and_then(shared::redis_util::eviction_refused) {
        return Err(crate::ApiError::NotReady(why));
    }
    let redis_memory = info.as_deref().and_then(RedisMemory::from_info);
    crate::metrics::set_redis_memory(redis_memory);
    if redis_memory.is_some_and(|m| m.pressure) {
        tracing::warn!(
            message = "Redis is near its maxmemory: with noeviction it will refuse writes at the limit",
            used_bytes = redis_memory.map(|m| m.used_bytes),
            max_bytes = redis_memory.map(|m| m.max_bytes)
        );
    }
    Ok(Json(Health { status: "ready", redis_memory }))
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
    let mut conn = state.conn.clone();
    let info = async move { redis::cmd("INFO").arg("memory").query_async::<String>(&mut conn).await };
    if let Ok(Ok(info)) = tokio::time::timeout(SCRAPE_TIMEOUT, info).await {
        crate::metrics::set_redis_memory(RedisMemory::from_info(&info));
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
