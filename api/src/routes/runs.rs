//! `/v1/runs`: submit, list (and search), read, transcript, cancel, retry. Every input is checked
//! here or in `RunSpec::from_json` before anything reaches Redis.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use shared::runs::store::{parse_cursor, parse_transcript_cursor, transcript_cursor, valid_id};
use shared::runs::{Idempotency, Run, RunSpec, RunStatus, TranscriptEntry};

use crate::auth::{Caller, Tenant};
use crate::error::{ApiError, ErrorBody};
use crate::routes::guard::JsonContent;
use crate::state::AppState;

/// Default page size of `GET /v1/runs`.
pub const DEFAULT_LIMIT: usize = 20;
/// Largest page size of `GET /v1/runs`.
pub const MAX_LIMIT: usize = 100;
/// Longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The body of `POST /v1/runs`, for the OpenAPI document; the
/// handler validates the JSON itself (`shared::runs::spec`, `generation`) so
/// that each broken rule names its field.
#[allow(dead_code)]
#[derive(utoipa::ToSchema)]
pub struct SubmitRun {
    /// The model name, as the provider knows it.
    #[schema(example = "gpt-4.1-mini")]
    model: String,
    /// System instructions, resent on every turn.
    instructions: Option<String>,
    /// A string, or a list of Responses-API input items.
    #[schema(value_type = Object)]
    input: Value,
    /// Function tools: `{"type": "function", "name", "description", "parameters"}`.
    #[schema(value_type = Vec<Object>)]
    tools: Option<Vec<Value>>,
    /// Where tool calls are POSTed; must start with a prefix allowed to every
    /// tenant or to the caller's (`PACELINE_TOOL_ENDPOINTS`).
    tool_endpoint: Option<String>,
    /// MCP servers whose tools the model is offered as `<name>__<tool>`:
    /// `[{"name", "url", "allowed_tools"?, "headers_from_env"?}]`, at most 8;
    /// each `url` allowed by `PACELINE_MCP_ENDPOINTS`; `headers_from_env` maps a
    /// header to the name of a worker's environment variable holding its value.
    #[schema(value_type = Vec<Object>, example = json!([{"name": "files", "url": "https://mcp.example.com/mcp",
        "allowed_tools": ["read", "search"], "headers_from_env": {"Authorization": "FILES_MCP_TOKEN"}}]))]
    mcp_servers: Option<Vec<Value>>,
    /// `work` (default) or `companion` (only tenants in `PACELINE_COMPANION_TENANTS`, when set).
    mode: Option<shared::pacer::Mode>,
    /// 1 to 1000 (default 40).
    max_turns: Option<u32>,
    /// Output limit of each call (default 2048).
    max_output_tokens: Option<u32>,
    /// A wall-clock deadline from the run's creation, 1 s to 30 days: a turn
    /// that would start after it fails the run with `error.kind = "deadline"`.
    #[schema(minimum = 1, maximum = 2592000)]
    max_run_seconds: Option<u32>,
    /// Any JSON object; returned as given.
    #[schema(value_type = Object)]
    metadata: Option<Value>,
    /// One of the fleet's `PACELINE_PROVIDERS` (default: the first; a
    /// single-provider fleet's one provider is `default`).
    #[schema(example = "claude")]
    provider: Option<String>,
    /// Sampling temperature, 0 to 2 (Anthropic: at most 1 is sent).
    #[schema(minimum = 0, maximum = 2)]
    temperature: Option<f64>,
    /// Nucleus sampling, greater than 0 and at most 1.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f64>,
    /// `{"effort": "minimal" | "low" | "medium" | "high"}` (Chat: `reasoning_effort`;
    /// Anthropic: `thinking` with a budget).
    #[schema(value_type = Object, example = json!({"effort": "high"}))]
    reasoning: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict", "description"}}`
    /// (Chat: `response_format`; Anthropic: a forced answer tool).
    #[schema(value_type = Object, example = json!({"format": {"type": "json_schema", "name": "verdict",
        "strict": true, "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}}))]
    text: Option<Value>,
    /// `"auto"`, `"required"`, `"none"` or `{"type": "function", "name": ...}` naming one of `tools`.
    #[schema(value_type = Object, example = json!("required"))]
    tool_choice: Option<Value>,
    /// Whether the model may call several tools in one turn (default true).
    parallel_tool_calls: Option<bool>,
    /// A stop sequence, or a list of 1 to 4 (not sent to Responses, which has none).
    #[schema(value_type = Object, example = json!(["END"]))]
    stop: Option<Value>,
    /// Best-effort determinism (Chat only).
    seed: Option<i64>,
    /// `auto`, `default`, `flex`, `scale` or `priority` (Anthropic: `auto`, and `default` as `standard_only`).
    #[schema(example = "flex")]
    service_tier: Option<String>,
    /// Groups requests for the provider's prompt cache (1 to 1024 characters; OpenAI styles).
    prompt_cache_key: Option<String>,
    /// Whether the provider keeps the response (Responses; default false: turns are stateless).
    store: Option<bool>,
    /// `auto` or `disabled` (Responses).
    #[schema(example = "disabled")]
    truncation: Option<String>,
    /// `auto` (default: Anthropic cache breakpoints, a `prompt_cache_key` for
    /// the run on Responses) or `off` (SPEC §4a).
    #[schema(example = "auto")]
    prompt_cache: Option<String>,
    /// What a turn that would overflow the model's context window does:
    /// `trim` (default), `compact` or `fail` (SPEC §4a).
    #[schema(example = "trim")]
    context_overflow: Option<String>,
    /// The model's context window in tokens, over the built-in table's (1 024 to 100 000 000).
    #[schema(minimum = 1024, maximum = 100000000)]
    context_window_tokens: Option<u64>,
    /// The most the run may cost, USD at the model's price: a call that would cross it
    /// is not sent, and the run fails with `error.kind = "budget_exceeded"`.
    #[schema(exclusive_minimum = 0, maximum = 1000000)]
    max_cost_usd: Option<f64>,
}

