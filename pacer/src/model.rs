//! The pacer's policy for one budget and model: may this call go now, and if
//! not, how long is it owed?
//!
//! The state is two provider buckets (`bucket.rs`), the tenants' fair tags
//! (`fair.rs`), and two sets of records, each keyed by reservation id:
//! - **the line**: turns owed time, each with its place (`order`), what it is
//!   expected to use (`line`), and when it may come back (`due_ms`);
//! - **flights**: calls cleared and not yet settled, each with its reservation.
//!
//! A turn is clear when the bucket holds what the turns ahead of it in line
//! are expected to use plus its own reservation above the floor; otherwise it
//! is owed the time until the refill brings that, and waits in line. What the
//! turns ahead hold is *summed from the line each time*, never kept in a
//! counter beside it, so nothing can drift (docs/pacing.md, "One line per
//! budget"). A waiter that does not come back by `due + late_ms` stops
//! holding budget for the turns behind it (it keeps its place), and leaves
//! the line at `due + booking_grace_ms`.
//!
//! Liveness follows: the head of the line needs only its own reservation above
//! the floor (never more than the limit), the level refills to the limit, and
//! a head that does not come back stops counting after `late_ms`. The
//! simulator (`sim.rs`) checks it over thousands of random workloads.
//!
//! `scripts.lua` is this model as one atomic Redis script (the shared pacer);
//! `local.rs` runs this one in-process. The differential test in
//! `tests/integration/pacer.rs` keeps the two one policy.

use super::bucket::{Bucket, Observation, Refill, Seen};
use super::fair::{self, Tenant};
use super::refund::{RefundShare, Snapshot};
use crate::Millis;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Who is asking: a live listener (companion) draws the budget lower than
/// background work and goes first in line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Mode {
    /// Background work (the default).
    Work,
    /// A person is listening live.
    Companion,
}

impl Mode {
    /// The name used in the API, in Redis and by the pacer's script (its serde name).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Work => "work",
            Self::Companion => "companion",
        }
    }

    /// Parses the name [`Mode::as_str`] gives.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "work" => Self::Work,
            "companion" => Self::Companion,
            _ => return None,
        })
    }
}

/// The pacing knobs (docs/pacing.md). All durations in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct PacingConfig {
    /// Headroom work turns leave in the bucket, as a fraction of the limit.
    pub floor_work: f64,
    /// Headroom companion turns leave (smaller: a companion turn draws lower).
    pub floor_companion: f64,
    /// A reset further out than this describes something else (a daily cap,
    /// clock skew): we do not pace on it and let the reactive layer carry the
    /// call. Also the longest single owed time: a turn owed more comes back
    /// then and is re-timed.
    pub max_pace_ms: u64,
    /// Positive jitter added to owed time, as a fraction of it …
    pub jitter_frac: f64,
    /// … and never more than this.
    pub jitter_max_ms: u64,
    /// A reservation not settled within this is dropped (its worker crashed).
    pub reservation_ttl_ms: u64,
    /// A turn not back this long after its due time leaves the line (its run
    /// was cancelled, its worker died). The local baseline keeps this short:
    /// its turns come back to other processes.
    pub booking_grace_ms: u64,
    /// A turn not back this long after its due time stops holding budget for
    /// the turns behind it (it keeps its place until `booking_grace_ms`).
    pub late_ms: u64,
    /// The shortest recheck horizon: a turn owed longer sleeps at most this
    /// (or a few turns' worth of refill, when that is longer) and is re-timed.
    pub recheck_ms: u64,
    /// With no headers yet, one probe call goes first; the others wait this long
    /// (or until the probe's headers arrive) before asking again.
    pub probe_wait_ms: u64,
    /// Configured limits for providers that send no headers (vLLM, Ollama).
    pub configured_tpm: Option<u64>,
    /// See `configured_tpm`.
    pub configured_rpm: Option<u64>,
    /// Waiters sleep their whole predicted wait (a deep line's too, past the
    /// bucket's reset) instead of three quarters of it and a re-timing, and
    /// the fetch that asks the pacer moves up the ones near the head whose
    /// prediction shortened ([`pull_in`]). Off: the per-process baseline
    /// (`LocalPacer`), which has no queue to move.
    pub whole_waits: bool,
}

/// How long a probe holds the other turns back at most, when it does not settle.
pub const PROBE_HOLD_MS: Millis = 10_000;

/// Calls cleared closer together than this form a burst: any of them may
/// reach the provider first, so their headers do not say which of the others
/// they include (see [`Flight::alone`]).
pub const BURST_GAP_MS: Millis = 60;

/// A call in flight this many `late_ms` is no longer waited for to name a
/// window's next boundary (`may_probe`).
const PROBE_AFTER_LATE: Millis = 4;

/// The default of [`PacingConfig::late_ms`].
pub const DEFAULT_LATE_MS: u64 = 1_000;

impl Default for PacingConfig {
    fn default() -> Self {
        Self {
            floor_work: 0.05,
            floor_companion: 0.02,
            max_pace_ms: 90_000,
            jitter_frac: 0.02,
            jitter_max_ms: 100,
            reservation_ttl_ms: 120_000,
            booking_grace_ms: 10_000,
            late_ms: DEFAULT_LATE_MS,
            recheck_ms: 2_000,
            probe_wait_ms: 100,
            configured_tpm: None,
            configured_rpm: None,
            whole_waits: true,
        }
    }
}

impl PacingConfig {
    /// The floor for a mode, as a fraction of the limit.
    pub fn floor(&self, mode: Mode) -> f64 {
        match mode {
            Mode::Work => self.floor_work,
            Mode::Companion => self.floor_companion,
        }
    }
}

/// What a call is expected to cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Estimate {
    /// Input tokens (by a real tokenizer) plus `max_output_tokens`.
    pub tokens: u64,
    /// Requests: 1 per call.
    pub requests: u64,
    /// The part of `tokens` reserved for output (`max_output_tokens`), which a
    /// call usually gives mostly back; 0 when the caller does not split (the
    /// whole estimate is then treated as such a reservation).
    #[serde(default)]
    pub output: u64,
}

impl Estimate {
    /// What the call costs in each bucket, in [`PacerState::buckets`] order:
    /// the whole estimate, one request, its input part, its output reservation.
    fn costs(&self) -> [f64; BUCKETS] {
        let output = self.output.min(self.tokens);
        [self.tokens as f64, self.requests as f64, (self.tokens - output) as f64, output as f64]
    }

    /// The input part and the output reservation, as the usage ratio sees them.
    fn split(&self) -> (f64, f64) {
        let output = if self.output > 0 { self.output.min(self.tokens) } else { self.tokens };
        ((self.tokens - output) as f64, output as f64)
    }
}

/// Who asks: the tenant, its weight and its optional cap (fair admission: docs/pacing.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Who<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its weight (`PACELINE_TENANT_WEIGHTS`, default 1).
    pub weight: f64,
    /// Its cap as a fraction of the budget (`PACELINE_TENANT_CAPS`); 0 = none.
    pub cap: f64,
}

impl Who<'static> {
    /// The default tenant, weight 1, no cap.
    pub const DEFAULT: Who<'static> = Who { tenant: "default", weight: 1.0, cap: 0.0 };
}

/// Why a turn is owed time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OwedReason {
    /// Not enough budget (tokens or requests) yet.
    Budget,
    /// A 429 closed the window for every worker.
    RateLimited,
    /// Nothing is known yet and a probe call is out.
    Probe,
    /// The budget is scarce and other tenants' turns go first (their share,
    /// or this tenant's cap).
    FairShare,
}

impl OwedReason {
    /// Reads the number the script answers with (`scripts.lua`: 1 budget,
    /// 2 rate_limited, 3 probe, 4 fair_share).
    pub fn from_code(code: i64) -> Self {
        match code {
            2 => Self::RateLimited,
            3 => Self::Probe,
            4 => Self::FairShare,
            _ => Self::Budget,
        }
    }
}

/// The pacer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send now; the estimate is reserved.
    Clear,
    /// Come back after `ms` with the same reservation id (the turn keeps its
    /// place in line).
    Owed {
        /// Milliseconds owed, jitter included.
        ms: u64,
        /// Why.
        reason: OwedReason,
    },
}

/// A turn waiting in line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    /// Its place: companion turns first by arrival, then work turns by fair
    /// tag (ties by reservation id, as a Redis sorted set orders them).
    pub order: f64,
    /// Its estimate.
    pub est: Estimate,
    /// What it is expected to use (input plus the learned share of the output
    /// reservation): what it holds for the turns behind it.
    pub line: f64,
    /// Its tenant.
    pub tenant: String,
    /// When it may come back (never earlier): a checkpoint, at most when it
    /// is predicted clear.
    pub due_ms: Millis,
    /// When it is predicted clear (the refill it needs), as of its last ask.
    pub clear_ms: Millis,
    /// When it first waited.
    pub since_ms: Millis,
    /// Why it waits.
    pub reason: OwedReason,
}

impl Waiter {
    /// What it holds for the turns behind it, per bucket
    /// ([`PacerState::buckets`] order): its line cost, its requests, its
    /// input, the output it keeps (`kept`: [`PacerState::output_kept`]).
    fn holds(&self, kept: f64) -> [f64; BUCKETS] {
        let costs = self.est.costs();
        [self.line, costs[1], costs[2], costs[3] * kept]
    }
}

