//! Release: the line lets its turns go, once each. With every op — before an
//! ask (so that its answer is the line's: a waiter that would go is not told
//! to wait), after a settle or a forgotten turn — the head of the line is
//! weighed: while it fits,
//! it is admitted and handed to its host — the queue, in the shared pacer:
//! its entry is due now, cleared — and the next head is weighed; the first
//! that does not fit gets the line's one timer, its queue entry due when it
//! is next weighed (`head_timer`). So a waiting turn costs nothing while it
//! waits, and what it costs to let one go does not grow with the line.
//! `shared/src/pacer/lua/release.lua` takes the same steps.

use crate::acquire::{head_timer, reserve, room_for_head, send, Place};
use crate::fair;
use crate::model::{Mode, PacingConfig};
use crate::state::PacerState;
use crate::Millis;

/// What the pacer asks of the place its waiting turns are kept (the shared
/// pacer's: the run store's queue, `runs/pacer_host.lua`). Each answers
/// whether the turn was still there to move: a turn whose run was cancelled,
/// or whose queue entry is gone, is dropped from the line instead.
pub trait Host {
    /// Turn `id` is cleared: its queue entry becomes due now.
    fn release(&mut self, id: &str) -> bool;
    /// Turn `id`, the head, is next weighed at `at`: its entry becomes due then.
    fn retime(&mut self, id: &str, at: Millis) -> bool;
    /// Whether it still holds turn `id` (a head past its timer that has not
    /// asked: its entry may be waiting for a free slot, or lost with its run).
    fn holds(&mut self, id: &str) -> bool;
}

/// A host that holds every turn it is told of (the model's tests).
#[derive(Debug, Default)]
pub struct Everyone;

impl Host for Everyone {
    fn release(&mut self, _: &str) -> bool {
        true
    }
    fn retime(&mut self, _: &str, _: Millis) -> bool {
        true
    }
    fn holds(&mut self, _: &str) -> bool {
        true
    }
}

/// What a release moved in its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Move {
    /// Cleared: due now.
    Release(String),
    /// The head's timer: due at this time.
    Retime(String, Millis),
}

/// The most turns one op releases; a head that still fits after them is due
/// now (its queue entry asks, and releases the rest).
pub const MAX_RELEASES: usize = 64;

/// A head's timer is moved only when it comes this much sooner (a later
/// prediction needs no write: the head asks, and is owed the rest).
pub const RETIME_GAIN_MS: Millis = 20;

/// Lets the line go as far as the budget takes it (see the module doc). With
/// no host (`PacingConfig::parks` off) it lets nothing go — the line moves as
/// its turns come back and ask — and only drops a head that stopped asking.
pub fn release(state: &mut PacerState, cfg: &PacingConfig, now: Millis, host: &mut dyn Host) -> Vec<Move> {
    let mut moves = vec![];
    let mut released = 0;
    while let Some((id, w)) = state.head().map(|(id, w)| (id.to_owned(), w.clone())) {
        let mode = if fair::is_work(w.order) { Mode::Work } else { Mode::Companion };
        let place = Place { order: w.order, line: w.line };
        if !cfg.parks {
            // No host to move a turn: the line moves only as its turns ask
            // (the head, at its timer, is weighed then); a head not back
            // within `booking_grace_ms` of its due time has stopped asking.
            if now > w.due_ms + cfg.booking_grace_ms as Millis {
                forget(state, &id);
                continue;
            }
            break;
        }
        if released >= MAX_RELEASES {
            // More may fit: the head asks at once, and its ask releases the rest.
            if now + RETIME_GAIN_MS < w.due_ms {
                retime(state, host, &id, now, &mut moves);
            }
            break;
        }
        let room = room_for_head(state, cfg, now, w.est, mode);
        if room.fits && room.probe && state.headerless {
            // Answered without headers, with nothing configured: nothing is
            // paced. The line wakes — each turn leaves it, due now, and asks
            // when a worker takes it — rather than being cleared wholesale:
            // a 429 that teaches the pacer the bucket then holds the turns
            // not sent yet, as it holds any ask.
            forget(state, &id);
            if host.retime(&id, now) {
                moves.push(Move::Retime(id, now));
            }
            released += 1;
            continue;
        }
        if room.fits {
            if !host.release(&id) {
                forget(state, &id);
                continue;
            }
            reserve(state, cfg, now, &id, w.est, mode, &w.tenant, (!room.probe).then_some(place));
            moves.push(Move::Release(id));
            released += 1;
            continue;
        }
        let at = now + head_timer(state, cfg, now, &room, place.line).ceil() as Millis;
        if let Some(w) = state.waiters.get_mut(&id) {
            w.reason = room.reason;
        }
        let at = timer_at(state, cfg, now, at);
        if at + RETIME_GAIN_MS < w.due_ms && !retime(state, host, &id, at, &mut moves) {
            continue;
        }
        // A head well past its timer that has not asked: its entry waits for
        // a slot, or was lost with its run (a failover's lost writes) — then
        // the line goes on without it. Asked once a `late_ms`.
        if now > w.due_ms + cfg.late_ms as Millis {
            if !host.holds(&id) {
                forget(state, &id);
                continue;
            }
            if let Some(w) = state.waiters.get_mut(&id) {
                w.due_ms = now;
            }
        }
        break;
    }
    moves
}

