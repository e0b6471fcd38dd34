//! The HTTP face: axum routes over one `Mutex<State>` in which every admission
//! is decided, so two concurrent requests can never both spend the same budget.
//! The lock is never held across an `.await`; answers are written after it.

use crate::bucket::{Bucket, ChargeMode};
use crate::cache::{Lookup, PromptCache};
use crate::config::MockConfig;
use crate::duration::{ceil_ms, go_duration};
use crate::fault::Fault;
use crate::limits::{Charge, Level, Limit, RateLimits, Refused, Snapshot};
use crate::prefix;
use crate::script::{self, Script};
use crate::shape::{self, HeaderStyle, LimitsMode};
use crate::stats::{BucketView, Buckets, KeptBody, LogEntry, Stats};
use crate::wire::{self, error_body, Api, Reply, Request, StreamError};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State as AxState};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
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

/// Bodies are agentic histories: allow far more than axum's 2 MB default.
const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// A running mock provider. Dropping it stops accepting connections; call
/// [`MockServer::shutdown`] to also wait until it has stopped.
#[derive(Debug)]
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<ServerState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

/// Sends each write of an accepted connection at once: a stream's frames are
/// small writes, which Nagle's algorithm would hold back until the client's
/// (delayed, up to 40 ms) ACK of the one before.
fn no_delay(stream: &mut tokio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
}

impl MockServer {
    /// Binds `config.listen` (port 0 allowed) and starts serving.
    pub async fn start(config: MockConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(ServerState::new(config));
        let (stop, stopped) = oneshot::channel::<()>();
        let app = router(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener.tap_io(no_delay), app)
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

    /// Zeroes the counters and logs, refills the buckets, forgets queued
    /// faults and cached prompts, and re-seeds the dice (as `POST /_mock/reset`).
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

fn router(shared: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/responses", post(responses))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/_mock/stats", get(stats))
        .route("/_mock/reset", post(reset))
        .route("/_mock/faults", post(faults))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(shared)
}

async fn responses(AxState(shared): AxState<Arc<ServerState>>, headers: HeaderMap, body: Bytes) -> Response {
    shared.handle(Api::Responses, &headers, body).await
}

async fn chat_completions(AxState(shared): AxState<Arc<ServerState>>, headers: HeaderMap, body: Bytes) -> Response {
    shared.handle(Api::Chat, &headers, body).await
}

async fn messages(AxState(shared): AxState<Arc<ServerState>>, headers: HeaderMap, body: Bytes) -> Response {
    shared.handle(Api::Messages, &headers, body).await
}

/// What a kept body notes of the request's headers: which one carried a key
/// (never the key), and Anthropic's version header.
fn header_notes(headers: &HeaderMap) -> (Option<String>, Option<String>) {
    let auth = ["authorization", "x-api-key"].into_iter().find(|h| headers.contains_key(*h)).map(str::to_owned);
    let version = headers.get("anthropic-version").and_then(|v| v.to_str().ok()).map(str::to_owned);
    (auth, version)
}

#[derive(Debug, serde::Deserialize)]
struct StatsQuery {
    /// `?log=false` leaves out the log and the bodies (cheap polling).
    log: Option<bool>,
}

async fn stats(AxState(shared): AxState<Arc<ServerState>>, Query(q): Query<StatsQuery>) -> Response {
    Json(shared.stats(q.log.unwrap_or(true))).into_response()
}

async fn reset(AxState(shared): AxState<Arc<ServerState>>) -> Response {
    shared.reset();
    Json(json!({"reset": true})).into_response()
}

/// Takes one fault object or a list of them.
async fn faults(AxState(shared): AxState<Arc<ServerState>>, body: Bytes) -> Response {
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
struct ServerState {
    cfg: MockConfig,
    start: Instant,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The buckets; `None` under `--limits none`.
    limits: Option<RateLimits>,
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
    /// The stored prompt prefixes (`--cache`); emptied by a reset.
    cache: PromptCache,
}

/// An admitted request, on its way to be answered.
#[derive(Debug)]
struct Admission {
    seq: u64,
    request: Request,
    body: Value,
    max_out: u64,
    /// The rate-limit headers as of the admission.
    rate_headers: Vec<(String, String)>,
    midstream: Option<StreamError>,
    stall: Duration,
}

impl ServerState {
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
        st.refill(now);
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
        st.refill(now);
        let mut stats = st.stats.clone();
        stats.tokens_admitted = stats.tokens_charged.saturating_sub(stats.tokens_refunded);
        // Input is never given back, so the refunds are all output.
        stats.output_tokens_admitted = stats.tokens_admitted.saturating_sub(stats.input_tokens_admitted);
        stats.largest_overdraft = st.limits.as_ref().map_or(0, RateLimits::largest_overdraft);
        stats.buckets = self.bucket_views(&st);
        if with_log {
            stats.log = st.log.iter().cloned().collect();
            stats.bodies = st.bodies.iter().cloned().collect();
        }
        stats
    }

    async fn handle(self: Arc<Self>, api: Api, headers: &HeaderMap, raw: Bytes) -> Response {
        let (body, parsed) = match serde_json::from_slice::<Value>(&raw) {
            Ok(body) => {
                // The prefixes are read here, outside the lock, and only when they are used.
                let parsed = wire::parse(api, &body).map(|mut request| {
                    if self.cfg.cache {
                        request.prefix = prefix::read(api, &body);
                    }
                    request
                });
                (body, parsed)
            }
            Err(e) => (
                Value::String(String::from_utf8_lossy(&raw).into_owned()),
                Err(format!(
                    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.) {e}"
                )),
            ),
        };
        match self.admit(api, body, parsed, header_notes(headers)) {
            Ok(admission) => self.answer(admission).await,
            Err(refusal) => refusal,
        }
    }

