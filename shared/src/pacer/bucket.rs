//! The proactive model of the provider's token bucket: owed time from a snapshot.
//!
//! OpenAI's buckets refill continuously: `x-ratelimit-reset-tokens` is the time
//! until the bucket is *full* again, so the refill rate is
//! `(limit - remaining) / reset`, and a call that needs `n` tokens waits only
//! until `n` (plus the floor) have returned — not until the bucket is full, and
//! never less.
//!
//! The model keeps, per bucket (tokens and requests), a *level*: what the
//! provider's bucket holds minus what we have promised and not yet seen charged.
//! Every acquire deducts its estimate at once — also when the answer is "owed":
//! the owed turn has *booked* the budget that returns during its wait, so the
//! next waiter is owed the time after it, and waiters leave in order instead of
//! waking as one herd to find the same scarce budget. The level may go below zero
//! while turns are booked; it rises with the refill rate and never above the limit.
//!
//! Header snapshots only ever *lower* the level (min of ours and theirs): headers
//! lag the calls still in flight, so a snapshot that shows more than we think is
//! stale, while one that shows less tells us of spending we did not see (another
//! account user, a provider-side estimate).
//!
//! This file is the policy; `scripts.lua` is the same model as atomic Redis
//! scripts for the shared pacer, and `local.rs` runs this one in-process. The
//! differential test in `tests/integration/pacer.rs` drives both with the same
//! operations and checks they agree.

use crate::clock::Millis;
use serde::{Deserialize, Serialize};

/// Who is asking: a live listener (companion) draws the budget lower than
/// background work, so a live turn finds room while work waits.
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

/// The pacing knobs (SPEC §4). All durations in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct PacingConfig {
    /// Headroom work turns leave in the bucket, as a fraction of the limit.
    pub floor_work: f64,
    /// Headroom companion turns leave (smaller: a live turn draws lower).
    pub floor_companion: f64,
    /// A reset further out than this describes something else (a daily cap,
    /// clock skew): we do not pace on it and let the reactive layer carry the call.
    pub max_pace_ms: u64,
    /// Positive jitter added to owed time, as a fraction of it …
    pub jitter_frac: f64,
    /// … and never more than this.
    pub jitter_max_ms: u64,
    /// A reservation not settled within this is dropped (its worker crashed).
    pub reservation_ttl_ms: u64,
    /// A booking (or a place in a tenant's line) not claimed this long after
    /// its due time lapses and gives its budget back. The local baseline keeps
    /// this short: its turns come back to other processes, where its bookings
    /// mean nothing.
    pub booking_grace_ms: u64,
    /// With no headers yet, one probe call goes first; the others wait this long
    /// (or until the probe's headers arrive) before asking again.
    pub probe_wait_ms: u64,
    /// Fair admission: a work turn whose tenant's line puts it further out
    /// than this is not booked on the bucket's line yet; it waits in its
    /// tenant's line and comes back when it is closer.
    pub fair_horizon_ms: u64,
    /// Configured limits for providers that send no headers (vLLM, Ollama).
    pub configured_tpm: Option<u64>,
    /// See `configured_tpm`.
    pub configured_rpm: Option<u64>,
}

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
            probe_wait_ms: 100,
            fair_horizon_ms: 2_000,
            configured_tpm: None,
            configured_rpm: None,
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
    /// The input part and the output reservation, as the usage ratio sees them.
    fn split(&self) -> (f64, f64) {
        let output = if self.output > 0 { self.output.min(self.tokens) } else { self.tokens };
        ((self.tokens - output) as f64, output as f64)
    }
}

/// One bucket's view in a header snapshot: limit, remaining, time to full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Observation {
    /// `x-ratelimit-limit-*`.
    pub limit: Option<u64>,
    /// `x-ratelimit-remaining-*`.
    pub remaining: Option<u64>,
    /// `x-ratelimit-reset-*`, in ms from when the headers were sent.
    pub reset_ms: Option<u64>,
}

/// One bucket of the model (tokens or requests).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Bucket {
    /// Capacity; 0 means unknown (no pacing on this bucket).
    pub limit: f64,
    /// Refill, per millisecond.
    pub rate: f64,
    /// Level at `at_ms` (may be negative while turns are booked).
    pub level: f64,
    /// When `level` was computed (Redis server clock).
    pub at_ms: Millis,
    /// Booked by owed turns that have not yet come back.
    pub booked: f64,
    /// The part of `booked` held by companion (live) turns: work turns leave it
    /// alone, so a live turn's booking is never taken by background work.
    #[serde(default)]
    pub booked_live: f64,
    /// Every refund given back so far (cumulative). A call notes it when it is
    /// sent; at its settle, what others gave back since is credited to the
    /// headers it brought, which could not show those refunds yet.
    #[serde(default)]
    pub refunded: f64,
    /// When the provider said the bucket is full again (its reset), or 0.
    #[serde(default)]
    pub full_at_ms: Millis,
    /// Net tokens charged by calls sent since the last headers (those the
    /// reset cannot know of): at the reset the bucket holds the limit less these.
    #[serde(default)]
    pub charged_since: f64,
    /// The rate comes from the headers' readings (not the per-minute default).
    #[serde(default)]
    pub rated: bool,
    /// When the headers that set `full_at_ms` were sent: older headers (a
    /// call admitted earlier that settles later) do not move it back.
    #[serde(default)]
    pub full_seen_ms: Millis,
    /// Reserved by calls in flight (cleared, not yet settled).
    pub in_flight: f64,
}