/// A call cleared and not yet settled.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Flight {
    /// What it reserved (zero on a bucket whose limit was unknown then).
    pub est: Estimate,
    /// The worker's own estimate of its input (before the input ratio; 0
    /// when the estimate did not split input and output), to learn the ratio from.
    pub input: u64,
    /// The token bucket's `refunded` when it was sent.
    pub mark: f64,
    /// The token bucket's `sent` when it was sent (its own charge included).
    #[serde(default)]
    pub sent: f64,
    /// What it reserved on the separate input and output buckets (where the
    /// provider reports them: Anthropic), 0 where they are not known.
    #[serde(default)]
    pub held_input: u64,
    /// See `held_input`.
    #[serde(default)]
    pub held_output: u64,
    /// The output bucket's `refunded` when it was sent.
    #[serde(default)]
    pub omark: f64,
    /// The `sent` ledgers of the request, input and output buckets when it
    /// was sent (the token bucket's is `sent`).
    #[serde(default)]
    pub marks: [f64; 3],
    /// No other call was cleared within [`BURST_GAP_MS`] of it: its headers
    /// and its `sent` see the same calls (in a burst, calls cleared after it
    /// may reach the provider before it), so the refund learner may read them.
    #[serde(default)]
    pub alone: bool,
    /// When the reservation lapses unsettled.
    pub expiry_ms: Millis,
}

impl Flight {
    /// What it holds of each bucket, in [`PacerState::buckets`] order.
    fn held(&self) -> [f64; BUCKETS] {
        [self.est.tokens as f64, self.est.requests as f64, self.held_input as f64, self.held_output as f64]
    }
}

/// The whole pacer state for one budget and model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PacerState {
    /// The token bucket.
    pub tokens: Bucket,
    /// The request bucket.
    pub requests: Bucket,
    /// A separate input token bucket, where the provider reports one
    /// (`anthropic-ratelimit-input-tokens-*`): charged a call's input.
    #[serde(default)]
    pub input: Bucket,
    /// A separate output token bucket (`anthropic-ratelimit-output-tokens-*`):
    /// charged a call's output reservation, its unused part given back when
    /// the answer is done (Anthropic estimates output from `max_tokens` and
    /// corrects it at the end, as documented).
    #[serde(default)]
    pub output: Bucket,
    /// A 429 closed the window until then: nothing is admitted before.
    pub blocked_until_ms: Millis,
    /// With nothing known yet, a probe call is out until then.
    pub probe_until_ms: Millis,
    /// A call was answered without rate-limit headers while nothing was known
    /// or configured: no proactive pacing (every call is clear) until headers
    /// arrive.
    #[serde(default)]
    pub headerless: bool,
    /// The token bucket of a budget without headers is learned from its 429s
    /// (`learn_headerless`): the tokens its answered calls used since
    /// `hl_since_ms` (the last cut, or the first call), …
    #[serde(default)]
    pub hl_used: f64,
    /// … since when, …
    #[serde(default)]
    pub hl_since_ms: Millis,
    /// … when the learned rate was last cut (a 429 of a call cleared before
    /// was sent at the old rate and cuts nothing), …
    #[serde(default)]
    pub hl_cut_ms: Millis,
    /// … when an answer last grew it, …
    #[serde(default)]
    pub hl_grow_ms: Millis,
    /// … the most one answered call used (no bucket is smaller than two), …
    #[serde(default)]
    pub hl_max: f64,
    /// … and, after the first cut, what the calls cleared before it that
    /// were answered after it used, over the span they were sent in (ms; 0:
    /// none): a cold fleet's first 429 comes before most of its first wave's
    /// answers, which lift the rate as they come.
    #[serde(default)]
    pub hl_prev: f64,
    /// See `hl_prev`.
    #[serde(default)]
    pub hl_prev_span: f64,
    /// When headers were last read.
    pub observed_at_ms: Millis,
    /// When a call was last cleared (the watchdog's "time since admission").
    pub last_admit_ms: Millis,
    /// Which call that was (a call cleared right after it is not alone, nor is it).
    #[serde(default)]
    pub last_admit_id: String,
    /// Output tokens used / output tokens reserved, averaged over settled
    /// calls (0 = not yet known, read as 1). A waiter holds the input plus this
    /// share of its output reservation for the turns behind it: a call
    /// reserves its whole `max_output_tokens` but usually gives most of it
    /// back, and a line spaced by reservations would leave the refunds idle.
    pub usage_ratio: f64,
    /// Input tokens the provider counted / input tokens estimated, learned
    /// at every settle (0 = not yet known, read as 1). Each process's worker
    /// estimates with its own tokenizer; the provider charges by its own
    /// count. Asks are charged by the provider's count: a model that charged
    /// less than the provider would sit below it after every header seen while
    /// such a call was in flight, for good (headers only lower the level).
    /// Shared by every process, and taught by the probe before the first wave.
    #[serde(default)]
    pub input_ratio: f64,
    /// How long an answered call takes from its clearance to its settle, ms,
    /// averaged (0 = not yet known): what a turn waits for when what it is
    /// short of is coming back from the calls in flight.
    #[serde(default)]
    pub call_ms: f64,
    /// Whether, and how much of, the unused output the provider gives back
    /// (`refund.rs`), learned from the headers.
    #[serde(default)]
    pub refunds: RefundShare,
    /// Fair admission's system virtual time (see `fair.rs`).
    pub fair_time: f64,
    /// Each tenant's fair-admission state.
    pub tenants: BTreeMap<String, Tenant>,
    /// The line: turns owed time, by reservation id.
    pub waiters: BTreeMap<String, Waiter>,
    /// Calls in flight, by reservation id.
    pub flights: BTreeMap<String, Flight>,
}

/// The buckets a budget may know, in one order: the combined token bucket,
/// requests, and the separate input and output token buckets.
const BUCKETS: usize = 4;

impl PacerState {
    /// Every bucket, in the order of `Estimate::costs`.
    pub fn buckets(&self) -> [&Bucket; BUCKETS] {
        [&self.tokens, &self.requests, &self.input, &self.output]
    }

    /// See [`PacerState::buckets`].
    fn buckets_mut(&mut self) -> [&mut Bucket; BUCKETS] {
        [&mut self.tokens, &mut self.requests, &mut self.input, &mut self.output]
    }

    /// Whether any bucket's limit is known (and so the budget is paced).
    pub fn any_known(&self) -> bool {
        self.buckets().iter().any(|b| b.known())
    }

    /// The share of its output reservation a call is expected to keep on the
    /// output bucket (which gives the unused part back).
    fn output_kept(&self) -> f64 {
        if self.usage_ratio > 0.0 {
            self.usage_ratio.clamp(0.05, 1.0)
        } else {
            1.0
        }
    }

    /// What the provider will charge for `est`: its input part at the
    /// learned input ratio (an estimate that does not split is taken as is).
    pub fn charged(&self, est: Estimate) -> Estimate {
        if self.input_ratio <= 0.0 || est.output == 0 {
            return est;
        }
        let output = est.output.min(est.tokens);
        let input = (est.tokens - output) as f64;
        Estimate { tokens: (input * self.input_ratio).ceil() as u64 + output, ..est }
    }

    /// The share of unused output the provider gives back, credited to the
    /// level: none until learned (the documented rule, which cannot overdraw).
    pub fn refund_share(&self) -> f64 {
        self.learned_share().unwrap_or(0.0)
    }

    /// The refund share once known. A token bucket never described by
    /// headers (configured by `PACELINE_TPM`, or learned from 429s by
    /// `learn_headerless`) is the workers' own: it is charged what a call
    /// used, so the unused output comes back whole.
    pub fn learned_share(&self) -> Option<f64> {
        if self.observed_at_ms == 0 && self.tokens.known() {
            return Some(1.0);
        }
        self.refunds.share(self.tokens.limit)
    }

    /// What a turn of `est` is expected to use (its line cost): its input,
    /// the output it uses, and the unused output the provider keeps.
    pub fn line_cost(&self, est: Estimate) -> f64 {
        let ratio = if self.usage_ratio > 0.0 { self.usage_ratio.clamp(0.05, 1.0) } else { 1.0 };
        // A prediction: until the share is learned, the refunds are assumed.
        let share = self.learned_share().unwrap_or(1.0);
        let kept = ratio + (1.0 - ratio) * (1.0 - share);
        let (input, output) = est.split();
        (input + output * kept).ceil()
    }

    /// Whether waits are slept whole and re-timed by pull-ins
    /// ([`PacingConfig::whole_waits`]): not while a bucket is guessed — learned
    /// without headers, or its limit inferred from `remaining` alone — whose
    /// predictions are only as good as the guess (a pull-in would send a
    /// burst into a bucket that is not there).
    pub fn waits_whole(&self, cfg: &PacingConfig) -> bool {
        cfg.whole_waits && !self.headerless && !self.buckets().iter().any(|b| b.known() && b.assumed)
    }

