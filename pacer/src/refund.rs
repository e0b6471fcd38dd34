//! Does the provider give back the unused output reservation, and how much?
//!
//! Providers charge a call its input plus its whole `max_output_tokens` when
//! they admit it. Some give the unused output back when the answer is done
//! (our mock by default); OpenAI's documented admission rule and several
//! gateways keep it. A pacer that credits refunds the provider never gives sits
//! above the provider's bucket and sends into 429s; one that credits none
//! against a refunding provider leaves a quarter of the budget idle. So the
//! pacer learns the share from the headers (docs/pacing.md, "Provider shapes").
//!
//! Between two header snapshots of the token bucket, sent at `h1 < h2`:
//!
//! ```text
//! remaining2 = remaining1 + rate·(h2 − h1) − charged between + share · unused given back between
//! ```
//!
//! as long as the bucket cannot have reached its limit in between (there the
//! refill stops and the equation says nothing). The charges are the pacer's
//! own ledger of what it cleared (`Bucket::sent`, corrected to the provider's
//! input count at each settle) and the unused output is the ledger of what
//! settled calls left unused (`Bucket::refunded`); each call notes both when it
//! is cleared, and its settle brings the headers sent when it arrived. The
//! learner sums both sides over consecutive snapshots, so what a pair misplaces
//! (a refund that happened before a settle reported it) the next pair takes
//! back, and the ratio of the sums is the share.
//!
//! Two kinds of snapshot would mislead it, and are not taken:
//! - from a call cleared in a burst (another within `BURST_GAP_MS`): any of
//!   the burst may reach the provider first, so its headers may include calls
//!   its ledger mark does not (the simulator's first wave put the share of a
//!   provider that keeps everything at 2.1 this way);
//!
//! A pair in which no unused output was *settled* is still taken: the
//! provider gives a refund back when the answer is done, the ledger learns of
//! it at the settle a little later, so the refunds a pair's headers show are
//! often in the next pair's ledger. Skipping the pairs whose ledger saw none
//! dropped their refunds and not their ledger's, which read a refunding
//! provider as giving back three quarters (a bench trace: ~240 given a pair,
//! the ledger 0, 246 or 492).
//!
//! Until it has seen enough, the pacer credits no refund: it assumes the
//! documented rule (nothing comes back), which cannot send into a 429. Against
//! a refunding provider that costs only the first few seconds: the refunds it
//! withheld meanwhile — and, once it is learned, the part a share below one
//! leaves uncredited — are credited as the newest headers confirm them
//! (`Bucket::withheld`, credited by `learn_refund_share` in `model.rs`). The
//! line's spacing, a prediction, assumes the refunds meanwhile: a turn that wakes too early is re-timed, where one that
//! sleeps on a pessimistic prediction leaves budget idle.

use serde::{Deserialize, Serialize};

/// The learner's sums and its last snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RefundShare {
    /// Σ (remaining2 − remaining1 − refill + charged): what came back.
    pub given: f64,
    /// Σ unused output settled: what could have come back.
    pub unused: f64,
    /// Pairs that saw unused output.
    pub pairs: f64,
    /// The last snapshot: when its headers were sent (0: none yet) …
    pub at_ms: i64,
    /// … what they said remained …
    pub remaining: f64,
    /// … and the ledgers as its call noted them when it was cleared.
    pub sent: f64,
    /// See `sent`.
    pub refunded: f64,
    /// The newest headers seen from any call (snapshots come only from calls
    /// cleared alone).
    #[serde(default)]
    pub seen_ms: i64,
    /// The last snapshot's window ends then (a window bucket's boundary; 0:
    /// a continuous bucket): a pair that spans it says nothing.
    #[serde(default)]
    pub until_ms: i64,
    /// The last snapshot saw the bucket (all but) full: a window's start
    /// (`window_start`), or a cold start's probe. If nothing refills before
    /// the next (a window), refunds after it can only have been clamped
    /// where charges had not made room yet, which only lowers what is learned.
    #[serde(default)]
    pub full: bool,
}

/// The sums are scaled down past this many limits of unused output, so the
/// share follows a provider that changes (the last few limits weigh most).
const HORIZON_LIMITS: f64 = 2.0;

/// Not known before this share of the limit in unused output has been seen …
const MIN_UNUSED_OF_LIMIT: f64 = 0.1;

/// … over at least this many pairs (or two, when they saw this share of the
/// limit in unused output).
const MIN_PAIRS: f64 = 4.0;

/// See `MIN_PAIRS`.
const FEW_PAIRS_UNUSED_OF_LIMIT: f64 = 0.25;

/// A bucket that may have touched its limit says nothing: the margin below it.
const CLAMP_MARGIN: f64 = 0.02;

/// A learned share below this is read as 0, above `1 - SNAP` as 1: the sums
/// carry the noise of the few calls at their ends, and the shapes that exist
/// are "keep" and "refund".
const SNAP: f64 = 0.15;

/// One header snapshot of the token bucket, with the ledgers its call noted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    /// When the headers were sent.
    pub at_ms: i64,
    /// What they said remained.
    pub remaining: f64,
    /// `Bucket::sent` when the call was cleared (its own charge included).
    pub sent: f64,
    /// `Bucket::refunded` when the call was cleared.
    pub refunded: f64,
    /// A window bucket's boundary after these headers (0: continuous).
    pub until_ms: i64,
}