impl Bucket {
    /// A full bucket of `limit` per minute.
    pub fn per_minute(limit: u64, now: Millis) -> Self {
        Self {
            limit: limit as f64,
            rate: limit as f64 / 60_000.0,
            level: limit as f64,
            at_ms: now,
            ..Self::default()
        }
    }

    /// Whether we know this bucket's limit (and so pace on it).
    pub fn known(&self) -> bool {
        self.limit > 0.0 && self.rate > 0.0
    }

    /// The level at `now`: refilled since `at_ms`, never above the limit.
    pub fn level_at(&self, now: Millis) -> f64 {
        let elapsed = (now - self.at_ms).max(0) as f64;
        (self.level + self.rate * elapsed).min(self.limit)
    }

    fn advance(&mut self, now: Millis) {
        if now > self.at_ms {
            self.level = self.level_at(now);
            self.at_ms = now;
        }
    }

    /// Milliseconds until the level reaches `need` (0 if it is there), and
    /// never past the moment the provider said the bucket is full again.
    fn ms_until(&self, now: Millis, need: f64) -> f64 {
        self.refill_ms(now, need - self.level_at(now))
    }

    /// Milliseconds until `short` tokens have returned, never past the reset.
    fn refill_ms(&self, now: Millis, short: f64) -> f64 {
        if short <= 0.0 {
            0.0
        } else if self.full_at_ms > now {
            (short / self.rate).min((self.full_at_ms - now) as f64)
        } else {
            short / self.rate
        }
    }

    /// At the provider's reset the bucket is full again, but for what was sent
    /// since (and what is booked): the level is lifted to that. (A window bucket
    /// refills at once at its boundary, which the continuous refill rate,
    /// estimated mid-window, cannot foresee.)
    fn lift(&mut self, now: Millis) {
        if self.full_at_ms > 0 && now >= self.full_at_ms {
            self.advance(now);
            self.level = self.level.max(self.limit - self.charged_since - self.booked);
            self.full_at_ms = 0;
        }
    }

    /// What a call of `cost` needs in the bucket before it may go: the cost plus
    /// the floor, but never more than a full bucket (a call larger than the floor
    /// allows waits for a full bucket; one larger than the limit is sent when the
    /// bucket is full and the provider's "request too large" answers it).
    fn need(&self, cost: f64, floor: f64) -> f64 {
        (cost + floor * self.limit).min(self.limit)
    }

    /// Takes a header observation into the model. Only ever lowers the level.
    /// `refund` is what the observed call gave back after its headers were sent
    /// (the unused part of its reservation), which the headers cannot show yet.
    fn observe(&mut self, obs: &Observation, now: Millis, headers_at: Millis, refund: f64, max_pace_ms: u64) {
        let (Some(limit), Some(remaining)) = (obs.limit, obs.remaining) else {
            return;
        };
        if limit == 0 {
            return;
        }
        let reset_ms = obs.reset_ms.unwrap_or(0);
        if reset_ms > max_pace_ms {
            // A far-away reset is a daily cap or clock skew: not ours to pace on.
            return;
        }
        let limit = limit as f64;
        let remaining = (remaining as f64).min(limit);
        let missing = limit - remaining;
        // OpenAI's reset is the time until full: it gives the refill rate, when
        // enough is missing for it to say something (just after a window
        // bucket's boundary, a little missing and a long reset would make the
        // rate look many times slower than it is).
        if reset_ms >= 20 && missing >= limit * 0.1 {
            self.rate = missing / reset_ms as f64;
            self.rated = true;
        } else if reset_ms >= 20 && missing >= limit * 0.005 && (!self.rated || missing / reset_ms as f64 > self.rate) {
            // A lightly used bucket says little, but never that the refill is
            // slower than it is: such a reading may only raise the rate (a
            // per-minute default is far too slow for a scaled-down window).
            self.rate = missing / reset_ms as f64;
            self.rated = true;
        } else if self.rate <= 0.0 || (self.limit - limit).abs() > f64::EPSILON {
            self.rate = limit / 60_000.0;
        }
        if !self.known() || self.limit != limit {
            if self.limit <= 0.0 {
                self.level = limit;
                self.at_ms = now;
            }
            self.limit = limit;
        }
        self.advance(now);
        // What the provider holds now, less what is booked (surely not yet charged).
        let elapsed = (now - headers_at).max(0) as f64;
        let theirs = (remaining + refund + self.rate * elapsed).min(limit) - self.booked;
        if theirs < self.level {
            self.level = theirs;
        }
        if obs.reset_ms.is_some() && headers_at >= self.full_seen_ms {
            self.full_seen_ms = headers_at;
            self.full_at_ms = headers_at + reset_ms as Millis;
            // The calls still in flight may not be in these headers yet.
            self.charged_since = self.in_flight;
        }
    }
}