    /// The least work tag still in line.
    fn least_work_tag(&self) -> Option<f64> {
        self.waiters.values().map(|w| w.order).filter(|o| fair::is_work(*o)).min_by(f64::total_cmp)
    }

    /// What the turns ahead of `(order, id)` hold. A waiter more than
    /// `late_ms` past its due time holds nothing.
    fn ahead_of(&self, order: f64, id: &str, tenant: &str, now: Millis, late_ms: u64) -> Ahead {
        let mut ahead = Ahead::default();
        let kept = self.output_kept();
        for (other, w) in &self.waiters {
            let before = match w.order.total_cmp(&order) {
                std::cmp::Ordering::Less => true,
                std::cmp::Ordering::Equal => other.as_str() < id,
                std::cmp::Ordering::Greater => false,
            };
            if before && other != id && now <= w.due_ms + late_ms as Millis {
                for (sum, held) in ahead.held.iter_mut().zip(w.holds(kept)) {
                    *sum += held;
                }
                ahead.other_tenant |= fair::is_work(w.order) && w.tenant != tenant;
                ahead.last_clear_ms = ahead.last_clear_ms.max(w.clear_ms);
            }
        }
        ahead
    }

    /// The age of the oldest waiter (watchdog), 0 when none waits.
    pub fn oldest_wait_ms(&self, now: Millis) -> Millis {
        self.waiters.values().map(|w| now - w.since_ms).max().unwrap_or(0).max(0)
    }
}

/// What the turns ahead of one in line hold.
#[derive(Debug, Clone, Copy, Default)]
struct Ahead {
    /// What they are expected to use of each bucket ([`PacerState::buckets`]
    /// order): their line cost, their requests, their input, the output they keep.
    held: [f64; BUCKETS],
    /// Another tenant's work turn is among them.
    other_tenant: bool,
    /// The latest predicted clear time among them (0: none).
    last_clear_ms: Millis,
}

/// One ask: a call of `est` under reservation `id`, in `mode`, for `who`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask<'a> {
    /// The reservation id (a turn keeps it while it waits).
    pub id: &'a str,
    /// What the call is expected to cost.
    pub est: Estimate,
    /// Work or companion.
    pub mode: Mode,
    /// Its tenant, weight and cap.
    pub who: Who<'a>,
}

/// Asks for `ask.est` at `now`. `jitter_u` is a uniform
/// number in [0, 1) from the caller (Redis scripts must be deterministic, so
/// randomness comes from outside).
pub fn acquire(state: &mut PacerState, cfg: &PacingConfig, now: Millis, ask: &Ask<'_>, jitter_u: f64) -> Decision {
    // Everything below charges what the provider will charge.
    let raw_input = if ask.est.output > 0 { ask.est.tokens - ask.est.output.min(ask.est.tokens) } else { 0 };
    let ask = &Ask { est: state.charged(ask.est), ..*ask };
    let Ask { id, est, mode, who } = *ask;
    expire(state, cfg, now);
    // 1. Asked again for a call already cleared (a redelivery): still clear.
    if state.flights.contains_key(id) {
        return Decision::Clear;
    }
    // 2. Back before its time: owed the rest (a wait cut short is not a wait saved).
    if let Some(w) = state.waiters.get(id) {
        if now < w.due_ms {
            return Decision::Owed { ms: (w.due_ms - now) as u64, reason: w.reason };
        }
    }
    ensure_configured(state, cfg, now);
    // 3. A window a 429 closed, or a probe out: wait (a waiter keeps its place).
    if now < state.blocked_until_ms {
        let ms = (state.blocked_until_ms - now) as f64;
        return hold_place(state, cfg, now, id, ms, OwedReason::RateLimited, jitter_u);
    }
    if !state.any_known() {
        if state.headerless {
            // No headers, no configured limits and no 429 yet: no proactive
            // pacing (docs/pacing.md, "A provider without headers"); a 429 closes the window above and teaches a
            // bucket (`learn_headerless`).
            return admit(state, cfg, now, ask, raw_input, None);
        }
        if now < state.probe_until_ms {
            let ms = (state.probe_until_ms - now).min(cfg.probe_wait_ms as Millis) as f64;
            return hold_place(state, cfg, now, id, ms, OwedReason::Probe, jitter_u);
        }
        // The probe holds the rest until it settles (its headers show what
        // it was charged; a second call sent before them would be charged
        // where the model cannot see it), or until the hold lapses.
        state.probe_until_ms = now + PROBE_HOLD_MS.min(cfg.reservation_ttl_ms as Millis);
        return admit(state, cfg, now, ask, raw_input, None);
    }
    lift(state, cfg, now);
    // 4. Its place in line: kept if it waited before, else given now (a
    //    capped tenant's turn first passes its cap).
    let line = state.line_cost(est);
    let order = match state.waiters.get_mut(id) {
        Some(w) => {
            w.line = line;
            w.order
        }
        None => match fresh_place(state, now, mode, &who, line) {
            Ok(order) => order,
            // No jitter: the gate's time is exact, so a redelivery that asks
            // before it is still held (the turn has no place in line to keep it).
            Err(ms) => return owed(ms, OwedReason::FairShare, cfg, 0.0),
        },
    };
    // 5. Clear if the bucket holds the turns ahead and this one above the floor.
    let ahead = state.ahead_of(order, id, who.tenant, now, cfg.late_ms);
    let floor = cfg.floor(mode);
    let mut wait: f64 = 0.0;
    let mut fits = true;
    // The head may go to find a window's next boundary when nothing else
    // holds it and no call cleared since the last boundary will bring it (one
    // in flight for longer than a few `late_ms` may never: its worker died).
    let ttl = cfg.reservation_ttl_ms as Millis;
    let answering = now - PROBE_AFTER_LATE * cfg.late_ms as Millis;
    let since_boundary =
        |b: &Bucket| b.known() && state.flights.values().any(|f| f.expiry_ms - ttl >= b.boundary_ms.max(answering));
    let head = ahead.held.iter().all(|h| *h <= 0.0);
    let mut probe = head && !state.buckets().iter().any(|b| since_boundary(b));
    let idle = state.flights.is_empty() && now - state.last_admit_ms >= BURST_GAP_MS;
    let share_known = state.learned_share().is_some();
    let costs = est.costs();
    let deep = state.waits_whole(cfg);
    let mut shorts = [0.0; BUCKETS];
    for (i, bucket) in state.buckets_mut().into_iter().enumerate() {
        if bucket.known() {
            bucket.advance(now);
            let short = ahead.held[i] + bucket.need(costs[i], bucket.floor_at(now, floor)) - bucket.level;
            if short > 0.0 {
                fits = false;
                shorts[i] = short;
                wait = wait.max(bucket.refill_ms(now, short, deep));
                probe &= bucket.may_probe(now);
            }
        }
    }
    // Only the token bucket holds the turn.
    let tokens_only = shorts[0] > 0.0 && shorts[1..].iter().all(|s| *s <= 0.0);
    // A window bucket whose refunds are not known yet and whose head is held
    // only by them: once per window, when every call has settled, the head
    // goes alone, so that its headers tell (against the window's start) how
    // much came back. A provider that keeps the charge refuses it: one 429 a
    // window until the share is learned.
    let t = &state.tokens;
    let refund_probe = head
        && idle
        && !share_known
        && t.windowed()
        && t.full_at_ms > now
        && (t.probed_ms == 0 || t.probed_ms < t.boundary_ms)
        && tokens_only
        && shorts[0] <= t.withheld;
    if !fits && refund_probe {
        state.tokens.probed_ms = now;
        fits = true;
    }
    if !fits && probe {
        for bucket in state.buckets_mut() {
            if bucket.known() && bucket.may_probe(now) {
                bucket.probed_ms = now;
            }
        }
        fits = true;
    }
    if fits {
        return admit(state, cfg, now, ask, raw_input, Some((order, line)));
    }
    // 6. Otherwise wait in line until the refill brings it — for at most
    //    three quarters of that, or a few turns' refill when that is longer. A
    //    long wait is a prediction (the line's expected use, refunds to come,
    //    turns ahead that may never come back): a turn asked back early is
    //    re-timed with what is known then, where one that sleeps past a
    //    pessimistic prediction leaves the bucket idle. Shrinking the rest by
    //    four each time keeps the asks of a deep line few (a logarithm of its
    //    wait); a prediction up to a quarter too pessimistic costs nothing.
    //    A wait within [`RECHECK_TAIL`] of the horizon is slept whole: the rest
    //    a horizon's sleep would leave is a whole round (a fetch, an ask, a
    //    requeue) for a third of a horizon. (Not a bucket learned without
    //    headers: its waits are guesses until the answers of its wave come.)
    //    It never sends before it is clear. With whole waits
    //    ([`PacerState::waits_whole`]) every wait is slept whole (behind
    //    others, a tenth longer), and [`pull_in`] moves up the waiters near
    //    the head whose prediction shortens (the re-timing comes to them).
    let reason = if ahead.other_tenant { OwedReason::FairShare } else { OwedReason::Budget };
    let recheck = recheck_ms(&state.tokens, cfg, line);
    let answered = answer_recheck(state, recheck);
    let whole = deep || (!state.headerless && wait <= recheck * RECHECK_TAIL);
    let mut sleep = if whole { wait } else { wait.min((wait * RECHECK_SHARE).max(recheck)) };
    // Behind others, a whole wait errs late: the pull-ins re-time it near the
    // head, where a prediction is a few turns long; one that erred early
    // would come back owed the rest, a round of the queue.
    if deep && !head {
        sleep *= 1.0 + WHOLE_WAIT_MARGIN;
    }
    let mut sleep = sleep.min(cfg.max_pace_ms as f64);
    // A wait predicted before the bucket's shape is known is only as good as
    // the shape guessed (none refills before its reset): be back within the
    // recheck horizon, when the votes may have decided.
    // So is one predicted before any call has settled (the line's costs are
    // then the whole reservations; the first answers say how much is used).
    if state.usage_ratio <= 0.0 || state.buckets().iter().any(|b| b.known() && b.refill == Refill::Unknown) {
        sleep = sleep.min(recheck);
    }
    // A bucket learned without headers at its first 429 is lifted by the
    // answers of the wave the 429 came in (`learn_headerless`): while they
    // come, a wait timed by it is far too long.
    let wave = state.headerless && state.hl_prev_span > 0.0;
    if wave && state.flights.values().any(|f| f.expiry_ms - ttl <= state.hl_cut_ms) {
        sleep = sleep.min(cfg.recheck_ms as f64);
    }
    // A window gives nothing back before its boundary but refunds: when the
    // calls in flight are expected to give back what the turn is short of,
    // be back within the recheck horizon rather than at the boundary.
    // Likewise a window bucket short of no more than the calls in flight hold
    // on it: their settles may give it back (refunds, or a call the lift
    // charged to the new window that went into the old one).
    // So is one short by no more than a window's floor, which shrinks to
    // the boundary (`Bucket::floor_at`): it fits before then.
    for (i, bucket) in state.buckets().into_iter().enumerate() {
        if bucket.windowed() && shorts[i] > 0.0 {
            let holding: f64 = state.flights.values().map(|f| f.held()[i]).sum();
            if holding >= shorts[i] {
                sleep = sleep.min(answered);
            } else if shorts[i] <= bucket.floor_at(now, floor) * bucket.limit {
                sleep = sleep.min(recheck);
            }
        }
    }
    // A window's head held only by refunds whose share is not known yet
    // (withheld, or to be withheld at the settles of the calls in flight):
    // back when those calls are answered, to go alone as the refund probe.
    if head && !share_known && state.tokens.windowed() && tokens_only {
        let coming: f64 = state.flights.values().map(|f| f.est.output as f64).sum();
        if shorts[0] <= state.tokens.withheld + coming {
            sleep = sleep.min(answered);
        }
    }
    let share = state.refund_share();
    if state.tokens.windowed() && share > 0.0 && tokens_only {
        let kept = if state.usage_ratio > 0.0 { state.usage_ratio.clamp(0.0, 1.0) } else { 1.0 };
        let coming: f64 = state.flights.values().map(|f| f.est.output as f64 * (1.0 - kept) * share).sum();
        if coming >= shorts[0] {
            sleep = sleep.min(answered);
        }
    }
    // The turns ahead are predicted clear by `last_clear_ms`; one that never
    // comes back (its run cancelled, its worker dead) stops counting by then
    // plus `late_ms`: be back then to take its place. (Their checkpoints are
    // not the mark: waking with every one of them would make a deep line ask
    // as often as its head.)
    if ahead.last_clear_ms > 0 {
        sleep = sleep.min((ahead.last_clear_ms + cfg.late_ms as Millis - now) as f64);
    }
    let decision = owed(sleep.max(1.0), reason, cfg, jitter_u);
    if let Decision::Owed { ms, .. } = decision {
        let fresh = !state.waiters.contains_key(id);
        let w = state.waiters.entry(id.to_owned()).or_insert_with(|| Waiter {
            order,
            est,
            line,
            tenant: who.tenant.to_owned(),
            due_ms: now,
            clear_ms: now,
            since_ms: now,
            reason,
        });
        w.due_ms = now + ms as Millis;
        w.clear_ms = now + (wait.ceil() as Millis).max(ms as Millis);
        w.reason = reason;
        w.est = est;
        if fresh {
            state.tenants.entry(who.tenant.to_owned()).or_default().waits += 1.0;
        }
    }
    decision
}

