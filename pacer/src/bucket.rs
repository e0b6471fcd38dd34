//! One provider bucket (tokens or requests) as the pacer models it: owed time
//! from a snapshot.
//!
//! Providers refill their buckets in one of two shapes, and the model learns
//! which from the headers (`vote`):
//! - **continuous** (OpenAI, Anthropic): `x-ratelimit-reset-tokens` is the time
//!   until the bucket is *full* again, so the refill rate is
//!   `(limit - remaining) / reset`, and a call that needs `n` tokens waits only
//!   until `n` (plus the floor) have returned — not until the bucket is full,
//!   and never less;
//! - **fixed window** (Azure-style windows, many gateways): nothing returns until
//!   the window's boundary, where the bucket is full at once; the reset counts
//!   down to that boundary. A call that does not fit waits for the boundary.
//!
//! The two tell themselves apart in any two snapshots of one period in which
//! more went missing: a continuous bucket's reset grows with what is missing,
//! a window's shrinks as its boundary comes closer. Until the votes say
//! otherwise a bucket is taken as continuous.
//!
//! The model keeps a *level*: what the provider's bucket holds minus what we
//! have sent and not yet seen settled. It rises with the refill rate (a window
//! bucket: only at its boundary) and never above the limit. Turns waiting in
//! line hold nothing here: what they hold for each other is derived from the
//! line itself (`model.rs`).
//!
//! Header snapshots only ever *lower* the level (min of ours and theirs):
//! headers lag the calls still in flight, so a snapshot that shows more than we
//! think is stale, while one that shows less tells us of spending we did not
//! see (another account user, a provider-side estimate).

use crate::Millis;
use serde::{Deserialize, Serialize};

/// One bucket (tokens or requests) as a response's headers describe it:
/// limit, remaining, time to full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Observation {
    /// The bucket's capacity (`x-ratelimit-limit-*`).
    pub limit: Option<u64>,
    /// What is left in it now (`x-ratelimit-remaining-*`).
    pub remaining: Option<u64>,
    /// Milliseconds from when the headers were read until the bucket is full
    /// again (`x-ratelimit-reset-*`, OpenAI's meaning; Anthropic's instant is
    /// converted to the same).
    pub reset_ms: Option<u64>,
}

impl Observation {
    /// No field was read.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// How a provider's bucket gets its budget back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum Refill {
    /// Not known yet (a bucket whose headers carry a reset, before the votes
    /// decide): paced as continuous, its refill counted apart so that it can
    /// be taken back if the votes say window; its waits are the sooner of the
    /// two shapes' and short (re-timed once the shape is known).
    #[default]
    Unknown,
    /// Continuously, at `rate` (OpenAI, Anthropic; configured limits; headers
    /// without a reset).
    Continuous,
    /// Whole at window boundaries: nothing returns before the boundary.
    Window,
}

impl Refill {
    /// Its number in the pacer's script (`<p>refill`).
    pub fn code(self) -> f64 {
        match self {
            Self::Unknown => 0.0,
            Self::Continuous => 1.0,
            Self::Window => 2.0,
        }
    }

    /// Reads [`Refill::code`].
    pub fn from_code(code: f64) -> Self {
        match code as i64 {
            1 => Self::Continuous,
            2 => Self::Window,
            _ => Self::Unknown,
        }
    }
}

