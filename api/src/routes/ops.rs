//! What the shared machinery is doing: `/v1/pacer`, `/v1/pacer/history`,
//! `/v1/queue`, `/v1/workers`, `/v1/dead`.
//! Times are shown as RFC 3339 (Redis clock) and, where useful, as ms.
//!
//! Scopes (README, "Who sees what"): the operator (and open mode) sees every budget with
//! every tenant's line, the global queue counts and the workers; a tenant sees
//! the budgets and models its turns used, with its own line only, and its own
//! runs' counts.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use shared::pacer::TenantShare;
use shared::runs::record::rfc3339_ms;
use shared::runs::store::parse_cursor;
use shared::runs::TurnJob;

use crate::auth::{Caller, Operator};
use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// One budget and model, as every worker sees it: the pacer's snapshot as it
/// is, with the caller's view of the tenants' lines.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BudgetView {
    /// The budget's state (its fields, at the top level).
    #[serde(flatten)]
    pub snapshot: shared::pacer::BudgetSnapshot,
    /// When rate-limit headers were last read (RFC 3339, Redis clock).
    pub observed_at: Option<String>,
    /// The calling tenant's line in this budget (fair admission); null for
    /// the operator, who reads every line in `tenants`.
    pub tenant: Option<TenantShare>,
    /// Every tenant's line: shown to the operator (and in open mode) only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<TenantShare>>,
}

/// `GET /v1/pacer`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PacerView {
    /// Every budget and model known under this deployment's prefix.
    pub budgets: Vec<BudgetView>,
}

/// `GET /v1/queue`: for the operator the queue's exact counts; for a tenant
/// its own unfinished runs counted where their turn is (the queue does not
/// know tenants) and its dead-lettered turns.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct QueueView {
    /// Whose counts: null for the whole queue, else the calling tenant.
    pub tenant: Option<String>,
    /// Due now, waiting for a worker slot.
    pub ready: u64,
    /// Due later (budget waits, retries).
    pub delayed: u64,
    /// Leased by a worker.
    pub in_flight: u64,
    /// In the dead set.
    pub dead: u64,
    /// Due time of the next delayed turn (RFC 3339, Redis clock).
    pub next_due_at: Option<String>,
    /// Milliseconds until then.
    pub next_due_in_ms: Option<i64>,
    /// When the counts were read (RFC 3339, Redis clock).
    pub observed_at: String,
    /// A tenant's counts read only its oldest 10 000 unfinished runs (or its
    /// newest 1 000 dead turns).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// One live worker process.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkerView {
    /// Unique per process start.
    pub identity: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Worker slots.
    pub concurrency: usize,
    /// Turns it holds.
    pub in_flight: usize,
    /// When it started (RFC 3339, Redis clock).
    pub started_at: String,
    /// Its last heartbeat (RFC 3339, Redis clock).
    pub last_heartbeat: String,
}

/// `GET /v1/workers`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkersView {
    /// Workers whose heartbeat is recent.
    pub workers: Vec<WorkerView>,
}

/// The shared budget state(s).
#[utoipa::path(
    get, path = "/v1/pacer", tag = "operations",
    responses(
        (status = 200, description = "Every budget and model (operator), or those the tenant's turns used", body = PacerView),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn pacer(State(state): State<AppState>, caller: Caller) -> Result<Json<PacerView>, ApiError> {
    let snapshots = state.redis("read pacer", state.pacer.snapshot()).await?;
    crate::metrics::set_pacer(&snapshots);
    let budgets = snapshots
        .into_iter()
        .filter_map(|mut s| {
            let own = caller.tenant().and_then(|t| s.tenants.iter().find(|l| l.tenant == t).cloned());
            // A tenant sees a budget and model its turns used (it has a line
            // there), never another tenant's line.
            if !caller.is_operator() && own.is_none() {
                return None;
            }
            // The snapshot does not serialise its lines: the view shows them by caller.
            let lines = std::mem::take(&mut s.tenants);
            let tenants = caller.is_operator().then_some(lines);
            Some(BudgetView { observed_at: s.observed_at_ms.map(rfc3339_ms), tenant: own, tenants, snapshot: s })
        })
        .collect();
    Ok(Json(PacerView { budgets }))
}

/// `GET /v1/pacer/history`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HistoryView {
    /// The same budgets and models as `GET /v1/pacer` shows the caller: the
    /// last 15 minutes of each, one point a second, oldest first. The counts
    /// are the whole budget's (every tenant's turns), as its level is.
    pub budgets: Vec<shared::pacer::History>,
}