/// The waiters near the head whose wait, predicted now, ends sooner than
/// their due time ([`PacingConfig::whole_waits`]): up to `k` of them, in line
/// order, are moved up to it (never later, never past a lapse), and returned
/// with their new due time for the caller to move their queue entries. A turn
/// sleeping a whole wait predicted behind a deep line would otherwise sleep
/// past budget the turns ahead did not use (a cancelled run, a call that used
/// less than its line cost, refunds).
pub fn pull_in(state: &mut PacerState, cfg: &PacingConfig, now: Millis, k: usize) -> Vec<(String, Millis)> {
    if !cfg.whole_waits {
        return vec![];
    }
    expire(state, cfg, now);
    if !state.waits_whole(cfg) || state.waiters.is_empty() || now < state.blocked_until_ms || !state.any_known() {
        return vec![];
    }
    for bucket in state.buckets_mut() {
        if bucket.known() {
            bucket.advance(now);
        }
    }
    let late = cfg.late_ms as Millis;
    let mut line: Vec<(&String, &Waiter)> = state.waiters.iter().filter(|(_, w)| now <= w.due_ms + late).collect();
    line.sort_by(|a, b| a.1.order.total_cmp(&b.1.order).then(a.0.cmp(b.0)));
    let kept = state.output_kept();
    let mut ahead = [0.0; BUCKETS];
    let mut moved = vec![];
    for (id, w) in line.into_iter().take(k) {
        let costs = w.est.costs();
        let floor = cfg.floor(if fair::is_work(w.order) { Mode::Work } else { Mode::Companion });
        let mut wait: f64 = 0.0;
        for (i, b) in state.buckets().into_iter().enumerate() {
            if b.known() {
                let short = ahead[i] + b.need(costs[i], b.floor_at(now, floor)) - b.level;
                wait = wait.max(b.refill_ms(now, short, true));
            }
        }
        let due = now + (wait.ceil() as Millis).max(1) + PULL_IN_PAD_MS;
        if due + PULL_IN_GAIN_MS + (cfg.jitter_max_ms as Millis) < w.due_ms {
            moved.push((id.clone(), due));
        }
        for (sum, held) in ahead.iter_mut().zip(w.holds(kept)) {
            *sum += held;
        }
    }
    for (id, due) in &moved {
        if let Some(w) = state.waiters.get_mut(id) {
            w.due_ms = *due;
            w.clear_ms = w.clear_ms.min(*due);
        }
    }
    moved
}

/// How much longer than its predicted wait a turn behind others sleeps
/// with whole waits (see step 6 of [`acquire`]).
const WHOLE_WAIT_MARGIN: f64 = 0.1;

/// A pulled-in waiter is due this much after its predicted clear time: the
/// bench's came back owed 20–90 ms more (a settle's headers lowering the
/// level meanwhile), each an in-place pause in a worker (its lease, an ask
/// and a start: ~7 commands more than a clear in the fetch).
const PULL_IN_PAD_MS: Millis = 50;

/// A pull-in moves a waiter up by more than this plus the jitter's most, or
/// not at all (a queue write for less is not worth it, and the jitter just
/// drawn is not taken back).
const PULL_IN_GAIN_MS: Millis = 50;

/// The shortest sleep of a turn owed longer: a few turns' worth of refill (so
/// a slow tier is not asked every second), at least `recheck_ms`, at most
/// `max_pace_ms`. A turn owed more sleeps [`RECHECK_SHARE`] of its wait,
/// then is re-timed.
fn recheck_ms(tokens: &Bucket, cfg: &PacingConfig, line: f64) -> f64 {
    let turns = if tokens.known() { RECHECK_TURNS * line / tokens.share_rate() } else { 0.0 };
    turns.max(cfg.recheck_ms as f64).min(cfg.max_pace_ms as f64)
}

/// See [`recheck_ms`].
const RECHECK_TURNS: f64 = 4.0;

/// How soon a turn short of what the calls in flight are expected to give
/// back asks again: after about one call's time (`PacerState::call_ms`), when
/// they have been answered and settled, within [[`ANSWER_RECHECK_MIN_MS`],
/// `recheck`]. A window gives nothing else back before its boundary, and a
/// turn that slept the whole recheck horizon instead left those refunds idle
/// for it (in a 10-s window, a fifth of the window each round).
fn answer_recheck(state: &PacerState, recheck: f64) -> f64 {
    if state.call_ms > 0.0 {
        state.call_ms.clamp(ANSWER_RECHECK_MIN_MS, recheck)
    } else {
        recheck
    }
}

/// See [`answer_recheck`].
const ANSWER_RECHECK_MIN_MS: f64 = 50.0;

/// The share of a long predicted wait a turn sleeps before it is re-timed.
const RECHECK_SHARE: f64 = 0.75;

/// A wait up to this many recheck horizons is slept whole (see step 6 of
/// [`acquire`]): the bench's turns came back from a horizon's sleep owed a
/// few hundred ms, a round of the queue each.
const RECHECK_TAIL: f64 = 4.0 / 3.0;

