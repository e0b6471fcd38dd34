//! Acquire: may this call go now, and if not, how long is it owed? In named
//! steps (`shared/src/pacer/lua/acquire.lua` takes the same ones), with the
//! pull-in that moves up waiters near the head.

use crate::bucket::{Bucket, Refill};
use crate::fair;
use crate::model::{
    ensure_configured, expire, lift, owed, Decision, Estimate, Mode, OwedReason, PacingConfig, Who, BURST_GAP_MS,
    PROBE_AFTER_LATE, PROBE_HOLD_MS,
};
use crate::state::{Ahead, Flight, PacerState, Waiter, BUCKETS};
use crate::Millis;

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
/// randomness comes from outside). In named steps, as `acquire.lua`.
pub fn acquire(state: &mut PacerState, cfg: &PacingConfig, now: Millis, ask: &Ask<'_>, jitter_u: f64) -> Decision {
    // Everything below charges what the provider will charge.
    let raw_input = if ask.est.output > 0 { ask.est.tokens - ask.est.output.min(ask.est.tokens) } else { 0 };
    let ask = &Ask { est: state.charged(ask.est), ..*ask };
    expire(state, cfg, now);
    // 1. Asked again for a call already cleared (a redelivery): still clear.
    if state.flights.contains_key(ask.id) {
        return Decision::Clear;
    }
    // 2. Back before its time: owed the rest (a wait cut short is not a wait saved).
    if let Some(owed) = back_early(state, ask.id, now) {
        return owed;
    }
    ensure_configured(state, cfg, now);
    // 3. A window a 429 closed, or nothing known yet: a probe, or no pacing at all.
    if let Some(decision) = closed_or_unknown(state, cfg, now, ask, raw_input, jitter_u) {
        return decision;
    }
    lift(state, cfg, now);
    // 4. Its place in line: kept if it waited before, else given now (a
    //    capped tenant's turn first passes its cap; no jitter: the gate's time
    //    is exact, so a redelivery that asks before it is still held).
    let place = match take_place(state, now, ask) {
        Ok(place) => place,
        Err(ms) => return owed(ms, OwedReason::FairShare, cfg, 0.0),
    };
    // 5. Clear if the bucket holds the turns ahead and this one above the floor.
    let room = room_for(state, cfg, now, ask, &place);
    if room.fits {
        return admit(state, cfg, now, ask, raw_input, Some((place.order, place.line)));
    }
    // 6. Otherwise it waits in line until the refill brings it.
    wait_in_line(state, cfg, now, ask, &place, &room, jitter_u)
}

/// Step 2: a waiter back before its due time is owed the rest.
fn back_early(state: &PacerState, id: &str, now: Millis) -> Option<Decision> {
    let w = state.waiters.get(id)?;
    (now < w.due_ms).then(|| Decision::Owed { ms: (w.due_ms - now) as u64, reason: w.reason })
}

/// Step 3: a window a 429 closed holds every turn (a waiter keeps its
/// place); with nothing known, one probe goes and the rest wait for its
/// headers — or, once an answer came without headers and nothing is
/// configured, nothing is paced at all (docs/pacing.md, "A provider without
/// headers"; a 429 closes the window and teaches a bucket, `learn_headerless`).
fn closed_or_unknown(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    ask: &Ask<'_>,
    raw_input: u64,
    jitter_u: f64,
) -> Option<Decision> {
    if now < state.blocked_until_ms {
        let ms = (state.blocked_until_ms - now) as f64;
        return Some(hold_place(state, cfg, now, ask.id, ms, OwedReason::RateLimited, jitter_u));
    }
    if state.any_known() {
        return None;
    }
    if state.headerless {
        return Some(admit(state, cfg, now, ask, raw_input, None));
    }
    if now < state.probe_until_ms {
        let ms = (state.probe_until_ms - now).min(cfg.probe_wait_ms as Millis) as f64;
        return Some(hold_place(state, cfg, now, ask.id, ms, OwedReason::Probe, jitter_u));
    }
    // The probe holds the rest until it settles (its headers show what it
    // was charged; a second call sent before them would be charged where the
    // model cannot see it), or until the hold lapses.
    state.probe_until_ms = now + PROBE_HOLD_MS.min(cfg.reservation_ttl_ms as Millis);
    Some(admit(state, cfg, now, ask, raw_input, None))
}

