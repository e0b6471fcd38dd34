//! The pacer's policy for one budget and model: may this call go now, and if
//! not, how long is it owed?
//!
//! The state is four provider buckets (`bucket.rs`), the tenants' fair tags
//! (`fair.rs`), and two sets of records, each keyed by reservation id
//! (`state.rs`):
//! - **the line**: turns waiting, each with its place (`order`), what it is
//!   expected to use (`line`), and when its queue entry is due (`due_ms`);
//! - **flights**: calls cleared and not yet settled, each with its reservation.
//!
//! Only the head of the line is weighed: it is clear when every bucket holds
//! its own reservation above the floor. A turn behind it is parked without a
//! look at the turns ahead, and released once, by the pacer
//! (`release.rs`): by the settle or refill that makes room, or by the head's
//! timer (docs/pacing.md, "The line"). Nothing is summed over the line and no
//! counter is kept beside it, so nothing can drift.
//!
//! Liveness follows: the head needs only its own reservation above the floor
//! (never more than the limit), the level refills to the limit, every op that
//! can make room weighs the head, and the head always has a timer — its own
//! queue entry, due when the refill brings what it is short of. A head whose
//! run ended while it waited leaves the line when it is weighed (its host no
//! longer holds it). The simulator (`sim.rs`) checks it over thousands of
//! random workloads.
//!
//! `shared/src/pacer/lua/` is this model as one atomic Redis script (the shared pacer);
//! `local.rs` runs this one in-process. The differential test in
//! `tests/integration/pacer.rs` keeps the two one policy.

use crate::bucket::{Bucket, Observation};
use crate::refund::Snapshot;
use crate::Millis;
use serde::{Deserialize, Serialize};

pub use crate::acquire::{acquire, Ask};
pub use crate::release::{forget, release, Everyone, Host, Move};
pub use crate::settle::settle;
pub(crate) use crate::state::BUCKETS;
pub use crate::state::{Flight, PacerState, Waiter};

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
    /// A turn that must wait is parked in line, and a host moves its queue
    /// entry when the pacer releases it ([`crate::release`]): the shared
    /// pacer of the workers, whose host is the run store's queue. Off, there
    /// is no host (the per-process baseline, `LocalPacer`; a shared pacer
    /// asked directly): the line is kept and released all the same, but its
    /// turns come back at their estimate and ask again — one released finds
    /// itself clear — and a head that stops coming back leaves the line after
    /// `booking_grace_ms`.
    pub parks: bool,
}

/// How long a probe holds the other turns back at most, when it does not settle.
pub const PROBE_HOLD_MS: Millis = 10_000;

/// Calls cleared closer together than this form a burst: any of them may
/// reach the provider first, so their headers do not say which of the others
/// they include (see [`Flight::alone`]).
pub const BURST_GAP_MS: Millis = 60;

/// A call in flight this many `late_ms` is no longer waited for to name a
/// window's next boundary (`may_probe`).
pub(crate) const PROBE_AFTER_LATE: Millis = 4;

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
            parks: true,
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
    pub(crate) fn costs(&self) -> [f64; BUCKETS] {
        let output = self.output.min(self.tokens);
        [self.tokens as f64, self.requests as f64, (self.tokens - output) as f64, output as f64]
    }

    /// The input part and the output reservation, as the usage ratio sees them.
    pub(crate) fn split(&self) -> (f64, f64) {
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
    /// Reads the number the script answers with (`shared/src/pacer/lua/`: 1 budget,
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
    /// place in line; a parked turn is released before then).
    Owed {
        /// Milliseconds until its queue entry is due, jitter included.
        ms: u64,
        /// Why.
        reason: OwedReason,
        /// Milliseconds until it is expected clear (what its run shows).
        eta_ms: u64,
    },
}

