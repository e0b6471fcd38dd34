//! Settle: a finished call's report (its usage, its headers, a 429) corrects
//! the model, in named steps (`shared/src/pacer/lua/settle.lua` takes the same
//! ones), with what it learns of the provider: the refund share, the bucket of
//! a provider without headers.

use crate::bucket::{Bucket, Observation, Refill, Seen};
use crate::model::{ensure_configured, expire, lift, CallOutcome, PacingConfig, BURST_GAP_MS};
use crate::refund::Snapshot;
use crate::state::{Flight, PacerState, BUCKETS};
use crate::Millis;
use std::collections::BTreeMap;

/// Settles reservation `id`: refunds what it reserved beyond what it used,
/// then lowers the model to the headers (never raises it), and on a 429
/// closes the window for every worker. In named steps, as `settle.lua`.
pub fn settle(state: &mut PacerState, cfg: &PacingConfig, now: Millis, id: &str, outcome: &CallOutcome) {
    expire(state, cfg, now);
    ensure_configured(state, cfg, now);
    // 1. The reservation leaves the model: what it held, what the report corrects.
    let r = take_reservation(state, cfg, now, id, outcome);
    // 2. What the call's usage teaches: the input ratio, the call's time, the usage ratio.
    learn_usage(state, cfg, now, &r);
    // 3. A reset that passed since the last ask is lifted before these headers
    //    name the next one (or the window that began would be skipped).
    lift(state, cfg, now);
    // 4. What the headers cannot show: others' refunds, what was cleared after it.
    let unseen = unseen_by_headers(state, &r);
    // 5. A window's boundary that went by unnamed, found from these headers.
    boundary_from_headers(state, cfg, now, &r);
    // 6. The reservation credited back: the input fix, the refund, what is withheld.
    credit_reservation(state, cfg, now, &r, unseen.share);
    // 7. The headers lower the model (never raise it).
    observe_headers(state, cfg, now, &r, &unseen);
    // 8. The refund share, and what was withheld while it was not known.
    learn_refund_share(state, cfg, now, r.flight, outcome, r.headers_at, r.unused);
    // 9. Headers seen, or none: a provider without them has its bucket learned from its 429s.
    note_headers(state, cfg, now, &r);
    // 10. A 429 closes the window for every worker.
    close_window(state, &r);
}

/// A settled call measured against its reservation (step 1 of [`settle`]).
#[derive(Clone, Copy)]
pub(crate) struct Report<'o> {
    /// What the call reported.
    outcome: &'o CallOutcome,
    /// Its reservation, if it was in flight.
    flight: Option<Flight>,
    /// Refused with a 429: nothing of it was charged.
    limited: bool,
    /// Released by the line and given back before its worker started it:
    /// it reached no provider, and never entered the ledgers.
    unsent: bool,
    /// What it held of each bucket ([`PacerState::buckets`] order).
    held: [f64; BUCKETS],
    /// Its estimate's input part less what the provider counted.
    input_fix: f64,
    /// The output it left unused, which the provider gives back in its share.
    unused: f64,
    /// The separate input bucket's fix (the input charged as counted).
    input_bucket_fix: f64,
    /// The separate output bucket's unused reservation (given back whole).
    output_unused: f64,
    /// When its headers were received.
    headers_at: Millis,
    /// When it was cleared.
    cleared_ms: Option<Millis>,
}

impl Report<'_> {
    /// The headers of each bucket, in [`PacerState::buckets`] order.
    fn observed(&self) -> [&Observation; BUCKETS] {
        let o = self.outcome;
        [&o.tokens, &o.requests, &o.input, &o.output]
    }
}

/// Step 1: the reservation leaves the line and the calls in flight; what it
/// held and what the report corrects of it. What the call's reservation was
/// off by: its input part — the provider charged the input it counted, not
/// our estimate; its output part — what the call left unused, which the
/// provider gives back in its learned share (`refund.rs`) after its headers
/// were sent, whatever our own estimate of the input was. (Crediting our own
/// refund, the estimate less what was used, would leave the model off the
/// provider by the estimate's error on every call, for good.) A refused call
/// was charged nothing.
fn take_reservation<'o>(
    state: &mut PacerState,
    cfg: &PacingConfig,
    now: Millis,
    id: &str,
    outcome: &'o CallOutcome,
) -> Report<'o> {
    state.waiters.remove(id);
    let flight = state.flights.remove(id);
    state.count_unsent();
    if flight.is_some() {
        // A probe (or any call) that settled: the next probe may go.
        state.probe_until_ms = 0;
    }
    let reserved = flight.map(|f| f.est).unwrap_or_default();
    let limited = outcome.rate_limited_ms.is_some();
    let (input, output) = reserved.split();
    let (input_fix, unused) = match (outcome.used_tokens, outcome.input_tokens) {
        _ if limited => (0.0, 0.0),
        (Some(used), Some(counted)) if reserved.output > 0 => {
            (input - counted as f64, (counted as f64 + output - used as f64).max(0.0))
        }
        (Some(used), _) => (0.0, reserved.tokens.saturating_sub(used) as f64),
        (None, _) => (0.0, 0.0),
    };
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
    Report {
        outcome,
        flight,
        limited,
        unsent: flight.is_some_and(|f| !f.started),
        held,
        input_fix,
        unused,
        input_bucket_fix,
        output_unused,
        headers_at: now - outcome.headers_age_ms as Millis,
        // A call cleared just before a window's boundary was charged to the new
        // window at its lift (`recent`); its headers tell which window it went
        // into: the one that ended, when the boundary they name is that one.
        cleared_ms: flight.map(|f| f.expiry_ms - cfg.reservation_ttl_ms as Millis),
    }
}