/// The whole pacer state for one budget and model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PacerState {
    /// The token bucket.
    pub tokens: Bucket,
    /// The request bucket.
    pub requests: Bucket,
    /// A 429 closed the window until then: nothing is admitted before.
    pub blocked_until_ms: Millis,
    /// With nothing known yet, a probe call is out until then.
    pub probe_until_ms: Millis,
    /// When headers were last read.
    pub observed_at_ms: Millis,
    /// The latest due time of any booking made (stale once past: harmless).
    pub last_due_ms: Millis,
    /// Output tokens used / output tokens reserved, averaged over settled
    /// calls (0 = not yet known, read as 1). Bookings are spaced by the
    /// expected use — the input plus this share of the output reservation —
    /// not by the reservation: a call reserves its whole `max_output_tokens`
    /// but usually gives most of it back, and a line spaced by reservations
    /// would leave the refunds idle in the bucket until the end of the line.
    /// (One ratio over the whole estimate would under-book calls with long
    /// inputs and over-book short ones, tilting tenants' shares.)
    pub usage_ratio: f64,
    /// Fair admission's system virtual time: the least virtual time among the
    /// waiting tenants at each admission (never moving back). A tenant that
    /// comes back from idle starts here.
    #[serde(default)]
    pub fair_time: f64,
    /// Each tenant's line (fair admission of work turns).
    #[serde(default)]
    pub tenants: std::collections::BTreeMap<String, TenantLine>,
}

/// Who asks: the tenant, its weight and its optional cap (SPEC §4, fair admission).
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

/// One tenant's line, in line tokens (expected use). Turns join at `next`
/// and are admitted to the bucket's line in order; `next - served` is what is
/// waiting in the tenant's line. While several tenants have turns waiting, a
/// tenant's line moves at its weighted share of the refill — start-time fair
/// queuing, kept in the pacer's state so it holds across every worker.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TenantLine {
    /// Where the next turn joins (cumulative line tokens registered).
    pub next: f64,
    /// Line tokens admitted so far (or given up by turns that never came back).
    pub served: f64,
    /// The tenant's weight, as last seen.
    pub weight: f64,
    /// With a cap: when the tenant's admitted use is paid at its capped rate.
    pub cap_due_ms: Millis,
    /// Tokens admitted (line cost), for `GET /v1/pacer` and `/metrics`.
    pub admitted: f64,
    /// Times a turn of this tenant waited in its line.
    pub waits: f64,
    /// The tenant's virtual time: line tokens admitted over its weight, lifted
    /// to the system's (`PacerState::fair_time`) when it comes back from idle
    /// (so idleness earns no credit). While tenants have turns waiting, none is admitted further
    /// than a quarter horizon of virtual time ahead of the furthest behind, so their
    /// admitted tokens keep the ratio of their weights over any long window.
    #[serde(default)]
    pub tag: f64,
}

impl TenantLine {
    /// What is waiting in this tenant's line.
    pub fn waiting(&self) -> f64 {
        (self.next - self.served).max(0.0)
    }
}

impl PacerState {
    /// The other tenants with turns waiting: their weights summed and the
    /// least virtual time among them (`None`: no one else waits).
    fn others_waiting(&self, tenant: &str) -> (f64, Option<f64>) {
        self.tenants
            .iter()
            .filter(|(name, line)| name.as_str() != tenant && line.waiting() > 0.5)
            .fold((0.0, None), |(weights, least), (_, line)| {
                (weights + line.weight, Some(least.map_or(line.tag, |v: f64| v.min(line.tag))))
            })
    }

    /// What a booking holds on the line: the expected use of the call (its
    /// request count in full).
    pub fn booking_cost(&self, est: Estimate) -> Estimate {
        let ratio = if self.usage_ratio > 0.0 { self.usage_ratio.clamp(0.05, 1.0) } else { 1.0 };
        let (input, output) = est.split();
        Estimate { tokens: (input + output * ratio).ceil() as u64, requests: est.requests, output: 0 }
    }
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
    /// The budget is scarce and other tenants' turns go first (their share).
    FairShare,
}

/// The pacer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send now; the estimate is reserved.
    Clear,
    /// Come back after `ms`; the estimate is booked for then (unless `booked`
    /// is false: then ask again from scratch).
    Owed {
        /// Milliseconds owed, jitter included.
        ms: u64,
        /// Why.
        reason: OwedReason,
        /// Whether budget was booked for the owed turn (present the booking when
        /// coming back; it is then clear at once).
        booked: bool,
        /// The turn waits in its tenant's line at this position (come back with
        /// the same reservation id: the position is kept).
        waiting: Option<u64>,
    },
}

