//! One provider bucket (tokens or requests) as the pacer models it: owed time
//! from a snapshot.
//!
//! OpenAI's buckets refill continuously: `x-ratelimit-reset-tokens` is the time
//! until the bucket is *full* again, so the refill rate is
//! `(limit - remaining) / reset`, and a call that needs `n` tokens waits only
//! until `n` (plus the floor) have returned — not until the bucket is full, and
//! never less.
//!
//! The model keeps a *level*: what the provider's bucket holds minus what we
//! have sent and not yet seen settled. It rises with the refill rate and never
//! above the limit. Turns waiting in line hold nothing here: what they hold
//! for each other is derived from the line itself (`model.rs`).
//!
//! Header snapshots only ever *lower* the level (min of ours and theirs):
//! headers lag the calls still in flight, so a snapshot that shows more than we
//! think is stale, while one that shows less tells us of spending we did not
//! see (another account user, a provider-side estimate).

use crate::clock::Millis;
use serde::{Deserialize, Serialize};

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
    /// Level at `at_ms` (negative after a 429 or an overdraft).
    pub level: f64,
    /// When `level` was computed (Redis server clock).
    pub at_ms: Millis,
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
    /// Every charge cleared so far (cumulative), corrected at each settle to
    /// what the provider charged (its input count; nothing for a 429): the
    /// ledger the refund learner reads (`refund.rs`).
    #[serde(default)]
    pub sent: f64,
    /// Unused output settled while the refund share was not known (none of
    /// it credited), since the model last met the provider (a header lowered
    /// it): a refunding provider holds the level plus this, never above its
    /// limit. Credited at the learned share as the headers confirm it.
    #[serde(default)]
    pub withheld: f64,
}

impl Bucket {
    /// A full bucket of `limit` per minute.
    pub fn per_minute(limit: u64, now: Millis) -> Self {
        Self { limit: limit as f64, rate: limit as f64 / 60_000.0, level: limit as f64, at_ms: now, ..Self::default() }
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

    pub(crate) fn advance(&mut self, now: Millis) {
        if now > self.at_ms {
            self.level = self.level_at(now);
            self.at_ms = now;
        }
        self.cap_withheld();
    }

    /// A provider that gave back what we withheld would have filled up to its
    /// limit and no further: what passes it was never ours to credit.
    pub(crate) fn cap_withheld(&mut self) {
        self.withheld = self.withheld.min((self.limit - self.level).max(0.0));
    }

    /// Credits (or, negative, takes back) `tokens` given back to the bucket.
    pub(crate) fn credit(&mut self, tokens: f64) {
        self.level = (self.level + tokens).min(self.limit.max(self.level));
        self.charged_since = (self.charged_since - tokens).max(0.0);
    }

    /// Milliseconds until `short` tokens have returned, never past the reset.
    pub(crate) fn refill_ms(&self, now: Millis, short: f64) -> f64 {
        if short <= 0.0 {
            0.0
        } else if self.full_at_ms > now {
            (short / self.rate).min((self.full_at_ms - now) as f64)
        } else {
            short / self.rate
        }
    }

    /// At the provider's reset the bucket is full again, but for what was sent
    /// since: the level is lifted to that. (A window bucket
    /// refills at once at its boundary, which the continuous refill rate,
    /// estimated mid-window, cannot foresee.)
    pub(crate) fn lift(&mut self, now: Millis) {
        if self.full_at_ms > 0 && now >= self.full_at_ms {
            self.advance(now);
            self.level = self.level.max(self.limit - self.charged_since);
            self.full_at_ms = 0;
        }
    }

    /// What a call of `cost` needs in the bucket before it may go: the cost plus
    /// the floor, but never more than a full bucket (a call larger than the floor
    /// allows waits for a full bucket; one larger than the limit is sent when the
    /// bucket is full and the provider's "request too large" answers it).
    pub(crate) fn need(&self, cost: f64, floor: f64) -> f64 {
        (cost + floor * self.limit).min(self.limit)
    }

    /// Takes a header observation into the model. Only ever lowers the level:
    /// a call we cleared may reach the provider after these headers were sent,
    /// so headers that show more than we think can never be trusted to raise
    /// it (a rule that did, when no call was cleared after the headers, let
    /// real worker processes into 429s: clearance and receipt are not one instant).
    /// `refund` is what the observed call gave back after its headers were sent
    /// (the unused part of its reservation), which the headers cannot show yet.
    pub(crate) fn observe(
        &mut self,
        obs: &Observation,
        now: Millis,
        headers_at: Millis,
        refund: f64,
        max_pace_ms: u64,
    ) {
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
        // What the provider holds now: what it said, what was given back since
        // (which it could not show), and the refill since.
        let elapsed = (now - headers_at).max(0) as f64;
        let theirs = (remaining + refund + self.rate * elapsed).min(limit);
        if theirs < self.level {
            self.level = theirs;
            // The model meets the provider: nothing withheld before is owed.
            self.withheld = 0.0;
        }
        if obs.reset_ms.is_some() && headers_at >= self.full_seen_ms {
            self.full_seen_ms = headers_at;
            self.full_at_ms = headers_at + reset_ms as Millis;
            // The calls still in flight may not be in these headers yet.
            self.charged_since = self.in_flight;
        }
    }
}
