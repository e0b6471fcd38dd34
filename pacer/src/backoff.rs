//! The reactive ladder: how long to wait before the next attempt, and when to stop.
//!
//! The rules, with their reasons (docs/pacing.md has the rest):
//!
//! - Only rate limits and transient failures retry; at most `max_attempts` (6)
//!   attempts for one call in all.
//! - A delay the server gave (`retry-after-ms`, `x-ms-retry-after-ms`,
//!   `retry-after`, the message's "try again in" hint) is paid **in full**, plus
//!   a small positive jitter, up to `max_retry_after_ms` (90 s). "Truncating a
//!   55 s answer to 30 sent the retry back inside a window we had just been told
//!   was closed: it 429'd again, burned a slot out of the bounded ladder, and
//!   made the total wait longer than honouring the number would have been."
//! - A server delay past `max_retry_after_ms` "is a daily or monthly quota, and
//!   parking a companion turn on it is worse than letting the bounded ladder fail the
//!   turn": we give up at once.
//! - Without a server delay, our own guess: `base × 2^(attempt-1)`, capped at
//!   `cap_ms`, ± `jitter`. "The cap bounds our guess and nothing else."
//!
//! Pure functions: randomness comes in as an `Rng`, so tests seed it.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::classify::{try_again_hint_ms, FailureKind};
use super::headers::HeaderSnapshot;

/// The ladder's knobs. `Default` is the policy's: 6 attempts, 1 s doubling
/// to 30 s with 20 % jitter, a server's delay honoured up to 90 s plus up to
/// 250 ms of jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts for one call, the first included (6).
    pub max_attempts: u32,
    /// The first backoff step, in ms (1 000).
    pub base_ms: u64,
    /// The largest backoff *guess*, in ms (30 000). Never applied to a server's delay.
    pub cap_ms: u64,
    /// Relative jitter on our guess: 0.2 is ± 20 %. Clamped to `0.0..=1.0`.
    pub jitter: f64,
    /// The longest server delay we park a turn for, in ms (90 000); a longer
    /// one fails the turn ([`GiveUp::RetryAfterTooLong`]).
    pub max_retry_after_ms: u64,
    /// Upper bound of the positive jitter added to a server delay, in ms (250),
    /// so that turns 429'd together do not return as a herd.
    pub server_jitter_max_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base_ms: 1_000,
            cap_ms: 30_000,
            jitter: 0.2,
            max_retry_after_ms: 90_000,
            server_jitter_max_ms: 250,
        }
    }
}

/// Where a retry's delay came from; reported by `turn.retry` and in logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelaySource {
    /// The `retry-after-ms` header.
    RetryAfterMs,
    /// Azure's `x-ms-retry-after-ms` header.
    #[serde(rename = "x_ms_retry_after_ms")]
    MsRetryAfterMs,
    /// The `retry-after` header (seconds or an HTTP date).
    RetryAfter,
    /// The error message's "try again in 1.146s".
    MessageHint,
    /// The error body's `details[].retryDelay` (Google's `RetryInfo`, e.g.
    /// `"33s"`): Gemini-style APIs that send no rate-limit headers.
    RetryDelay,
    /// The shared pacer state's reset (the caller's fallback; it needs Redis).
    SharedReset,
    /// Our own exponential guess.
    Backoff,
}

impl DelaySource {
    /// The name used in events and logs (the same as its JSON form).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RetryAfterMs => "retry_after_ms",
            Self::MsRetryAfterMs => "x_ms_retry_after_ms",
            Self::RetryAfter => "retry_after",
            Self::MessageHint => "message_hint",
            Self::RetryDelay => "retry_delay",
            Self::SharedReset => "shared_reset",
            Self::Backoff => "backoff",
        }
    }

    /// Whether the number came from the provider (and so is paid in full and
    /// bounded by `max_retry_after_ms`) rather than from our own guess.
    pub fn is_from_server(self) -> bool {
        !matches!(self, Self::Backoff)
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Requeue the turn to run again in `delay_ms`.
    Retry {
        /// How long to wait, in ms.
        delay_ms: u64,
        /// Where the delay came from.
        source: DelaySource,
    },
    /// Stop: the run fails (its `error.kind` follows the failure's kind:
    /// `shared::runs::ErrorKind`'s `From<FailureKind>`).
    GiveUp(GiveUp),
}