/// The last 15 minutes per budget and model: admitted tokens, 429s and budget
/// waits per second, and the token limit's refill rate (the dashboard's chart).
#[utoipa::path(
    get, path = "/v1/pacer/history", tag = "operations",
    responses(
        (status = 200, description = "Every budget and model (operator), or those the tenant's turns used", body = HistoryView),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn pacer_history(State(state): State<AppState>, caller: Caller) -> Result<Json<HistoryView>, ApiError> {
    let snapshots = state.redis("read pacer", state.pacer.snapshot()).await?;
    let mut budgets = vec![];
    for s in snapshots.iter().filter(|s| visible(&caller, s)) {
        budgets.push(state.redis("read pacer history", state.pacer.history(&s.budget, &s.model)).await?);
    }
    Ok(Json(HistoryView { budgets }))
}

/// Whether `caller` may see budget and model `s`: the operator every one, a
/// tenant one its turns used (it has a line there).
fn visible(caller: &Caller, s: &shared::pacer::BudgetSnapshot) -> bool {
    caller.is_operator() || caller.tenant().is_some_and(|t| s.tenants.iter().any(|l| l.tenant == t))
}

/// The most dead turns read to count a tenant's.
const MAX_DEAD_READ: usize = 1000;

/// Queue counts: the whole queue for the operator, the caller's own runs for a tenant.
#[utoipa::path(
    get, path = "/v1/queue", tag = "operations",
    responses(
        (status = 200, description = "Exact counts (operator), or the tenant's own", body = QueueView),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn queue(State(state): State<AppState>, caller: Caller) -> Result<Json<QueueView>, ApiError> {
    let tenant = match caller {
        Caller::Tenant(t) => t,
        Caller::Open | Caller::Operator => {
            let c = state.redis("read queue", state.queue.counts()).await?;
            crate::metrics::set_queue_depth(&c);
            return Ok(Json(QueueView {
                tenant: None,
                ready: c.ready,
                delayed: c.delayed,
                in_flight: c.in_flight,
                dead: c.dead,
                next_due_at: c.next_due_ms.map(rfc3339_ms),
                next_due_in_ms: c.next_due_ms.map(|d| (d - c.now_ms).max(0)),
                observed_at: rfc3339_ms(c.now_ms),
                truncated: false,
            }));
        }
    };
    let c = state.redis("read the tenant's runs", state.runs.tenant_counts(&tenant)).await?;
    let dead = state.redis("read the dead turns", state.queue.list_dead(MAX_DEAD_READ)).await?;
    let ids: Vec<String> = dead.iter().map(|d| d.id.clone()).collect();
    let owners = state.redis("read the dead turns' tenants", state.runs.tenants_of(&ids)).await?;
    let own_dead = owners.iter().filter(|t| t.as_deref() == Some(tenant.as_str())).count() as u64;
    Ok(Json(QueueView {
        ready: c.ready,
        delayed: c.delayed,
        in_flight: c.in_flight,
        dead: own_dead,
        next_due_at: c.next_due_ms.map(rfc3339_ms),
        next_due_in_ms: c.next_due_ms.map(|d| (d - c.now_ms).max(0)),
        observed_at: rfc3339_ms(c.now_ms),
        truncated: c.truncated || dead.len() == MAX_DEAD_READ,
        tenant: Some(tenant),
    }))
}

/// One dead-lettered turn (`GET /v1/dead`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DeadView {
    /// Its run (a run's turn is queued under the run's id).
    pub run_id: String,
    /// The run's tenant; null when the run's record has expired.
    pub tenant: Option<String>,
    /// Why it was buried (its deliveries spent, a payload or spec it could not read, …).
    pub reason: String,
    /// When it was buried (RFC 3339, Redis clock).
    pub died_at: String,
    /// The turn it would have run (its queue payload's `turn`), when readable.
    pub turn: Option<u32>,
}

/// `GET /v1/dead`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DeadList {
    /// Newest first.
    pub data: Vec<DeadView>,
    /// Pass as `cursor` for the next page; `null` on the last one.
    pub next_cursor: Option<String>,
    /// Whether there may be more.
    pub has_more: bool,
}

/// Query of `GET /v1/dead`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeadQuery {
    /// Page size, 1 to 200 (default 50).
    limit: Option<String>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
}