/// A page of runs (`paceline runs` reads it back with the same type).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunList {
    /// Newest first.
    pub data: Vec<Run>,
    /// Pass as `cursor` for the next page; `null` on the last one.
    pub next_cursor: Option<String>,
    /// Whether there may be more.
    pub has_more: bool,
}

/// A run's transcript, a page at a time.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Transcript {
    /// The run.
    pub run_id: String,
    /// Items in order, each tagged with the turn that added it.
    pub items: Vec<TranscriptEntry>,
    /// Pass as `cursor` for the next page; `null` on the last one.
    pub next_cursor: Option<String>,
    /// Whether more items follow.
    pub has_more: bool,
}

/// Query of `GET /v1/runs/{id}/transcript`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TranscriptQuery {
    /// Items per page, 1 to 1000 (default 1000).
    limit: Option<String>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// Default (and largest) page of `GET /v1/runs/{id}/transcript`.
pub const TRANSCRIPT_MAX_LIMIT: usize = 1_000;

/// Query of `GET /v1/runs`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only runs in this status (`queued`, `running`, `waiting`, `completed`, `failed`, `cancelled`).
    status: Option<String>,
    /// Page size, 1 to 100 (default 20).
    limit: Option<String>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
    /// Only runs whose id or a metadata value contains this (case-insensitive, up to 200 characters).
    q: Option<String>,
}

/// Reads a body whose size the router has bounded; a body over the limit is a
/// 413 without being read whole, one that is not JSON a 400.
fn json_body(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
    body_timeout: std::time::Duration,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(limit)
        } else if past_its_deadline(&r) {
            ApiError::RequestTimeout(body_timeout)
        } else {
            ApiError::BadRequest(r.body_text())
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::MalformedJson(e.to_string()))
}

/// Whether reading the body failed at its deadline (`routes::BodyDeadline`).
fn past_its_deadline(rejection: &BytesRejection) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(e) = cause {
        if e.is::<super::BodyDeadline>() {
            return true;
        }
        cause = e.source();
    }
    false
}

fn idempotency(headers: &HeaderMap, spec: &RunSpec) -> Result<Option<Idempotency>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else { return Ok(None) };
    let key = value
        .to_str()
        .ok()
        .filter(|k| (1..=MAX_IDEMPOTENCY_KEY).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::invalid("Idempotency-Key", format!("must be 1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters"))
        })?;
    // The fingerprint is of the validated spec, so the same request sent
    // again (whatever its key order or whitespace) is recognised.
    let canonical = serde_json::to_vec(spec).map_err(anyhow::Error::from)?;
    let fingerprint = Sha256::digest(&canonical).iter().map(|b| format!("{b:02x}")).collect();
    Ok(Some(Idempotency { key: key.to_owned(), fingerprint }))
}