/// Lifts both buckets at their provider's reset. A window bucket's lift
/// subtracts what was cleared within `late_ms` before its boundary: the
/// provider may have received those calls after it.
pub(crate) fn lift(state: &mut PacerState, cfg: &PacingConfig, now: Millis) {
    let ttl = cfg.reservation_ttl_ms as Millis;
    let lifts = |b: &Bucket| b.windowed() && b.full_at_ms > 0 && now >= b.full_at_ms;
    let boundaries: Vec<Option<Millis>> =
        state.buckets().iter().map(|b| lifts(b).then_some(b.full_at_ms - cfg.late_ms as Millis)).collect();
    let mut recent = [0.0; BUCKETS];
    for f in state.flights.values() {
        for (i, held) in f.held().into_iter().enumerate() {
            if boundaries[i].is_some_and(|since| !f.started || f.expiry_ms - ttl >= since) {
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

/// Drops the reservations in flight past their expiry, never settled (their
/// worker died): we cannot know whether the call was sent, so the tokens stay
/// spent and return by refill — but for one the line released that no worker
/// started, which reached no provider (`drop_flight`). A waiting turn never
/// lapses here: it leaves the line when it is released, or, at the head, when
/// its host no longer holds it — with no host, when it has not come back
/// within `booking_grace_ms` ([`crate::release`]).
pub fn expire(state: &mut PacerState, _cfg: &PacingConfig, now: Millis) {
    state.count_unsent();
    let gone: Vec<String> = state.flights.iter().filter(|(_, f)| f.expiry_ms <= now).map(|(k, _)| k.clone()).collect();
    for id in gone {
        if let Some(f) = state.flights.remove(&id) {
            drop_flight(state, &f);
        }
    }
}

/// A call in flight leaves the model unsettled (lapsed, or forgotten): what
/// it held is no longer in flight, and one the line released that was never
/// started reached no provider: its reservation comes back whole.
pub(crate) fn drop_flight(state: &mut PacerState, f: &crate::state::Flight) {
    for (bucket, held) in state.buckets_mut().into_iter().zip(f.held()) {
        bucket.in_flight = (bucket.in_flight - held).max(0.0);
        if !f.started {
            bucket.unsent = (bucket.unsent - held).max(0.0);
            bucket.credit(held);
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

pub(crate) fn ensure_configured(state: &mut PacerState, cfg: &PacingConfig, now: Millis) {
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

pub(crate) fn owed(ms: f64, reason: OwedReason, cfg: &PacingConfig, jitter_u: f64) -> Decision {
    // Owed time is paid in full: round up, then add positive jitter so that
    // waiting turns do not wake as one herd.
    let base = ms.ceil().max(1.0);
    let jitter = (base * cfg.jitter_frac).min(cfg.jitter_max_ms as f64) * jitter_u.clamp(0.0, 1.0);
    let ms = (base + jitter).ceil() as u64;
    Decision::Owed { ms, reason, eta_ms: ms }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Refill;

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

    /// The input ratio's first count is taken whole within a factor of two:
    /// a tokenizer's difference at once; a call whose expected prompt cache
    /// had expired (counted ten times its estimate) starts it at 2, not 4,
    /// and the next counts bring it down.
    #[test]
    fn the_first_input_count_is_taken_whole_within_a_factor_of_two() {
        let cfg =
            PacingConfig { configured_tpm: Some(60_000), configured_rpm: Some(10_000), ..PacingConfig::default() };
        // `ask`'s input is 800 tokens (1 000 less a 200-token output reservation).
        let first = |counted| {
            let mut s = PacerState::default();
            assert_eq!(acquire(&mut s, &cfg, T0, &ask("a"), 0.0), Decision::Clear);
            let outcome =
                CallOutcome { input_tokens: Some(counted), used_tokens: Some(counted + 50), ..CallOutcome::default() };
            settle(&mut s, &cfg, T0 + 300, "a", &outcome);
            s
        };
        assert!((first(960).input_ratio - 1.2).abs() < 1e-9, "a tokenizer's 20 %, whole");
        assert!((first(480).input_ratio - 0.6).abs() < 1e-9, "and below");
        let mut s = first(8_000);
        assert!((s.input_ratio - 2.0).abs() < 1e-9, "an expired cache's count: {}", s.input_ratio);
        assert_eq!(acquire(&mut s, &cfg, T0 + 400, &ask("b"), 0.0), Decision::Clear);
        let exact = CallOutcome { input_tokens: Some(800), used_tokens: Some(850), ..CallOutcome::default() };
        settle(&mut s, &cfg, T0 + 700, "b", &exact);
        // One step (1.25) at 30 %: 0.7 × 2 + 0.3 × 1.6.
        assert!((s.input_ratio - 1.88).abs() < 1e-9, "the next count brings it down: {}", s.input_ratio);
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
            Decision::Owed { ms: 3_999, reason: OwedReason::FairShare, eta_ms: 3_999 }
        );
        let a = s.tenants["a"];
        assert_eq!(a.admitted, 1_000.0, "its tokens count as admitted");
        assert_eq!(a.finish, 1_000.0, "and move its finish tag: its next work turn stands behind them");
    }

    /// The line: a turn behind the head is parked without a look at the
    /// turns ahead (owed until a safety deadline, told its estimate); the
    /// head is owed until the refill brings it; the release at the head's
    /// time lets it go and times the next head; a settle that makes room
    /// releases the head at once; a head its host no longer holds leaves the
    /// line and the next is weighed.
    #[test]
    fn the_line_parks_once_and_releases_once() {
        use crate::release::{release, Everyone, Host, Move};
        let cfg = PacingConfig {
            configured_tpm: Some(60_000),
            configured_rpm: Some(100_000),
            jitter_frac: 0.0,
            ..PacingConfig::default()
        };
        assert!(cfg.parks);
        let mut s = PacerState::default();
        let big = |id| Ask { id, est: Estimate { tokens: 10_000, requests: 1, output: 0 }, ..ask(id) };
        for id in ["c1", "c2", "c3", "c4", "c5"] {
            assert_eq!(acquire(&mut s, &cfg, T0, &big(id), 0.0), Decision::Clear, "{id}");
        }
        // 10 000 left, 1 token a ms, 10 000 a turn above a 3 000 floor: the
        // head `a` owes 3 000 ms; `b` and `c` are parked behind it, their
        // estimates a turn's refill apart, due at the safety deadline.
        let owed = |s: &mut PacerState, id| match acquire(s, &cfg, T0, &big(id), 0.0) {
            Decision::Owed { ms, eta_ms, .. } => (ms, eta_ms),
            Decision::Clear => panic!("{id} is clear"),
        };
        assert_eq!(owed(&mut s, "a"), (3_000, 3_000));
        assert_eq!(owed(&mut s, "b"), (26_000, 13_000));
        assert_eq!(owed(&mut s, "c"), (46_000, 23_000));
        assert_eq!(release(&mut s, &cfg, T0 + 10, &mut Everyone), vec![], "nothing fits, the head's timer holds");
        // Asked a moment early, the head is owed the rest.
        assert!(matches!(acquire(&mut s, &cfg, T0 + 2_999, &big("a"), 0.0), Decision::Owed { ms: 1, .. }));
        // At its time the release lets it go and times the next head.
        let at = T0 + 3_000;
        assert_eq!(
            release(&mut s, &cfg, at, &mut Everyone),
            vec![Move::Release("a".into()), Move::Retime("b".into(), at + 10_000)]
        );
        assert_eq!(acquire(&mut s, &cfg, at, &big("a"), 0.0), Decision::Clear, "released: cleared");
        // A call that used none of its reservation gives it all back: `b` goes at once.
        settle(&mut s, &cfg, at + 1, "c1", &CallOutcome { used_tokens: Some(0), ..CallOutcome::default() });
        let moves = release(&mut s, &cfg, at + 1, &mut Everyone);
        assert_eq!(moves.first(), Some(&Move::Release("b".into())), "{moves:?}");
        // A head whose run ended while it waited leaves the line when it is weighed.
        struct Gone(&'static str);
        impl Host for Gone {
            fn release(&mut self, id: &str) -> bool {
                id != self.0
            }
            fn retime(&mut self, id: &str, _: Millis) -> bool {
                id != self.0
            }
            fn holds(&mut self, id: &str) -> bool {
                id != self.0
            }
        }
        assert!(s.waiters.contains_key("c"));
        release(&mut s, &cfg, at + 100_000, &mut Gone("c"));
        assert!(!s.waiters.contains_key("c"));
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
        // The probe's answer wakes the line (`b` was parked behind it): due
        // now, not cleared — it asks, as every turn does while nothing is paced.
        let woken = crate::release::release(&mut s, &cfg, T0 + 300, &mut crate::release::Everyone);
        assert_eq!(woken, vec![crate::release::Move::Retime("b".into(), T0 + 300)]);
        assert!(s.waiters.is_empty());
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
