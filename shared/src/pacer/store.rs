//! Where the pacer's state lives: in Redis for every worker (`shared`), in the
//! process (`local`, a baseline like a single-process client), or nowhere (`off`,
//! reactive backoff only). The benchmark compares the three.
//!
//! Every call names a reservation id. A turn keeps the same id while it waits,
//! so when it comes back after its owed time it finds its booked budget and is
//! clear at once; `settle` with the same id refunds what the call did not use.

use super::bucket::{self, Decision, Estimate, Mode, Observation, OwedReason, PacerState, PacingConfig, Who};
use crate::clock::{Clock, Millis, SystemClock};
use crate::keys::Keys;
use redis::aio::ConnectionManager;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The atomic operations of the shared pacer, one script (see the file's header).
static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("scripts.lua")));

/// Which pacer a worker uses (`PACELINE_PACER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PacerKind {
    /// One state in Redis for every worker (the product).
    Shared,
    /// State kept in each process (a baseline).
    Local,
    /// No proactive pacing (a baseline).
    Off,
}

/// What a finished call reports to the pacer (see [`bucket::Outcome`]; the
/// reservation is found by its id).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CallOutcome {
    /// Tokens the provider reported as used.
    pub used_tokens: Option<u64>,
    /// The call was answered 429, and the window is closed this long.
    pub rate_limited_ms: Option<u64>,
    /// Token bucket headers.
    pub tokens: Observation,
    /// Request bucket headers.
    pub requests: Observation,
    /// Age of the headers when settling (ms since they were received).
    pub headers_age_ms: u64,
}

/// One budget and model as the workers see it (`GET /v1/pacer`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetSnapshot {
    /// The budget name (`PACELINE_BUDGET`).
    pub budget: String,
    /// The model (providers report limits per model).
    pub model: String,
    /// Estimated tokens available now.
    pub remaining_tokens: Option<i64>,
    /// Token limit.
    pub limit_tokens: Option<u64>,
    /// Time until the token bucket is full again.
    pub reset_tokens_in_ms: Option<u64>,
    /// Tokens reserved by calls in flight.
    pub reserved_tokens: u64,
    /// Tokens booked by turns owed time.
    pub booked_tokens: u64,
    /// Estimated requests available now.
    pub remaining_requests: Option<i64>,
    /// Request limit.
    pub limit_requests: Option<u64>,
    /// Time until the request bucket is full again.
    pub reset_requests_in_ms: Option<u64>,
    /// Requests reserved by calls in flight.
    pub reserved_requests: u64,
    /// A 429 closed the window for this long from now.
    pub blocked_for_ms: u64,
    /// When headers were last read (ms since the epoch, Redis clock); None if never.
    pub observed_at_ms: Option<Millis>,
    /// Each tenant's line (fair admission).
    pub tenants: Vec<TenantShare>,
}

/// One tenant's line in a budget (`GET /v1/pacer`, `/metrics`).
// `TenantView` is its published name in the API's OpenAPI document.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = TenantView))]
pub struct TenantShare {
    /// The tenant.
    pub tenant: String,
    /// Its weight (`PACELINE_TENANT_WEIGHTS`), as last seen.
    pub weight: f64,
    /// Tokens admitted (expected use) since the state began.
    pub admitted_tokens: u64,
    /// Tokens of its turns waiting or booked, not yet sent.
    pub waiting_tokens: u64,
    /// Times one of its turns waited in its line (for its fair share).
    pub waits: u64,
}

impl BudgetSnapshot {
    fn from_state(budget: &str, model: &str, s: &PacerState, now: Millis) -> Self {
        let level = |b: &bucket::Bucket| b.known().then(|| b.level_at(now).floor() as i64);
        let limit = |b: &bucket::Bucket| b.known().then_some(b.limit as u64);
        let reset = |b: &bucket::Bucket| {
            b.known().then(|| ((b.limit - b.level_at(now)).max(0.0) / b.rate).ceil() as u64)
        };
        Self {
            budget: budget.to_owned(),
            model: model.to_owned(),
            remaining_tokens: level(&s.tokens),
            limit_tokens: limit(&s.tokens),
            reset_tokens_in_ms: reset(&s.tokens),
            reserved_tokens: s.tokens.in_flight.max(0.0) as u64,
            booked_tokens: s.tokens.booked.max(0.0) as u64,
            remaining_requests: level(&s.requests),
            limit_requests: limit(&s.requests),
            reset_requests_in_ms: reset(&s.requests),
            reserved_requests: s.requests.in_flight.max(0.0) as u64,
            blocked_for_ms: (s.blocked_until_ms - now).max(0) as u64,
            observed_at_ms: (s.observed_at_ms > 0).then_some(s.observed_at_ms),
            tenants: s
                .tenants
                .iter()
                .map(|(tenant, line)| TenantShare {
                    tenant: tenant.clone(),
                    weight: line.weight,
                    admitted_tokens: line.admitted.max(0.0) as u64,
                    waiting_tokens: line.waiting() as u64,
                    waits: line.waits.max(0.0) as u64,
                })
                .collect(),
        }
    }
}