/// Submit a run.
#[utoipa::path(
    post, path = "/v1/runs", tag = "runs",
    request_body(content = SubmitRun, description = "The run spec"),
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "A retried submit with the same key and body returns the first run"),
        ("traceparent" = Option<String>, Header, description = "W3C trace context: the run's spans join this trace (one that does not read is ignored)"),
    ),
    responses(
        (status = 202, description = "Accepted (or the first run of this Idempotency-Key)", body = Run),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 403, description = "The operator token (it has no runs), or `mode: companion` from a tenant not in PACELINE_COMPANION_TENANTS", body = ErrorBody),
        (status = 413, description = "Body over the limit", body = ErrorBody),
        (status = 415, description = "The body is not sent as application/json", body = ErrorBody),
        (status = 422, description = "A rule is broken; `field` names it", body = ErrorBody),
        (status = 429, description = "Over a tenant's quota (PACELINE_MAX_ACTIVE_RUNS, PACELINE_SUBMITS_PER_MIN); `Retry-After` says when to try again, and nothing was written", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn submit(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    _: JsonContent,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let value = json_body(body, state.config.serve.body_limit, state.config.serve.body_timeout)?;
    let spec = RunSpec::from_json(&value, &state.policy)?;
    state.policy.admit(&tenant, &spec)?;
    let idem = idempotency(&headers, &spec)?;
    let first_ask = state.config.first_ask.as_ref().map(|f| f.ask(&spec, &tenant));
    // A submitter's `traceparent` (W3C trace context): the run's spans join its trace.
    let traceparent = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::trim);
    let created = state
        .redis("create run", state.runs.create_in_trace(&tenant, &spec, idem.as_ref(), first_ask, traceparent))
        .await?;
    if created.replayed {
        tracing::info!(message = "idempotent submit replayed", run.id = %created.run.id, tenant = %tenant);
    } else {
        tracing::info!(message = "run submitted", run.id = %created.run.id, tenant = %tenant, model = %spec.model);
    }
    let mut response = (StatusCode::ACCEPTED, Json(created.run)).into_response();
    if created.replayed {
        response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// List runs, newest first.
#[utoipa::path(
    get, path = "/v1/runs", tag = "runs",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of runs", body = RunList),
        (status = 400, description = "Unreadable query", body = ErrorBody),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 422, description = "Bad status, limit or cursor", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<RunList>, ApiError> {
    let Query(q) = query.map_err(|r| ApiError::BadRequest(r.body_text()))?;
    let status = match q.status.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(RunStatus::parse(s).ok_or_else(|| {
            ApiError::invalid("status", "must be queued, running, waiting, completed, failed or cancelled")
        })?),
    };
    let limit = match q.limit.as_deref().filter(|s| !s.is_empty()) {
        None => DEFAULT_LIMIT,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| ApiError::invalid("limit", format!("must be an integer from 1 to {MAX_LIMIT}")))?,
    };
    let cursor = q.cursor.as_deref().filter(|s| !s.is_empty());
    if cursor.is_some_and(|c| parse_cursor(c).is_none()) {
        return Err(ApiError::invalid("cursor", "is not a cursor this API gave out"));
    }
    let search = q.q.as_deref().map(str::trim).filter(|s| !s.is_empty());
    if search.is_some_and(|s| s.chars().count() > 200) {
        return Err(ApiError::invalid("q", "must be at most 200 characters"));
    }
    let (data, next_cursor) =
        state.redis("list runs", state.runs.list_matching(&tenant, status, search, limit, cursor)).await?;
    // The store hands a cursor back when the page is full (or its scan
    // bound was reached); an exactly full last page costs one more request.
    let has_more = next_cursor.is_some();
    Ok(Json(RunList { data, next_cursor, has_more }))
}

async fn find(state: &AppState, tenant: &str, id: &str) -> Result<Run, ApiError> {
    if !valid_id(id) {
        return Err(ApiError::NotFound(format!("no run {id}")));
    }
    state.redis("read run", state.runs.get(tenant, id)).await?.ok_or_else(|| ApiError::NotFound(format!("no run {id}")))
}

/// One run.
#[utoipa::path(
    get, path = "/v1/runs/{id}", tag = "runs",
    params(("id" = String, Path, description = "Run id (`run_…`)")),
    responses(
        (status = 200, description = "The run", body = Run),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 404, description = "No such run for this tenant", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
) -> Result<Json<Run>, ApiError> {
    find(&state, &tenant, &id).await.map(Json)
}