/// A new turn's place in line, or `Err(ms)` while its tenant's cap holds it
/// back (it does not join the line then).
fn fresh_place(state: &mut PacerState, now: Millis, mode: Mode, who: &Who<'_>, line: f64) -> Result<f64, f64> {
    // A cap is a share of the token bucket (or, split, of the input bucket).
    let cap_bucket = if state.tokens.known() { &state.tokens } else { &state.input };
    let refill = cap_bucket.share_rate();
    let known = cap_bucket.known();
    let virtual_time = state.fair_time;
    let tenant = state.tenants.entry(who.tenant.to_owned()).or_default();
    if known {
        if let Some(ms) = fair::cap_gate(tenant, who.cap, refill, line, now) {
            return Err(ms);
        }
    }
    let tag = fair::place_work(tenant, who.weight, virtual_time, line);
    // A companion turn goes first in line, but its tokens count in its
    // tenant's cap (above) and share (the finish tag moved past them) as a
    // work turn's do: switching to companion mode buys a tenant nothing.
    Ok(if mode == Mode::Companion { fair::place_companion(now) } else { tag })
}

/// An owed answer for something other than the line (a closed window, a
/// probe): a waiter keeps its place and comes back then; a new turn does not
/// join.
fn hold_place(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    id: &str,
    ms: f64,
    reason: OwedReason,
    u: f64,
) -> Decision {
    // A new turn gets the exact time (no jitter): it has no place in line to
    // hold it, so a redelivery that asks before then is held by the same cause.
    let u = if state.waiters.contains_key(id) { u } else { 0.0 };
    let decision = owed(ms, reason, cfg, u);
    if let (Decision::Owed { ms, .. }, Some(w)) = (decision, state.waiters.get_mut(id)) {
        w.due_ms = now + ms as Millis;
        w.clear_ms = w.clear_ms.max(w.due_ms);
        w.reason = reason;
    }
    decision
}

/// Clears the call: it leaves the line, its reservation is charged and in
/// flight. `place` is its order and line cost when it stood in line (none for
/// a probe, which no tenant's share is charged for); `input` is the worker's
/// own input estimate, kept to learn the input ratio from.
fn admit(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    ask: &Ask<'_>,
    input: u64,
    place: Option<(f64, f64)>,
) -> Decision {
    let Ask { id, est, mode, who } = *ask;
    state.waiters.remove(id);
    let costs = est.costs();
    let mut held = [0.0; BUCKETS];
    for (i, bucket) in state.buckets_mut().into_iter().enumerate() {
        if bucket.known() {
            bucket.advance(now);
            bucket.level -= costs[i];
            bucket.in_flight += costs[i];
            bucket.charged_since += costs[i];
            bucket.sent += costs[i];
            held[i] = costs[i];
        }
    }
    let mut reserved = Estimate { tokens: held[0] as u64, requests: held[1] as u64, output: 0 };
    if state.tokens.known() {
        reserved.output = est.output;
    }
    let alone = now - state.last_admit_ms >= BURST_GAP_MS;
    if !alone {
        if let Some(previous) = state.flights.get_mut(&state.last_admit_id) {
            previous.alone = false;
        }
    }
    let flight = Flight {
        est: reserved,
        input,
        mark: state.tokens.refunded,
        sent: state.tokens.sent,
        held_input: held[2] as u64,
        held_output: held[3] as u64,
        omark: state.output.refunded,
        marks: [state.requests.sent, state.input.sent, state.output.sent],
        alone,
        expiry_ms: now + cfg.reservation_ttl_ms as Millis,
    };
    state.flights.insert(id.to_owned(), flight);
    if let Some((order, line)) = place {
        state.tenants.entry(who.tenant.to_owned()).or_default().admitted += line;
        if mode == Mode::Work {
            let least = state.least_work_tag();
            state.fair_time = fair::virtual_time_after(state.fair_time, order, least);
        }
    }
    state.last_admit_ms = now;
    state.last_admit_id = id.to_owned();
    Decision::Clear
}

/// Lifts both buckets at their provider's reset. A window bucket's lift
/// subtracts what was cleared within `late_ms` before its boundary: the
/// provider may have received those calls after it.
fn lift(state: &mut PacerState, cfg: &PacingConfig, now: Millis) {
    let ttl = cfg.reservation_ttl_ms as Millis;
    let lifts = |b: &Bucket| b.windowed() && b.full_at_ms > 0 && now >= b.full_at_ms;
    let boundaries: Vec<Option<Millis>> =
        state.buckets().iter().map(|b| lifts(b).then_some(b.full_at_ms - cfg.late_ms as Millis)).collect();
    let mut recent = [0.0; BUCKETS];
    for f in state.flights.values() {
        for (i, held) in f.held().into_iter().enumerate() {
            if boundaries[i].is_some_and(|since| f.expiry_ms - ttl >= since) {
                recent[i] += held;
            }
        }
    }
    let window_lift = boundaries[0].is_some();
    for (i, bucket) in state.buckets_mut().into_iter().enumerate() {
        bucket.lift(now, recent[i]);
    }
    if window_lift {
        // The refund learner's pair starts at the boundary (`window_start`).
        let t = &state.tokens;
        let until_ms = t.boundary_ms + t.max_reset_ms as Millis;
        let snap = Snapshot {
            at_ms: t.boundary_ms,
            remaining: t.limit - recent[0],
            sent: t.sent,
            refunded: t.refunded,
            until_ms,
        };
        state.refunds.window_start(snap);
    }
}

/// Drops what lapsed: waiters not back by `due + grace` leave the line (the
/// turns behind them move up by exactly their cost, as it is summed anew);
/// reservations in flight past their expiry were never settled (their worker
/// died): we cannot know whether the call was sent, so the tokens stay spent
/// and return by refill.
pub fn expire(state: &mut PacerState, cfg: &PacingConfig, now: Millis) {
    let grace = cfg.booking_grace_ms as Millis;
    state.waiters.retain(|_, w| w.due_ms + grace > now);
    let gone: Vec<String> = state.flights.iter().filter(|(_, f)| f.expiry_ms <= now).map(|(k, _)| k.clone()).collect();
    for id in gone {
        if let Some(f) = state.flights.remove(&id) {
            for (bucket, held) in state.buckets_mut().into_iter().zip(f.held()) {
                bucket.in_flight = (bucket.in_flight - held).max(0.0);
            }
        }
    }
}

/// What a finished call reports to the pacer (its reservation is found by its id).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CallOutcome {
    /// Tokens the provider reported as used; `None` when unknown (the
    /// reservation then stands as the charge).
    pub used_tokens: Option<u64>,
    /// The part of `used_tokens` the provider counted as input. The provider
    /// charged that plus the output reserved, so what it gave back after the
    /// headers is the reserved output less the output used — whatever our own
    /// estimate of the input was.
    pub input_tokens: Option<u64>,
    /// The call was refused with a 429: nothing of it was charged, and the
    /// window is closed for `rate_limited_ms`.
    pub rate_limited_ms: Option<u64>,
    /// Token bucket headers.
    pub tokens: Observation,
    /// Request bucket headers.
    pub requests: Observation,
    /// Separate input token bucket headers (Anthropic's `input-tokens`).
    pub input: Observation,
    /// Separate output token bucket headers (Anthropic's `output-tokens`).
    pub output: Observation,
    /// How long ago (ms) the headers were received.
    pub headers_age_ms: u64,
}