/// An error of the pacer's store.
#[derive(Debug, thiserror::Error)]
pub enum PacerError {
    /// Redis did not answer or refused.
    #[error("pacer state in Redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The script answered something this code does not understand.
    #[error("pacer script answered {0:?}")]
    Protocol(String),
}

/// The pacer a worker asks before every call.
#[derive(Debug, Clone)]
pub enum Pacer {
    /// Shared state in Redis.
    Shared(SharedPacer),
    /// Per-process state.
    Local(LocalPacer),
    /// No proactive pacing.
    Off,
}

impl Pacer {
    /// Asks to reserve `est` for the call of reservation `id` on `model`, for
    /// `who` (its tenant's line decides the order of work turns when the
    /// budget is scarce).
    pub async fn acquire(
        &self,
        model: &str,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
    ) -> Result<Decision, PacerError> {
        match self {
            Self::Shared(p) => p.acquire(model, id, est, mode, who).await,
            Self::Local(p) => Ok(p.acquire(model, id, est, mode, who)),
            Self::Off => Ok(Decision::Clear),
        }
    }

    /// Settles reservation `id` with what the call reported (headers, usage, 429).
    /// Under `off` this does nothing: that baseline keeps no state at all.
    pub async fn settle(&self, model: &str, id: &str, outcome: &CallOutcome) -> Result<(), PacerError> {
        match self {
            Self::Shared(p) => p.settle(model, id, outcome).await,
            Self::Local(p) => {
                p.settle(model, id, outcome);
                Ok(())
            }
            Self::Off => Ok(()),
        }
    }

    /// Every budget and model this pacer knows.
    pub async fn snapshot(&self) -> Result<Vec<BudgetSnapshot>, PacerError> {
        match self {
            Self::Shared(p) => p.snapshot().await,
            Self::Local(p) => Ok(p.snapshot()),
            Self::Off => Ok(vec![]),
        }
    }
}

/// The shared pacer: state per (budget, model) in Redis, changed only by the
/// atomic script in `scripts.lua`.
#[derive(Clone)]
pub struct SharedPacer {
    conn: ConnectionManager,
    keys: Keys,
    budget: String,
    config: Arc<PacingConfig>,
    /// `None` in production: the script reads the Redis server's clock.
    test_clock: Option<Arc<dyn Clock>>,
    /// Models this process has already listed under the budget.
    registered: Arc<Mutex<std::collections::HashSet<String>>>,
}

impl std::fmt::Debug for SharedPacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPacer").field("budget", &self.budget).field("keys", &self.keys).finish()
    }
}

impl SharedPacer {
    /// A shared pacer for `budget`, over a (reconnecting) connection.
    pub fn new(conn: ConnectionManager, keys: Keys, budget: impl Into<String>, config: PacingConfig) -> Self {
        Self {
            conn,
            keys,
            budget: budget.into(),
            config: Arc::new(config),
            test_clock: None,
            registered: Arc::default(),
        }
    }