impl RefundShare {
    /// The share of unused output the provider gives back, once known.
    pub fn share(&self, limit: f64) -> Option<f64> {
        // Few pairs do when they saw much unused output (a window's pair
        // spans all of a window's refunds).
        let enough = self.pairs >= MIN_PAIRS || (self.pairs >= 2.0 && self.unused >= FEW_PAIRS_UNUSED_OF_LIMIT * limit);
        if !enough || self.unused < MIN_UNUSED_OF_LIMIT * limit || self.unused <= 0.0 {
            return None;
        }
        let share = (self.given / self.unused).clamp(0.0, 1.0);
        Some(if share < SNAP {
            0.0
        } else if share > 1.0 - SNAP {
            1.0
        } else {
            share
        })
    }

    /// Takes one snapshot of a bucket of `limit` refilled at `rate` per ms.
    /// An older snapshot than the last (a settle that came late) is ignored.
    pub fn learn(&mut self, snap: Snapshot, limit: f64, rate: f64, max_pace_ms: u64) {
        if snap.at_ms <= self.at_ms || limit <= 0.0 {
            return;
        }
        if self.at_ms > 0 && (self.until_ms == 0 || snap.at_ms < self.until_ms) {
            let span = (snap.at_ms - self.at_ms) as f64;
            let unused = (snap.refunded - self.refunded).max(0.0);
            let top = self.remaining + rate * span + unused;
            // From a full bucket that refills nothing between (a window's),
            // refunds can only have been clamped where charges had not made
            // room yet, which only lowers what is learned; a continuous
            // bucket's refill may have been clamped too, which the sums
            // cannot tell from a provider that keeps the charge.
            let full = self.full && rate <= 0.0;
            if span <= max_pace_ms as f64 && (full || top < (1.0 - CLAMP_MARGIN) * limit) {
                self.given += snap.remaining - self.remaining - rate * span + (snap.sent - self.sent);
                self.unused += unused;
                // A pair from a full bucket without refill between (a
                // window's, from its boundary or from a cold start) spans all
                // the refunds of its calls, exactly: it counts as two.
                self.pairs += if full { 2.0 } else { 1.0 };
                let horizon = HORIZON_LIMITS * limit;
                if self.unused > horizon {
                    let scale = horizon / self.unused;
                    self.given *= scale;
                    self.unused *= scale;
                }
            }
        }
        *self = Self {
            at_ms: snap.at_ms,
            remaining: snap.remaining,
            sent: snap.sent,
            refunded: snap.refunded,
            until_ms: snap.until_ms,
            // A bucket (all but) full, as at a window's start (a cold start's
            // probe): taken as such if it refills nothing until the next.
            full: snap.remaining >= (1.0 - CLAMP_MARGIN) * limit,
            ..*self
        };
    }

    /// A window bucket's boundary: the bucket holds `snap.remaining` (its
    /// limit, less what may have arrived after the boundary) with the ledgers
    /// as they are now. It starts the next pair: in a window the calls go
    /// out as one burst at the boundary, none alone, and the first call
    /// cleared alone afterwards pairs with this.
    pub fn window_start(&mut self, snap: Snapshot) {
        if snap.at_ms <= self.at_ms {
            return;
        }
        *self = Self {
            at_ms: snap.at_ms,
            remaining: snap.remaining,
            sent: snap.sent,
            refunded: snap.refunded,
            until_ms: snap.until_ms,
            full: true,
            ..*self
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider of `limit`, refilled at `rate`, giving back `share` of the
    /// unused output: calls of 500 input + 300 output reserved, 45 used, sent
    /// whenever the bucket holds 1 000, each answered 400 ms later.
    fn learned(share: f64) -> f64 {
        let (limit, rate) = (40_000.0, 40_000.0 / 60_000.0);
        let mut learner = RefundShare::default();
        let (mut level, mut sent, mut refunded) = (5_000.0, 0.0, 0.0);
        let mut pending: Vec<(i64, f64)> = vec![];
        for i in 0..2_000 {
            let t = 1_000 + i * 100;
            // Answers done by now give back their share (and settle).
            pending.retain(|&(done, unused)| {
                if done <= t {
                    level += share * unused;
                    refunded += unused;
                }
                done > t
            });
            level = (level + rate * 100.0).min(limit);
            if level >= 1_000.0 {
                level -= 800.0;
                sent += 800.0;
                learner.learn(
                    Snapshot { at_ms: t, remaining: level, sent, refunded, until_ms: 0 },
                    limit,
                    rate,
                    90_000,
                );
                pending.push((t + 400, 255.0));
            }
        }
        learner.share(limit).expect("learned")
    }

    #[test]
    fn it_learns_keep_refund_and_a_part() {
        assert_eq!(learned(0.0), 0.0);
        assert_eq!(learned(1.0), 1.0);
        assert!((learned(0.5) - 0.5).abs() < 0.05, "{}", learned(0.5));
    }

    #[test]
    fn nothing_is_known_from_a_full_bucket() {
        let mut learner = RefundShare::default();
        for i in 0..50 {
            let snap = Snapshot {
                at_ms: 1 + i * 1_000,
                remaining: 39_500.0,
                sent: 500.0 * i as f64,
                refunded: 0.0,
                until_ms: 0,
            };
            learner.learn(snap, 40_000.0, 40_000.0 / 60_000.0, 90_000);
        }
        assert_eq!(learner.share(40_000.0), None);
        assert_eq!(learner.pairs, 0.0);
    }
}
