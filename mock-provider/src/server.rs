//! The HTTP face: axum routes over one `Mutex<State>` in which every admission
//! is decided, so two concurrent requests can never both spend the same budget.
//! The lock is never held across an `.await`; answers are written after it.

use crate::bucket::{Bucket, Refusal};
use crate::config::MockConfig;
use crate::duration::{ceil_ms, go_duration};
use crate::fault::Fault;
use crate::script::{self, Script};
use crate::stats::{BucketView, Buckets, KeptBody, LogEntry, Stats};
use crate::wire::{self, error_body, Api, Reply, Request, StreamError};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State as AxState};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

/// A daily cap's window: a fixed day, so nothing returns until it ends.
const DAY_US: u64 = 86_400 * 1_000_000;
/// Bodies are agentic histories: allow far more than axum's 2 MB default.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// A running mock provider. Dropping it stops accepting connections; call
/// [`MockServer::shutdown`] to also wait until it has stopped.
#[derive(Debug)]
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl MockServer {
    /// Binds `config.listen` (port 0 allowed) and starts serving.
    pub async fn start(config: MockConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(config));
        let (stop, stopped) = oneshot::channel::<()>();
        let app = router(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Self { addr, shared, stop: Some(stop), task: Some(task) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR` (the `/_mock/…` routes live here).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://ADDR/v1`, what a client takes as its OpenAI base URL.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &MockConfig {
        &self.shared.cfg
    }

    /// The same data as `GET /_mock/stats`.
    pub fn stats(&self) -> Stats {
        self.shared.stats(true)
    }

    /// The counters and buckets without the log and bodies (cheap to poll).
    pub fn summary(&self) -> Stats {
        self.shared.stats(false)
    }

    /// Queues a fault for the next API request.
    pub fn inject(&self, fault: Fault) {
        self.shared.lock().faults.push_back(fault);
    }

    /// Zeroes the counters and logs, refills both buckets, forgets queued
    /// faults and re-seeds the dice (as `POST /_mock/reset`).
    pub fn reset(&self) {
        self.shared.reset();
    }

    /// Stops accepting, lets answers in flight finish, and waits for the server to end.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Serves until `shutdown` resolves, then stops cleanly.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()>) {
        shutdown.await;
        self.shutdown().await;
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/responses", post(responses))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/_mock/stats", get(stats))
        .route("/_mock/reset", post(reset))
        .route("/_mock/faults", post(faults))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(shared)
}

async fn responses(AxState(shared): AxState<Arc<Shared>>, body: Bytes) -> Response {
    shared.handle(Api::Responses, body).await
}

async fn chat_completions(AxState(shared): AxState<Arc<Shared>>, body: Bytes) -> Response {
    shared.handle(Api::Chat, body).await
}

#[derive(Debug, serde::Deserialize)]
struct StatsQuery {
    /// `?log=false` leaves out the log and the bodies (cheap polling).
    log: Option<bool>,
}

async fn stats(AxState(shared): AxState<Arc<Shared>>, Query(q): Query<StatsQuery>) -> Response {
    Json(shared.stats(q.log.unwrap_or(true))).into_response()
}

async fn reset(AxState(shared): AxState<Arc<Shared>>) -> Response {
    shared.reset();
    Json(json!({"reset": true})).into_response()
}

/// Takes one fault object or a list of them.
async fn faults(AxState(shared): AxState<Arc<Shared>>, body: Bytes) -> Response {
    let parsed: Result<Vec<Fault>, _> = serde_json::from_slice::<Vec<Fault>>(&body)
        .or_else(|_| serde_json::from_slice::<Fault>(&body).map(|f| vec![f]));
    match parsed {
        Ok(list) => {
            let mut st = shared.lock();
            let n = list.len();
            st.faults.extend(list);
            Json(json!({"queued": n, "pending": st.faults.len()})).into_response()
        }
        Err(e) => {
            (StatusCode::BAD_REQUEST, Json(error_body("invalid_request_error", None, &format!("bad fault: {e}"))))
                .into_response()
        }
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    let msg = format!("Invalid URL ({method} {})", uri.path());
    (StatusCode::NOT_FOUND, Json(error_body("invalid_request_error", None, &msg))).into_response()
}

/// State shared by every handler.
#[derive(Debug)]
struct Shared {
    cfg: MockConfig,
    start: Instant,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    tokens: Bucket,
    requests: Bucket,
    rng: StdRng,
    /// Request numbers are never reused (not even after a reset), so response ids stay unique.
    seq: u64,
    /// Admitted requests, for `quota_after`.
    admitted: u64,
    /// Counters; the log and bodies live in the deques below.
    stats: Stats,
    log: VecDeque<LogEntry>,
    bodies: VecDeque<KeptBody>,
    faults: VecDeque<Fault>,
}

/// The `x-ratelimit-*` values right after a decision.
#[derive(Debug, Clone, Copy)]
struct RateSnapshot {
    limit_requests: u64,
    remaining_requests: u64,
    reset_requests_ms: u64,
    limit_tokens: u64,
    remaining_tokens: u64,
    reset_tokens_ms: u64,
}

/// An admitted request, on its way to be answered.
#[derive(Debug)]
struct Admission {
    seq: u64,
    request: Request,
    body: Value,
    max_out: u64,
    snapshot: RateSnapshot,
    midstream: Option<StreamError>,
    stall: Duration,
}

/// Which bucket refused.
#[derive(Debug, Clone, Copy)]
enum Limit {
    Tokens,
    Requests,
}

impl Shared {
    fn new(cfg: MockConfig) -> Self {
        let state = State::new(&cfg);
        Self { cfg, start: Instant::now(), state: Mutex::new(state) }
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// A handler that panicked mid-update leaves counters, not broken
    /// invariants (every update is a few plain assignments), so keep serving.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn reset(&self) {
        let mut st = self.lock();
        let seq = st.seq;
        *st = State::new(&self.cfg);
        st.seq = seq;
        // A fresh bucket starts at time 0; bring it to now so a continuous
        // bucket does not credit itself the time before the reset.
        let now = self.now_us();
        st.tokens.refill(now);
        st.requests.refill(now);
    }

    fn script(&self) -> Script {
        Script {
            tool_rounds: self.cfg.tool_rounds,
            calls_per_round: self.cfg.calls_per_round,
            output_tokens: self.cfg.output_tokens,
        }
    }

    fn stats(&self, with_log: bool) -> Stats {
        let mut st = self.lock();
        let now = self.now_us();
        st.tokens.refill(now);
        st.requests.refill(now);
        let mut stats = st.stats.clone();
        stats.tokens_admitted = stats.tokens_charged.saturating_sub(stats.tokens_refunded);
        stats.largest_overdraft = st.tokens.largest_overdraft().max(st.requests.largest_overdraft());
        stats.buckets = Buckets { tokens: view(&st.tokens), requests: view(&st.requests) };
        if with_log {
            stats.log = st.log.iter().cloned().collect();
            stats.bodies = st.bodies.iter().cloned().collect();
        }
        stats
    }

    async fn handle(self: Arc<Self>, api: Api, raw: Bytes) -> Response {
        let (body, parsed) = match serde_json::from_slice::<Value>(&raw) {
            Ok(body) => {
                let parsed = wire::parse(api, &body);
                (body, parsed)
            }
            Err(e) => (
                Value::String(String::from_utf8_lossy(&raw).into_owned()),
                Err(format!(
                    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.) {e}"
                )),
            ),
        };
        match self.admit(api, body, parsed) {
            Ok(admission) => self.answer(admission).await,
            Err(refusal) => refusal,
        }
    }

    /// Every decision about one request, made under the lock: parse errors,
    /// injected and random faults, the quota, then both buckets (atomically:
    /// a request refused by the token bucket gets its request slot back).
    // The refusal is returned once per request and answered at once: boxing it buys nothing.
    #[allow(clippy::result_large_err)]
    fn admit(&self, api: Api, body: Value, parsed: Result<Request, String>) -> Result<Admission, Response> {
        let cfg = &self.cfg;
        let mut st = self.lock();
        // "Now" is read under the lock, so the log's times follow the order in
        // which the bucket saw the requests: the ledger a test rebuilds from the
        // log is then exactly the bucket's history.
        let now = self.now_us();
        st.seq += 1;
        let seq = st.seq;
        st.stats.requests += 1;
        if cfg.keep_bodies > 0 {
            if st.bodies.len() == cfg.keep_bodies {
                st.bodies.pop_front();
            }
            st.bodies.push_back(KeptBody { seq, body: body.clone() });
        }
        st.tokens.refill(now);
        st.requests.refill(now);
        let mut entry = LogEntry {
            seq,
            at_us: now,
            at_ms: now / 1000,
            api: Some(api),
            model: None,
            stream: false,
            status: 0,
            code: None,
            input_tokens: 0,
            tool_outputs: 0,
            charged: 0,
            refunded: 0,
            refunded_at_us: None,
        };
        let request = match parsed {
            Ok(request) => request,
            Err(msg) => {
                let body = error_body("invalid_request_error", None, &msg);
                return Err(self.refuse(&mut st, entry, StatusCode::BAD_REQUEST, None, body, None));
            }
        };
        let prompt = &request.prompt;
        entry.model = Some(prompt.model.clone());
        entry.stream = request.stream;
        entry.input_tokens = prompt.input_tokens;
        entry.tool_outputs = prompt.tool_outputs;

        let fault = st.faults.pop_front();
        // Three draws per request whatever happens, so the n-th request's
        // fate depends only on the seed and n.
        let fail_roll: f64 = st.rng.random();
        let midstream_roll: f64 = st.rng.random();
        let pick = st.rng.random_range(0..3usize);

        let server_status = match &fault {
            Some(Fault::ServerError { status }) => Some(*status),
            _ if fail_roll < cfg.fail_rate => Some([500, 503, 529][pick]),
            _ => None,
        };
        if let Some(status) = server_status {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Err(self.refuse(&mut st, entry, status, None, server_error_body(status), None));
        }

        if matches!(fault, Some(Fault::Quota)) || cfg.quota_after.is_some_and(|n| st.admitted >= n) {
            let body = error_body(
                "insufficient_quota",
                Some("insufficient_quota"),
                "You exceeded your current quota, please check your plan and billing details. For more information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
            );
            return Err(self.refuse(
                &mut st,
                entry,
                StatusCode::TOO_MANY_REQUESTS,
                Some("insufficient_quota"),
                body,
                None,
            ));
        }

        let max_out = prompt.max_output_tokens.unwrap_or_else(|| cfg.default_max_output());
        let charge = prompt.input_tokens + max_out;

        if let Some(Fault::RateLimited { retry_after_ms }) = fault {
            let used = st.tokens.capacity() - st.tokens.remaining();
            let msg =
                self.limit_message(Limit::Tokens, &prompt.model, st.tokens.capacity(), used, charge, retry_after_ms);
            let body = error_body("tokens", Some("rate_limit_exceeded"), &msg);
            return Err(self.refuse(
                &mut st,
                entry,
                StatusCode::TOO_MANY_REQUESTS,
                Some("rate_limit_exceeded"),
                body,
                Some(retry_after_ms * 1000),
            ));
        }

        if charge > st.tokens.capacity() {
            let msg = format!(
                "Request too large for {} in organization {} on {}: Limit {}, Requested {}. The input or output tokens must be reduced in order to run successfully. Visit https://platform.openai.com/account/rate-limits to learn more.",
                prompt.model, cfg.organization, self.unit(Limit::Tokens), st.tokens.capacity(), charge
            );
            let body = error_body("tokens", Some("rate_limit_exceeded"), &msg);
            return Err(self.refuse(
                &mut st,
                entry,
                StatusCode::TOO_MANY_REQUESTS,
                Some("rate_limit_exceeded"),
                body,
                None,
            ));
        }

        let refused = match st.requests.try_take(now, 1) {
            Err(Refusal::Wait { wait_us }) => Some((Limit::Requests, wait_us, 1)),
            Err(Refusal::TooLarge) => Some((Limit::Requests, st.requests.window_us(), 1)),
            Ok(()) => match st.tokens.try_take(now, charge) {
                Ok(()) => None,
                Err(refusal) => {
                    // Both buckets or neither: hand the request slot back.
                    st.requests.give_back(now, 1);
                    let wait_us = match refusal {
                        Refusal::Wait { wait_us } => wait_us,
                        Refusal::TooLarge => st.tokens.window_us(),
                    };
                    Some((Limit::Tokens, wait_us, charge))
                }
            },
        };
        if let Some((limit, wait_us, requested)) = refused {
            let bucket = match limit {
                Limit::Tokens => &st.tokens,
                Limit::Requests => &st.requests,
            };
            let used = bucket.capacity() - bucket.remaining();
            let msg = self.limit_message(limit, &prompt.model, bucket.capacity(), used, requested, ceil_ms(wait_us));
            let kind = match limit {
                Limit::Tokens => "tokens",
                Limit::Requests => "requests",
            };
            let body = error_body(kind, Some("rate_limit_exceeded"), &msg);
            return Err(self.refuse(
                &mut st,
                entry,
                StatusCode::TOO_MANY_REQUESTS,
                Some("rate_limit_exceeded"),
                body,
                Some(wait_us),
            ));
        }

        st.admitted += 1;
        st.stats.tokens_charged += charge;
        st.stats.ok += 1;
        *st.stats.by_status.entry(200).or_default() += 1;
        entry.status = 200;
        entry.charged = charge;
        self.push_log(&mut st, entry);
        let snapshot = snapshot(&st);

        let midstream = if !request.stream {
            None
        } else {
            let code = match &fault {
                Some(Fault::MidstreamError { code }) => {
                    Some(code.clone().unwrap_or_else(|| "server_error".to_string()))
                }
                _ if midstream_roll < cfg.midstream_error_rate => Some(cfg.midstream_error_code.clone()),
                _ => None,
            };
            code.map(|code| self.stream_error(&code, &prompt.model, &snapshot, charge))
        };
        let stall = match &fault {
            Some(Fault::Stall { ms }) => Duration::from_millis(*ms),
            _ => cfg.stall,
        };
        drop(st);
        Ok(Admission { seq, request, body, max_out, snapshot, midstream, stall })
    }

    /// Records a refused request and builds its answer: the error body, the
    /// rate-limit headers, and `retry-after`/`retry-after-ms` when there is a wait.
    fn refuse(
        &self,
        st: &mut State,
        mut entry: LogEntry,
        status: StatusCode,
        code: Option<&str>,
        body: Value,
        retry_us: Option<u64>,
    ) -> Response {
        entry.status = status.as_u16();
        entry.code = code.map(str::to_string).or_else(|| body["error"]["code"].as_str().map(str::to_string));
        *st.stats.by_status.entry(status.as_u16()).or_default() += 1;
        if status.is_success() {
            st.stats.ok += 1;
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            st.stats.rate_limited += 1;
            let code = code.unwrap_or("unknown").to_string();
            *st.stats.rate_limited_by_code.entry(code).or_default() += 1;
        }
        let seq = entry.seq;
        self.push_log(st, entry);
        let mut headers = HeaderMap::new();
        self.common_headers(&mut headers, seq, &snapshot(st));
        if let Some(us) = retry_us {
            let ms = ceil_ms(us).max(1);
            insert(&mut headers, "retry-after", ms.div_ceil(1000).to_string());
            insert(&mut headers, "retry-after-ms", ms.to_string());
        }
        (status, headers, Json(body)).into_response()
    }

    fn push_log(&self, st: &mut State, entry: LogEntry) {
        if self.cfg.log_limit == 0 {
            return;
        }
        if st.log.len() == self.cfg.log_limit {
            st.log.pop_front();
        }
        st.log.push_back(entry);
    }

    fn unit(&self, limit: Limit) -> &'static str {
        match limit {
            Limit::Tokens if self.cfg.daily_cap => "tokens per day (TPD)",
            Limit::Tokens => "tokens per min (TPM)",
            Limit::Requests => "requests per min (RPM)",
        }
    }

    fn limit_message(&self, limit: Limit, model: &str, cap: u64, used: u64, requested: u64, wait_ms: u64) -> String {
        format!(
            "Rate limit reached for {model} in organization {} on {}: Limit {cap}, Used {used}, Requested {requested}. Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.",
            self.cfg.organization,
            self.unit(limit),
            go_duration(wait_ms.max(1)),
        )
    }

    fn stream_error(&self, code: &str, model: &str, snap: &RateSnapshot, charge: u64) -> StreamError {
        if code == "rate_limit_exceeded" {
            let used = snap.limit_tokens - snap.remaining_tokens;
            StreamError {
                kind: "tokens".into(),
                code: code.into(),
                message: self.limit_message(
                    Limit::Tokens,
                    model,
                    snap.limit_tokens,
                    used,
                    charge,
                    snap.reset_tokens_ms,
                ),
            }
        } else {
            StreamError {
                kind: "server_error".into(),
                code: code.into(),
                message: "The server had an error processing your request. Sorry about that! You can retry your request, or contact us through our help center at help.openai.com if you keep seeing this error.".into(),
            }
        }
    }

    fn common_headers(&self, headers: &mut HeaderMap, seq: u64, snap: &RateSnapshot) {
        insert(headers, "x-request-id", format!("req_{:016x}", script::fnv1a(&seq.to_le_bytes(), 3)));
        if !self.cfg.headers {
            return;
        }
        insert(headers, "x-ratelimit-limit-requests", snap.limit_requests.to_string());
        insert(headers, "x-ratelimit-remaining-requests", snap.remaining_requests.to_string());
        insert(headers, "x-ratelimit-reset-requests", go_duration(snap.reset_requests_ms));
        insert(headers, "x-ratelimit-limit-tokens", snap.limit_tokens.to_string());
        insert(headers, "x-ratelimit-remaining-tokens", snap.remaining_tokens.to_string());
        insert(headers, "x-ratelimit-reset-tokens", go_duration(snap.reset_tokens_ms));
    }

    /// Gives back the unused output (unless the provider keeps the charge)
    /// and notes the end of the answer.
    fn refund(&self, seq: u64, amount: u64, midstream_error: bool) {
        let amount = if self.cfg.charge == crate::bucket::ChargeMode::Keep { 0 } else { amount };
        let mut st = self.lock();
        let now = self.now_us();
        st.tokens.give_back(now, amount);
        st.stats.tokens_refunded += amount;
        if midstream_error {
            st.stats.midstream_errors += 1;
        }
        if let Some(entry) = st.log.iter_mut().rev().find(|e| e.seq == seq) {
            entry.refunded = amount;
            entry.refunded_at_us = Some(now);
            if midstream_error {
                entry.code = Some("midstream_error".into());
            }
        }
    }

    /// Writes an admitted request's answer: after the latency, a JSON body,
    /// or a stream fed by a task that stalls or breaks at the plan's midpoint.
    async fn answer(self: Arc<Self>, adm: Admission) -> Response {
        if !self.cfg.latency.is_zero() {
            tokio::time::sleep(self.cfg.latency).await;
        }
        let answer = script::answer(&adm.request.prompt, &self.script());
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let reply = Reply { request: &adm.request, body: &adm.body, answer: &answer, seq: adm.seq, created };
        let mut headers = HeaderMap::new();
        self.common_headers(&mut headers, adm.seq, &adm.snapshot);
        let output = answer.output_tokens();

        if !adm.request.stream {
            let body = match adm.request.api {
                Api::Responses => wire::responses_json(&reply),
                Api::Chat => wire::chat_json(&reply),
            };
            self.refund(adm.seq, adm.max_out.saturating_sub(output), false);
            return (StatusCode::OK, headers, Json(body)).into_response();
        }

        let plan = match adm.request.api {
            Api::Responses => wire::responses_stream(&reply),
            Api::Chat => wire::chat_stream(&reply),
        };
        let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
        let shared = self.clone();
        let (seq, max_out, stall, midstream) = (adm.seq, adm.max_out, adm.stall, adm.midstream);
        tokio::spawn(async move {
            for (i, frame) in plan.frames.iter().enumerate() {
                if i == plan.midpoint {
                    if !stall.is_zero() {
                        shared.lock().stats.stalls += 1;
                        tokio::time::sleep(stall).await;
                    }
                    if let Some(err) = &midstream {
                        let _ = tx.send(Ok(Bytes::from(plan.error_frame(err)))).await;
                        shared.refund(seq, max_out.saturating_sub(plan.tokens_by_midpoint), true);
                        return;
                    }
                }
                if tx.send(Ok(Bytes::from(frame.clone()))).await.is_err() {
                    // The client went away; the budget is settled as if it had read it all.
                    break;
                }
            }
            shared.refund(seq, max_out.saturating_sub(output), false);
        });
        insert(&mut headers, "content-type", "text/event-stream; charset=utf-8".to_string());
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        (StatusCode::OK, headers, Body::from_stream(ReceiverStream::new(rx))).into_response()
    }
}