/// A turn's place in line (step 4): its order and its line cost (what it
/// is expected to use, what it holds for the turns behind it).
pub(crate) struct Place {
    order: f64,
    line: f64,
}

/// Step 4 (see [`Place`]); `Err(ms)` while its tenant's cap holds a new
/// turn back (it does not join the line then).
fn take_place(state: &mut PacerState, now: Millis, ask: &Ask<'_>) -> Result<Place, f64> {
    let line = state.line_cost(ask.est);
    let order = match state.waiters.get_mut(ask.id) {
        Some(w) => {
            w.line = line;
            w.order
        }
        None => fresh_place(state, now, ask.mode, &ask.who, line)?,
    };
    Ok(Place { order, line })
}

/// What step 5 found: whether the turn fits, and if not, what holds it.
pub(crate) struct Room {
    fits: bool,
    /// The refill time until it would fit, ms.
    wait: f64,
    /// What it is short of on each bucket.
    shorts: [f64; BUCKETS],
    /// Nothing ahead of it holds budget.
    head: bool,
    /// What the turns ahead hold.
    ahead: Ahead,
    /// Only the token bucket holds it.
    tokens_only: bool,
    /// The refund share is known.
    share_known: bool,
}

/// Step 5: clear if every bucket holds what the turns ahead hold and this
/// turn's reservation above the floor; the head may also go as a probe — to
/// find a window's next boundary when nothing else holds it and no call
/// cleared since the last boundary will bring it (one in flight for longer
/// than a few `late_ms` may never: its worker died), or, once per window, to
/// learn whether unused output comes back.
fn room_for(state: &mut PacerState, cfg: &PacingConfig, now: Millis, ask: &Ask<'_>, place: &Place) -> Room {
    let ahead = state.ahead_of(place.order, ask.id, ask.who.tenant, now, cfg.late_ms);
    let floor = cfg.floor(ask.mode);
    let mut wait: f64 = 0.0;
    let mut fits = true;
    let ttl = cfg.reservation_ttl_ms as Millis;
    let answering = now - PROBE_AFTER_LATE * cfg.late_ms as Millis;
    let since_boundary =
        |b: &Bucket| b.known() && state.flights.values().any(|f| f.expiry_ms - ttl >= b.boundary_ms.max(answering));
    let head = ahead.held.iter().all(|h| *h <= 0.0);
    let mut probe = head && !state.buckets().iter().any(|b| since_boundary(b));
    let idle = state.flights.is_empty() && now - state.last_admit_ms >= BURST_GAP_MS;
    let share_known = state.learned_share().is_some();
    let costs = ask.est.costs();
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
    Room { fits, wait, shorts, head, ahead, tokens_only, share_known }
}

