//! `GET /v1/runs/{id}/events`: a run's event stream as Server-Sent Events.
//!
//! `id:` is the Redis stream id, so a client resumes with `Last-Event-ID`;
//! `event:` is the event type; `data:` its JSON. A finished run's stream
//! replays and closes; a live one is followed with blocking reads until its
//! `run.completed` / `run.failed` / `run.cancelled` event has been sent.
//!
//! Each stream blocks on its own Redis connection: a blocking `XREAD` on the
//! shared multiplexed connection would hold up every other request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use shared::runs::state::event;
use shared::runs::store::{valid_id, valid_stream_id};
use shared::runs::{RunEvent, RunStore};
use tokio::sync::watch;

use crate::auth::Tenant;
use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// How long one blocking read waits for new events.
const BLOCK: Duration = Duration::from_secs(10);
/// Events read at once.
const BATCH: usize = 200;
/// Comment lines sent while nothing happens, so proxies keep the stream open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Whether an event ends its run's stream.
pub fn is_terminal(kind: &str) -> bool {
    matches!(kind, event::RUN_COMPLETED | event::RUN_FAILED | event::RUN_CANCELLED)
}

fn to_sse(e: &RunEvent) -> Event {
    Event::default().id(e.id.clone()).event(e.kind.clone()).data(e.data.to_string())
}

/// A run's events (SSE).
#[utoipa::path(
    get, path = "/v1/runs/{id}/events", tag = "runs",
    params(
        ("id" = String, Path, description = "Run id (`run_…`)"),
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event id"),
    ),
    responses(
        (status = 200, description = "Server-Sent Events: run.queued, turn.started, turn.paced, turn.rate_limited, \
            turn.retry, turn.output_text.delta, turn.tool_call, turn.tool_result, turn.completed, run.completed, \
            run.failed, run.cancelled. A finished run's stream replays and closes.",
            content_type = "text/event-stream", body = String),
        (status = 401, description = "No or bad token", body = ErrorBody),
        (status = 404, description = "No such run for this tenant", body = ErrorBody),
        (status = 400, description = "Last-Event-ID is not an event id", body = ErrorBody),
        (status = 503, description = "Redis unavailable", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn events(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if !valid_id(&id) {
        return Err(ApiError::NotFound(format!("no run {id}")));
    }
    let after = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .map(str::trim)
                .filter(|s| valid_stream_id(s))
                .ok_or_else(|| ApiError::BadRequest("Last-Event-ID is not an event id of this stream".into()))?
                .to_owned(),
        ),
    };
    let first = state
        .redis("read events", state.runs.events(&tenant, &id, after.as_deref(), None, BATCH))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no run {id}")))?;
    let mut follow = Follow {
        store: state.runs.clone(),
        blocking: None,
        url: state.config.redis.url.clone(),
        keys: state.config.redis.keys(),
        retention: state.config.retention,
        timeout: state.config.redis_timeout(),
        tenant,
        id,
        after,
        pending: VecDeque::new(),
        done: false,
        shutdown: state.shutdown.clone(),
    };
    if first.is_empty() {
        follow.check_finished().await;
    } else {
        follow.pending.extend(first);
    }
    let mut response = Sse::new(follow.into_stream()).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
    let h = response.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells nginx-style proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// Where a stream is.
struct Follow {
    /// For non-blocking reads (shared connection).
    store: RunStore,
    /// For blocking reads (this stream's own connection, opened on first use).
    blocking: Option<RunStore>,
    url: String,
    keys: shared::keys::Keys,
    retention: Duration,
    timeout: Duration,
    tenant: String,
    id: String,
    /// The last event id sent.
    after: Option<String>,
    pending: VecDeque<RunEvent>,
    /// The terminal event was sent, or the run is gone: end after `pending`.
    done: bool,
    shutdown: watch::Receiver<bool>,
}

impl Follow {
    /// After an empty read: if the run has finished (or is gone), read once
    /// more without blocking — its terminal event may have landed just after
    /// the read — and end.
    async fn check_finished(&mut self) {
        let run = tokio::time::timeout(self.timeout, self.store.get(&self.tenant, &self.id)).await;
        match run {
            Ok(Ok(Some(run))) if !run.status.is_finished() => return,
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => {
                self.done = true;
                return;
            }
            // Unknown: keep following; the next read will tell.
            _ => return,
        }
        let last =
            tokio::time::timeout(self.timeout, self.store.read_events(&self.id, self.after.as_deref(), None, BATCH))
                .await;
        if let Ok(Ok(events)) = last {
            self.pending.extend(events);
        }
        self.done = true;
    }

    fn blocking_store(&mut self) -> Result<RunStore, ApiError> {
        if let Some(s) = &self.blocking {
            return Ok(s.clone());
        }
        let conn = shared::redis_util::lazy_manager(&self.url, BLOCK + self.timeout)?;
        let store = RunStore::new(conn, self.keys.clone(), self.retention);
        self.blocking = Some(store.clone());
        Ok(store)
    }

    /// The next event to send, or `None` to close the stream.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                self.after = Some(e.id.clone());
                if is_terminal(&e.kind) {
                    self.done = true;
                    self.pending.clear();
                }
                return Some(to_sse(&e));
            }
            if self.done || *self.shutdown.borrow() {
                return None;
            }
            let store = match self.blocking_store() {
                Ok(s) => s,
                Err(error) => {
                    tracing::warn!(message = "event stream cannot open its connection", %error, run.id = %self.id);
                    return None;
                }
            };
            // The run's tenant was checked when the stream opened; a run that
            // is gone since reads as nothing, and `check_finished` ends the stream.
            let read = store.read_events(&self.id, self.after.as_deref(), Some(BLOCK), BATCH);
            let mut shutdown = self.shutdown.clone();
            let result = tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return None,
                r = tokio::time::timeout(BLOCK + self.timeout, read) => r,
            };
            match result {
                Ok(Ok(events)) if !events.is_empty() => self.pending.extend(events),
                Ok(Ok(_)) => self.check_finished().await,
                Ok(Err(error)) => {
                    // The client reconnects with Last-Event-ID and resumes.
                    tracing::warn!(message = "event stream read failed; closing it", %error, run.id = %self.id);
                    return None;
                }
                Err(_) => {
                    tracing::warn!(message = "event stream read timed out; closing it", run.id = %self.id);
                    return None;
                }
            }
        }
    }

    fn into_stream(self) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
        futures::stream::unfold(self, |mut f| async move { f.next().await.map(|e| (Ok(e), f)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_end_events_are_terminal() {
        assert!(is_terminal("run.cancelled") && !is_terminal("turn.completed"));
    }
}