/// Default page size of `GET /v1/dead`.
pub const DEAD_DEFAULT_LIMIT: usize = 50;
/// Largest page size of `GET /v1/dead`.
pub const DEAD_MAX_LIMIT: usize = 200;

/// Dead-lettered turns, newest first (operator).
#[utoipa::path(
    get, path = "/v1/dead", tag = "operations",
    params(DeadQuery),
    responses(
        (status = 200, description = "A page of dead turns, newest first", body = DeadList),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 403, description = "Not the operator token", body = ErrorBody),
        (status = 422, description = "A limit or cursor this API cannot read", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn dead(
    State(state): State<AppState>,
    _: Operator,
    q: Result<Query<DeadQuery>, QueryRejection>,
) -> Result<Json<DeadList>, ApiError> {
    let Query(q) = q.map_err(|r| ApiError::BadRequest(r.body_text()))?;
    let limit = match q.limit.as_deref().filter(|s| !s.is_empty()) {
        None => DEAD_DEFAULT_LIMIT,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=DEAD_MAX_LIMIT).contains(n))
            .ok_or_else(|| ApiError::invalid("limit", format!("must be an integer from 1 to {DEAD_MAX_LIMIT}")))?,
    };
    let cursor = match q.cursor.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(c) => {
            Some(parse_cursor(c).ok_or_else(|| ApiError::invalid("cursor", "is not a cursor this API gave out"))?)
        }
    };
    // One more than the page, to know whether there is a next one.
    let mut turns = state.redis("read the dead turns", state.queue.list_dead_page(limit + 1, cursor)).await?;
    let has_more = turns.len() > limit;
    turns.truncate(limit);
    let ids: Vec<String> = turns.iter().map(|t| t.id.clone()).collect();
    let tenants = state.redis("read the dead turns' tenants", state.runs.tenants_of(&ids)).await?;
    let next_cursor = has_more.then(|| turns.last().map(|t| format!("{}:{}", t.died_at_ms, t.id))).flatten();
    let data = turns
        .into_iter()
        .zip(tenants)
        .map(|(t, tenant)| DeadView {
            turn: serde_json::from_str::<TurnJob>(&t.payload).ok().map(|j| j.turn),
            run_id: t.id,
            tenant,
            reason: t.reason,
            died_at: rfc3339_ms(t.died_at_ms),
        })
        .collect();
    Ok(Json(DeadList { data, next_cursor, has_more }))
}

/// `GET /v1/webhooks/dead`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DeadDeliveries {
    /// Newest first, at most [`DEAD_MAX_LIMIT`].
    pub data: Vec<shared::runs::webhooks::DeadDelivery>,
}

/// Webhook deliveries that used every attempt, newest first (operator):
/// each kept 7 days for a re-drive.
#[utoipa::path(
    get, path = "/v1/webhooks/dead", tag = "operations",
    responses(
        (status = 200, description = "The newest dead-lettered deliveries", body = DeadDeliveries),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 403, description = "Not the operator token", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn dead_webhooks(State(state): State<AppState>, _: Operator) -> Result<Json<DeadDeliveries>, ApiError> {
    let data = state.redis("read the dead webhook deliveries", state.webhooks().dead(DEAD_MAX_LIMIT)).await?;
    Ok(Json(DeadDeliveries { data }))
}

/// `POST /v1/webhooks/{event_id}/retry`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Redriven {
    /// The event, due again now (same `webhook-id`, same body).
    pub event_id: String,
    /// Its run.
    pub run_id: String,
}