/// When the head's timer goes, weighed at `now` to fit at `at`. Sooner than
/// `at` a call in flight may settle — one in `call_ms` over the calls on
/// their way (started, and not yet twice `call_ms` old: one overdue may be
/// lost) — and a settle weighs the head again and lets it go if it fits by
/// then. Then the timer goes only to when the last of those calls is
/// overdue, the latest a settle is expected: the settles do the releasing,
/// and the head's timer is not moved earlier at each (a move wakes a worker
/// to watch the new time). A head let go a little late costs nothing with a
/// line behind it: the bucket keeps what refilled meanwhile.
fn timer_at(state: &PacerState, cfg: &PacingConfig, now: Millis, at: Millis) -> Millis {
    let call = state.call_ms;
    if call <= 0.0 {
        return at;
    }
    let ttl = cfg.reservation_ttl_ms as Millis;
    let (n, overdue) = state
        .flights
        .values()
        .filter(|f| f.started)
        .map(|f| (f.expiry_ms - ttl) as f64 + 2.0 * call)
        .filter(|&overdue| overdue >= now as f64)
        .fold((0, 0.0f64), |(n, last), overdue| (n + 1, last.max(overdue)));
    if n > 0 && now as f64 + call / n as f64 <= at as f64 {
        at.max(overdue.ceil() as Millis)
    } else {
        at
    }
}

/// Moves the head `id`'s timer to `at`; false (and the turn dropped from
/// the line) when its host no longer holds it.
fn retime(state: &mut PacerState, host: &mut dyn Host, id: &str, at: Millis, moves: &mut Vec<Move>) -> bool {
    if !host.retime(id, at) {
        forget(state, id);
        return false;
    }
    if let Some(w) = state.waiters.get_mut(id) {
        w.due_ms = at;
        w.clear_ms = at;
    }
    moves.push(Move::Retime(id.to_owned(), at));
    true
}

/// A call the line released reaches its worker (its fetch asks, and is
/// clear: `acquire`'s first step): from now on it may reach the provider.
/// Its marks — where the ledgers stood, which later headers are read
/// against — are taken again, as at a clearance: between its release and
/// its start, others may have been sent, and its headers will count them.
/// Its reservation's lifetime starts again. A call started already (a
/// redelivery) is left as it is.
pub fn start(state: &mut PacerState, cfg: &PacingConfig, now: Millis, id: &str) {
    if state.flights.get(id).is_some_and(|f| !f.started) {
        send(state, cfg, now, id);
    }
}

/// Turn `id` leaves the pacer without being sent (its run ended while it
/// waited): out of the line, or, released and not started yet, its
/// reservation given back; the ops' release then weighs the head that follows.
pub fn forget(state: &mut PacerState, id: &str) {
    state.waiters.remove(id);
    if state.flights.get(id).is_some_and(|f| !f.started) {
        if let Some(f) = state.flights.remove(id) {
            crate::model::drop_flight(state, &f);
        }
    }
}