/// What one answer's headers could not show of a bucket, for `observe`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Seen {
    /// When the headers were sent.
    pub headers_at: Millis,
    /// What changed at the provider after the headers were sent: what was
    /// given back since (the observed call's unused reservation, others'
    /// refunds) less what was cleared after the observed call (a call cleared
    /// later reaches the provider later).
    pub since: f64,
    /// What the observed call itself was charged here.
    pub own: f64,
    /// What calls cleared after the observed one were charged and have
    /// settled already (not in these headers, nor in flight).
    pub settled_after: f64,
    /// The unused output settled since the observed call was cleared: what a
    /// refunding provider gave back after these headers.
    pub unseen_refunds: f64,
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
    /// Of `in_flight`, what the line released that no worker has sent yet
    /// ([`crate::state::Flight::started`]): the provider does not hold it
    /// yet, so the level can refill only to the limit less this ([`Bucket::top`]).
    /// Kept from the calls in flight, not stored ([`crate::state::PacerState::count_unsent`]).
    #[serde(skip)]
    pub unsent: f64,
    /// Every charge cleared so far (cumulative), corrected at each settle to
    /// what the provider charged (its input count; nothing for a 429): the
    /// ledger the refund learner reads (`refund.rs`).
    #[serde(default)]
    pub sent: f64,
    /// Unused output settled and not credited — all of it while the refund
    /// share was not known, the rest of a share learned below one — since the
    /// model last met the provider (a header lowered it): a refunding
    /// provider holds the level plus this, never above its limit. Credited as
    /// far as the newest headers show it at the provider.
    #[serde(default)]
    pub withheld: f64,
    /// Evidence on the bucket's shape from pairs of snapshots (`vote`): up for
    /// a fixed window, down for a continuous refill, within ±[`MAX_VOTES`].
    #[serde(default)]
    pub votes: f64,
    /// How the bucket refills, as far as the votes tell.
    #[serde(default)]
    pub refill: Refill,
    /// The longest reset seen, ms: a window is at least this long.
    #[serde(default)]
    pub max_reset_ms: f64,
    /// The last snapshot with a reset taken in, for the votes: when its
    /// headers were sent (0: none yet), what it said was missing, and its reset.
    #[serde(default)]
    pub obs_at_ms: Millis,
    /// See `obs_at_ms`.
    #[serde(default)]
    pub obs_missing: f64,
    /// See `obs_at_ms`.
    #[serde(default)]
    pub obs_reset_ms: f64,
    /// A window bucket: the last boundary the level was lifted at (0: none).
    #[serde(default)]
    pub boundary_ms: Millis,
    /// A window bucket: when a call last went to find the next boundary
    /// (`may_probe`).
    #[serde(default)]
    pub probed_ms: Millis,
    /// The refill counted while the shape was unknown: taken back if the
    /// votes say window (which gives nothing back before its boundary).
    #[serde(default)]
    pub unknown_credit: f64,
    /// The limit was inferred from `remaining` alone (no limit header, none
    /// configured): it may grow as larger readings show more.
    #[serde(default)]
    pub assumed: bool,
}

/// Net votes that make a bucket a window (or continuous again).
pub const SHAPE_VOTES: f64 = 2.0;

/// Votes are kept within ± this, so a change of shape is seen within a few pairs.
pub const MAX_VOTES: f64 = 4.0;

/// The shortest window the guesses assume (`may_probe`): no provider refills
/// a window more often than every second.
const MIN_WINDOW_MS: f64 = 1_000.0;

/// A pair votes only when each snapshot misses, and they differ by, at least
/// this share of the limit (less is rounding) …
const VOTE_MISSING: f64 = 0.01;

/// … and both resets are at least this long (providers round them to the ms).
const MIN_VOTE_RESET_MS: f64 = 20.0;

/// Two ratios of reset to missing within this share of each other agree
/// (resets come rounded to the ms, or to the second past a minute: `6m0s`).
const VOTE_AGREE: f64 = 0.03;

impl Bucket {
    /// A full bucket of `limit` per minute.
    pub fn per_minute(limit: u64, now: Millis) -> Self {
        Self {
            limit: limit as f64,
            rate: limit as f64 / 60_000.0,
            level: limit as f64,
            at_ms: now,
            refill: Refill::Continuous,
            ..Self::default()
        }
    }

    /// Whether the bucket is known to refill whole at window boundaries.
    pub fn windowed(&self) -> bool {
        self.refill == Refill::Window
    }

    /// Whether we know this bucket's limit (and so pace on it).
    pub fn known(&self) -> bool {
        self.limit > 0.0 && self.rate > 0.0
    }