/// Settles reservation `id`: refunds what it reserved beyond what it used,
/// then lowers the model to the headers (never raises it), and on a 429
/// closes the window for every worker.
pub fn settle(state: &mut PacerState, cfg: &PacingConfig, now: Millis, id: &str, outcome: &CallOutcome) {
    expire(state, cfg, now);
    ensure_configured(state, cfg, now);
    state.waiters.remove(id);
    let flight = state.flights.remove(id);
    if flight.is_some() {
        // A probe (or any call) that settled: the next probe may go.
        state.probe_until_ms = 0;
    }
    let reserved = flight.map(|f| f.est).unwrap_or_default();
    let limited = outcome.rate_limited_ms.is_some();
    // What the call's reservation was off by. Its input part: the provider
    // charged the input it counted, not our estimate. Its output part: what
    // the call left unused, which the provider gives back in its learned share
    // (`refund.rs`) after its headers were sent — whatever our own estimate of
    // the input was. (Crediting our own refund, the estimate less what was
    // used, would leave the model off the provider by the estimate's error on
    // every call, for good.) A refused call was charged nothing.
    let (input, output) = reserved.split();
    let (input_fix, unused) = match (outcome.used_tokens, outcome.input_tokens) {
        _ if limited => (0.0, 0.0),
        (Some(used), Some(counted)) if reserved.output > 0 => {
            (input - counted as f64, (counted as f64 + output - used as f64).max(0.0))
        }
        (Some(used), _) => (0.0, reserved.tokens.saturating_sub(used) as f64),
        (None, _) => (0.0, 0.0),
    };
    if let (false, Some(counted), Some(f)) = (limited, outcome.input_tokens, flight) {
        if f.input > 0 {
            // The first count is taken whole (the probe's answer teaches the
            // first wave); later ones weigh 30 %.
            let seen = (counted as f64 / f.input as f64).clamp(0.25, 4.0);
            let prior = if state.input_ratio > 0.0 { state.input_ratio } else { seen };
            state.input_ratio = 0.7 * prior + 0.3 * seen;
        }
    }
    if let (false, Some(f)) = (limited, flight) {
        // The first answer's time is taken whole; later ones weigh 20 %.
        let seen = (now - (f.expiry_ms - cfg.reservation_ttl_ms as Millis)).max(0) as f64;
        let prior = if state.call_ms > 0.0 { state.call_ms } else { seen };
        state.call_ms = 0.8 * prior + 0.2 * seen;
    }
    if let (false, Some(used)) = (limited, outcome.used_tokens) {
        // The output reservation: on the combined bucket, or (split, the
        // combined bucket unknown) on the output bucket.
        let (input, output) = match flight {
            Some(f) if reserved.tokens == 0 && f.held_output > 0 => (f.held_input as f64, f.held_output as f64),
            _ => (input, output),
        };
        let input = outcome.input_tokens.map_or(input, |counted| counted as f64);
        if output > 0.0 {
            let seen = ((used as f64 - input) / output).clamp(0.0, 1.0);
            // The first call's use is taken whole (the probe's answer sets the
            // line's spacing for the first wave); later ones weigh 20 %.
            let prior = if state.usage_ratio > 0.0 { state.usage_ratio } else { seen.max(0.05) };
            state.usage_ratio = 0.8 * prior + 0.2 * seen;
        }
    }
    // A reset that passed since the last ask is lifted before these headers
    // name the next one (or the window that began would be skipped).
    lift(state, cfg, now);
    let share = state.refund_share();
    // What others left unused since this call was sent, and what was cleared
    // after it: its headers cannot show either.
    let others_unused = flight.map(|f| (state.tokens.refunded - f.mark).max(0.0)).unwrap_or(0.0);
    let others_output = flight.map(|f| (state.output.refunded - f.omark).max(0.0)).unwrap_or(0.0);
    // (Calls cleared within a burst of it may reach the provider before it:
    // only those cleared later than that are surely not in its headers.)
    let mut after = [0.0; BUCKETS];
    // And what was cleared after it and has settled already: its charge is in
    // the ledger since this call's mark, but no longer in flight.
    let mut settled_after = [0.0; BUCKETS];
    if let Some(f) = flight {
        let mut later = [0.0; BUCKETS];
        for g in state.flights.values() {
            for (i, held) in g.held().into_iter().enumerate() {
                if g.expiry_ms - f.expiry_ms > BURST_GAP_MS {
                    after[i] += held;
                }
                if g.expiry_ms > f.expiry_ms {
                    later[i] += held;
                }
            }
        }
        let marks = [f.sent, f.marks[0], f.marks[1], f.marks[2]];
        for (i, bucket) in state.buckets().into_iter().enumerate() {
            settled_after[i] = (bucket.sent - marks[i] - later[i]).max(0.0);
        }
    }
    // The separate input and output buckets (Anthropic): the input charged
    // as the provider counted it; the output reservation's unused part given
    // back when the answer is done.
    let held = flight.map(|f| f.held()).unwrap_or_default();
    let counted_input = outcome.input_tokens.map(|c| c as f64);
    let input_bucket_fix = match counted_input {
        Some(counted) if held[2] > 0.0 => held[2] - counted,
        _ => 0.0,
    };
    let output_unused = match (outcome.used_tokens, counted_input) {
        _ if limited => 0.0,
        (Some(used), Some(counted)) if held[3] > 0.0 => (held[3] - (used as f64 - counted)).max(0.0),
        _ => 0.0,
    };
    // Per bucket: what it held, the input fix, the unused output and the share
    // of it credited (the combined bucket's learned share; the output bucket
    // gives it all back, as Anthropic documents), and what of it is withheld:
    // the part not credited — all of it while the share is not known, the
    // rest of a share learned below one — which the headers may confirm later
    // (`learn_refund_share`). A share learned low from noisy first pairs
    // otherwise left what it did not credit idle for good: headers only lower
    // the level.
    let per_bucket = [
        (held[0], input_fix, unused, share, unused * (1.0 - share).max(0.0)),
        (held[1], 0.0, 0.0, 0.0, 0.0),
        (held[2], input_bucket_fix, 0.0, 0.0, 0.0),
        (held[3], 0.0, output_unused, 1.0, 0.0),
    ];
    let headers_at = now - outcome.headers_age_ms as Millis;
    let observed = [&outcome.tokens, &outcome.requests, &outcome.input, &outcome.output];
    // A call cleared just before a window's boundary was charged to the new
    // window at its lift (`recent`); its headers tell which window it went
    // into: the one that ended, when the boundary they name is that one.
    let cleared_ms = flight.map(|f| f.expiry_ms - cfg.reservation_ttl_ms as Millis);
    // A window whose boundary went by while no headers named it (so it was
    // not lifted at): the first headers from the window that began name the
    // next boundary, a window later. The bucket was full at the one between,
    // less what was cleared since (this call among them).
    let ttl = cfg.reservation_ttl_ms as Millis;
    for (i, obs) in observed.iter().enumerate() {
        let b = state.buckets()[i];
        let (true, Some(reset)) = (b.windowed(), obs.reset_ms) else {
            continue;
        };
        let window = b.max_reset_ms;
        let start = headers_at + reset as Millis - window as Millis;
        if window > 0.0 && b.full_at_ms <= now && start <= now && start as f64 > b.boundary_ms as f64 + window / 2.0 {
            let since = start - cfg.late_ms as Millis;
            let mut recent: f64 =
                state.flights.values().filter(|f| f.expiry_ms - ttl >= since).map(|f| f.held()[i]).sum();
            if cleared_ms.is_some_and(|c| c >= since) {
                recent += held[i];
            }
            let bucket = state.buckets_mut().into_iter().nth(i).expect("a bucket");
            bucket.advance(now);
            bucket.level = bucket.level.max(bucket.limit - recent);
            bucket.boundary_ms = start;
            bucket.charged_since = 0.0;
        }
    }
    // How high a refund can have lifted each bucket (`refund_cap`).
    let mut caps = [f64::INFINITY; BUCKETS];
    if let Some(cleared) = cleared_ms {
        for (i, b) in state.buckets().into_iter().enumerate() {
            caps[i] = refund_cap(b, &state.flights, i, cleared, now, cfg);
        }
    }
    let mut old_window = [false; BUCKETS];
    for (i, (bucket, obs)) in state.buckets().into_iter().zip(observed).enumerate() {
        if let (true, Some(cleared), Some(reset)) = (bucket.windowed(), cleared_ms, obs.reset_ms) {
            let counted_new = cleared < bucket.boundary_ms && cleared >= bucket.boundary_ms - cfg.late_ms as Millis;
            old_window[i] = counted_new
                && ((headers_at + reset as Millis) as f64) < bucket.boundary_ms as f64 + bucket.max_reset_ms / 2.0;
        }
    }
    for (i, (bucket, (held, fix, unused, share, withhold))) in
        state.buckets_mut().into_iter().zip(per_bucket).enumerate()
    {
        if old_window[i] && !limited {
            bucket.level = (bucket.level + held).min(bucket.limit.max(bucket.level));
        }
        bucket.advance(now);
        bucket.in_flight = (bucket.in_flight - held).max(0.0);
        // A refused call's whole reservation comes back, to us and to the ledger.
        let fix = if limited { held } else { fix };
        bucket.credit(fix);
        bucket.credit_refund(share * unused, caps[i]);
        bucket.sent -= fix;
        bucket.refunded += unused;
        if withhold > 0.0 {
            bucket.withheld += withhold;
        }
        bucket.cap_withheld();
    }
    let had_headers = observed.iter().any(|o| o.remaining.is_some());
    // What changed at each provider bucket since the headers were sent.
    let since =
        [share * (unused + others_unused) - after[0], -after[1], -after[2], output_unused + others_output - after[3]];
    // What this call itself was charged on each (a limit inferred from
    // `remaining` alone is at least that plus its charge).
    let own = if limited { [0.0; BUCKETS] } else { held };
    for (i, (bucket, obs)) in state.buckets_mut().into_iter().zip(observed).enumerate() {
        let unseen_refunds = if i == 0 { unused + others_unused } else { 0.0 };
        let seen = Seen { headers_at, since: since[i], own: own[i], settled_after: settled_after[i], unseen_refunds };
        bucket.observe(obs, now, &seen, cfg.max_pace_ms);
    }
    learn_refund_share(state, cfg, now, flight, outcome, headers_at, unused);
    if had_headers {
        state.observed_at_ms = now;
        state.probe_until_ms = 0;
        state.headerless = false;
    } else if flight.is_some() && !state.any_known() {
        // A call answered without rate-limit headers, and nothing is
        // configured: the provider has none to give (vLLM, Ollama). Probing on
        // would hold the fleet to one call at a time.
        state.headerless = true;
    }
    if let (true, Some(f)) = (state.headerless, flight) {
        learn_headerless(state, cfg, now, &f, outcome.used_tokens, limited);
    }
    if let Some(ms) = outcome.rate_limited_ms {
        // The provider says the window is closed for `ms`, for everyone. What
        // is left after it is what the 429's headers say; without headers,
        // remaining = 0.
        state.blocked_until_ms = state.blocked_until_ms.max(headers_at + ms as Millis);
        for (bucket, obs) in state.buckets_mut().into_iter().zip(observed) {
            if bucket.known() && obs.remaining.is_none() {
                bucket.level = bucket.level.min(0.0);
            }
        }
    }
}