impl State {
    fn new(cfg: &MockConfig) -> Self {
        let window_us = cfg.window.as_micros().max(1) as u64;
        let tokens = if cfg.daily_cap {
            Bucket::new(cfg.tpm, DAY_US, crate::bucket::BucketMode::Window)
        } else {
            Bucket::new(cfg.tpm, window_us, cfg.bucket)
        };
        Self {
            tokens,
            requests: Bucket::new(cfg.rpm, window_us, cfg.bucket),
            rng: StdRng::seed_from_u64(cfg.seed),
            seq: 0,
            admitted: 0,
            stats: Stats::default(),
            log: VecDeque::new(),
            bodies: VecDeque::new(),
            faults: VecDeque::new(),
        }
    }
}

fn snapshot(st: &State) -> RateSnapshot {
    RateSnapshot {
        limit_requests: st.requests.capacity(),
        remaining_requests: st.requests.remaining(),
        reset_requests_ms: ceil_ms(st.requests.reset_us()),
        limit_tokens: st.tokens.capacity(),
        remaining_tokens: st.tokens.remaining(),
        reset_tokens_ms: ceil_ms(st.tokens.reset_us()),
    }
}

fn view(b: &Bucket) -> BucketView {
    BucketView {
        limit: b.capacity(),
        remaining: b.remaining(),
        reset_ms: ceil_ms(b.reset_us()),
        window_us: b.window_us(),
        mode: b.mode(),
    }
}

fn insert(headers: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

fn server_error_body(status: StatusCode) -> Value {
    match status.as_u16() {
        503 => error_body("server_error", None, "The engine is currently overloaded, please try again later."),
        529 => error_body("overloaded_error", Some("overloaded"), "Overloaded"),
        _ => {
            error_body("server_error", None, "The server had an error while processing your request. Sorry about that!")
        }
    }
}