/// Asks for `est` at `now`. `jitter_u` is a uniform number in [0, 1) from the
/// caller (Redis scripts must be deterministic, so randomness comes from outside).
pub fn acquire(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    est: Estimate,
    mode: Mode,
    who: &Who<'_>,
    waiting: Option<u64>,
    jitter_u: f64,
) -> Decision {
    ensure_configured(state, cfg, now);
    let floor = cfg.floor(mode);
    // A turn back from its tenant's line keeps its place while it waits for
    // something else (a closed window, a probe).
    let keep_place = |d: Decision| match d {
        Decision::Owed { ms, reason, booked, .. } => Decision::Owed { ms, reason, booked, waiting },
        clear => clear,
    };
    if now < state.blocked_until_ms {
        let ms = (state.blocked_until_ms - now) as f64;
        return keep_place(owed(ms, OwedReason::RateLimited, false, cfg, jitter_u));
    }
    if !state.tokens.known() && !state.requests.known() {
        // Nothing known: let one probe call go and learn the headers from it.
        if now < state.probe_until_ms {
            let ms = (state.probe_until_ms - now).min(cfg.probe_wait_ms as i64) as f64;
            return keep_place(owed(ms, OwedReason::Probe, false, cfg, jitter_u));
        }
        state.probe_until_ms = now + cfg.probe_wait_ms as i64 * 10;
        return Decision::Clear;
    }
    state.tokens.lift(now);
    state.requests.lift(now);
    let tokens = est.tokens as f64;
    let requests = est.requests as f64;
    // Fair admission (work turns): the tenant's line first. A turn with more of
    // its tenant's line ahead than the horizon waits there (not on the
    // bucket's line, so a change of shares re-times it when it comes back);
    // otherwise it is admitted no earlier than its share allows.
    let mut share_wait: f64 = 0.0;
    if mode == Mode::Work && state.tokens.known() {
        let lc = state.booking_cost(est).tokens as f64;
        let (others_weight, others_least) = state.others_waiting(who.tenant);
        let weight = who.weight.max(0.001);
        // Virtual time runs at the refill over the waiting tenants' weights
        // (itself included); the tenant's share of the refill is its weight's
        // worth of it, never above its cap.
        let pace = state.tokens.rate / (weight + others_weight);
        let mut rate = pace * weight;
        if who.cap > 0.0 {
            rate = rate.min(state.tokens.rate * who.cap);
        }
        let system_time = state.fair_time;
        let line = state.tenants.entry(who.tenant.to_owned()).or_default();
        line.weight = who.weight;
        if waiting.is_none() && line.waiting() <= 0.5 {
            // Back from idle: no credit for the time away (and no debt for
            // what it used while the others could not).
            line.tag = line.tag.max(system_time);
        }
        let position = waiting.map(|p| p as f64).unwrap_or(line.next + lc);
        let ahead = (position - lc - line.served).max(0.0);
        let horizon = cfg.fair_horizon_ms as f64;
        // A tenant more than a quarter horizon of virtual time ahead of the
        // furthest behind lets the others catch up (start-time fair queuing,
        // with the slack that lets turns come back on timers without idling
        // the bucket).
        let lead = others_least.map_or(0.0, |least| line.tag - least - horizon * pace / 4.0);
        if ahead / rate > horizon || lead > 0.0 {
            if waiting.is_none() {
                line.next = position;
                line.waits += 1.0;
            }
            let reason = if others_least.is_some() { OwedReason::FairShare } else { OwedReason::Budget };
            let mut ms = if ahead / rate > horizon { ahead / rate - horizon / 2.0 } else { 0.0 };
            if lead > 0.0 {
                ms = ms.max(lead / pace).max(horizon / 16.0);
            }
            return match owed(ms, reason, false, cfg, jitter_u) {
                Decision::Owed { ms, reason, booked, .. } => {
                    Decision::Owed { ms, reason, booked, waiting: Some(position.round() as u64) }
                }
                clear => clear,
            };
        }
        let start = line.tag;
        line.tag += lc / weight;
        if waiting.is_none() {
            line.next = position;
        }
        // `served` moves when the turn is sent (clear now, or its booking
        // claimed), so the tenant's booked turns count as ahead of its next:
        // each tenant keeps at most its share of the horizon on the bucket's
        // line, and the line interleaves them. Within the horizon the bucket
        // decides (so refunds are used at once); a cap is a rate of its own.
        if who.cap > 0.0 {
            share_wait = (line.cap_due_ms - now) as f64;
        }
        state.fair_time = state.fair_time.max(others_least.map_or(start, |least| least.min(start)));
    }
    // Clear now only if the call fits both now (the bucket holds it, booked
    // budget included) and at the last booking's due time (so taking it now
    // delays no turn that is already booked). The second condition is what lets
    // refunds that arrive while turns are booked be used at once, instead of
    // sitting in the bucket until the end of the booking line.
    //
    // Live turns first: a companion turn ignores the work turns' line (they are
    // booked but not yet sent: it may go before them, and their claim will find
    // out) and draws the bucket down to its lower floor; only other live
    // bookings are ahead of it.
    let live = mode == Mode::Companion;
    let horizon = state.last_due_ms.max(now);
    let line = state.booking_cost(est);
    let mut fits = true;
    let mut wait: f64 = 0.0;
    for (bucket, cost, line_cost) in [
        (&mut state.tokens, tokens, line.tokens as f64),
        (&mut state.requests, requests, line.requests as f64),
    ] {
        if bucket.known() {
            bucket.advance(now);
            let need = bucket.need(cost, floor);
            let present = bucket.level + bucket.booked - bucket.booked_live;
            if live {
                fits &= present >= need;
                wait = wait.max(bucket.refill_ms(now, bucket.need(line_cost, floor) - present));
            } else {
                fits &= bucket.level_at(horizon) >= need && present >= need;
                wait = wait.max(bucket.ms_until(now, bucket.need(line_cost, floor)));
            }
        }
    }
    if fits && share_wait <= 0.0 {
        wait = 0.0;
    } else {
        wait = wait.max(share_wait).max(1.0);
    }
    if mode == Mode::Work && who.cap > 0.0 && state.tokens.known() {
        let lc = state.booking_cost(est).tokens as f64;
        let capped = state.tokens.rate * who.cap;
        if let Some(line) = state.tenants.get_mut(who.tenant) {
            let start = now + wait.ceil() as Millis;
            line.cap_due_ms = line.cap_due_ms.max(start) + (lc / capped).ceil() as Millis;
        }
    }
    let line = state.booking_cost(est);
    for (bucket, cost, line_cost) in [
        (&mut state.tokens, tokens, line.tokens as f64),
        (&mut state.requests, requests, line.requests as f64),
    ] {
        if bucket.known() {
            if wait > 0.0 {
                bucket.level -= line_cost;
                bucket.booked += line_cost;
                if live {
                    bucket.booked_live += line_cost;
                }
            } else {
                bucket.level -= cost;
                bucket.in_flight += cost;
                bucket.charged_since += cost;
            }
        }
    }
    if wait <= 0.0 {
        if mode == Mode::Work {
            serve(state, who.tenant, line.tokens as f64);
        }
        Decision::Clear
    } else {
        let decision = owed(wait, OwedReason::Budget, true, cfg, jitter_u);
        if let (Decision::Owed { ms, .. }, false) = (decision, live) {
            state.last_due_ms = state.last_due_ms.max(now + ms as Millis);
        }
        decision
    }
}

