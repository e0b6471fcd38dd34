//! Acquire: may this call go now, and if not, where does it wait? In named
//! steps (`shared/src/pacer/lua/acquire.lua` takes the same ones).
//!
//! A turn that must wait is **parked** once in its budget's line, in fair
//! order, and released once by the pacer ([`crate::release`]): by the settle
//! or refill that makes room, or by the one timer of the line, its head's.
//! Only the head of the line is ever weighed against the buckets; a turn
//! behind it joins the line without a look at the turns ahead (no ask sums
//! the line). The answer to a parked turn says when its queue entry is due —
//! the head's predicted clear time, or, behind it, a safety deadline well
//! past its estimate, for a release lost to a crash — and its estimate.
//!
//! The per-process baseline (`PacingConfig::parks` off) has no host to
//! release its turns: a waiter comes back at its estimate and asks again.

use crate::bucket::{Bucket, Refill};
use crate::fair;
use crate::model::{
    ensure_configured, expire, lift, owed, Decision, Estimate, Mode, OwedReason, PacingConfig, Who, BURST_GAP_MS,
    PROBE_AFTER_LATE, PROBE_HOLD_MS,
};
use crate::state::{Flight, PacerState, Waiter, BUCKETS};
use crate::Millis;

/// One ask: a call of `est` under reservation `id`, in `mode`, for `who`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask<'a> {
    /// The reservation id (a turn keeps it while it waits).
    pub id: &'a str,
    /// What the call is expected to cost, as the worker counts it (the pacer
    /// charges its input at the learned input ratio).
    pub est: Estimate,
    /// Work or companion.
    pub mode: Mode,
    /// Its tenant, weight and cap.
    pub who: Who<'a>,
}

/// Asks for `ask.est` at `now`. `jitter_u` is a uniform number in [0, 1) from
/// the caller (Redis scripts must be deterministic, so randomness comes from
/// outside). In named steps, as `acquire.lua`.
pub fn acquire(state: &mut PacerState, cfg: &PacingConfig, now: Millis, ask: &Ask<'_>, jitter_u: f64) -> Decision {
    expire(state, cfg, now);
    // 1. Asked again for a call already cleared (a redelivery, or a turn the
    //    line released, which its worker starts now): still clear.
    if state.flights.contains_key(ask.id) {
        crate::release::start(state, cfg, now, ask.id);
        return Decision::Clear;
    }
    // 2. Back before its time: owed the rest (a wait cut short is not a wait saved).
    if let Some(owed) = back_early(state, ask.id, now) {
        return owed;
    }
    ensure_configured(state, cfg, now);
    // 3. Nothing known yet: with no probe out this call is the probe; answered
    //    without headers while nothing is configured, nothing is paced at all.
    if !state.any_known() && (state.headerless || now >= state.probe_until_ms) {
        if !state.headerless {
            state.probe_until_ms = now + PROBE_HOLD_MS.min(cfg.reservation_ttl_ms as Millis);
        }
        return admit(state, cfg, now, ask.id, ask.est, ask.mode, ask.who.tenant, None);
    }
    lift(state, cfg, now);
    // 4. Its place in line: kept if it waited before, else given now (a
    //    capped tenant's turn first passes its cap; no jitter: the gate's time
    //    is exact, so a redelivery that asks before it is still held).
    let place = match take_place(state, now, ask) {
        Ok(place) => place,
        Err(ms) => return owed(ms, OwedReason::FairShare, cfg, 0.0),
    };
    // 5. At the head of the line, clear if its reservation fits above the floor.
    if state.is_head(ask.id, place.order) {
        let room = room_for_head(state, cfg, now, ask.est, ask.mode);
        if room.fits {
            let place = (!room.probe).then_some(place);
            return admit(state, cfg, now, ask.id, ask.est, ask.mode, ask.who.tenant, place);
        }
        return park(state, cfg, now, ask, place, Some(&room), jitter_u);
    }
    // 6. Behind others: parked in line until the pacer releases it — or, with
    //    no host, back at its time ahead of a head not back yet, when the
    //    buckets hold both their reservations above the floor.
    if pulls_in(state, cfg, now, ask) {
        return admit(state, cfg, now, ask.id, ask.est, ask.mode, ask.who.tenant, Some(place));
    }
    park(state, cfg, now, ask, place, None, jitter_u)
}