    /// The same pacer on an injected clock instead of the Redis server's
    /// (for tests of time-dependent policy; production never calls this).
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
        self
    }

    fn invocation(&self, op: &str, model: &str, mode: Mode) -> redis::ScriptInvocation<'static> {
        let c = &self.config;
        let mut inv = SCRIPT.prepare_invoke();
        inv.key(self.keys.pacer_state(&self.budget, model))
            .key(self.keys.pacer_reservations(&self.budget, model))
            .key(self.keys.pacer_reservation_data(&self.budget, model))
            .arg(op)
            .arg(c.floor(mode))
            .arg(c.max_pace_ms)
            .arg(c.jitter_frac)
            .arg(c.jitter_max_ms)
            .arg(c.reservation_ttl_ms)
            .arg(c.probe_wait_ms)
            .arg(c.fair_horizon_ms)
            .arg(c.configured_tpm.unwrap_or(0))
            .arg(c.configured_rpm.unwrap_or(0))
            .arg(self.test_clock.as_ref().map(|c| c.now_ms().to_string()).unwrap_or_default());
        inv
    }

    /// Lists the model under the budget (once per process), for `snapshot`.
    async fn register(&self, model: &str) -> Result<(), PacerError> {
        if self.registered.lock().unwrap_or_else(|e| e.into_inner()).contains(model) {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        redis::pipe()
            .sadd(self.keys.pacer_budgets(), &self.budget)
            .ignore()
            .sadd(self.keys.pacer_models(&self.budget), model)
            .ignore()
            .query_async::<()>(&mut conn)
            .await?;
        self.registered.lock().unwrap_or_else(|e| e.into_inner()).insert(model.to_owned());
        Ok(())
    }

    /// See [`Pacer::acquire`].
    pub async fn acquire(&self, model: &str, id: &str, est: Estimate, mode: Mode, who: &Who<'_>) -> Result<Decision, PacerError> {
        self.register(model).await?;
        let mut inv = self.invocation("acquire", model, mode);
        let jitter_u = if self.config.jitter_frac > 0.0 { rand::random::<f64>() } else { 0.0 };
        inv.arg(id)
            .arg(est.tokens)
            .arg(est.requests)
            .arg(jitter_u)
            .arg(mode.as_str())
            .arg(who.weight)
            .arg(who.cap)
            .arg(who.tenant)
            .arg(self.config.booking_grace_ms)
            .arg(est.output);
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = inv.invoke_async(&mut conn).await?;
        match reply.as_slice() {
            [0] => Ok(Decision::Clear),
            [1, ms, reason, booked, waiting] => Ok(Decision::Owed {
                ms: (*ms).max(0) as u64,
                reason: match reason {
                    2 => OwedReason::RateLimited,
                    3 => OwedReason::Probe,
                    4 => OwedReason::FairShare,
                    _ => OwedReason::Budget,
                },
                booked: *booked == 1,
                waiting: (*waiting >= 0).then_some(*waiting as u64),
            }),
            other => Err(PacerError::Protocol(format!("{other:?}"))),
        }
    }

    /// See [`Pacer::settle`].
    pub async fn settle(&self, model: &str, id: &str, o: &CallOutcome) -> Result<(), PacerError> {
        let opt = |v: Option<u64>| v.map(|v| v as i64).unwrap_or(-1);
        let mut inv = self.invocation("settle", model, Mode::Work);
        inv.arg(id)
            .arg(opt(o.used_tokens))
            .arg(opt(o.rate_limited_ms))
            .arg(opt(o.tokens.limit))
            .arg(opt(o.tokens.remaining))
            .arg(opt(o.tokens.reset_ms))
            .arg(opt(o.requests.limit))
            .arg(opt(o.requests.remaining))
            .arg(opt(o.requests.reset_ms))
            .arg(o.headers_age_ms);
        let mut conn = self.conn.clone();
        let _: Vec<i64> = inv.invoke_async(&mut conn).await?;
        Ok(())
    }

    /// The state of one model of this budget, as the script sees it now.
    pub async fn state(&self, model: &str) -> Result<(PacerState, Millis), PacerError> {
        let inv = self.invocation("snapshot", model, Mode::Work);
        let mut conn = self.conn.clone();
        let flat: Vec<String> = inv.invoke_async(&mut conn).await?;
        Ok(state_from_fields(&flat))
    }

    /// See [`Pacer::snapshot`]: every budget and model under this prefix.
    pub async fn snapshot(&self) -> Result<Vec<BudgetSnapshot>, PacerError> {
        let mut conn = self.conn.clone();
        let budgets: Vec<String> = redis::cmd("SMEMBERS").arg(self.keys.pacer_budgets()).query_async(&mut conn).await?;
        let mut out = vec![];
        for budget in budgets {
            let models: Vec<String> =
                redis::cmd("SMEMBERS").arg(self.keys.pacer_models(&budget)).query_async(&mut conn).await?;
            let other = Self { budget: budget.clone(), ..self.clone() };
            for model in models {
                let (state, now) = other.state(&model).await?;
                out.push(BudgetSnapshot::from_state(&budget, &model, &state, now));
            }
        }
        out.sort_by(|a, b| (&a.budget, &a.model).cmp(&(&b.budget, &b.model)));
        Ok(out)
    }
}