/// A booked turn came back at its due time holding `held` on the line. It is
/// clear if the bucket (booked budget included) now holds its whole
/// reservation above the floor; its budget then moves from booked to in flight.
/// Otherwise it is owed the time until it does, and keeps its booking.
pub fn claim(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    est: Estimate,
    held: Estimate,
    mode: Mode,
    tenant: Option<&str>,
    jitter_u: f64,
) -> Decision {
    let floor = cfg.floor(mode);
    let live = mode == Mode::Companion;
    state.tokens.lift(now);
    state.requests.lift(now);
    let mut short: f64 = 0.0;
    for (bucket, cost, line_cost) in [
        (&mut state.tokens, est.tokens, held.tokens as f64),
        (&mut state.requests, est.requests, held.requests as f64),
    ] {
        if bucket.known() {
            bucket.advance(now);
            let need = bucket.need(cost as f64, floor);
            // What is there for this turn: live bookings are ahead of work
            // turns (a live turn's own booking is its own).
            let own = if live { line_cost } else { 0.0 };
            let truth = bucket.level + bucket.booked - bucket.booked_live + own;
            if truth < need {
                short = short.max(bucket.refill_ms(now, need - truth));
            }
        }
    }
    if short > 0.0 {
        return owed(short, OwedReason::Budget, true, cfg, jitter_u);
    }
    for (bucket, cost, line_cost) in [
        (&mut state.tokens, est.tokens as f64, held.tokens as f64),
        (&mut state.requests, est.requests as f64, held.requests as f64),
    ] {
        if bucket.known() {
            bucket.booked = (bucket.booked - line_cost).max(0.0);
            if live {
                bucket.booked_live = (bucket.booked_live - line_cost).max(0.0);
            }
            bucket.in_flight += cost;
            bucket.charged_since += cost;
            bucket.level -= cost - line_cost;
        }
    }
    if let Some(tenant) = tenant {
        serve(state, tenant, held.tokens as f64);
    }
    Decision::Clear
}

/// A work turn of `tenant` is sent (or gives up its place): its tenant's line moves.
fn serve(state: &mut PacerState, tenant: &str, line_tokens: f64) {
    if let Some(line) = state.tenants.get_mut(tenant) {
        line.served += line_tokens;
        line.admitted += line_tokens;
    }
}

/// A booking expired without its turn coming back (cancelled, crashed): the
/// budget it held returns to the level.
pub fn release_booking(state: &mut PacerState, est: Estimate, live: bool, tenant: Option<&str>, now: Millis) {
    if let Some(tenant) = tenant {
        release_waiting(state, tenant, est.tokens as f64);
    }
    for (bucket, cost) in [(&mut state.tokens, est.tokens), (&mut state.requests, est.requests)] {
        if bucket.known() {
            bucket.advance(now);
            let cost = (cost as f64).min(bucket.booked);
            bucket.booked -= cost;
            if live {
                bucket.booked_live = (bucket.booked_live - cost).max(0.0);
            }
            bucket.level = (bucket.level + cost).min(bucket.limit);
        }
    }
}

/// A turn waiting in its tenant's line never came back (cancelled, crashed):
/// its place is given up, so the turns behind it do not wait for a ghost.
pub fn release_waiting(state: &mut PacerState, tenant: &str, line_tokens: f64) {
    if let Some(line) = state.tenants.get_mut(tenant) {
        line.served += line_tokens;
    }
}

/// A reservation in flight expired unsettled (its worker died): we cannot know
/// whether the call was sent, so the tokens stay spent and return by refill.
pub fn drop_in_flight(state: &mut PacerState, est: Estimate) {
    for (bucket, cost) in [(&mut state.tokens, est.tokens), (&mut state.requests, est.requests)] {
        bucket.in_flight = (bucket.in_flight - cost as f64).max(0.0);
    }
}

/// What a finished call reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Outcome {
    /// The reservation it held (zero when it held none, e.g. pacing was off).
    pub reserved: Estimate,
    /// Tokens the provider reported as used; `None` when unknown (the
    /// reservation then stands as the charge).
    pub used_tokens: Option<u64>,
    /// The call was refused with a 429: nothing of it was charged, and the
    /// window is closed for `rate_limited_ms`.
    pub rate_limited_ms: Option<u64>,
    /// Token bucket headers.
    pub tokens: Observation,
    /// Request bucket headers.
    pub requests: Observation,
    /// How long ago (ms) the headers were received.
    pub headers_age_ms: u64,
    /// `refunded` of the token bucket when the call was sent (see `Bucket::refunded`).
    pub refund_mark: Option<f64>,
}