/// A bucket learned without headers holds this long of its rate (a burst
/// after an idle spell goes no further).
const HL_BURST_MS: f64 = 15_000.0;
/// The first 429 spreads what was answered before it over at least this long:
/// limits are per minute, and a cold fleet's first wave takes a whole bucket
/// in a second.
const HL_FIRST_SPAN_MS: f64 = 60_000.0;
/// A 429 cuts the learned rate to this share of what was answered since the
/// last cut …
const HL_CUT: f64 = 0.9;
/// … but no lower than this share of the rate it had.
const HL_CUT_MIN: f64 = 0.5;
/// While the learned bucket binds, each answer grows its rate by this share
/// per ms since the answer before (0.5 % a second: some 20 s from a cut back
/// to where the 429 came) …
const HL_GROW_PER_MS: f64 = 5e-6;
/// … counting no more than this long, and faster the longer no 429 came:
/// once more for each this long since the last cut (a rate learned far too
/// low, the first over a minute from a provider whose period is 10 s, is
/// found again in a minute or two, not in ten).
const HL_GROW_MAX_MS: f64 = 10_000.0;
/// See [`HL_GROW_MAX_MS`].
const HL_ACCEL_MS: f64 = 20_000.0;
/// The most the growth is sped up.
const HL_ACCEL_MAX: f64 = 4.0;

/// Learns the token bucket of a budget without headers from a settled call
/// `f` (`used`: what it used; `limited`: a 429). Nothing but the 429s says
/// what fits, and the 429's delay alone sends the whole fleet back in one
/// wave: so a 429 of a call cleared since the last cut sets a continuous
/// bucket at [`HL_CUT`] of the rate answered since (the first over at least
/// [`HL_FIRST_SPAN_MS`], and lifted by the answers of its wave that come
/// after it), empty; answers while it binds grow its rate slowly (as TCP
/// finds a link's rate it cannot see). Charged as a configured budget is:
/// what a call used (its unused output comes back whole), the same count the
/// rate is learned in, whatever the provider's own rule.
fn learn_headerless(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    f: &Flight,
    used: Option<u64>,
    limited: bool,
) {
    let cleared = f.expiry_ms - cfg.reservation_ttl_ms as Millis;
    if state.hl_since_ms == 0 {
        state.hl_since_ms = cleared;
    }
    let t = &mut state.tokens;
    if !limited {
        let used = used.unwrap_or(f.est.tokens) as f64;
        state.hl_max = state.hl_max.max(used);
        if t.known() {
            t.advance(now);
        }
        if cleared > state.hl_cut_ms {
            state.hl_used += used;
        } else if state.hl_prev_span > 0.0 {
            state.hl_prev += used;
            t.rate = t.rate.max(HL_CUT * state.hl_prev / state.hl_prev_span);
            t.limit = t.limit.max(t.rate * HL_BURST_MS);
        }
        if t.known() && t.level < t.limit / 2.0 {
            let dt = ((now - state.hl_grow_ms) as f64).clamp(0.0, HL_GROW_MAX_MS);
            let accel = ((now - state.hl_cut_ms) as f64 / HL_ACCEL_MS).clamp(1.0, HL_ACCEL_MAX);
            t.rate *= 1.0 + HL_GROW_PER_MS * accel * dt;
            t.limit = t.limit.max(t.rate * HL_BURST_MS);
        }
        state.hl_grow_ms = now;
        return;
    }
    // Sent at the old rate (a call cleared in the cut's millisecond may have
    // been cleared before it), or nothing answered yet to scale a bucket by.
    if cleared <= state.hl_cut_ms || state.hl_max <= 0.0 {
        return;
    }
    let span = (now - state.hl_since_ms).max(1) as f64;
    let (rate, prev_span) = if t.known() {
        ((HL_CUT * state.hl_used / span).clamp(HL_CUT_MIN * t.rate, HL_CUT * t.rate), 0.0)
    } else {
        let span = span.max(HL_FIRST_SPAN_MS);
        (HL_CUT * state.hl_used / span, span)
    };
    // No slower than the largest call a minute.
    let rate = rate.max(state.hl_max / 60_000.0);
    let limit = (rate * HL_BURST_MS).max(2.0 * state.hl_max);
    if t.known() {
        t.advance(now);
        t.rate = rate;
        t.limit = limit;
        t.level = t.level.min(0.0);
    } else {
        *t = Bucket { limit, rate, level: 0.0, at_ms: now, refill: Refill::Continuous, ..Bucket::default() };
    }
    state.hl_prev = state.hl_used;
    state.hl_prev_span = prev_span;
    state.hl_used = 0.0;
    state.hl_since_ms = now;
    state.hl_cut_ms = now;
    state.hl_grow_ms = now;
}

/// The highest level a refund can have lifted bucket `i` to, for a call
/// cleared at `cleared`. The provider gave the refund when the answer was
/// done, some time after `cleared`, which may be well before the settle that
/// brings it; a bucket full then kept only what fitted. Whatever the moment
/// `s`, the bucket now holds at most its limit, plus the refill since `s`,
/// less what was cleared after `s` (the calls still in flight; a window's
/// since its boundary): the least of that over the moments the calls in
/// flight were cleared.
fn refund_cap(
    b: &Bucket,
    flights: &BTreeMap<String, Flight>,
    i: usize,
    cleared: Millis,
    now: Millis,
    cfg: &PacingConfig,
) -> f64 {
    if !b.known() {
        return f64::INFINITY;
    }
    let ttl = cfg.reservation_ttl_ms as Millis;
    let since = if b.windowed() { cleared.max(b.boundary_ms - cfg.late_ms as Millis) } else { cleared };
    let mut later: Vec<(Millis, f64)> = flights
        .values()
        .map(|f| (f.expiry_ms - ttl, f.held()[i]))
        .filter(|(at, held)| *at > since && *held > 0.0)
        .collect();
    later.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)));
    let rate = b.refill_rate();
    let (mut after, mut cap) = (0.0, b.limit);
    for (at, held) in later {
        after += held;
        cap = cap.min(b.limit + rate * (now - at).max(0) as f64 - after);
    }
    cap
}

/// Feeds an answered call's token headers to the refund learner. Once the
/// share is known, the refunds withheld while it was not are credited at that
/// share as the headers confirm them: never above what these headers allow —
/// what they said remained, the refill since, this call's own refund (given
/// after them), less what was cleared after this call. (Others' refunds may
/// already be in the headers, so they are left out: the bound must not be high.)
fn learn_refund_share(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    flight: Option<Flight>,
    outcome: &CallOutcome,
    headers_at: Millis,
    own_unused: f64,
) {
    let obs = &outcome.tokens;
    let (Some(f), Some(remaining)) = (flight, obs.remaining) else {
        return;
    };
    let limited = outcome.rate_limited_ms.is_some();
    let tokens = &state.tokens;
    // A limit inferred from `remaining` alone (Azure) is a lower bound, and
    // so is its per-minute refill: what the provider refilled beyond it
    // would read as refunds. Such a bucket learns nothing here (and credits
    // no refund: Azure counts each request's estimate when it arrives).
    let Some(limit) = obs.limit.map(|l| l as f64) else {
        return;
    };
    if !tokens.known() || limit != tokens.limit || obs.reset_ms.unwrap_or(0) > cfg.max_pace_ms {
        return;
    }
    let remaining = (remaining as f64).min(limit);
    let newest = headers_at > state.refunds.seen_ms;
    state.refunds.seen_ms = state.refunds.seen_ms.max(headers_at);
    if f.alone {
        // A pair must not span the reset these headers name, unless the
        // bucket is known to refill continuously (the learner sees itself
        // whether it could have filled): past it a window refilled whole.
        let until_ms = match (tokens.refill, obs.reset_ms) {
            (Refill::Continuous, _) | (_, None) => 0,
            (_, Some(reset)) => headers_at + reset as Millis,
        };
        // A refused call was charged nothing: its own charge is not in its headers.
        let sent = if limited { f.sent - f.est.tokens as f64 } else { f.sent };
        let snap = Snapshot { at_ms: headers_at, remaining, sent, refunded: f.mark, until_ms };
        state.refunds.learn(snap, tokens.limit, tokens.refill_rate(), cfg.max_pace_ms);
    }
    if limited {
        return;
    }
    let Some(share) = state.refunds.share(state.tokens.limit) else {
        return;
    };
    // (A share of nought does not drop what was withheld: the first pairs are
    // noisy — one bench run read 0.0, then 0.24, against a provider that gives
    // everything back, and the first wave's refunds, half the bucket, were gone
    // for good. The bound below is what keeps a provider that keeps the charge
    // from being credited.)
    if !newest || state.tokens.withheld <= 0.0 {
        // (Not the newest headers: calls received after them settled
        // already, and the bound below cannot see them.)
        return;
    }
    state.tokens.advance(now);
    let elapsed = (now - headers_at).max(0) as f64;
    // Calls still in flight may have given their refunds already (the
    // provider's level may hold them; the model's will at their settles), and
    // those cleared before this one may have reached the provider after its
    // headers (clearance and receipt are not one instant): neither is in the
    // bound.
    let pending: f64 = state
        .flights
        .values()
        .map(|other| if other.sent < f.sent { other.est.tokens } else { other.est.output } as f64)
        .sum();
    let tokens = &mut state.tokens;
    let theirs = (remaining + share * own_unused + tokens.refill_rate() * elapsed).min(tokens.limit)
        - (tokens.sent - f.sent).max(0.0)
        - pending;
    // What was withheld comes back as far as these headers show it at the
    // provider (the bound, not the share, keeps this safe: a share learned
    // low, or one that is not one, credits no more than the headers allow).
    let owed = tokens.withheld.min((theirs - tokens.level).max(0.0));
    // Not `credit`: these refunds came before the headers that set the
    // provider's reset, so the reset already counts them.
    tokens.level = (tokens.level + owed).min(tokens.limit.max(tokens.level));
    tokens.withheld = (tokens.withheld - owed).max(0.0);
}