/// Reads the script's flat field list into the model's state.
fn state_from_fields(flat: &[String]) -> (PacerState, Millis) {
    let map: HashMap<&str, f64> =
        flat.chunks(2).filter_map(|kv| Some((kv[0].as_str(), kv.get(1)?.parse().ok()?))).collect();
    let f = |k: &str| map.get(k).copied().unwrap_or(0.0);
    let bucket = |p: &str| bucket::Bucket {
        limit: f(&format!("{p}limit")),
        rate: f(&format!("{p}rate")),
        level: f(&format!("{p}level")),
        at_ms: f(&format!("{p}at")) as Millis,
        booked: f(&format!("{p}booked")),
        booked_live: f(&format!("{p}booked_live")),
        refunded: f(&format!("{p}refunded")),
        full_at_ms: f(&format!("{p}full_at")) as Millis,
        charged_since: f(&format!("{p}charged_since")),
        rated: f(&format!("{p}rated")) > 0.0,
        full_seen_ms: f(&format!("{p}full_seen")) as Millis,
        in_flight: f(&format!("{p}inflight")),
    };
    let state = PacerState {
        tokens: bucket("t_"),
        requests: bucket("r_"),
        blocked_until_ms: f("blocked_until") as Millis,
        probe_until_ms: f("probe_until") as Millis,
        observed_at_ms: f("observed_at") as Millis,
        last_due_ms: f("last_due") as Millis,
        usage_ratio: f("usage_ratio"),
        fair_time: f("fair_time"),
        tenants: map
            .keys()
            .filter_map(|k| k.strip_prefix("tn:"))
            .map(|t| {
                let g = |p: &str| map.get(format!("{p}:{t}").as_str()).copied().unwrap_or(0.0);
                let line = bucket::TenantLine {
                    next: g("tn"),
                    served: g("ts"),
                    weight: g("tw"),
                    cap_due_ms: g("tc") as Millis,
                    admitted: g("tadm"),
                    waits: g("twait"),
                    tag: g("tv"),
                };
                (t.to_owned(), line)
            })
            .collect(),
    };
    (state, f("now") as Millis)
}

/// A reservation held by the local pacer (the same ledger the script keeps).
#[derive(Debug, Clone)]
struct Held {
    /// Waiting in its tenant's line (tenant, position), not yet on the bucket's line.
    waiting: Option<(String, u64)>,
    /// Why it waits (returned again if it comes back early).
    reason: OwedReason,
    /// A work turn's booking: its tenant (whose line moves when it is claimed).
    tenant: Option<String>,
    /// In flight: the token bucket's `refunded` when it was sent.
    mark: f64,
    booked: bool,
    /// A companion (live) turn's booking.
    live: bool,
    est: Estimate,
    /// What a booking holds on the line (see `PacerState::booking_cost`).
    line: Estimate,
    due: Millis,
    expiry: Millis,
}

#[derive(Debug, Default)]
struct LocalModel {
    state: PacerState,
    held: BTreeMap<String, Held>,
}

/// The per-process baseline: the same model as the shared pacer, kept in this
/// process only, like a single-process client. Many processes each believe
/// they have the whole budget.
#[derive(Debug, Clone)]
pub struct LocalPacer {
    models: Arc<Mutex<HashMap<String, LocalModel>>>,
    budget: String,
    config: Arc<PacingConfig>,
    clock: Arc<dyn Clock>,
}

impl LocalPacer {
    /// A local pacer on the host clock.
    pub fn new(budget: impl Into<String>, config: PacingConfig) -> Self {
        Self::with_clock(budget, config, Arc::new(SystemClock))
    }

    /// A local pacer on the given clock (tests).
    pub fn with_clock(budget: impl Into<String>, config: PacingConfig, clock: Arc<dyn Clock>) -> Self {
        Self {
            models: Arc::default(),
            budget: budget.into(),
            config: Arc::new(config),
            clock,
        }
    }

    /// Jitter's random draw (0 when the config has no jitter, so that tests
    /// can compare exact answers).
    fn jitter_u(&self) -> f64 {
        if self.config.jitter_frac > 0.0 {
            rand::random::<f64>()
        } else {
            0.0
        }
    }

    fn expire(m: &mut LocalModel, now: Millis) {
        let gone: Vec<String> = m.held.iter().filter(|(_, h)| h.expiry <= now).map(|(k, _)| k.clone()).collect();
        for id in gone {
            if let Some(h) = m.held.remove(&id) {
                if let Some((tenant, _)) = &h.waiting {
                    bucket::release_waiting(&mut m.state, tenant, h.line.tokens as f64);
                } else if h.booked {
                    bucket::release_booking(&mut m.state, h.line, h.live, h.tenant.as_deref(), now);
                } else {
                    bucket::drop_in_flight(&mut m.state, h.est);
                }
            }
        }
    }