/// The most one settle's count may differ from the learned input ratio
/// (either way) before it is weighed in: a count far off the others is that
/// call's own (a prompt cache its ask expected that had expired), not the
/// tokenizers' difference, which the probe's count shows whole at once.
pub const INPUT_RATIO_STEP: f64 = 1.25;

/// The first count is taken whole within this factor of 1, either way
/// (tokenizers differ by less); further off, it is that call's own (a
/// prompt cache its ask expected had expired: ten times the estimate), and
/// the ratio starts at the band's edge, the later counts bringing it the
/// rest of the way. (Taken whole, one such first call charged every ask
/// of the first minute up to 4× its input — a 27-s stall in the simulator,
/// seed 544.)
pub const INPUT_RATIO_FIRST_BAND: f64 = 2.0;

/// Step 2: the ratios an answered call teaches — the provider's input count
/// against our estimate, the call's time from clearance to settle, and the
/// share of its output reservation it used.
fn learn_usage(state: &mut PacerState, cfg: &PacingConfig, now: Millis, r: &Report<'_>) {
    let (outcome, flight) = (r.outcome, r.flight);
    if r.limited {
        return;
    }
    if let (Some(counted), Some(f)) = (outcome.input_tokens, flight) {
        if f.input > 0 {
            // The first count is taken whole, within INPUT_RATIO_FIRST_BAND
            // (the probe's answer teaches the first wave); later ones weigh 30 %.
            let mut seen = (counted as f64 / f.input as f64).clamp(0.25, 4.0);
            let prior = if state.input_ratio > 0.0 {
                state.input_ratio
            } else {
                seen = seen.clamp(1.0 / INPUT_RATIO_FIRST_BAND, INPUT_RATIO_FIRST_BAND);
                seen
            };
            // One count moves the ratio a step at most (INPUT_RATIO_STEP).
            let seen = seen.clamp(prior / INPUT_RATIO_STEP, prior * INPUT_RATIO_STEP);
            state.input_ratio = 0.7 * prior + 0.3 * seen;
        }
    }
    if let Some(f) = flight {
        // The first answer's time is taken whole; later ones weigh 20 %.
        let seen = (now - (f.expiry_ms - cfg.reservation_ttl_ms as Millis)).max(0) as f64;
        let prior = if state.call_ms > 0.0 { state.call_ms } else { seen };
        state.call_ms = 0.8 * prior + 0.2 * seen;
    }
    if let Some(used) = outcome.used_tokens {
        // The output reservation: on the combined bucket, or (split, the
        // combined bucket unknown) on the output bucket.
        let reserved = flight.map(|f| f.est).unwrap_or_default();
        let (input, output) = match flight {
            Some(f) if reserved.tokens == 0 && f.held_output > 0 => (f.held_input as f64, f.held_output as f64),
            _ => reserved.split(),
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
}

/// What a call's headers cannot show (step 4): what others left unused since
/// it was sent, what was cleared after it, and what was cleared after it and
/// has settled already.
pub(crate) struct Unseen {
    /// The refund share credited now.
    share: f64,
    /// Others' unused output on the combined bucket since it was sent.
    others_unused: f64,
    /// Others' unused output on the separate output bucket since it was sent.
    others_output: f64,
    /// What was cleared more than a burst after it, still in flight (calls
    /// cleared within a burst of it may reach the provider before it: only
    /// those cleared later than that are surely not in its headers), and
    /// what the line released that no worker has started yet.
    after: [f64; BUCKETS],
    /// What was cleared after it and has settled already: its charge is in the
    /// ledger since this call's mark, but no longer in flight.
    settled_after: [f64; BUCKETS],
}

/// Step 4 (see [`Unseen`]).
fn unseen_by_headers(state: &PacerState, r: &Report<'_>) -> Unseen {
    let flight = r.flight;
    let mut unseen = Unseen {
        share: state.refund_share(),
        others_unused: flight.map(|f| (state.tokens.refunded - f.mark).max(0.0)).unwrap_or(0.0),
        others_output: flight.map(|f| (state.output.refunded - f.omark).max(0.0)).unwrap_or(0.0),
        after: [0.0; BUCKETS],
        settled_after: [0.0; BUCKETS],
    };
    if let Some(f) = flight {
        let mut later = [0.0; BUCKETS];
        for g in state.flights.values() {
            for (i, held) in g.held().into_iter().enumerate() {
                if !g.started || g.expiry_ms - f.expiry_ms > BURST_GAP_MS {
                    unseen.after[i] += held;
                }
                if g.expiry_ms > f.expiry_ms {
                    later[i] += held;
                }
            }
        }
        let marks = [f.sent, f.marks[0], f.marks[1], f.marks[2]];
        for (i, bucket) in state.buckets().into_iter().enumerate() {
            unseen.settled_after[i] = (bucket.sent - marks[i] - later[i]).max(0.0);
        }
    }
    unseen
}

/// Step 5: a window whose boundary went by while no headers named it (so it
/// was not lifted at): the first headers from the window that began name the
/// next boundary, a window later. The bucket was full at the one between,
/// less what was cleared since (this call among them).
fn boundary_from_headers(state: &mut PacerState, cfg: &PacingConfig, now: Millis, r: &Report<'_>) {
    let ttl = cfg.reservation_ttl_ms as Millis;
    for (i, obs) in r.observed().iter().enumerate() {
        let b = state.buckets()[i];
        let (true, Some(reset)) = (b.windowed(), obs.reset_ms) else {
            continue;
        };
        let window = b.max_reset_ms;
        let start = r.headers_at + reset as Millis - window as Millis;
        if window > 0.0 && b.full_at_ms <= now && start <= now && start as f64 > b.boundary_ms as f64 + window / 2.0 {
            let since = start - cfg.late_ms as Millis;
            let mut recent: f64 =
                state.flights.values().filter(|f| !f.started || f.expiry_ms - ttl >= since).map(|f| f.held()[i]).sum();
            if r.cleared_ms.is_some_and(|c| c >= since) {
                recent += r.held[i];
            }
            let bucket = state.buckets_mut().into_iter().nth(i).expect("a bucket");
            bucket.advance(now);
            bucket.level = bucket.level.max(bucket.limit - recent);
            bucket.boundary_ms = start;
            bucket.charged_since = 0.0;
        }
    }
}

/// Step 6: each bucket gets back what the reservation held beyond the
/// charge: the input fix, and the unused output at the share credited (the
/// combined bucket's learned share; the output bucket gives it all back, as
/// Anthropic documents) — no higher than a refund can have lifted it
/// (`refund_cap`) — and what of it is withheld: the part not credited, all
/// of it while the share is not known, the rest of a share learned below one,
/// which the headers may confirm later (`learn_refund_share`). A share
/// learned low from noisy first pairs otherwise left what it did not credit
/// idle for good: headers only lower the level. A refused call's whole
/// reservation comes back, to us and to the ledger.
fn credit_reservation(state: &mut PacerState, cfg: &PacingConfig, now: Millis, r: &Report<'_>, share: f64) {
    let (held, unused) = (r.held, r.unused);
    let per_bucket = [
        (held[0], r.input_fix, unused, share, unused * (1.0 - share).max(0.0)),
        (held[1], 0.0, 0.0, 0.0, 0.0),
        (held[2], r.input_bucket_fix, 0.0, 0.0, 0.0),
        (held[3], 0.0, r.output_unused, 1.0, 0.0),
    ];
    // How high a refund can have lifted each bucket (`refund_cap`).
    let mut caps = [f64::INFINITY; BUCKETS];
    if let Some(cleared) = r.cleared_ms {
        for (i, b) in state.buckets().into_iter().enumerate() {
            caps[i] = refund_cap(b, &state.flights, i, cleared, now, cfg);
        }
    }
    // A call cleared just before a window's boundary, charged to the new one
    // at its lift, whose headers say it went into the old one.
    let mut old_window = [false; BUCKETS];
    for (i, (bucket, obs)) in state.buckets().into_iter().zip(r.observed()).enumerate() {
        if let (true, Some(cleared), Some(reset)) = (bucket.windowed(), r.cleared_ms, obs.reset_ms) {
            let counted_new = cleared < bucket.boundary_ms && cleared >= bucket.boundary_ms - cfg.late_ms as Millis;
            old_window[i] = counted_new
                && ((r.headers_at + reset as Millis) as f64) < bucket.boundary_ms as f64 + bucket.max_reset_ms / 2.0;
        }
    }
    for (i, (bucket, (held, fix, unused, share, withhold))) in
        state.buckets_mut().into_iter().zip(per_bucket).enumerate()
    {
        if old_window[i] && !r.limited {
            bucket.level = (bucket.level + held).min(bucket.limit.max(bucket.level));
        }
        bucket.advance(now);
        bucket.in_flight = (bucket.in_flight - held).max(0.0);
        let fix = if r.limited || r.unsent { held } else { fix };
        bucket.credit(fix);
        bucket.credit_refund(share * unused, caps[i]);
        if !r.unsent {
            bucket.sent -= fix;
        }
        bucket.refunded += unused;
        if withhold > 0.0 {
            bucket.withheld += withhold;
        }
        bucket.cap_withheld();
    }
}

/// Step 7: each bucket's headers, with what changed at the provider since
/// they were sent, and what this call itself was charged there (a limit
/// inferred from `remaining` alone is at least that plus its charge).
fn observe_headers(state: &mut PacerState, cfg: &PacingConfig, now: Millis, r: &Report<'_>, u: &Unseen) {
    let (unused, after) = (r.unused, u.after);
    let since = [
        u.share * (unused + u.others_unused) - after[0],
        -after[1],
        -after[2],
        r.output_unused + u.others_output - after[3],
    ];
    let own = if r.limited { [0.0; BUCKETS] } else { r.held };
    for (i, (bucket, obs)) in state.buckets_mut().into_iter().zip(r.observed()).enumerate() {
        let unseen_refunds = if i == 0 { unused + u.others_unused } else { 0.0 };
        let seen = Seen {
            headers_at: r.headers_at,
            since: since[i],
            own: own[i],
            settled_after: u.settled_after[i],
            unseen_refunds,
        };
        bucket.observe(obs, now, &seen, cfg.max_pace_ms);
    }
}

/// Step 9: headers seen; or, for a call answered without them while nothing
/// is configured, the provider has none to give (vLLM, Ollama): probing on
/// would hold the fleet to one call at a time, so nothing is paced until a
/// 429 teaches a bucket ([`learn_headerless`]).
fn note_headers(state: &mut PacerState, cfg: &PacingConfig, now: Millis, r: &Report<'_>) {
    if r.observed().iter().any(|o| o.remaining.is_some()) {
        state.observed_at_ms = now;
        state.probe_until_ms = 0;
        state.headerless = false;
    } else if r.flight.is_some() && !state.any_known() {
        state.headerless = true;
    }
    if let (true, Some(f)) = (state.headerless, r.flight) {
        learn_headerless(state, cfg, now, &f, r.outcome.used_tokens, r.limited);
    }
}

/// Step 10: the provider says the window is closed for `ms`, for everyone.
/// What is left after it is what the 429's headers say; without headers,
/// remaining = 0.
fn close_window(state: &mut PacerState, r: &Report<'_>) {
    let Some(ms) = r.outcome.rate_limited_ms else { return };
    state.blocked_until_ms = state.blocked_until_ms.max(r.headers_at + ms as Millis);
    for (bucket, obs) in state.buckets_mut().into_iter().zip(r.observed()) {
        if bucket.known() && obs.remaining.is_none() {
            bucket.level = bucket.level.min(0.0);
        }
    }
}

/// A bucket learned without headers holds this long of its rate (a burst
/// after an idle spell goes no further).
pub(crate) const HL_BURST_MS: f64 = 15_000.0;
/// The first 429 spreads what was answered before it over at least this long:
/// limits are per minute, and a cold fleet's first wave takes a whole bucket
/// in a second.
pub(crate) const HL_FIRST_SPAN_MS: f64 = 60_000.0;
/// A 429 cuts the learned rate to this share of what was answered since the
/// last cut …
pub(crate) const HL_CUT: f64 = 0.9;
/// … but no lower than this share of the rate it had.
pub(crate) const HL_CUT_MIN: f64 = 0.5;
/// While the learned bucket binds, each answer grows its rate by this share
/// per ms since the answer before (0.5 % a second: some 20 s from a cut back
/// to where the 429 came) …
pub(crate) const HL_GROW_PER_MS: f64 = 5e-6;
/// … counting no more than this long, and faster the longer no 429 came:
/// once more for each this long since the last cut (a rate learned far too
/// low, the first over a minute from a provider whose period is 10 s, is
/// found again in a minute or two, not in ten).
pub(crate) const HL_GROW_MAX_MS: f64 = 10_000.0;
/// See [`HL_GROW_MAX_MS`].
pub(crate) const HL_ACCEL_MS: f64 = 20_000.0;
/// The most the growth is sped up.
pub(crate) const HL_ACCEL_MAX: f64 = 2.0;

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
pub(crate) fn learn_headerless(
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
pub(crate) fn refund_cap(
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
        .map(|f| (if f.started { f.expiry_ms - ttl } else { now }, f.held()[i]))
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
pub(crate) fn learn_refund_share(
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