/// Settles a finished call: refunds what it reserved beyond what it used, then
/// lowers the model to the headers (never raises it), and on a 429 closes the
/// window for every worker.
pub fn settle(state: &mut PacerState, cfg: &PacingConfig, now: Millis, outcome: &Outcome) {
    ensure_configured(state, cfg, now);
    let refunded_tokens = match (outcome.rate_limited_ms, outcome.used_tokens) {
        (Some(_), _) => outcome.reserved.tokens,
        (None, Some(used)) => outcome.reserved.tokens.saturating_sub(used),
        (None, None) => 0,
    };
    let refunded_requests = if outcome.rate_limited_ms.is_some() { outcome.reserved.requests } else { 0 };
    if let (None, Some(used)) = (outcome.rate_limited_ms, outcome.used_tokens) {
        let (input, output) = outcome.reserved.split();
        if output > 0.0 {
            let seen = ((used as f64 - input) / output).clamp(0.0, 1.0);
            let prior = if state.usage_ratio > 0.0 { state.usage_ratio } else { 1.0 };
            state.usage_ratio = 0.8 * prior + 0.2 * seen;
        }
    }
    // What others gave back since this call was sent: its headers cannot show it.
    let others_refunds = outcome.refund_mark.map(|m| (state.tokens.refunded - m).max(0.0)).unwrap_or(0.0);
    for (bucket, reserved, refund) in [
        (&mut state.tokens, outcome.reserved.tokens, refunded_tokens),
        (&mut state.requests, outcome.reserved.requests, refunded_requests),
    ] {
        bucket.advance(now);
        bucket.in_flight = (bucket.in_flight - reserved as f64).max(0.0);
        bucket.level = (bucket.level + refund as f64).min(bucket.limit.max(bucket.level));
        bucket.refunded += refund as f64;
        bucket.charged_since = (bucket.charged_since - refund as f64).max(0.0);
    }
    let headers_at = now - outcome.headers_age_ms as i64;
    let had_headers = outcome.tokens.remaining.is_some() || outcome.requests.remaining.is_some();
    let credit = refunded_tokens as f64 + others_refunds;
    state.tokens.observe(&outcome.tokens, now, headers_at, credit, cfg.max_pace_ms);
    state.requests.observe(&outcome.requests, now, headers_at, refunded_requests as f64, cfg.max_pace_ms);
    if had_headers {
        state.observed_at_ms = now;
        state.probe_until_ms = 0;
    }
    if let Some(ms) = outcome.rate_limited_ms {
        // The provider says the window is closed for `ms`, for everyone. What
        // is left after it is what the 429's headers say; without headers,
        // remaining = 0.
        state.blocked_until_ms = state.blocked_until_ms.max(headers_at + ms as i64);
        for (bucket, obs) in [(&mut state.tokens, &outcome.tokens), (&mut state.requests, &outcome.requests)] {
            if bucket.known() && obs.remaining.is_none() {
                bucket.level = bucket.level.min(-bucket.booked);
            }
        }
    }
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

fn owed(ms: f64, reason: OwedReason, booked: bool, cfg: &PacingConfig, jitter_u: f64) -> Decision {
    // Owed time is paid in full: round up, then add positive jitter so that
    // waiting turns do not wake as one herd.
    let base = ms.ceil().max(1.0);
    let jitter = (base * cfg.jitter_frac).min(cfg.jitter_max_ms as f64) * jitter_u.clamp(0.0, 1.0);
    Decision::Owed { ms: (base + jitter).ceil() as u64, reason, booked, waiting: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_000_000;

    #[test]
    fn a_modes_name_is_its_serde_name() {
        for mode in [Mode::Work, Mode::Companion] {
            assert_eq!(serde_json::to_value(mode).unwrap(), mode.as_str());
            assert_eq!(Mode::parse(mode.as_str()), Some(mode));
        }
        assert_eq!(Mode::parse("Work"), None);
    }

    /// The mechanics with round figures: a 10 % work floor.
    fn cfg() -> PacingConfig {
        PacingConfig { jitter_frac: 0.0, floor_work: 0.10, ..PacingConfig::default() }
    }

    fn est(tokens: u64) -> Estimate {
        Estimate { tokens, requests: 1, output: 0 }
    }

    fn obs(limit: u64, remaining: u64, reset_ms: u64) -> Observation {
        Observation { limit: Some(limit), remaining: Some(remaining), reset_ms: Some(reset_ms) }
    }

    /// A state that has seen one set of headers: 60 000 TPM, `remaining` left.
    fn seen(remaining: u64) -> PacerState {
        let mut s = PacerState::default();
        let reset = ((60_000 - remaining) as f64 / 1.0).ceil() as u64; // 1 token/ms
        settle(&mut s, &cfg(), T0, &Outcome { tokens: obs(60_000, remaining, reset), ..Outcome::default() });
        s
    }

    #[test]
    fn with_nothing_known_one_probe_goes_and_the_rest_wait_briefly() {
        let mut s = PacerState::default();
        assert_eq!(acquire(&mut s, &cfg(), T0, est(100), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        match acquire(&mut s, &cfg(), T0 + 1, est(100), Mode::Work, &Who::DEFAULT, None, 0.0) {
            Decision::Owed { ms, reason: OwedReason::Probe, booked: false, .. } => assert!(ms <= 100),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn configured_limits_pace_without_headers() {
        let c = PacingConfig { configured_tpm: Some(6_000), ..cfg() };
        let mut s = PacerState::default();
        // 6 000 per minute = 0.1 token/ms; floor 10 % = 600.
        assert_eq!(acquire(&mut s, &c, T0, est(5_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        match acquire(&mut s, &c, T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0) {
            // level 1 000, needs 1 000 + 600: 600 short at 0.1/ms = 6 000 ms.
            Decision::Owed { ms, reason: OwedReason::Budget, booked: true, .. } => assert_eq!(ms, 6_000),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_rate_comes_from_the_reset_header_of_a_continuous_bucket() {
        let s = seen(30_000); // 30 000 missing, full in 30 000 ms: 1 token/ms
        assert!((s.tokens.rate - 1.0).abs() < 1e-9);
        assert_eq!(s.tokens.level_at(T0), 30_000.0);
        assert_eq!(s.tokens.level_at(T0 + 10_000), 40_000.0);
        assert_eq!(s.tokens.level_at(T0 + 1_000_000), 60_000.0, "never above the limit");
    }

    #[test]
    fn owed_is_until_enough_returns_not_until_full_and_never_earlier() {
        let mut s = seen(10_000);
        // needs 20 000 + 6 000 floor = 26 000; has 10 000; 1 token/ms -> 16 000 ms.
        match acquire(&mut s, &cfg(), T0, est(20_000), Mode::Work, &Who::DEFAULT, None, 0.0) {
            Decision::Owed { ms, .. } => assert_eq!(ms, 16_000),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn companion_turns_draw_the_budget_lower_than_work_turns() {
        let mut work = seen(7_000);
        let mut live = work.clone();
        // 7 000 left: work needs 1 000 + 6 000 floor (ok, exactly); then 6 000 left.
        assert_eq!(acquire(&mut work, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        assert!(matches!(acquire(&mut work, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Owed { .. }));
        assert_eq!(acquire(&mut live, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        // The companion floor is 2 % = 1 200: 6 000 left covers 1 000 + 1 200.
        assert_eq!(acquire(&mut live, &cfg(), T0, est(1_000), Mode::Companion, &Who::DEFAULT, None, 0.0), Decision::Clear);
    }

    #[test]
    fn waiters_book_in_order_instead_of_waking_as_a_herd() {
        let mut s = seen(6_000); // at the floor exactly
        let mut dues = vec![];
        // (A long fair horizon: every turn is booked on the bucket's line.)
        let c = PacingConfig { fair_horizon_ms: 60_000, ..cfg() };
        for _ in 0..5 {
            match acquire(&mut s, &c, T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0) {
                Decision::Owed { ms, booked: true, .. } => dues.push(ms),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(dues, vec![1_000, 2_000, 3_000, 4_000, 5_000]);
        assert_eq!(s.tokens.booked, 5_000.0);
    }

    #[test]
    fn a_live_turn_goes_before_booked_work_and_work_leaves_its_booking_alone() {
        let mut s = seen(7_000);
        // Work books the line: 7 000 present, each needs 2 000 + 6 000 floor.
        let mut work_dues = vec![];
        for _ in 0..3 {
            match acquire(&mut s, &cfg(), T0, est(2_000), Mode::Work, &Who::DEFAULT, None, 0.0) {
                Decision::Owed { ms, .. } => work_dues.push(ms),
                other => panic!("{other:?}"),
            }
        }
        // A live turn fits now above its 2 % floor (1 200): it goes at once.
        assert_eq!(acquire(&mut s, &cfg(), T0, est(2_000), Mode::Companion, &Who::DEFAULT, None, 0.0), Decision::Clear);
        // Another live turn is owed only what it lacks, not the work line.
        let live_due = match acquire(&mut s, &cfg(), T0, est(4_000), Mode::Companion, &Who::DEFAULT, None, 0.0) {
            Decision::Owed { ms, .. } => ms,
            other => panic!("{other:?}"),
        };
        assert!(live_due < work_dues[2], "live {live_due} ms vs the work line's {work_dues:?}");
        // When the first work turn comes due, the live booking is not its to take.
        let held = s.booking_cost(est(2_000));
        let at = T0 + work_dues[0] as Millis;
        assert!(matches!(claim(&mut s, &cfg(), at, est(2_000), held, Mode::Work, None, 0.0), Decision::Owed { .. }));
        let live_held = s.booking_cost(est(4_000));
        let at = T0 + live_due as Millis;
        assert_eq!(claim(&mut s, &cfg(), at, est(4_000), live_held, Mode::Companion, None, 0.0), Decision::Clear);
    }

    #[test]
    fn beyond_the_fair_horizon_a_turn_waits_in_its_tenants_line_not_on_the_bucket() {
        let mut s = seen(6_000);
        let mut answers = vec![];
        for _ in 0..4 {
            answers.push(acquire(&mut s, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0));
        }
        // Three are booked (2 000 ms of the tenant's line ahead is the horizon) ...
        assert!(answers[..3].iter().all(|d| matches!(d, Decision::Owed { booked: true, .. })), "{answers:?}");
        // ... the fourth waits in the line, alone (so for budget, not fair share),
        // and comes back when it is within half the horizon of its turn.
        match answers[3] {
            Decision::Owed { ms, reason: OwedReason::Budget, booked: false, waiting: Some(pos) } => {
                assert_eq!((ms, pos), (2_000, 4_000));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(s.tokens.booked, 3_000.0, "nothing booked for the waiting turn");
    }

    #[test]
    fn a_far_reset_is_not_paced_on() {
        let mut s = PacerState::default();
        settle(&mut s, &cfg(), T0, &Outcome { tokens: obs(60_000, 0, 3_600_000), ..Outcome::default() });
        assert!(!s.tokens.known(), "a daily cap must not become the pacing model");
    }

    #[test]
    fn headers_lower_the_estimate_but_never_raise_it() {
        let mut s = seen(30_000);
        assert_eq!(acquire(&mut s, &cfg(), T0, est(10_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        assert_eq!(s.tokens.level_at(T0), 20_000.0);
        // A stale snapshot (taken before our call was charged) shows more: ignored.
        settle(&mut s, &cfg(), T0, &Outcome { tokens: obs(60_000, 30_000, 30_000), ..Outcome::default() });
        assert_eq!(s.tokens.level_at(T0), 20_000.0);
        // One that shows less (someone else spent) lowers it.
        settle(&mut s, &cfg(), T0, &Outcome { tokens: obs(60_000, 5_000, 55_000), ..Outcome::default() });
        assert_eq!(s.tokens.level_at(T0), 5_000.0);
    }

    #[test]
    fn a_settled_call_refunds_what_it_did_not_use() {
        let mut s = seen(30_000);
        assert_eq!(acquire(&mut s, &cfg(), T0, est(10_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        assert_eq!(s.tokens.in_flight, 10_000.0);
        settle(&mut s, &cfg(), T0, &Outcome { reserved: est(10_000), used_tokens: Some(4_000), ..Outcome::default() });
        assert_eq!(s.tokens.level_at(T0), 26_000.0);
        assert_eq!(s.tokens.in_flight, 0.0);
    }

    #[test]
    fn a_429_closes_the_window_for_everyone_and_refunds_the_refused_call() {
        let mut s = seen(30_000);
        assert_eq!(acquire(&mut s, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Clear);
        settle(
            &mut s,
            &cfg(),
            T0,
            &Outcome { reserved: est(1_000), rate_limited_ms: Some(3_000), ..Outcome::default() },
        );
        match acquire(&mut s, &cfg(), T0 + 10, est(1), Mode::Companion, &Who::DEFAULT, None, 0.0) {
            Decision::Owed { ms, reason: OwedReason::RateLimited, .. } => assert_eq!(ms, 2_990),
            other => panic!("{other:?}"),
        }
        assert!(s.tokens.level_at(T0) <= 0.0, "remaining = 0 after a 429");
    }

    #[test]
    fn a_call_larger_than_the_floor_allows_waits_for_a_full_bucket_not_forever() {
        let mut s = seen(0);
        match acquire(&mut s, &cfg(), T0, est(59_000), Mode::Work, &Who::DEFAULT, None, 0.0) {
            Decision::Owed { ms, .. } => assert_eq!(ms, 60_000),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn jitter_is_positive_and_bounded() {
        let c = PacingConfig { jitter_frac: 0.02, jitter_max_ms: 100, ..cfg() };
        for u in [0.0, 0.3, 0.999] {
            let mut s = seen(6_000);
            match acquire(&mut s, &c, T0, est(1_000), Mode::Work, &Who::DEFAULT, None, u) {
                Decision::Owed { ms, .. } => assert!((1_000..=1_020).contains(&ms), "{ms}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_line_books_the_input_in_full_and_the_output_by_its_usage() {
        let mut s = seen(30_000);
        // 1 000 in, 1 000 reserved for output, 200 of it used (1 200 in all).
        let call = Estimate { tokens: 2_000, requests: 1, output: 1_000 };
        for _ in 0..40 {
            settle(&mut s, &cfg(), T0, &Outcome { reserved: call, used_tokens: Some(1_200), ..Outcome::default() });
        }
        assert!((s.usage_ratio - 0.2).abs() < 0.01, "{}", s.usage_ratio);
        // A long input with the same output reservation is booked for its
        // input plus a fifth of the output, not by a fifth of the whole.
        let long = Estimate { tokens: 9_000, requests: 1, output: 1_000 };
        assert!((8_200..=8_201).contains(&s.booking_cost(long).tokens));
        // A caller that does not split is booked by the ratio of the whole.
        assert!((1_800..=1_801).contains(&s.booking_cost(Estimate { output: 0, ..long }).tokens));
    }

    #[test]
    fn a_released_booking_returns_its_budget() {
        let mut s = seen(6_000);
        assert!(matches!(acquire(&mut s, &cfg(), T0, est(1_000), Mode::Work, &Who::DEFAULT, None, 0.0), Decision::Owed { .. }));
        release_booking(&mut s, est(1_000), false, None, T0);
        assert_eq!(s.tokens.booked, 0.0);
        assert_eq!(s.tokens.level_at(T0), 6_000.0);
    }
}