/// Step 6: the turn waits in line until the refill brings it — for at most
/// three quarters of that, or a few turns' refill when that is longer. A
/// long wait is a prediction (the line's expected use, refunds to come, turns
/// ahead that may never come back): a turn asked back early is re-timed with
/// what is known then, where one that sleeps past a pessimistic prediction
/// leaves the bucket idle. Shrinking the rest by four each time keeps the
/// asks of a deep line few (a logarithm of its wait); a prediction up to a
/// quarter too pessimistic costs nothing. A wait within [`RECHECK_TAIL`] of
/// the horizon is slept whole: the rest a horizon's sleep would leave is a
/// whole round (a fetch, an ask, a requeue) for a third of a horizon. (Not a
/// bucket learned without headers: its waits are guesses until the answers
/// of its wave come.) It never sends before it is clear. With whole waits
/// ([`PacerState::waits_whole`]) every wait is slept whole (behind others, a
/// tenth longer), and [`pull_in`] moves up the waiters near the head whose
/// prediction shortens (the re-timing comes to them).
fn wait_in_line(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    ask: &Ask<'_>,
    place: &Place,
    room: &Room,
    jitter_u: f64,
) -> Decision {
    let Ask { id, est, mode, who } = *ask;
    let (wait, head, shorts, tokens_only) = (room.wait, room.head, room.shorts, room.tokens_only);
    let floor = cfg.floor(mode);
    let ttl = cfg.reservation_ttl_ms as Millis;
    let deep = state.waits_whole(cfg);
    let reason = if room.ahead.other_tenant { OwedReason::FairShare } else { OwedReason::Budget };
    let recheck = recheck_ms(&state.tokens, cfg, place.line);
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
    if head && !room.share_known && state.tokens.windowed() && tokens_only {
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
    if room.ahead.last_clear_ms > 0 {
        sleep = sleep.min((room.ahead.last_clear_ms + cfg.late_ms as Millis - now) as f64);
    }
    let decision = owed(sleep.max(1.0), reason, cfg, jitter_u);
    if let Decision::Owed { ms, .. } = decision {
        let fresh = !state.waiters.contains_key(id);
        let w = state.waiters.entry(id.to_owned()).or_insert_with(|| Waiter {
            order: place.order,
            est,
            line: place.line,
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
pub(crate) const WHOLE_WAIT_MARGIN: f64 = 0.1;

/// A pulled-in waiter is due this much after its predicted clear time: the
/// bench's came back owed 20–90 ms more (a settle's headers lowering the
/// level meanwhile), each an in-place pause in a worker (its lease, an ask
/// and a start: ~7 commands more than a clear in the fetch).
pub(crate) const PULL_IN_PAD_MS: Millis = 50;

/// A pull-in moves a waiter up by more than this plus the jitter's most, or
/// not at all (a queue write for less is not worth it, and the jitter just
/// drawn is not taken back).
pub(crate) const PULL_IN_GAIN_MS: Millis = 50;

/// The shortest sleep of a turn owed longer: a few turns' worth of refill (so
/// a slow tier is not asked every second), at least `recheck_ms`, at most
/// `max_pace_ms`. A turn owed more sleeps [`RECHECK_SHARE`] of its wait,
/// then is re-timed.
pub(crate) fn recheck_ms(tokens: &Bucket, cfg: &PacingConfig, line: f64) -> f64 {
    let turns = if tokens.known() { RECHECK_TURNS * line / tokens.share_rate() } else { 0.0 };
    turns.max(cfg.recheck_ms as f64).min(cfg.max_pace_ms as f64)
}

/// See [`recheck_ms`].
pub(crate) const RECHECK_TURNS: f64 = 4.0;

/// How soon a turn short of what the calls in flight are expected to give
/// back asks again: after about one call's time (`PacerState::call_ms`), when
/// they have been answered and settled, within [[`ANSWER_RECHECK_MIN_MS`],
/// `recheck`]. A window gives nothing else back before its boundary, and a
/// turn that slept the whole recheck horizon instead left those refunds idle
/// for it (in a 10-s window, a fifth of the window each round).
pub(crate) fn answer_recheck(state: &PacerState, recheck: f64) -> f64 {
    if state.call_ms > 0.0 {
        state.call_ms.clamp(ANSWER_RECHECK_MIN_MS, recheck)
    } else {
        recheck
    }
}

/// See [`answer_recheck`].
pub(crate) const ANSWER_RECHECK_MIN_MS: f64 = 50.0;

/// The share of a long predicted wait a turn sleeps before it is re-timed.
pub(crate) const RECHECK_SHARE: f64 = 0.75;

/// A wait up to this many recheck horizons is slept whole (see step 6 of
/// [`acquire`]): the bench's turns came back from a horizon's sleep owed a
/// few hundred ms, a round of the queue each.
pub(crate) const RECHECK_TAIL: f64 = 4.0 / 3.0;

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

/// An owed answer for something other than the line (a closed window, a
/// probe): a waiter keeps its place and comes back then; a new turn does not
/// join.
pub(crate) fn hold_place(
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
pub(crate) fn admit(
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