    /// The level at `now`: refilled since `at_ms`, never above [`Bucket::top`].
    pub fn level_at(&self, now: Millis) -> f64 {
        let elapsed = (now - self.at_ms).max(0) as f64;
        (self.level + self.refill_rate() * elapsed).min(self.top())
    }

    /// The most the bucket holds for calls not cleared yet: its limit, less
    /// what the line released that no worker has sent yet (the provider holds
    /// its limit at most, and those calls will take theirs from it).
    pub fn top(&self) -> f64 {
        self.limit - self.unsent
    }

    /// The continuous refill counted on, per ms: none for a window bucket,
    /// which refills only at its boundary (`lift`). A bucket whose shape is
    /// not known yet counts it and keeps the count (`unknown_credit`), to
    /// take it back if the votes say window.
    pub fn refill_rate(&self) -> f64 {
        if self.windowed() {
            0.0
        } else {
            self.rate
        }
    }

    /// The average refill, per ms, for what spaces turns rather than admits
    /// them (a tenant's cap, the recheck horizon). While the shape is not
    /// known, a rate read off a window's headers can be many times too slow;
    /// the faster of the two readings leaves a cap loose for a while rather
    /// than hold its tenant for a window.
    pub fn share_rate(&self) -> f64 {
        match self.refill {
            Refill::Unknown => self.rate.max(self.limit / self.window_ms()),
            _ => self.rate,
        }
    }

    /// A window bucket's length as far as it is known (for predictions only:
    /// the level is lifted at boundaries the headers name, never at one
    /// reckoned from this).
    fn window_ms(&self) -> f64 {
        self.max_reset_ms.max(1.0)
    }

    /// A window bucket whose next boundary no headers have named yet: the
    /// window after the last lift, as far as its length is known.
    fn guessed_boundary(&self, now: Millis) -> Option<Millis> {
        if self.refill == Refill::Continuous || self.full_at_ms > now || self.boundary_ms <= 0 {
            return None;
        }
        let window = self.window_ms().max(MIN_WINDOW_MS);
        let passed = ((now - self.boundary_ms) as f64 / window).floor() + 1.0;
        Some(self.boundary_ms + (passed * window).ceil() as Millis)
    }

    /// A window bucket that cannot say when it refills (no headers named its
    /// next reset, and the level is too low to send the call that would bring
    /// them): the head of the line may go, once per window, to find out. The
    /// provider answers it or refuses it with the reset; either way the next
    /// lift is known. Without this such a bucket could hold the fleet with
    /// budget available (docs/pacing.md, "Liveness is a property, not a case").
    pub(crate) fn may_probe(&self, now: Millis) -> bool {
        let window = self.window_ms().max(MIN_WINDOW_MS) as Millis;
        self.windowed() && self.full_at_ms <= now && now - self.boundary_ms >= window && now - self.probed_ms >= window
    }