    /// See [`Pacer::acquire`].
    pub fn acquire(&self, model: &str, id: &str, est: Estimate, mode: Mode, who: &Who<'_>) -> Decision {
        let now = self.clock.now_ms();
        let ttl = self.config.reservation_ttl_ms as Millis;
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let m = models.entry(model.to_owned()).or_default();
        Self::expire(m, now);
        let jitter_u = self.jitter_u();
        let mut position = None;
        if let Some(h) = m.held.get(id).cloned() {
            if (h.booked || h.waiting.is_some()) && now < h.due {
                // Never before its time: a wait cut short is not a wait saved.
                let waiting = h.waiting.as_ref().map(|(_, p)| *p);
                return Decision::Owed { ms: (h.due - now) as u64, reason: h.reason, booked: h.booked, waiting };
            }
            if let Some((_, p)) = h.waiting {
                // Back from its tenant's line: ask again from its place in it.
                m.held.remove(id);
                position = Some(p);
            } else {
                if h.booked {
                    let tenant = h.tenant.as_deref();
                    let decision = bucket::claim(&mut m.state, &self.config, now, h.est, h.line, mode, tenant, jitter_u);
                    if let Decision::Owed { ms, .. } = decision {
                        let due = now + ms as Millis;
                        let expiry = due + self.config.booking_grace_ms as Millis;
                        m.held.insert(id.to_owned(), Held { due, expiry, ..h });
                        return decision;
                    }
                }
                let mark = m.state.tokens.refunded;
                m.held.insert(id.to_owned(), Held { booked: false, live: false, mark, due: now, expiry: now + ttl, ..h });
                return Decision::Clear;
            }
        }
        let line = m.state.booking_cost(est);
        let decision = bucket::acquire(&mut m.state, &self.config, now, est, mode, who, position, jitter_u);
        let known = |tokens: u64, requests: u64, output: u64| Estimate {
            tokens: if m.state.tokens.known() { tokens } else { 0 },
            requests: if m.state.requests.known() { requests } else { 0 },
            output: if m.state.tokens.known() { output } else { 0 },
        };
        let (charged, line) = (known(est.tokens, est.requests, est.output), known(line.tokens, line.requests, 0));
        let tenant = (mode == Mode::Work).then(|| who.tenant.to_owned());
        let held = |booked, live, waiting, reason, due: Millis, expiry| Held {
            waiting,
            reason,
            tenant: if booked { tenant.clone() } else { None },
            mark: 0.0,
            booked,
            live,
            est: charged,
            line,
            due,
            expiry,
        };
        match decision {
            Decision::Clear => {
                let mark = m.state.tokens.refunded;
                let in_flight = Held { mark, ..held(false, false, None, OwedReason::Budget, now, now + ttl) };
                m.held.insert(id.to_owned(), in_flight);
            }
            Decision::Owed { ms, reason, booked: true, .. } => {
                let due = now + ms as Millis;
                let live = mode == Mode::Companion;
                m.held.insert(id.to_owned(), held(true, live, None, reason, due, due + self.config.booking_grace_ms as Millis));
            }
            Decision::Owed { ms, reason, waiting: Some(p), .. } => {
                let due = now + ms as Millis;
                let waiting = Some((who.tenant.to_owned(), p));
                m.held.insert(id.to_owned(), held(false, false, waiting, reason, due, due + self.config.booking_grace_ms as Millis));
            }
            Decision::Owed { .. } => {}
        }
        decision
    }

    /// See [`Pacer::settle`].
    pub fn settle(&self, model: &str, id: &str, o: &CallOutcome) {
        let now = self.clock.now_ms();
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let m = models.entry(model.to_owned()).or_default();
        Self::expire(m, now);
        let (reserved, mark) = match m.held.remove(id) {
            Some(h) if !h.booked && h.waiting.is_none() => (h.est, Some(h.mark)),
            _ => (Estimate::default(), None),
        };
        let outcome = bucket::Outcome {
            reserved,
            used_tokens: o.used_tokens,
            rate_limited_ms: o.rate_limited_ms,
            tokens: o.tokens,
            requests: o.requests,
            headers_age_ms: o.headers_age_ms,
            refund_mark: mark,
        };
        bucket::settle(&mut m.state, &self.config, now, &outcome);
    }

    /// The state of one model (tests, differential checks).
    pub fn state(&self, model: &str) -> PacerState {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models.get(model).map(|m| m.state.clone()).unwrap_or_default()
    }

    /// See [`Pacer::snapshot`].
    pub fn snapshot(&self) -> Vec<BudgetSnapshot> {
        let now = self.clock.now_ms();
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = models
            .iter()
            .map(|(model, m)| BudgetSnapshot::from_state(&self.budget, model, &m.state, now))
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }
}