/// Why the ladder stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GiveUp {
    /// The failure is not worth retrying (quota, spend limit, too large, terminal 4xx).
    NotRetryable(FailureKind),
    /// The last of `max_attempts` attempts failed.
    AttemptsExhausted,
    /// The server asked for a wait longer than `max_retry_after_ms`: a daily or
    /// monthly quota, not a window worth parking a turn for.
    RetryAfterTooLong {
        /// The server's delay, in ms.
        delay_ms: u64,
    },
}

/// The server's own delay for a failed call, in this order:
/// `retry-after-ms`, `x-ms-retry-after-ms`, `retry-after` (already chosen in
/// that order by [`HeaderSnapshot::from_headers`]), then the message's "try
/// again in …" hint. The shared state's reset, the last source, is the caller's
/// to add (`.or(shared_reset.map(|ms| (ms, DelaySource::SharedReset)))`): it
/// needs Redis.
pub fn server_delay(snapshot: &HeaderSnapshot, message: &str) -> Option<(u64, DelaySource)> {
    if let Some(ms) = snapshot.retry_after_ms {
        return Some((ms, snapshot.retry_after_source.unwrap_or(DelaySource::RetryAfter)));
    }
    try_again_hint_ms(message).map(|ms| (ms, DelaySource::MessageHint))
}

/// Decides what follows the failure of attempt number `attempt` (1-based; 0 is
/// read as 1) of one call.
///
/// Order of the rules: not retryable → give up; the last attempt → give up;
/// a server delay → honoured in full plus `0..=server_jitter_max_ms`, or give
/// up if it is past `max_retry_after_ms`; else [`backoff_ms`].
///
/// One exception: a [`DelaySource::SharedReset`] past `max_retry_after_ms` is
/// not the provider answering this call but our state's view of a far reset
/// (a daily cap, clock skew). The policy is not to pace on such a reset but to
/// let the reactive layer carry the call, so it falls back to the ladder
/// instead of failing the turn.
pub fn next_retry<R: Rng + ?Sized>(
    policy: &RetryPolicy,
    attempt: u32,
    kind: FailureKind,
    server_delay: Option<(u64, DelaySource)>,
    rng: &mut R,
) -> RetryDecision {
    if !kind.is_retryable() {
        return RetryDecision::GiveUp(GiveUp::NotRetryable(kind));
    }
    if attempt.max(1) >= policy.max_attempts {
        return RetryDecision::GiveUp(GiveUp::AttemptsExhausted);
    }
    match server_delay {
        Some((ms, DelaySource::SharedReset)) if ms > policy.max_retry_after_ms => {}
        Some((ms, _)) if ms > policy.max_retry_after_ms => {
            return RetryDecision::GiveUp(GiveUp::RetryAfterTooLong { delay_ms: ms });
        }
        Some((ms, source)) => {
            // Paid in full, never less: the jitter is only ever added. The cap
            // is not applied here — "the cap bounds our guess and nothing else".
            let jitter = rng.random_range(0..=policy.server_jitter_max_ms);
            return RetryDecision::Retry { delay_ms: ms.saturating_add(jitter), source };
        }
        None => {}
    }
    RetryDecision::Retry { delay_ms: backoff_ms(policy, attempt, rng), source: DelaySource::Backoff }
}

/// Our guess when the server gave no delay: [`capped_base_ms`] ± `jitter`
/// (uniform, integer ms, always within the bounds).
///
/// The jitter applies after the cap, so that turns which have all climbed to
/// the cap still spread out instead of returning as one herd; the delay is
/// therefore at most `cap_ms × (1 + jitter)`.
pub fn backoff_ms<R: Rng + ?Sized>(policy: &RetryPolicy, attempt: u32, rng: &mut R) -> u64 {
    let guess = u128::from(capped_base_ms(policy, attempt));
    // The jitter in parts per million: exact integer bounds, no float drift.
    let ppm: u128 = if policy.jitter > 0.0 { (policy.jitter.min(1.0) * 1e6).round() as u128 } else { 0 };
    let low = (guess * (1_000_000 - ppm)).div_ceil(1_000_000);
    let high = guess * (1_000_000 + ppm) / 1_000_000;
    let to_u64 = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
    rng.random_range(to_u64(low)..=to_u64(high))
}