/// Step 6, with no host (`PacingConfig::parks` off): nothing moves a turn, so
/// the head is weighed only when it comes back. A waiter back at its time
/// (not a new ask: it would jump the line) may go ahead of a head not due
/// yet when every bucket holds both their reservations above the floor now:
/// the head, back at its time, still fits.
fn pulls_in(state: &mut PacerState, cfg: &PacingConfig, now: Millis, ask: &Ask<'_>) -> bool {
    if cfg.parks || now < state.blocked_until_ms || !state.any_known() || !state.waiters.contains_key(ask.id) {
        return false;
    }
    let Some(head_est) = state.head().filter(|(_, h)| h.due_ms > now).map(|(_, h)| h.est) else {
        return false;
    };
    let (mine, theirs) = (state.charged(ask.est).costs(), state.charged(head_est).costs());
    let floor = cfg.floor(ask.mode);
    state.buckets_mut().into_iter().enumerate().all(|(i, bucket)| {
        if !bucket.known() {
            return true;
        }
        bucket.advance(now);
        bucket.level >= bucket.need(mine[i] + theirs[i], bucket.floor_at(now, floor))
    })
}

/// Step 2: a waiter back before its due time is owed the rest.
fn back_early(state: &PacerState, id: &str, now: Millis) -> Option<Decision> {
    let w = state.waiters.get(id)?;
    (now < w.due_ms).then(|| Decision::Owed {
        ms: (w.due_ms - now) as u64,
        reason: w.reason,
        eta_ms: (w.clear_ms - now).max(0) as u64,
    })
}

/// A turn's place in line (step 4): its order and its line cost (what it
/// is expected to use).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place {
    pub(crate) order: f64,
    pub(crate) line: f64,
}

/// Step 4 (see [`Place`]); `Err(ms)` while its tenant's cap holds a new
/// turn back (it does not join the line then).
fn take_place(state: &mut PacerState, now: Millis, ask: &Ask<'_>) -> Result<Place, f64> {
    let line = state.line_cost(state.charged(ask.est));
    let order = match state.waiters.get_mut(ask.id) {
        Some(w) => {
            w.line = line;
            w.order
        }
        None => fresh_place(state, now, ask.mode, &ask.who, line)?,
    };
    Ok(Place { order, line })
}

/// What weighing the head of the line found (step 5, and each release).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Room {
    /// It may go now.
    pub(crate) fits: bool,
    /// It goes as the probe of a budget that knows nothing yet (no tenant's
    /// share is charged for it).
    pub(crate) probe: bool,
    /// The refill time until it would fit, ms.
    pub(crate) wait: f64,
    /// What it is short of on each bucket.
    pub(crate) shorts: [f64; BUCKETS],
    /// Why it waits.
    pub(crate) reason: OwedReason,
}

impl Room {
    fn held(wait: f64, reason: OwedReason) -> Self {
        Self { fits: false, probe: false, wait, shorts: [0.0; BUCKETS], reason }
    }
}