    /// Every decision about one request, made under the lock: parse errors,
    /// injected and random faults, the quota, then the buckets (all of them
    /// or none: see `RateLimits::admit`).
    // The refusal is returned once per request and answered at once: boxing it buys nothing.
    #[allow(clippy::result_large_err)]
    fn admit(
        &self,
        api: Api,
        body: Value,
        parsed: Result<Request, String>,
        (auth, anthropic_version): (Option<String>, Option<String>),
    ) -> Result<Admission, Response> {
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
            st.bodies.push_back(KeptBody { seq, body: body.clone(), auth, anthropic_version });
        }
        st.refill(now);
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
            charged_input: 0,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
            refunded: 0,
            refunded_at_us: None,
        };
        let mut request = match parsed {
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

        // A prompt longer than the model's window is an invalid request, refused
        // like a bad body: before the faults, the dice and the buckets.
        if let Some(window) = cfg.context_window.filter(|w| prompt.input_tokens > *w) {
            let body = context_length_body(api, window, prompt.input_tokens);
            let code = Some("context_length_exceeded");
            return Err(self.refuse(&mut st, entry, StatusCode::BAD_REQUEST, code, body, None));
        }

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

        if let Some(Fault::InvalidRequest { message }) = &fault {
            let message = message.as_deref().unwrap_or("prompt is too long: 210000 tokens > 200000 maximum");
            let body = error_body("invalid_request_error", None, message);
            return Err(self.refuse(&mut st, entry, StatusCode::BAD_REQUEST, None, body, None));
        }

        if matches!(fault, Some(Fault::Quota)) || cfg.quota_after.is_some_and(|n| st.admitted >= n) {
            if api == Api::Messages {
                // Anthropic's billing stop is a 400, in its own words.
                let body = error_body(
                    "invalid_request_error",
                    None,
                    "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits.",
                );
                return Err(self.refuse(&mut st, entry, StatusCode::BAD_REQUEST, Some("credit_balance"), body, None));
            }
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
        // The cache is consulted before the buckets, since Anthropic does not
        // charge its reads to the input limit (OpenAI charges them in full);
        // it is written only once the request is admitted.
        let lookup =
            if cfg.cache { st.cache.lookup(now, &request.prefix, cfg.cache_rules()) } else { Lookup::default() };
        let input = match api {
            Api::Messages => prompt.input_tokens.saturating_sub(lookup.usage.read),
            Api::Responses | Api::Chat => prompt.input_tokens,
        };
        let charge = Charge { input, output: max_out };

        if let Some(Fault::RateLimited { retry_after_ms }) = fault {
            let tokens = st.snapshot().map(|snap| snap.tokens).unwrap_or_default();
            let used = tokens.limit - tokens.remaining;
            let msg =
                self.limit_message(Limit::Tokens, &prompt.model, tokens.limit, used, charge.total(), retry_after_ms);
            let body = self.rate_limit_body(Limit::Tokens, &msg, retry_after_ms);
            return Err(self.refuse(
                &mut st,
                entry,
                StatusCode::TOO_MANY_REQUESTS,
                Some("rate_limit_exceeded"),
                body,
                Some(retry_after_ms * 1000),
            ));
        }

        let decision = st.limits.as_mut().map_or(Ok(()), |limits| limits.admit(now, charge));
        match decision {
            Ok(()) => {}
            Err(Refused::TooLarge { limit, capacity, requested }) => {
                let msg = format!(
                    "Request too large for {} in organization {} on {}: Limit {capacity}, Requested {requested}. The input or output tokens must be reduced in order to run successfully. Visit https://platform.openai.com/account/rate-limits to learn more.",
                    prompt.model, cfg.organization, self.unit(limit)
                );
                let body = error_body(kind(limit), Some("rate_limit_exceeded"), &msg);
                return Err(self.refuse(
                    &mut st,
                    entry,
                    StatusCode::TOO_MANY_REQUESTS,
                    Some("rate_limit_exceeded"),
                    body,
                    None,
                ));
            }
            Err(Refused::Wait { limit, wait_us, capacity, used, requested }) => {
                let wait_ms = ceil_ms(wait_us);
                let msg = self.limit_message(limit, &prompt.model, capacity, used, requested, wait_ms);
                let body = self.rate_limit_body(limit, &msg, wait_ms);
                return Err(self.refuse(
                    &mut st,
                    entry,
                    StatusCode::TOO_MANY_REQUESTS,
                    Some("rate_limit_exceeded"),
                    body,
                    Some(wait_us),
                ));
            }
        }

        st.admitted += 1;
        let cache = st.cache.commit(now, lookup);
        st.stats.tokens_charged += charge.total();
        st.stats.input_tokens_admitted += charge.input;
        st.stats.cache_read_tokens += cache.read;
        st.stats.cache_write_tokens += cache.write;
        st.stats.ok += 1;
        *st.stats.by_status.entry(200).or_default() += 1;
        entry.status = 200;
        entry.charged = charge.total();
        entry.charged_input = charge.input;
        entry.cache_read_tokens = cache.read;
        entry.cache_write_tokens = cache.write;
        self.push_log(&mut st, entry);
        let snapshot = st.snapshot();
        let rate_headers = self.rate_headers(snapshot.as_ref());

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
            code.map(|code| self.stream_error(&code, &prompt.model, snapshot.as_ref(), charge.total()))
        };
        let stall = match &fault {
            Some(Fault::Stall { ms }) => Duration::from_millis(*ms),
            _ => cfg.stall,
        };
        drop(st);
        request.cache = cache;
        Ok(Admission { seq, request, body, max_out, rate_headers, midstream, stall })
    }

    /// Records a refused request and builds its answer: the error body, the
    /// rate-limit headers, and the shape's retry headers when there is a wait.
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
        // The same refusal, in the shape of the endpoint it came in on.
        let body = if entry.api == Some(Api::Messages) {
            crate::messages::from_openai_error(status.as_u16(), &body)
        } else {
            body
        };
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
        self.common_headers(&mut headers, seq, &self.rate_headers(st.snapshot().as_ref()));
        if let Some(us) = retry_us {
            for (name, value) in shape::retry_headers(self.cfg.headers, us) {
                insert(&mut headers, &name, value);
            }
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
        match (limit, self.cfg.daily_cap) {
            (Limit::Tokens, true) => "tokens per day (TPD)",
            (Limit::Tokens, false) => "tokens per min (TPM)",
            (Limit::InputTokens, true) => "input tokens per day (ITPD)",
            (Limit::InputTokens, false) => "input tokens per minute (ITPM)",
            (Limit::OutputTokens, true) => "output tokens per day (OTPD)",
            (Limit::OutputTokens, false) => "output tokens per minute (OTPM)",
            (Limit::Requests, _) => "requests per min (RPM)",
        }
    }

    /// A rate-limit 429's body: OpenAI's error, plus (for a headerless
    /// provider, whose only channel is the body) a `RetryInfo` detail.
    fn rate_limit_body(&self, limit: Limit, message: &str, wait_ms: u64) -> Value {
        let mut body = error_body(kind(limit), Some("rate_limit_exceeded"), message);
        if self.cfg.headers == HeaderStyle::None {
            body["error"]["details"] = shape::retry_details(wait_ms.max(1));
        }
        body
    }

    /// The rate-limit headers describing `snap` in the configured style; none
    /// without buckets.
    fn rate_headers(&self, snap: Option<&Snapshot>) -> Vec<(String, String)> {
        snap.map(|snap| shape::rate_headers(self.cfg.headers, snap, SystemTime::now())).unwrap_or_default()
    }

    fn bucket_views(&self, st: &State) -> Buckets {
        let (headers, limits) = (self.cfg.headers, self.cfg.limits);
        let Some(rate) = &st.limits else {
            let none = BucketView {
                window_us: self.cfg.window.as_micros().max(1) as u64,
                mode: self.cfg.bucket,
                ..BucketView::default()
            };
            return Buckets { tokens: none.clone(), requests: none, input: None, output: None, headers, limits };
        };
        let view_of = |limit| rate.bucket(limit).map(view);
        Buckets {
            tokens: view_of(Limit::Tokens).unwrap_or_default(),
            requests: view_of(Limit::Requests).unwrap_or_default(),
            input: view_of(Limit::InputTokens),
            output: view_of(Limit::OutputTokens),
            headers,
            limits,
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

    fn stream_error(&self, code: &str, model: &str, snap: Option<&Snapshot>, charge: u64) -> StreamError {
        if code == "rate_limit_exceeded" {
            let tokens: Level = snap.map(|snap| snap.tokens).unwrap_or_default();
            let used = tokens.limit - tokens.remaining;
            StreamError {
                kind: "tokens".into(),
                code: code.into(),
                message: self.limit_message(Limit::Tokens, model, tokens.limit, used, charge, ceil_ms(tokens.reset_us)),
            }
        } else {
            StreamError {
                kind: "server_error".into(),
                code: code.into(),
                message: "The server had an error processing your request. Sorry about that! You can retry your request, or contact us through our help center at help.openai.com if you keep seeing this error.".into(),
            }
        }
    }

    fn common_headers(&self, headers: &mut HeaderMap, seq: u64, rate: &[(String, String)]) {
        insert(headers, "x-request-id", format!("req_{:016x}", script::fnv1a(&seq.to_le_bytes(), 3)));
        for (name, value) in rate {
            insert(headers, name, value.clone());
        }
    }

    /// Gives back the unused output (unless the provider keeps the charge)
    /// and notes the end of the answer.
    fn refund(&self, seq: u64, amount: u64, midstream_error: bool) {
        let amount = if self.cfg.charge == ChargeMode::Keep { 0 } else { amount };
        let mut st = self.lock();
        let now = self.now_us();
        if let Some(limits) = st.limits.as_mut() {
            limits.give_back(now, amount);
        }
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
        self.common_headers(&mut headers, adm.seq, &adm.rate_headers);
        let output = match adm.request.api {
            // Anthropic counts thinking as output.
            Api::Messages => crate::messages::output_tokens(&reply),
            Api::Responses | Api::Chat => reply.output_tokens(),
        };

        if !adm.request.stream {
            let body = match adm.request.api {
                Api::Responses => wire::responses_json(&reply),
                Api::Chat => wire::chat_json(&reply),
                Api::Messages => crate::messages::messages_json(&reply),
            };
            self.refund(adm.seq, adm.max_out.saturating_sub(output), false);
            return (StatusCode::OK, headers, Json(body)).into_response();
        }

        let plan = match adm.request.api {
            Api::Responses => wire::responses_stream(&reply),
            Api::Chat => wire::chat_stream(&reply),
            Api::Messages => crate::messages::messages_stream(&reply),
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
        let limits = match cfg.limits {
            LimitsMode::Enforced => Some(RateLimits::new(cfg)),
            LimitsMode::None => None,
        };
        Self {
            limits,
            rng: StdRng::seed_from_u64(cfg.seed),
            seq: 0,
            admitted: 0,
            stats: Stats::default(),
            log: VecDeque::new(),
            bodies: VecDeque::new(),
            faults: VecDeque::new(),
            cache: PromptCache::default(),
        }
    }

    fn refill(&mut self, now_us: u64) {
        if let Some(limits) = self.limits.as_mut() {
            limits.refill(now_us);
        }
    }

    /// The buckets as of the last refill; `None` without buckets.
    fn snapshot(&self) -> Option<Snapshot> {
        self.limits.as_ref().map(RateLimits::snapshot)
    }
}

/// The error body's `type` for a bucket: OpenAI's `tokens` or `requests`
/// (the Anthropic shape still answers in OpenAI's words; its message names the bucket).
fn kind(limit: Limit) -> &'static str {
    match limit {
        Limit::Requests => "requests",
        Limit::Tokens | Limit::InputTokens | Limit::OutputTokens => "tokens",
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

fn insert(headers: &mut HeaderMap, name: &str, value: String) {
    if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(&value)) {
        headers.insert(name, value);
    }
}

/// The provider's own 400 for a prompt longer than the context window
/// (`refuse` puts Anthropic's in its shape; its message names both numbers).
fn context_length_body(api: Api, window: u64, tokens: u64) -> Value {
    let (param, message) = match api {
        Api::Chat => (
            Some("messages"),
            format!(
                "This model's maximum context length is {window} tokens. However, your messages resulted in {tokens} tokens. Please reduce the length of the messages."
            ),
        ),
        // The Responses API names no numbers.
        Api::Responses => (
            Some("input"),
            "Your input exceeds the context window of this model. Please adjust your input and try again.".to_string(),
        ),
        Api::Messages => (None, format!("prompt is too long: {tokens} tokens > {window} maximum")),
    };
    let mut body = error_body("invalid_request_error", Some("context_length_exceeded"), &message);
    body["error"]["param"] = json!(param);
    body
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

#[cfg(test)]
mod tests {
    //! Caching and the context window through the whole admission and answer,
    //! without a socket: `handle` is what the routes call.
    use super::*;

    fn state(cfg: MockConfig) -> Arc<ServerState> {
        Arc::new(ServerState::new(MockConfig { bucket: crate::BucketMode::Window, ..cfg }))
    }

    /// The status and the body: the JSON, or a stream's `data:` lines as JSON.
    async fn call(shared: &Arc<ServerState>, api: Api, body: &Value) -> (u16, Vec<Value>) {
        let resp = shared.clone().handle(api, &HeaderMap::new(), Bytes::from(body.to_string())).await;
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let values = if body["stream"] == json!(true) {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
                .collect()
        } else {
            vec![serde_json::from_str(&text).unwrap()]
        };
        (status, values)
    }

    fn text(n: usize) -> String {
        "x".repeat(n)
    }

    fn anthropic_usage(u: &Value) -> (u64, u64, u64) {
        let n = |k: &str| u[k].as_u64().unwrap_or_else(|| panic!("no {k} in {u}"));
        (n("input_tokens"), n("cache_creation_input_tokens"), n("cache_read_input_tokens"))
    }

    #[tokio::test]
    async fn anthropic_cache_reads_are_not_charged_to_the_input_bucket() {
        let shared = state(MockConfig {
            cache: true,
            headers: HeaderStyle::Anthropic,
            itpm: Some(100_000),
            ..MockConfig::default()
        });
        // A marked system block: "text" + 6 000 + "ephemeral" = 6 013 chars, 1 504
        // tokens; then "user" + "what now?": 6 026 chars, 1 507 tokens in all.
        let body = json!({"model": "claude", "max_tokens": 10,
            "system": [{"type": "text", "text": text(6000), "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "what now?"}]});
        let (status, first) = call(&shared, Api::Messages, &body).await;
        assert_eq!(status, 200);
        assert_eq!(anthropic_usage(&first[0]["usage"]), (3, 1504, 0), "the system is written");
        let (_, second) = call(&shared, Api::Messages, &body).await;
        assert_eq!(anthropic_usage(&second[0]["usage"]), (3, 0, 1504), "and read");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, frames) = call(&shared, Api::Messages, &streamed).await;
        assert_eq!(frames[0]["type"], "message_start");
        assert_eq!(anthropic_usage(&frames[0]["message"]["usage"]), (3, 0, 1504));

        let stats = shared.stats(true);
        let charged: Vec<(u64, u64, u64)> =
            stats.log.iter().map(|e| (e.charged_input, e.cache_read_tokens, e.cache_write_tokens)).collect();
        assert_eq!(charged, [(1507, 0, 1504), (3, 1504, 0), (3, 1504, 0)]);
        assert_eq!(stats.input_tokens_admitted, 1507 + 3 + 3);
        assert_eq!((stats.cache_read_tokens, stats.cache_write_tokens), (3008, 1504));
        assert_eq!(stats.buckets.input.unwrap().remaining, 100_000 - 1513, "reads cost the input bucket nothing");
        assert!(stats.log.iter().all(|e| e.input_tokens == 1507), "the input counted is still the whole prompt");
    }

    #[tokio::test]
    async fn without_cache_nothing_is_cached() {
        let shared = state(MockConfig { headers: HeaderStyle::Anthropic, ..MockConfig::default() });
        let body = json!({"model": "claude", "max_tokens": 10,
            "system": [{"type": "text", "text": text(6000), "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "what now?"}]});
        for _ in 0..2 {
            let (_, answer) = call(&shared, Api::Messages, &body).await;
            assert_eq!(anthropic_usage(&answer[0]["usage"]), (1507, 0, 0));
        }
        let openai = state(MockConfig::default());
        let body = json!({"model": "gpt", "instructions": text(6000), "input": "hi", "prompt_cache_key": "k"});
        for _ in 0..2 {
            let (_, answer) = call(&openai, Api::Responses, &body).await;
            assert_eq!(answer[0]["usage"]["input_tokens_details"]["cached_tokens"], 0);
        }
    }

    #[tokio::test]
    async fn a_marker_moved_to_the_newest_block_still_reads_the_older_prefix() {
        let shared = state(MockConfig { cache: true, headers: HeaderStyle::Anthropic, ..MockConfig::default() });
        let marked = json!({"type": "ephemeral"});
        let turn1 = json!({"model": "claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text(6000), "cache_control": marked}]}]});
        let (_, first) = call(&shared, Api::Messages, &turn1).await;
        // "user" + "text" + 6 000 + "ephemeral" = 6 017 chars.
        assert_eq!(anthropic_usage(&first[0]["usage"]), (0, 1505, 0));
        // The marker moves on: the first block, unmarked, is still the same prefix.
        let turn2 = json!({"model": "claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text(6000)}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": text(400), "cache_control": marked}]}]});
        let (_, second) = call(&shared, Api::Messages, &turn2).await;
        // 6 008 chars (1 502 tokens) read; the rest up to the marker written.
        let total = 6008 + "assistanttextok".len() + "usertext".len() + 400 + "ephemeral".len();
        let total = total.div_ceil(4) as u64;
        assert_eq!(anthropic_usage(&second[0]["usage"]), (0, total - 1502, 1502));
    }

    #[tokio::test]
    async fn more_than_four_markers_is_a_400() {
        let shared = state(MockConfig { cache: true, headers: HeaderStyle::Anthropic, ..MockConfig::default() });
        let block = json!({"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}});
        let body = json!({"model": "claude", "max_tokens": 10, "system": [block, block, block],
            "messages": [{"role": "user", "content": [block, block]}]});
        let (status, answer) = call(&shared, Api::Messages, &body).await;
        assert_eq!(status, 400);
        assert_eq!(answer[0]["error"]["type"], "invalid_request_error");
        assert_eq!(answer[0]["error"]["message"], "A maximum of 4 blocks with cache_control may be provided. Found 5.");
    }

    #[tokio::test]
    async fn openai_cache_reads_are_charged_in_full() {
        let max_out = 10;
        let shared = state(MockConfig { cache: true, tpm: 100_000, ..MockConfig::default() });
        // 5 000 + 5 chars = 1 252 tokens: steps of 1 024 and 1 152.
        let body = json!({"model": "gpt", "instructions": text(5000), "input": "hello",
                          "max_output_tokens": max_out, "prompt_cache_key": "run-1"});
        let cached = |v: &Value| v["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let (_, first) = call(&shared, Api::Responses, &body).await;
        assert_eq!((first[0]["usage"]["input_tokens"].as_u64(), cached(&first[0])), (Some(1252), 0));
        let (_, second) = call(&shared, Api::Responses, &body).await;
        assert_eq!((second[0]["usage"]["input_tokens"].as_u64(), cached(&second[0])), (Some(1252), 1152));
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, frames) = call(&shared, Api::Responses, &streamed).await;
        assert_eq!(cached(&frames.last().unwrap()["response"]), 1152, "the streamed final usage too");
        let mut other_key = body.clone();
        other_key["prompt_cache_key"] = json!("run-2");
        assert_eq!(cached(&call(&shared, Api::Responses, &other_key).await.1[0]), 0, "another key, another partition");

        let stats = shared.stats(true);
        assert!(stats.log.iter().all(|e| e.charged_input == 1252), "cached or not, the whole input is charged");
        assert_eq!(stats.cache_read_tokens, 2 * 1152);
        assert_eq!(stats.cache_write_tokens, 0);

        // Chat, streamed with its usage chunk.
        let chat = json!({"model": "gpt", "max_tokens": max_out, "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": text(5000)}, {"role": "user", "content": "hello"}]});
        call(&shared, Api::Chat, &chat).await;
        let (_, frames) = call(&shared, Api::Chat, &chat).await;
        let usage = &frames.last().unwrap()["usage"];
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 1152);
        assert_eq!(usage["prompt_tokens"], 1254, "system + 5 000 + user + hello = 5 015 chars");
    }

    #[tokio::test]
    async fn a_prompt_over_the_context_window_is_the_providers_400() {
        let window = 100;
        let long = text(404 * 4);
        let cases = [
            (
                Api::Chat,
                json!({"model": "gpt", "messages": [{"role": "user", "content": long}]}),
                json!({"error": {"message": "This model's maximum context length is 100 tokens. However, your messages resulted in 405 tokens. Please reduce the length of the messages.",
                       "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
            ),
            (
                Api::Responses,
                json!({"model": "gpt", "input": long}),
                json!({"error": {"message": "Your input exceeds the context window of this model. Please adjust your input and try again.",
                       "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}),
            ),
            (
                Api::Messages,
                json!({"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": long}]}),
                json!({"type": "error", "error": {"type": "invalid_request_error",
                       "message": "prompt is too long: 405 tokens > 100 maximum"}, "request_id": "req_mock"}),
            ),
        ];
        for (api, body, expected) in cases {
            let shared = state(MockConfig { context_window: Some(window), ..MockConfig::default() });
            let (status, answer) = call(&shared, api, &body).await;
            assert_eq!((status, &answer[0]), (400, &expected), "{api:?}");
            let stats = shared.stats(true);
            assert_eq!((stats.tokens_charged, stats.ok), (0, 0), "{api:?}: not admitted");
            assert_eq!(stats.buckets.tokens.remaining, stats.buckets.tokens.limit, "{api:?}: nothing charged");
            let entry = &stats.log[0];
            assert_eq!((entry.status, entry.code.as_deref()), (400, Some("context_length_exceeded")));
            // Within the window, the same request is admitted.
            let roomy = state(MockConfig { context_window: Some(405), ..MockConfig::default() });
            assert_eq!(call(&roomy, api, &body).await.0, 200, "{api:?}");
        }
    }
}