/// The ladder's step before jitter: `base_ms × 2^(attempt-1)`, at most `cap_ms`.
pub fn capped_base_ms(policy: &RetryPolicy, attempt: u32) -> u64 {
    let doublings = attempt.max(1) - 1;
    let factor = 1u64.checked_shl(doublings).unwrap_or(u64::MAX);
    policy.base_ms.saturating_mul(factor).min(policy.cap_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use FailureKind::*;

    fn rng(seed: u64) -> StdRng {
        StdRng::seed_from_u64(seed)
    }

    fn no_jitter() -> RetryPolicy {
        RetryPolicy { jitter: 0.0, server_jitter_max_ms: 0, ..RetryPolicy::default() }
    }

    #[test]
    fn defaults_are_the_specs() {
        let p = RetryPolicy::default();
        assert_eq!(
            (p.max_attempts, p.base_ms, p.cap_ms, p.jitter, p.max_retry_after_ms, p.server_jitter_max_ms),
            (6, 1_000, 30_000, 0.2, 90_000, 250)
        );
    }

    #[test]
    fn the_ladder_doubles_and_is_capped() {
        let p = RetryPolicy::default();
        let cases = [
            (0, 1_000),
            (1, 1_000),
            (2, 2_000),
            (3, 4_000),
            (4, 8_000),
            (5, 16_000),
            (6, 30_000),
            (7, 30_000),
            (64, 30_000),
            (u32::MAX, 30_000),
        ];
        for (attempt, want) in cases {
            assert_eq!(capped_base_ms(&p, attempt), want, "attempt {attempt}");
            assert_eq!(backoff_ms(&no_jitter(), attempt, &mut rng(1)), want, "attempt {attempt} without jitter");
        }
        // A huge base saturates instead of overflowing.
        let big = RetryPolicy { base_ms: u64::MAX / 2, cap_ms: u64::MAX, ..RetryPolicy::default() };
        assert_eq!(capped_base_ms(&big, 10), u64::MAX);
    }

    #[test]
    fn jitter_stays_within_twenty_percent_and_spreads() {
        let p = RetryPolicy::default();
        for attempt in 1..=8 {
            let guess = capped_base_ms(&p, attempt);
            let delays: Vec<u64> = (0..500).map(|seed| backoff_ms(&p, attempt, &mut rng(seed))).collect();
            let (min, max) = (*delays.iter().min().unwrap(), *delays.iter().max().unwrap());
            assert!(min * 5 >= guess * 4, "attempt {attempt}: {min} < 0.8 × {guess}");
            assert!(max * 5 <= guess * 6, "attempt {attempt}: {max} > 1.2 × {guess}");
            // The jitter is there: both sides of the guess are used, and most of the band.
            assert!(min < guess && max > guess, "attempt {attempt}: no spread ({min}..{max})");
            assert!((max - min) * 10 >= (guess * 4 / 10) * 8, "attempt {attempt}: band {min}..{max} too narrow");
        }
    }

    #[test]
    fn only_rate_limits_and_transient_failures_retry() {
        let p = RetryPolicy::default();
        for kind in [Quota, RequestTooLarge, SpendLimit, Terminal] {
            for delay in [None, Some((1_000, DelaySource::RetryAfter))] {
                assert_eq!(
                    next_retry(&p, 1, kind, delay, &mut rng(0)),
                    RetryDecision::GiveUp(GiveUp::NotRetryable(kind)),
                    "{kind:?} with {delay:?}"
                );
            }
        }
        for kind in [RateLimited, Transient] {
            assert!(matches!(next_retry(&p, 1, kind, None, &mut rng(0)), RetryDecision::Retry { .. }), "{kind:?}");
        }
    }

    #[test]
    fn six_attempts_in_all() {
        let p = RetryPolicy::default();
        for (attempt, retries) in [(1, true), (5, true), (6, false), (7, false), (u32::MAX, false)] {
            for kind in [RateLimited, Transient] {
                for delay in [None, Some((2_000, DelaySource::RetryAfter)), Some((100_000, DelaySource::RetryAfter))] {
                    let got = next_retry(&p, attempt, kind, delay, &mut rng(7));
                    if retries {
                        assert_ne!(got, RetryDecision::GiveUp(GiveUp::AttemptsExhausted), "attempt {attempt}");
                    } else {
                        assert_eq!(
                            got,
                            RetryDecision::GiveUp(GiveUp::AttemptsExhausted),
                            "attempt {attempt} {kind:?} {delay:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn server_delays_are_paid_in_full_and_not_capped() {
        use DelaySource::*;
        let p = RetryPolicy::default();
        // (server delay, source, attempt)
        let cases = [
            (55_000, RetryAfter, 1), // 55 s is honoured as ≥ 55 s, not cut to the 30 s cap
            (55_000, RetryAfterMs, 5),
            (31_000, MsRetryAfterMs, 2), // just over the cap
            (90_000, RetryAfter, 1),     // exactly max_retry_after_ms: still honoured
            (1_146, MessageHint, 3),     // shorter than the ladder's guess: the server's number wins
            (0, RetryAfter, 1),          // "now": only the jitter
            (45_000, SharedReset, 1),
            (12, RetryAfterMs, 4),
        ];
        for (ms, source, attempt) in cases {
            for seed in 0..200 {
                match next_retry(&p, attempt, RateLimited, Some((ms, source)), &mut rng(seed)) {
                    RetryDecision::Retry { delay_ms, source: got } => {
                        assert_eq!(got, source);
                        assert!(delay_ms >= ms, "{delay_ms} < server's {ms}");
                        assert!(delay_ms <= ms + p.server_jitter_max_ms, "{delay_ms} > {ms} + jitter");
                    }
                    other => panic!("{ms} ms from {source:?}: {other:?}"),
                }
            }
        }
        // The jitter really is added (so 429'd turns do not return as a herd).
        let delays: std::collections::HashSet<u64> = (0..200)
            .map(|seed| match next_retry(&p, 1, RateLimited, Some((55_000, RetryAfter)), &mut rng(seed)) {
                RetryDecision::Retry { delay_ms, .. } => delay_ms,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(delays.len() > 50, "server jitter does not spread: {delays:?}");
        // Transient failures with a server delay (503 + Retry-After) honour it too.
        assert_eq!(
            next_retry(&no_jitter(), 1, Transient, Some((40_000, RetryAfter)), &mut rng(0)),
            RetryDecision::Retry { delay_ms: 40_000, source: RetryAfter }
        );
    }

    #[test]
    fn server_delays_past_max_retry_after_give_up() {
        use DelaySource::*;
        let p = RetryPolicy::default();
        for (ms, source) in
            [(91_000, RetryAfter), (90_001, RetryAfterMs), (3_600_000, MessageHint), (u64::MAX, MsRetryAfterMs)]
        {
            assert_eq!(
                next_retry(&p, 1, RateLimited, Some((ms, source)), &mut rng(0)),
                RetryDecision::GiveUp(GiveUp::RetryAfterTooLong { delay_ms: ms }),
                "{ms} from {source:?}"
            );
        }
    }

    #[test]
    fn a_far_shared_reset_falls_back_to_the_ladder() {
        let got = next_retry(&no_jitter(), 3, RateLimited, Some((86_400_000, DelaySource::SharedReset)), &mut rng(0));
        assert_eq!(got, RetryDecision::Retry { delay_ms: 4_000, source: DelaySource::Backoff });
    }

    #[test]
    fn without_a_server_delay_the_ladder_guesses() {
        let p = no_jitter();
        for (attempt, want) in [(1, 1_000), (2, 2_000), (5, 16_000)] {
            assert_eq!(
                next_retry(&p, attempt, RateLimited, None, &mut rng(0)),
                RetryDecision::Retry { delay_ms: want, source: DelaySource::Backoff }
            );
        }
    }

    #[test]
    fn server_delay_sources_in_order() {
        use DelaySource::*;
        let with = |ms: Option<u64>, source: Option<DelaySource>| HeaderSnapshot {
            retry_after_ms: ms,
            retry_after_source: source,
            ..Default::default()
        };
        let hint = "Rate limit reached. Please try again in 1.146s.";
        let cases = [
            (with(Some(1_200), Some(RetryAfterMs)), hint, Some((1_200, RetryAfterMs))),
            (with(Some(1_500), Some(MsRetryAfterMs)), hint, Some((1_500, MsRetryAfterMs))),
            (with(Some(20_000), Some(RetryAfter)), hint, Some((20_000, RetryAfter))),
            (with(Some(0), Some(RetryAfter)), hint, Some((0, RetryAfter))),
            (with(None, None), hint, Some((1_146, MessageHint))),
            (with(None, None), "Please try again in 84ms.", Some((84, MessageHint))),
            (with(None, None), "Internal error", None),
            // A snapshot built by hand without a source: a plain Retry-After.
            (with(Some(3_000), None), "", Some((3_000, RetryAfter))),
        ];
        for (snap, message, want) in cases {
            assert_eq!(server_delay(&snap, message), want, "{snap:?} {message:?}");
        }
        // End to end: real headers, Azure's -1 skipped, then the message.
        let snap = HeaderSnapshot::from_headers([("retry-after-ms", "-1"), ("x-ms-retry-after-ms", "-1")], 0);
        assert_eq!(server_delay(&snap, hint), Some((1_146, MessageHint)));
    }

    #[test]
    fn delay_sources_name_themselves() {
        use DelaySource::*;
        for source in [RetryAfterMs, MsRetryAfterMs, RetryAfter, MessageHint, SharedReset, Backoff] {
            assert_eq!(serde_json::to_string(&source).unwrap(), format!("\"{}\"", source.as_str()));
            assert_eq!(source.is_from_server(), source != Backoff);
        }
        assert_eq!(MsRetryAfterMs.as_str(), "x_ms_retry_after_ms");
    }

    proptest! {
        /// Our guess is always within ±20 % of the capped step, and never more
        /// than 1.2 × the cap.
        #[test]
        fn backoff_within_jitter_of_the_capped_step(attempt in 0u32..200, seed in any::<u64>()) {
            let p = RetryPolicy::default();
            let guess = capped_base_ms(&p, attempt);
            let d = backoff_ms(&p, attempt, &mut rng(seed));
            prop_assert!(d * 5 >= guess * 4 && d * 5 <= guess * 6, "{} vs {}", d, guess);
            prop_assert!(d * 5 <= p.cap_ms * 6);
        }

        /// Any policy: no panic, and the delay stays within its band.
        #[test]
        fn backoff_any_policy(base in any::<u64>(), cap in any::<u64>(), jitter in any::<f64>(), attempt in any::<u32>(), seed in any::<u64>()) {
            let p = RetryPolicy { base_ms: base, cap_ms: cap, jitter, ..RetryPolicy::default() };
            let guess = u128::from(capped_base_ms(&p, attempt));
            prop_assert!(guess <= u128::from(cap));
            let d = u128::from(backoff_ms(&p, attempt, &mut rng(seed)));
            prop_assert!(d <= guess * 2 || d == u128::from(u64::MAX));
        }

        /// A server delay within bounds is never shortened, never capped, and
        /// grows by at most the server jitter.
        #[test]
        fn server_delay_is_never_shortened(ms in 0u64..=90_000, attempt in 1u32..6, seed in any::<u64>(), transient in any::<bool>()) {
            let p = RetryPolicy::default();
            let kind = if transient { Transient } else { RateLimited };
            match next_retry(&p, attempt, kind, Some((ms, DelaySource::RetryAfter)), &mut rng(seed)) {
                RetryDecision::Retry { delay_ms, source } => {
                    prop_assert_eq!(source, DelaySource::RetryAfter);
                    prop_assert!(delay_ms >= ms && delay_ms <= ms + p.server_jitter_max_ms);
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }

        /// Past max_retry_after_ms, the turn fails rather than parks.
        #[test]
        fn too_long_server_delay_gives_up(ms in 90_001u64.., attempt in 1u32..6, seed in any::<u64>()) {
            let got = next_retry(&RetryPolicy::default(), attempt, RateLimited, Some((ms, DelaySource::RetryAfter)), &mut rng(seed));
            prop_assert_eq!(got, RetryDecision::GiveUp(GiveUp::RetryAfterTooLong { delay_ms: ms }));
        }
    }
}