/// Weighs the head of the line (a call of `est` in `mode`): clear if every
/// bucket holds its reservation above the floor. Held while a 429's window is
/// closed, or, with nothing known, while the probe is out (with no probe out,
/// it goes as the probe). The head may also go as a probe of a window — to
/// find its next boundary when nothing else holds it and no call cleared
/// since the last boundary will bring it (one in flight for longer than a few
/// `late_ms` may never: its worker died), or, once per window, to learn
/// whether unused output comes back.
pub(crate) fn room_for_head(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    est: Estimate,
    mode: Mode,
) -> Room {
    if now < state.blocked_until_ms {
        return Room::held((state.blocked_until_ms - now) as f64, OwedReason::RateLimited);
    }
    if !state.any_known() {
        if state.headerless || now >= state.probe_until_ms {
            if !state.headerless {
                state.probe_until_ms = now + PROBE_HOLD_MS.min(cfg.reservation_ttl_ms as Millis);
            }
            return Room { fits: true, probe: true, ..Room::held(0.0, OwedReason::Probe) };
        }
        return Room::held((state.probe_until_ms - now) as f64, OwedReason::Probe);
    }
    let floor = cfg.floor(mode);
    let mut room = Room { fits: true, ..Room::held(0.0, OwedReason::Budget) };
    let ttl = cfg.reservation_ttl_ms as Millis;
    let answering = now - PROBE_AFTER_LATE * cfg.late_ms as Millis;
    let since_boundary = |b: &Bucket| {
        b.known() && state.flights.values().any(|f| !f.started || f.expiry_ms - ttl >= b.boundary_ms.max(answering))
    };
    let mut probe = !state.buckets().iter().any(|b| since_boundary(b));
    let idle = state.flights.is_empty() && now - state.last_admit_ms >= BURST_GAP_MS;
    let share_known = state.learned_share().is_some();
    let costs = state.charged(est).costs();
    for (i, bucket) in state.buckets_mut().into_iter().enumerate() {
        if bucket.known() {
            bucket.advance(now);
            let short = bucket.need(costs[i], bucket.floor_at(now, floor)) - bucket.level;
            if short > 0.0 {
                room.fits = false;
                room.shorts[i] = short;
                room.wait = room.wait.max(bucket.refill_ms(now, short, false));
                probe &= bucket.may_probe(now);
            }
        }
    }
    let shorts = room.shorts;
    let tokens_only = shorts[0] > 0.0 && shorts[1..].iter().all(|s| *s <= 0.0);
    // A window bucket whose refunds are not known yet and whose head is held
    // only by them: once per window, when every call has settled, the head
    // goes alone, so that its headers tell (against the window's start) how
    // much came back. A provider that keeps the charge refuses it: one 429 a
    // window until the share is learned.
    let t = &state.tokens;
    let refund_probe = idle
        && !share_known
        && t.windowed()
        && t.full_at_ms > now
        && (t.probed_ms == 0 || t.probed_ms < t.boundary_ms)
        && tokens_only
        && shorts[0] <= t.withheld;
    if !room.fits && refund_probe {
        state.tokens.probed_ms = now;
        room.fits = true;
    }
    if !room.fits && probe {
        for bucket in state.buckets_mut() {
            if bucket.known() && bucket.may_probe(now) {
                bucket.probed_ms = now;
            }
        }
        room.fits = true;
    }
    room
}

/// When the head of the line is next weighed, ms from now: when the refill
/// brings what it is short of — sooner where that is a guess: before the
/// bucket's shape is known or any call has settled (the line's costs are
/// then whole reservations), for a bucket learned without headers while the
/// answers of its first 429's wave still lift it, and for a window short of
/// no more than its floor (which shrinks to the boundary). A settle that
/// makes room releases it at once; this timer is for the refill alone. The
/// baseline, which nothing releases, also comes back when the calls in
/// flight are expected to give back what it is short of.
pub(crate) fn head_timer(state: &PacerState, cfg: &PacingConfig, now: Millis, room: &Room, line: f64) -> f64 {
    let mut t = room.wait;
    // The baseline hears of no probe's answer: it looks again soon.
    if room.reason == OwedReason::Probe && !cfg.parks {
        t = t.min(cfg.probe_wait_ms as f64);
    }
    let recheck = recheck_ms(&state.tokens, cfg, line);
    if room.reason == OwedReason::Budget {
        if state.usage_ratio <= 0.0 || state.buckets().iter().any(|b| b.known() && b.refill == Refill::Unknown) {
            t = t.min(recheck);
        }
        let ttl = cfg.reservation_ttl_ms as Millis;
        let wave = state.headerless && state.hl_prev_span > 0.0;
        if wave && state.flights.values().any(|f| f.started && f.expiry_ms - ttl <= state.hl_cut_ms) {
            t = t.min(cfg.recheck_ms as f64);
        }
        let floor = cfg.floor_work;
        for (i, bucket) in state.buckets().into_iter().enumerate() {
            if bucket.windowed() && room.shorts[i] > 0.0 && room.shorts[i] <= bucket.floor_at(now, floor) * bucket.limit
            {
                t = t.min(recheck);
            }
            if !cfg.parks && bucket.windowed() && room.shorts[i] > 0.0 {
                let holding: f64 = state.flights.values().map(|f| f.held()[i]).sum();
                if holding >= room.shorts[i] {
                    t = t.min(answer_recheck(state, recheck));
                }
            }
        }
    }
    t.min(cfg.max_pace_ms as f64).max(1.0)
}

