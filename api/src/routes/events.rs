//! `GET /v1/runs/{id}/events`: a run's event stream as Server-Sent Events.
//!
//! `id:` is the Redis stream id, so a client resumes with `Last-Event-ID`;
//! `event:` is the event type; `data:` its JSON. A finished run's stream
//! replays and closes; a live one is followed with blocking reads until its
//! `run.completed` / `run.failed` / `run.cancelled` event has been sent.
//!
//! A stream reads its backlog itself, then follows its run through the
//! process's one event reader (`hub.rs`: one blocking `XREAD` over every
//! followed run, on one connection), so open streams cost Redis no
//! connection each. They are bounded per tenant and per process
//! (`--max-tenant-streams`, `--max-streams`; one more answers 429) and in
//! time (`--stream-lifetime`: then the stream ends, and the client resumes
//! with `Last-Event-ID`). A stream whose client reads too slowly for the
//! hub's buffer is dropped by the hub and catches up from Redis; one whose
//! client stopped reading altogether is not polled, so its lifetime cannot
//! end it: its connection is closed when a write stalls past
//! `--write-timeout` (`serve.rs`), and that frees its place.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use shared::runs::events::valid_stream_id;
use shared::runs::state::event;
use shared::runs::store::valid_id;
use shared::runs::{RunEvent, RunStore};
use tokio::sync::watch;

use crate::auth::Tenant;
use crate::error::{ApiError, ErrorBody};
use crate::hub::{EventHub, Next};
use crate::state::AppState;

/// How long a stream waits for an event before it looks whether its run is over.
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
        (status = 429, description = "Too many open event streams, for this tenant or this API process", body = ErrorBody),
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
    let slot = state.streams.open(&tenant, &state.config.streams)?;
    let first = state
        .redis("read events", state.runs.events(&tenant, &id, after.as_deref(), None, BATCH))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no run {id}")))?;
    // The reader follows the run from the last event read here (duplicates
    // are skipped, and what came in between is read by the stream itself).
    let from = first.last().map(|e| e.id.clone()).or_else(|| after.clone()).unwrap_or_else(|| "0-0".into());
    let sub = state.hub.subscribe(&id, &from);
    let mut follow = Follow {
        store: state.runs.clone(),
        hub: state.hub.clone(),
        sub,
        caught_up: false,
        timeout: state.config.serve.redis_timeout(),
        tenant,
        id,
        after,
        pending: VecDeque::new(),
        done: false,
        shutdown: state.shutdown.clone(),
        ends_at: tokio::time::Instant::now() + state.config.streams.lifetime,
        _slot: slot,
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

/// The event streams open in this process, per tenant and in all.
#[derive(Debug, Default)]
pub struct OpenStreams(Mutex<(usize, HashMap<String, usize>)>);

impl OpenStreams {
    /// Counts one more stream for `tenant`, or says which bound it would pass.
    pub fn open(self: &Arc<Self>, tenant: &str, limits: &crate::config::StreamArgs) -> Result<StreamSlot, ApiError> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (all, per) = &mut *open;
        let mine = per.get(tenant).copied().unwrap_or(0);
        if mine >= limits.max_tenant_streams {
            return Err(ApiError::TooManyStreams(format!(
                "this tenant has {mine} event streams open, the most allowed (PACELINE_MAX_TENANT_STREAMS); close one"
            )));
        }
        if *all >= limits.max_streams {
            return Err(ApiError::TooManyStreams(format!(
                "this API process has {all} event streams open, the most allowed (PACELINE_MAX_STREAMS); try again"
            )));
        }
        *all += 1;
        per.insert(tenant.to_owned(), mine + 1);
        Ok(StreamSlot { streams: self.clone(), tenant: tenant.to_owned() })
    }
}