/// Re-drives a dead-lettered webhook delivery (operator): due now, its
/// attempts counted from 0.
#[utoipa::path(
    post, path = "/v1/webhooks/{event_id}/retry", tag = "operations",
    params(("event_id" = String, Path, description = "The event's id (`webhook-id`)")),
    responses(
        (status = 202, description = "Due again now", body = Redriven),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 403, description = "Not the operator token", body = ErrorBody),
        (status = 404, description = "No such dead-lettered delivery", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn redrive_webhook(
    State(state): State<AppState>,
    _: Operator,
    Path(event_id): Path<String>,
) -> Result<(axum::http::StatusCode, Json<Redriven>), ApiError> {
    match state.redis("re-drive the webhook delivery", state.webhooks().redrive(&event_id)).await? {
        Some(run_id) => Ok((axum::http::StatusCode::ACCEPTED, Json(Redriven { event_id, run_id }))),
        None => Err(ApiError::NotFound("no such dead-lettered webhook delivery".into())),
    }
}

/// Live worker processes.
#[utoipa::path(
    get, path = "/v1/workers", tag = "operations",
    responses(
        (status = 200, description = "Workers with a recent heartbeat", body = WorkersView),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 403, description = "Not the operator token", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn workers(State(state): State<AppState>, _: Operator) -> Result<Json<WorkersView>, ApiError> {
    let list = state.redis("read workers", state.queue.list_workers()).await?;
    let workers = list
        .into_iter()
        .map(|w| WorkerView {
            identity: w.identity,
            host: w.host,
            pid: w.pid,
            concurrency: w.concurrency,
            in_flight: w.in_flight,
            started_at: rfc3339_ms(w.started_at_ms),
            last_heartbeat: rfc3339_ms(w.last_heartbeat_ms),
        })
        .collect();
    Ok(Json(WorkersView { workers }))
}

/// `GET /v1/usage`'s query.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
pub struct UsageQuery {
    /// First UTC day, `YYYY-MM-DD` (default: 29 days before `to`).
    from: Option<String>,
    /// Last UTC day, `YYYY-MM-DD` (default: today).
    to: Option<String>,
    /// `tenant`, `model` or `day` (default).
    group_by: Option<String>,
}

/// `GET /v1/usage`.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct UsageView {
    /// First day read, `YYYY-MM-DD`.
    pub from: String,
    /// Last day read.
    pub to: String,
    /// `tenant`, `model` or `day`.
    pub group_by: String,
    /// One row per tenant, model or day, in key order.
    pub data: Vec<UsageRow>,
    /// The rows' sum.
    pub total: shared::runs::usage::UsageTotals,
}

/// One row of [`UsageView`].
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct UsageRow {
    /// The tenant, the model or the day.
    pub key: String,
    /// Its counts and cost.
    #[serde(flatten)]
    pub totals: shared::runs::usage::UsageTotals,
}

/// Tokens by kind and cost per tenant, model or UTC day: a tenant sees its
/// own calls, the operator every tenant's. Counted by the workers, written
/// every 10 s and when they stop (SPEC §3).
#[utoipa::path(
    get, path = "/v1/usage", tag = "operations",
    params(UsageQuery),
    responses(
        (status = 200, description = "The sums, one row per group", body = UsageView),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 422, description = "A day, a range or a grouping this API cannot read", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn usage(
    State(state): State<AppState>,
    caller: Caller,
    q: Result<Query<UsageQuery>, QueryRejection>,
) -> Result<Json<UsageView>, ApiError> {
    use shared::runs::usage::{self, GroupBy, UsageTotals};
    let Query(q) = q.map_err(|r| ApiError::BadRequest(r.body_text()))?;
    let day = |field: &str, v: Option<&str>| -> Result<Option<u64>, ApiError> {
        v.filter(|s| !s.is_empty())
            .map(|s| usage::parse_day(s).ok_or_else(|| ApiError::invalid(field, "must be a UTC date, YYYY-MM-DD")))
            .transpose()
    };
    let today = {
        use shared::clock::Clock as _;
        usage::day_of(shared::clock::SystemClock.now_ms().max(0) as u64)
    };
    let to = day("to", q.to.as_deref())?.unwrap_or(today);
    let from = day("from", q.from.as_deref())?.unwrap_or(to.saturating_sub(29));
    if from > to {
        return Err(ApiError::invalid("from", "must not be after `to`"));
    }
    if to - from >= usage::MAX_DAYS {
        return Err(ApiError::invalid("from", format!("the range is at most {} days", usage::MAX_DAYS)));
    }
    let group_by = match q.group_by.as_deref().filter(|s| !s.is_empty()) {
        None => GroupBy::Day,
        Some(g) => GroupBy::parse(g).ok_or_else(|| ApiError::invalid("group_by", "must be tenant, model or day"))?,
    };
    // The operator (and open mode) every tenant's; a tenant its own.
    let tenant = if caller.is_operator() { None } else { caller.tenant() };
    let mut conn = state.conn.clone();
    let keys = state.config.redis.keys();
    let sums = state.redis("read the usage", usage::read(&mut conn, &keys, from, to, group_by, tenant)).await?;
    let total = sums.values().fold(UsageTotals::zero(), |total, t| total.plus(t));
    let group_by = serde_json::to_value(group_by).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
    let data = sums.into_iter().map(|(key, totals)| UsageRow { key, totals }).collect();
    Ok(Json(UsageView { from: usage::format_day(from), to: usage::format_day(to), group_by, data, total }))
}