/// Step 6: the turn waits in line. At the head, its queue entry is due when
/// [`head_timer`] says it is next weighed; behind it, at a safety deadline
/// ([`safety_ms`]) — the pacer releases it before then — or, in the baseline,
/// at its estimate, when it asks again. A turn new to the line counts one
/// wait for its tenant.
fn park(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    ask: &Ask<'_>,
    place: Place,
    room: Option<&Room>,
    jitter_u: f64,
) -> Decision {
    let (due_ms, eta, reason) = match room {
        Some(room) => {
            let t = head_timer(state, cfg, now, room, place.line).ceil() as Millis;
            (t, t, room.reason)
        }
        None => {
            let eta = (estimate(state, cfg, now, place) - now).max(1);
            // (No rate known yet, nothing says how long: the probe's answer
            // releases the line, and its head, due when the probe is, keeps
            // it going if the probe is lost.)
            let safety = if state.tokens.known() || state.input.known() { safety_ms(eta) } else { SAFETY_UNKNOWN_MS };
            let due = if cfg.parks { safety } else { eta.min(cfg.max_pace_ms as Millis) };
            (due, eta, reason_behind(state, now, ask.who.tenant))
        }
    };
    // The baseline's waiters come back to ask, and are jittered so as not to
    // come as a herd; a parked turn is released by the pacer, one at a time.
    let ms = match (cfg.parks, owed(due_ms as f64, reason, cfg, jitter_u)) {
        (false, Decision::Owed { ms, .. }) => ms,
        _ => due_ms as u64,
    };
    let eta_ms = eta as u64;
    let fresh = !state.waiters.contains_key(ask.id);
    let w = state.waiters.entry(ask.id.to_owned()).or_insert_with(|| Waiter {
        order: place.order,
        est: ask.est,
        line: place.line,
        tenant: ask.who.tenant.to_owned(),
        due_ms: now,
        clear_ms: now,
        since_ms: now,
        reason,
    });
    w.est = ask.est;
    w.due_ms = now + ms as Millis;
    w.clear_ms = now + eta_ms as Millis;
    w.reason = reason;
    if fresh {
        state.tenants.entry(ask.who.tenant.to_owned()).or_default().waits += 1.0;
    }
    Decision::Owed { ms, reason, eta_ms }
}

/// Why a turn behind the head waits: the window a 429 closed, the probe,
/// another tenant's turn at the head (its fair share), or the budget.
fn reason_behind(state: &PacerState, now: Millis, tenant: &str) -> OwedReason {
    if now < state.blocked_until_ms {
        OwedReason::RateLimited
    } else if !state.any_known() {
        OwedReason::Probe
    } else if state.head().is_some_and(|(_, h)| fair::is_work(h.order) && h.tenant != tenant) {
        OwedReason::FairShare
    } else {
        OwedReason::Budget
    }
}