    pub(crate) fn advance(&mut self, now: Millis) {
        if now > self.at_ms {
            let level = self.level_at(now);
            if self.refill == Refill::Unknown {
                self.unknown_credit += (level - self.level).max(0.0);
            }
            self.level = level;
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
        self.level = (self.level + tokens).min(self.top().max(self.level));
        self.charged_since = (self.charged_since - tokens).max(0.0);
    }

    /// Credits a refund the provider gave when an answer was done, which may
    /// have been before the settle brings it: a provider full then kept only
    /// what fitted, so the level is lifted no higher than `cap` (see
    /// `model.rs`, `refund_cap`).
    pub(crate) fn credit_refund(&mut self, tokens: f64, cap: f64) {
        let room = (cap - self.level).max(0.0);
        let credited = tokens.min(room).max(0.0);
        self.level += credited;
        self.charged_since = (self.charged_since - credited).max(0.0);
    }

    /// Milliseconds until `short` tokens have returned, never past the reset.
    /// A window bucket: at its boundary it holds its limit again, and one more
    /// limit at each boundary after (a prediction; the turn is re-timed).
    /// `deep`: a wait for more than the bucket is missing (a line deeper than
    /// a bucket) goes past the reset, at the rate after it; otherwise the
    /// reset caps every wait (a sleep so bounded is re-timed after it).
    pub(crate) fn refill_ms(&self, now: Millis, short: f64, deep: bool) -> f64 {
        if short <= 0.0 {
            0.0
        } else if self.refill == Refill::Unknown {
            // Either shape may come true: weighed again when the sooner would
            // bring it — the window's boundary, or the refill the level counts
            // meanwhile (at `rate`; a faster guess would have the head weighed
            // again and again before its level could hold it).
            let as_window = Bucket { refill: Refill::Window, ..*self }.refill_ms(now, short, deep);
            if self.rate > 0.0 {
                as_window.min(short / self.rate)
            } else {
                as_window
            }
        } else if self.refill == Refill::Window {
            let window = self.window_ms();
            if self.full_at_ms > now {
                let beyond = short + self.level - self.limit;
                let more = if beyond > 0.0 { (beyond / self.limit).ceil() } else { 0.0 };
                (self.full_at_ms - now) as f64 + more * window
            } else if let Some(guess) = self.guessed_boundary(now) {
                // No headers named the next boundary yet: the window after the
                // last one, where the head may go to find it (`may_probe`).
                (guess - now) as f64
            } else {
                short * window / self.limit
            }
        } else if self.full_at_ms > now {
            // Full at the reset the headers named (whatever rate was read);
            // a deep wait's rest, past what is missing, at `rate` after it.
            let beyond = if deep { (short - (self.limit - self.level).max(0.0)).max(0.0) } else { 0.0 };
            (short / self.rate).min((self.full_at_ms - now) as f64 + beyond / self.rate)
        } else {
            short / self.rate
        }
    }

    /// At the provider's reset the bucket is full again, but for what was sent
    /// since: the level is lifted to that. A continuous bucket (or one not
    /// known yet): less the charges since the headers that set the reset (a
    /// call we cleared may reach the provider after them). A window bucket
    /// refills whole at its boundary: less only `recent`, what was cleared so
    /// shortly before the boundary that the provider may have received it
    /// after (calls before were charged to the window that ended).
    pub(crate) fn lift(&mut self, now: Millis, recent: f64) {
        if self.full_at_ms > 0 && now >= self.full_at_ms {
            self.advance(now);
            let charged = if self.windowed() { recent } else { self.charged_since };
            self.level = self.level.max(self.limit - charged);
            if self.windowed() {
                self.charged_since = 0.0;
            }
            self.boundary_ms = self.full_at_ms;
            self.full_at_ms = 0;
        }
    }

    /// Takes one snapshot's shape evidence against the one before it (in
    /// whatever order they arrive). A continuous bucket's reset is the time
    /// its refill needs for what is missing, so reset / missing is one number
    /// (1 / rate) in every snapshot; a window's reset is the time to its
    /// boundary, which shrinks while more goes missing. So two snapshots whose
    /// ratios agree vote continuous (when more went missing from the first to
    /// the second, and the reset grew), and two whose resets moved against
    /// what is missing vote window.
    fn vote(&mut self, at: Millis, missing: f64, reset_ms: f64, limit: f64) {
        self.max_reset_ms = self.max_reset_ms.max(reset_ms);
        let (missing1, reset1) = (self.obs_missing, self.obs_reset_ms);
        let readable = |m: f64, r: f64| m >= VOTE_MISSING * limit && r >= MIN_VOTE_RESET_MS;
        if self.obs_at_ms > 0
            && readable(missing, reset_ms)
            && readable(missing1, reset1)
            && (missing - missing1).abs() >= VOTE_MISSING * limit
        {
            let (a, b) = (reset_ms * missing1, reset1 * missing);
            // What went missing between them, in the order they were sent.
            let forward = at >= self.obs_at_ms;
            let grew = if forward { missing - missing1 } else { missing1 - missing };
            let later = if forward { reset_ms - reset1 } else { reset1 - reset_ms };
            // Only a pair across which more went missing and the reset grew
            // with it votes continuous: a window whose refunds came back
            // between two snapshots shrinks what is missing while its reset
            // shrinks with time, and two close snapshots of a window move
            // little; either may agree within VOTE_AGREE as a continuous
            // bucket's do.
            if grew > 0.0 && later > 0.0 && (a - b).abs() <= VOTE_AGREE * a.max(b) {
                self.votes = (self.votes - 1.0).max(-MAX_VOTES);
            } else if (missing - missing1) * (reset_ms - reset1) < 0.0 {
                self.votes = (self.votes + 1.0).min(MAX_VOTES);
            }
            if self.votes >= SHAPE_VOTES {
                self.refill = Refill::Window;
            } else if self.votes <= -SHAPE_VOTES {
                self.refill = Refill::Continuous;
            }
        }
        (self.obs_at_ms, self.obs_missing, self.obs_reset_ms) = (at.max(1), missing, reset_ms);
    }

    /// What a call of `cost` needs in the bucket before it may go: the cost plus
    /// the floor, but never more than a full bucket (a call larger than the floor
    /// allows waits for a full bucket; one larger than the limit is sent when the
    /// bucket is full and the provider's "request too large" answers it).
    pub(crate) fn need(&self, cost: f64, floor: f64) -> f64 {
        (cost + floor * self.limit).min(self.limit)
    }

    /// The floor kept on this bucket at `now`: in a window, the floor's share
    /// of the window still to come (what is left at the boundary is lost, so
    /// the headroom for companion turns shrinks with the time they have to use
    /// it, to none at the boundary). Kept whole, 5 % of every window went
    /// unused, and a workload of six windows ran into a seventh.
    pub(crate) fn floor_at(&self, now: Millis, floor: f64) -> f64 {
        if self.windowed() && self.full_at_ms > now {
            floor * ((self.full_at_ms - now) as f64 / self.window_ms()).clamp(0.0, 1.0)
        } else {
            floor
        }
    }

    /// Takes a header observation into the model. Only ever lowers the level:
    /// a call we cleared may reach the provider after these headers were sent,
    /// so headers that show more than we think can never be trusted to raise
    /// it (a rule that did, when no call was cleared after the headers, let
    /// real worker processes into 429s: clearance and receipt are not one
    /// instant). `seen` says what the headers could not show (see [`Seen`]).
    pub(crate) fn observe(&mut self, obs: &Observation, now: Millis, seen: &Seen, max_pace_ms: u64) {
        let Seen { headers_at, since, own, settled_after, unseen_refunds } = *seen;
        let Some(remaining) = obs.remaining else {
            return;
        };
        let limit = match obs.limit {
            Some(0) => return,
            Some(limit) => {
                self.assumed = false;
                limit as f64
            }
            // `remaining` alone (Azure OpenAI): the limit is at least what
            // remained plus the observed call's own charge — exactly that when
            // it went into a full bucket, as the first call after a start
            // does — unless a limit is configured or was read before.
            None if self.known() && !self.assumed => self.limit,
            None => {
                self.assumed = true;
                self.limit.max(remaining as f64 + own)
            }
        };
        if limit <= 0.0 {
            return;
        }
        let reset_ms = obs.reset_ms.unwrap_or(0);
        if reset_ms > max_pace_ms {
            // A far-away reset is a daily cap or clock skew: not ours to pace on.
            return;
        }
        let remaining = (remaining as f64).min(limit);
        let missing = limit - remaining;
        let was_unknown = self.refill == Refill::Unknown;
        if obs.reset_ms.is_some() {
            self.vote(headers_at, missing, reset_ms as f64, limit);
        }
        // OpenAI's reset is the time until full: it gives the refill rate, when
        // enough is missing for it to say something (just after a window
        // bucket's boundary, a little missing and a long reset would make the
        // rate look many times slower than it is). A window's rate is its
        // limit per window, for the predictions that need one.
        if obs.reset_ms.is_none() {
            // Nothing says when it refills: a per-minute limit refilling continuously.
            self.refill = Refill::Continuous;
        }
        if self.windowed() {
            self.rate = limit / self.window_ms();
            self.rated = true;
        } else if reset_ms >= 20 && missing >= limit * 0.1 {
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
        if was_unknown && self.refill != Refill::Unknown {
            if self.windowed() {
                // A window gave nothing back before its boundary.
                self.level -= self.unknown_credit;
            }
            self.unknown_credit = 0.0;
        }
        // A window bucket's headers from before a boundary that has passed
        // since describe the window that ended.
        if self.windowed() && obs.reset_ms.is_some() && headers_at + reset_ms as Millis <= now {
            return;
        }
        // What the provider holds now: what it said, what changed since
        // (which it could not show), and the refill since.
        let elapsed = (now - headers_at).max(0) as f64;
        let theirs = (remaining + since + self.refill_rate() * elapsed).min(limit);
        if theirs < self.level {
            let lowered = self.level - theirs;
            self.level = theirs;
            // The model meets the provider: of the refunds withheld, only
            // those given after these headers are still owed. What these
            // headers lowered the level by may be charges they already
            // counted (a call cleared after the observed one, in a burst, may
            // have reached the provider first): outside a window, whose
            // boundary lifts a pessimistic level anyway, it is withheld too,
            // for later headers to give back as far as they show it there
            // (`learn_refund_share`); without that, nothing ever did.
            self.withheld = self.withheld.min(unseen_refunds) + if self.windowed() { 0.0 } else { lowered };
            if self.refill == Refill::Unknown {
                // Of the level now, only the refill since these headers was counted.
                self.unknown_credit = self.rate * elapsed;
            }
        }
        if obs.reset_ms.is_some() && headers_at >= self.full_seen_ms {
            self.full_seen_ms = headers_at;
            self.full_at_ms = headers_at + reset_ms as Millis;
            // The calls still in flight may not be in these headers yet, nor
            // those cleared after the observed call and settled already.
            self.charged_since = self.in_flight + settled_after;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_windows_floor_shrinks_to_its_boundary() {
        let b = Bucket {
            limit: 60_000.0,
            rate: 6.0,
            refill: Refill::Window,
            full_at_ms: 10_000,
            max_reset_ms: 10_000.0,
            ..Bucket::default()
        };
        assert_eq!(b.floor_at(0, 0.05), 0.05);
        assert!((b.floor_at(5_000, 0.05) - 0.025).abs() < 1e-12);
        assert_eq!(b.floor_at(10_000, 0.05), 0.05, "at the boundary a new window begins");
        let continuous = Bucket { refill: Refill::Continuous, ..b };
        assert_eq!(continuous.floor_at(9_000, 0.05), 0.05);
    }

    #[test]
    fn what_a_header_lowers_a_continuous_level_by_is_withheld_for_later_headers() {
        // A header may already count charges the model subtracts again (a
        // burst): outside a window, the lowering is kept in the ledger later
        // headers give back from (`learn_refund_share`); a window's boundary
        // lifts a pessimistic level anyway.
        let now = 100_000;
        let seen = Seen { headers_at: now, since: 0.0, own: 0.0, settled_after: 0.0, unseen_refunds: 500.0 };
        for (refill, reset_ms, withheld) in [(Refill::Continuous, 6_667, 10_500.0), (Refill::Window, 5_000, 500.0)] {
            let mut b = Bucket {
                limit: 60_000.0,
                rate: 6.0,
                rated: true,
                level: 30_000.0,
                at_ms: now,
                refill,
                votes: if refill == Refill::Window { MAX_VOTES } else { -MAX_VOTES },
                max_reset_ms: 10_000.0,
                full_at_ms: now + reset_ms,
                withheld: 2_000.0,
                ..Bucket::default()
            };
            let obs = Observation { limit: Some(60_000), remaining: Some(20_000), reset_ms: Some(reset_ms as u64) };
            b.observe(&obs, now, &seen, 90_000);
            assert_eq!(b.level, 20_000.0, "{refill:?}");
            // Of what was withheld, only the refunds after the header stay owed (500).
            assert_eq!(b.withheld, withheld, "{refill:?}");
        }
    }
}