fn ensure_configured(state: &mut PacerState, cfg: &PacingConfig, now: Millis) {
    if !state.tokens.known() {
        if let Some(tpm) = cfg.configured_tpm {
            state.tokens = Bucket::per_minute(tpm, now);
        }
    }
    if !state.requests.known() {
        if let Some(rpm) = cfg.configured_rpm {
            state.requests = Bucket::per_minute(rpm, now);
        }
    }
}

fn owed(ms: f64, reason: OwedReason, cfg: &PacingConfig, jitter_u: f64) -> Decision {
    // Owed time is paid in full: round up, then add positive jitter so that
    // waiting turns do not wake as one herd.
    let base = ms.ceil().max(1.0);
    let jitter = (base * cfg.jitter_frac).min(cfg.jitter_max_ms as f64) * jitter_u.clamp(0.0, 1.0);
    Decision::Owed { ms: (base + jitter).ceil() as u64, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_000_000;

    fn ask(id: &str) -> Ask<'_> {
        Ask { id, est: Estimate { tokens: 1_000, requests: 1, output: 200 }, mode: Mode::Work, who: Who::DEFAULT }
    }

    /// Architecture invariant: jitter is only ever added — owed time is paid
    /// in full whatever the draw (even one out of range).
    #[test]
    fn jitter_only_ever_adds_to_owed_time() {
        let cfg = PacingConfig { jitter_frac: 0.5, jitter_max_ms: 10_000, ..PacingConfig::default() };
        for ms in [0.1, 1.0, 249.5, 1_000.0, 86_400_000.0] {
            for u in [-1.0, 0.0, 0.3, 1.0, 7.0] {
                let Decision::Owed { ms: got, .. } = owed(ms, OwedReason::RateLimited, &cfg, u) else {
                    panic!("owed time is owed")
                };
                assert!(got as f64 >= ms.ceil(), "{ms} ms owed, {got} ms waited (u = {u})");
            }
        }
    }

    #[test]
    fn companion_turns_count_in_their_tenants_cap_and_share() {
        let cfg =
            PacingConfig { configured_tpm: Some(60_000), configured_rpm: Some(10_000), ..PacingConfig::default() };
        let mut s = PacerState::default();
        let capped = Who { tenant: "a", weight: 1.0, cap: 0.25 };
        let est = Estimate { tokens: 1_000, requests: 1, output: 200 };
        let live = |id| Ask { id, est, mode: Mode::Companion, who: capped };
        assert_eq!(acquire(&mut s, &cfg, T0, &live("l1"), 0.0), Decision::Clear);
        // The cap (a quarter of 1 000 tokens a second) paid for l1 until T0 + 4 s:
        // a second companion turn of the same tenant waits for it, as a work turn would.
        assert_eq!(
            acquire(&mut s, &cfg, T0 + 1, &live("l2"), 0.0),
            Decision::Owed { ms: 3_999, reason: OwedReason::FairShare }
        );
        let a = s.tenants["a"];
        assert_eq!(a.admitted, 1_000.0, "its tokens count as admitted");
        assert_eq!(a.finish, 1_000.0, "and move its finish tag: its next work turn stands behind them");
    }

    /// Whole waits: a turn deep in line sleeps its whole (pessimistic) wait;
    /// when a turn ahead of it never comes back, the fetch that clears the
    /// next one moves it up to the time it is clear then — and not before:
    /// asked a moment early, it is owed.
    #[test]
    fn a_waiter_whose_turn_ahead_never_came_back_is_pulled_in_to_when_it_is_clear() {
        let cfg = PacingConfig {
            configured_tpm: Some(60_000),
            configured_rpm: Some(100_000),
            jitter_frac: 0.0,
            ..PacingConfig::default()
        };
        assert!(cfg.whole_waits);
        let mut s = PacerState::default();
        let big = |id| Ask { id, est: Estimate { tokens: 10_000, requests: 1, output: 0 }, ..ask(id) };
        for id in ["c1", "c2", "c3", "c4", "c5"] {
            assert_eq!(acquire(&mut s, &cfg, T0, &big(id), 0.0), Decision::Clear, "{id}");
        }
        // 10 000 left, 1 token a ms, 10 000 a turn above a 3 000 floor: `a`
        // owes 3 000 ms; `b` 13 000, `c` 23 000 — each back no later than the
        // turn ahead of it is predicted clear, + late_ms.
        let owed = |s: &mut PacerState, id| match acquire(s, &cfg, T0, &big(id), 0.0) {
            Decision::Owed { ms, .. } => ms,
            Decision::Clear => panic!("{id} is clear"),
        };
        assert_eq!([owed(&mut s, "a"), owed(&mut s, "b"), owed(&mut s, "c")], [3_000, 4_000, 14_000]);
        assert_eq!(pull_in(&mut s, &cfg, T0 + 10, 4), vec![], "nothing changed: nobody is moved");
        // `a` never comes back: `b`, back when `a` is late, goes; `c`, which
        // counted `a`, is moved up from 14 000 to when it is clear now.
        let now = T0 + 3_000 + cfg.late_ms as Millis + 1;
        assert_eq!(acquire(&mut s, &cfg, now, &big("b"), 0.0), Decision::Clear);
        let due = now + 8_999 + PULL_IN_PAD_MS;
        assert_eq!(pull_in(&mut s, &cfg, now, 4), vec![("c".to_owned(), due)]);
        assert!(matches!(acquire(&mut s, &cfg, due - 1, &big("c"), 0.0), Decision::Owed { ms: 1, .. }));
        assert_eq!(acquire(&mut s, &cfg, due, &big("c"), 0.0), Decision::Clear);
        // Without whole waits there are no pull-ins.
        let old = PacingConfig { whole_waits: false, ..cfg };
        assert_eq!(pull_in(&mut PacerState::default(), &old, now, 4), vec![]);
    }

    /// A continuous bucket's wait for more than it is missing (a line deeper
    /// than a bucket) runs past its reset at the refill rate.
    #[test]
    fn a_deep_lines_wait_runs_past_the_reset() {
        let b = Bucket {
            limit: 10_000.0,
            rate: 1.0,
            level: 1_000.0,
            at_ms: T0,
            full_at_ms: T0 + 9_000,
            refill: Refill::Continuous,
            ..Bucket::default()
        };
        assert_eq!(b.refill_ms(T0, 5_000.0, true), 5_000.0, "within the bucket: the refill");
        assert_eq!(b.refill_ms(T0, 15_000.0, true), 15_000.0, "the reset, then 6 000 more at the rate");
        assert_eq!(b.refill_ms(T0, 15_000.0, false), 9_000.0, "not deep: capped at the reset");
    }

    #[test]
    fn a_provider_without_headers_is_probed_once_then_not_paced() {
        let (mut s, cfg) = (PacerState::default(), PacingConfig::default());
        assert_eq!(acquire(&mut s, &cfg, T0, &ask("a"), 0.0), Decision::Clear, "the probe");
        assert!(matches!(acquire(&mut s, &cfg, T0, &ask("b"), 0.0), Decision::Owed { reason: OwedReason::Probe, .. }));
        settle(&mut s, &cfg, T0 + 300, "a", &CallOutcome { used_tokens: Some(900), ..CallOutcome::default() });
        for id in ["b", "c", "d"] {
            assert_eq!(acquire(&mut s, &cfg, T0 + 300, &ask(id), 0.0), Decision::Clear, "{id}");
        }
        // Headers, once they come, bring the pacing back.
        let headers = Observation { limit: Some(10_000), remaining: Some(0), reset_ms: Some(60_000) };
        settle(&mut s, &cfg, T0 + 400, "b", &CallOutcome { tokens: headers, ..CallOutcome::default() });
        assert!(!s.headerless);
        assert!(matches!(acquire(&mut s, &cfg, T0 + 400, &ask("e"), 0.0), Decision::Owed { .. }));
    }
}