/// When a turn behind the head is expected clear: when the head is (its
/// timer), plus the refill for the turns ahead of it — counted, not summed:
/// as many as stand before its place, at its own line cost each. With a
/// host, an estimate for the run to show and for its safety deadline;
/// nothing is decided by it. With none (`PacingConfig::parks` off) the turn
/// comes back then, and a long guess leaves the budget idle: it is expected
/// clear when the refill brings the line costs ahead of it and its own,
/// summed (as many reads as turns ahead: the per-process baseline's, and a
/// shared pacer asked directly, not the workers'), less what the bucket
/// holds above its floor now.
fn estimate(state: &PacerState, cfg: &PacingConfig, now: Millis, place: Place) -> Millis {
    // (No rate known yet: the probe's answer tells, and lets the line go.)
    let rate = turn_rate(state, cfg);
    let ahead = state.waiters.values().filter(|w| w.order < place.order);
    if !cfg.parks {
        let b = if state.tokens.known() { &state.tokens } else { &state.input };
        let spare = (b.level_at(now) - cfg.floor_work * b.limit).max(0.0);
        let line: f64 = ahead.map(|w| w.line).sum::<f64>() + place.line;
        let refill = if rate > 0.0 { (line - spare).max(0.0) / rate } else { 0.0 };
        return now + refill.ceil() as Millis;
    }
    let head = state.head().map_or(now, |(_, h)| h.clear_ms).max(now);
    let refill = if rate > 0.0 { ahead.count() as f64 * place.line / rate } else { 0.0 };
    head + refill.ceil() as Millis
}

/// The refill the line is spaced by, tokens per ms: the token bucket's, or
/// the separate input bucket's (0: neither is known). With a host, its
/// learned rate: a parked turn's safety deadline follows from it, and one
/// too short brings the turn back to ask for nothing (the faster reading of
/// a bucket whose shape is not known yet, a window's limit over its reset,
/// once made a 10 000-run backlog's early turns ask every ten seconds); with
/// none, the faster reading (`Bucket::share_rate`): a turn that comes back
/// early asks again, one that comes back late leaves the budget idle.
fn turn_rate(state: &PacerState, cfg: &PacingConfig) -> f64 {
    let rate = |b: &Bucket| if cfg.parks { b.rate } else { b.share_rate() };
    if state.tokens.known() {
        rate(&state.tokens)
    } else if state.input.known() {
        rate(&state.input)
    } else {
        0.0
    }
}

/// A parked turn's queue entry is due at twice its expected wait, at least
/// [`SAFETY_MIN_MS`] and at most [`SAFETY_MAX_MS`] from now: the pacer
/// releases it long before, unless a release was lost (a crash, a failover
/// that lost the last writes) or the estimate was far off — then it asks
/// again, once, and is parked anew.
pub fn safety_ms(eta_ms: Millis) -> Millis {
    (2 * eta_ms).clamp(SAFETY_MIN_MS, SAFETY_MAX_MS)
}

/// See [`safety_ms`].
pub const SAFETY_MIN_MS: Millis = 10_000;
/// The safety deadline of a turn parked behind the head while no rate is
/// known (a cold start's probe out): its estimate says nothing, and a turn
/// due every [`SAFETY_MIN_MS`] through a long probe call would cost a fetch
/// each time for nothing.
pub const SAFETY_UNKNOWN_MS: Millis = 300_000;
/// See [`safety_ms`].
pub const SAFETY_MAX_MS: Millis = 6 * 3_600_000;

/// The shortest re-weighing of a head owed longer: a few turns' worth of
/// refill (so a slow tier is not asked every second), at least `recheck_ms`,
/// at most `max_pace_ms`.
pub(crate) fn recheck_ms(tokens: &Bucket, cfg: &PacingConfig, line: f64) -> f64 {
    let turns = if tokens.known() { RECHECK_TURNS * line / tokens.share_rate() } else { 0.0 };
    turns.max(cfg.recheck_ms as f64).min(cfg.max_pace_ms as f64)
}

/// See [`recheck_ms`].
pub(crate) const RECHECK_TURNS: f64 = 4.0;

/// How soon the baseline's head, short of what the calls in flight are
/// expected to give back, asks again: after about one call's time
/// (`PacerState::call_ms`), within [[`ANSWER_RECHECK_MIN_MS`], `recheck`].
pub(crate) fn answer_recheck(state: &PacerState, recheck: f64) -> f64 {
    if state.call_ms > 0.0 {
        state.call_ms.clamp(ANSWER_RECHECK_MIN_MS, recheck)
    } else {
        recheck
    }
}

/// See [`answer_recheck`].
pub(crate) const ANSWER_RECHECK_MIN_MS: f64 = 50.0;