/// One open stream's place in [`OpenStreams`], given back when the stream ends.
#[derive(Debug)]
pub struct StreamSlot {
    streams: Arc<OpenStreams>,
    tenant: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.streams.0.lock().unwrap_or_else(|e| e.into_inner());
        let (all, per) = &mut *open;
        *all = all.saturating_sub(1);
        if let Some(n) = per.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per.remove(&self.tenant);
            }
        }
    }
}

/// Where a stream is.
struct Follow {
    /// For non-blocking reads (shared connection).
    store: RunStore,
    /// The process's reader, to follow the run again after being dropped.
    hub: EventHub,
    /// Its run's new events, from the process's reader.
    sub: crate::hub::Subscription,
    /// Whether it has read what came before it subscribed.
    caught_up: bool,
    timeout: Duration,
    tenant: String,
    id: String,
    /// The last event id sent.
    after: Option<String>,
    pending: VecDeque<RunEvent>,
    /// The terminal event was sent, or the run is gone: end after `pending`.
    done: bool,
    shutdown: watch::Receiver<bool>,
    /// The stream's lifetime ends here: it closes, the client resumes.
    ends_at: tokio::time::Instant,
    /// Its place among the open streams.
    _slot: StreamSlot,
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

    /// The next event to send, or `None` to close the stream.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                if self.after.as_deref().is_some_and(|a| !shared::runs::events::stream_id_after(&e.id, a)) {
                    continue; // read twice: by the stream and by the reader
                }
                self.after = Some(e.id.clone());
                if is_terminal(&e.kind) {
                    self.done = true;
                    self.pending.clear();
                }
                return Some(to_sse(&e));
            }
            if self.done || *self.shutdown.borrow() || tokio::time::Instant::now() >= self.ends_at {
                return None;
            }
            if !self.caught_up {
                // What came before the reader followed the run for it, until a short page.
                let read = self.store.read_events(&self.id, self.after.as_deref(), None, BATCH);
                match tokio::time::timeout(self.timeout, read).await {
                    Ok(Ok(events)) => {
                        self.caught_up = events.len() < BATCH;
                        self.pending.extend(events);
                        continue;
                    }
                    _ => {
                        tracing::warn!(message = "event stream read failed; closing it", run.id = %self.id);
                        return None;
                    }
                }
            }
            let mut shutdown = self.shutdown.clone();
            let next = tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return None,
                // Its lifetime is over: the client resumes after the last id it got.
                _ = tokio::time::sleep_until(self.ends_at) => return None,
                e = self.sub.next(BLOCK) => e,
            };
            match next {
                Next::Event(e) => self.pending.push_back(e),
                // Quiet for BLOCK: is the run over (or gone)? The run's tenant
                // was checked when the stream opened.
                Next::Quiet => self.check_finished().await,
                // Too far behind for the hub's buffer: what it missed is in
                // Redis; read it as at the start, and follow the run anew.
                Next::Dropped => {
                    let from = self.after.as_deref().unwrap_or("0-0");
                    self.sub = self.hub.subscribe(&self.id, from);
                    self.caught_up = false;
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
    fn a_streams_place_is_counted_while_it_is_open_and_given_back() {
        let streams = Arc::new(OpenStreams::default());
        let limits = crate::config::StreamArgs { max_streams: 3, max_tenant_streams: 2, ..Default::default() };
        let a1 = streams.open("a", &limits).unwrap();
        let _a2 = streams.open("a", &limits).unwrap();
        assert!(matches!(streams.open("a", &limits), Err(ApiError::TooManyStreams(_))));
        let _b1 = streams.open("b", &limits).unwrap();
        assert!(matches!(streams.open("b", &limits), Err(ApiError::TooManyStreams(_))), "three in all");
        drop(a1);
        let _a3 = streams.open("a", &limits).unwrap();
        let open = streams.0.lock().unwrap();
        assert_eq!((open.0, open.1.get("a").copied(), open.1.get("b").copied()), (3, Some(2), Some(1)));
    }

    #[test]
    fn run_end_events_are_terminal() {
        assert!(is_terminal("run.cancelled") && !is_terminal("turn.completed"));
    }
}