/// A run's transcript, as the model was last allowed to read it.
#[utoipa::path(
    get, path = "/v1/runs/{id}/transcript", tag = "runs",
    params(("id" = String, Path, description = "Run id (`run_…`)"), TranscriptQuery),
    responses(
        (status = 200, description = "The transcript (clipped tool outputs stay clipped), in pages of up to 1000 items", body = Transcript),
        (status = 400, description = "A cursor that is not one, or a limit out of range", body = ErrorBody),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 404, description = "No such run for this tenant", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn transcript(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    Query(q): Query<TranscriptQuery>,
) -> Result<Json<Transcript>, ApiError> {
    if !valid_id(&id) {
        return Err(ApiError::NotFound(format!("no run {id}")));
    }
    let limit = match q.limit.as_deref() {
        None => TRANSCRIPT_MAX_LIMIT,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=TRANSCRIPT_MAX_LIMIT).contains(n))
            .ok_or_else(|| ApiError::BadRequest(format!("limit must be 1 to {TRANSCRIPT_MAX_LIMIT}")))?,
    };
    let from = match q.cursor.as_deref() {
        None => 0,
        Some(c) => parse_transcript_cursor(c)
            .ok_or_else(|| ApiError::BadRequest("cursor is not a next_cursor of this route".into()))?,
    };
    let (items, has_more) = state
        .redis("read transcript", state.runs.transcript_page(&tenant, &id, from, limit))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no run {id}")))?;
    let next_cursor = has_more.then(|| transcript_cursor(from + items.len()));
    Ok(Json(Transcript { run_id: id, items, next_cursor, has_more }))
}

/// Cancel a run that has not finished.
#[utoipa::path(
    post, path = "/v1/runs/{id}/cancel", tag = "runs",
    params(("id" = String, Path, description = "Run id (`run_…`)")),
    responses(
        (status = 200, description = "Cancelled; its queued turn never calls the provider", body = Run),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 404, description = "No such run for this tenant", body = ErrorBody),
        (status = 409, description = "The run already finished", body = ErrorBody),
        (status = 415, description = "A body not sent as application/json", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn cancel(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    _: JsonContent,
    Path(id): Path<String>,
) -> Result<Json<Run>, ApiError> {
    if !valid_id(&id) {
        return Err(ApiError::NotFound(format!("no run {id}")));
    }
    let run = state.redis("cancel run", state.runs.cancel(&tenant, &id)).await.map_err(|e| match e {
        ApiError::NotFound(_) => ApiError::NotFound(format!("no run {id}")),
        other => other,
    })?;
    tracing::info!(message = "run cancelled", run.id = %id, tenant = %tenant);
    Ok(Json(run))
}

/// Re-drive a failed (or dead-lettered) run from its last committed turn.
#[utoipa::path(
    post, path = "/v1/runs/{id}/retry", tag = "runs",
    params(("id" = String, Path, description = "Run id (`run_…`)")),
    responses(
        (status = 202, description = "Queued again: its next turn is enqueued with fresh deliveries, its dead turn out of the dead set", body = Run),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 404, description = "No such run for this tenant (the operator may retry any tenant's)", body = ErrorBody),
        (status = 409, description = "The run is not failed (or failed with max_turns, or was retried 10 times already)", body = ErrorBody),
        (status = 415, description = "A body not sent as application/json", body = ErrorBody),
        (status = 429, description = "A tenant's retry that would pass its PACELINE_MAX_ACTIVE_RUNS", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn retry(
    State(state): State<AppState>,
    caller: Caller,
    _: JsonContent,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if !valid_id(&id) {
        return Err(ApiError::NotFound(format!("no run {id}")));
    }
    let run = state.redis("retry run", state.runs.retry(caller.tenant(), &id)).await.map_err(|e| match e {
        ApiError::NotFound(_) => ApiError::NotFound(format!("no run {id}")),
        other => other,
    })?;
    tracing::info!(message = "run retried", run.id = %id, operator = caller.tenant().is_none(), turns = run.turns_completed);
    Ok((StatusCode::ACCEPTED, Json(run)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_are_checked_before_redis() {
        assert!(parse_cursor("1732960000000:run_01JDXXXXXXXXXXXXXXXXXXXXXX").is_some());
        for bad in ["", "x:run_01JDXXXXXXXXXXXXXXXXXXXXXX", "1:run_", "1", "1:../../etc"] {
            assert!(parse_cursor(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_same_spec_has_the_same_fingerprint_whatever_its_layout() {
        let p = shared::runs::SubmitPolicy::default();
        let a = RunSpec::from_json(&serde_json::json!({"model": "m", "input": "hi", "metadata": {"a": 1, "b": 2}}), &p)
            .unwrap();
        let b = RunSpec::from_json(&serde_json::json!({"metadata": {"b": 2, "a": 1}, "input": "hi", "model": "m"}), &p)
            .unwrap();
        let mut h = HeaderMap::new();
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        assert_eq!(
            idempotency(&h, &a).unwrap().unwrap().fingerprint,
            idempotency(&h, &b).unwrap().unwrap().fingerprint
        );
        h.insert("idempotency-key", HeaderValue::from_static("has space"));
        assert!(matches!(idempotency(&h, &a), Err(ApiError::Invalid(e)) if e.field == "Idempotency-Key"));
    }
}