/// A new turn's place in line, or `Err(ms)` while its tenant's cap holds it
/// back (it does not join the line then).
pub(crate) fn fresh_place(
    state: &mut PacerState,
    now: Millis,
    mode: Mode,
    who: &Who<'_>,
    line: f64,
) -> Result<f64, f64> {
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

/// Clears a call of `est` (as the worker counts it) under reservation `id`:
/// it leaves the line, its reservation — charged as the provider will charge
/// it — is in flight, and its worker sends it now. `place` is its order and
/// line cost when it stood in line (none for a probe, which no tenant's share
/// is charged for).
#[allow(clippy::too_many_arguments)]
pub(crate) fn admit(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    id: &str,
    est: Estimate,
    mode: Mode,
    tenant: &str,
    place: Option<Place>,
) -> Decision {
    reserve(state, cfg, now, id, est, mode, tenant, place);
    send(state, cfg, now, id);
    Decision::Clear
}

/// Takes the reservation of a call [`admit`] clears, or the line releases:
/// the call leaves the line, its charge leaves the buckets. Not sent yet:
/// its charge enters the ledgers when it is ([`send`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reserve(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    id: &str,
    est: Estimate,
    mode: Mode,
    tenant: &str,
    place: Option<Place>,
) {
    // The worker's own count of the input, kept to learn the input ratio from.
    let input = if est.output > 0 { est.tokens - est.output.min(est.tokens) } else { 0 };
    let est = state.charged(est);
    state.waiters.remove(id);
    let costs = est.costs();
    let mut held = [0.0; BUCKETS];
    for (i, bucket) in state.buckets_mut().into_iter().enumerate() {
        if bucket.known() {
            bucket.advance(now);
            bucket.level -= costs[i];
            bucket.in_flight += costs[i];
            bucket.charged_since += costs[i];
            held[i] = costs[i];
        }
    }
    let mut reserved = Estimate { tokens: held[0] as u64, requests: held[1] as u64, output: 0 };
    if state.tokens.known() {
        reserved.output = est.output;
    }
    let flight = Flight {
        est: reserved,
        input,
        mark: 0.0,
        sent: 0.0,
        held_input: held[2] as u64,
        held_output: held[3] as u64,
        omark: 0.0,
        marks: [0.0; 3],
        alone: false,
        expiry_ms: now + cfg.reservation_ttl_ms as Millis,
        started: false,
    };
    state.flights.insert(id.to_owned(), flight);
    state.count_unsent();
    if let Some(place) = place {
        state.tenants.entry(tenant.to_owned()).or_default().admitted += place.line;
        // A work turn admitted is the least in line: the system's virtual time
        // moves to its tag (never back).
        if mode == Mode::Work {
            state.fair_time = fair::virtual_time_after(state.fair_time, place.order, None);
        }
    }
}

/// The reserved call `id` is sent now: its charge enters the buckets'
/// `sent` ledgers, and its marks note where they stand (its own charge
/// included), which its headers are read against; it
/// is alone unless another was sent within [`BURST_GAP_MS`] of it (then
/// neither is); its reservation lapses `reservation_ttl_ms` from now.
pub(crate) fn send(state: &mut PacerState, cfg: &PacingConfig, now: Millis, id: &str) {
    let alone = now - state.last_admit_ms >= BURST_GAP_MS;
    if !alone {
        if let Some(previous) = state.flights.get_mut(&state.last_admit_id) {
            previous.alone = false;
        }
    }
    let held = state.flights.get(id).map(|f| f.held()).unwrap_or_default();
    for (bucket, held) in state.buckets_mut().into_iter().zip(held) {
        bucket.sent += held;
    }
    let (mark, sent, omark) = (state.tokens.refunded, state.tokens.sent, state.output.refunded);
    let marks = [state.requests.sent, state.input.sent, state.output.sent];
    if let Some(f) = state.flights.get_mut(id) {
        f.mark = mark;
        f.sent = sent;
        f.omark = omark;
        f.marks = marks;
        f.alone = alone;
        f.expiry_ms = now + cfg.reservation_ttl_ms as Millis;
        f.started = true;
    }
    state.count_unsent();
    state.last_admit_ms = now;
    state.last_admit_id = id.to_owned();
}
