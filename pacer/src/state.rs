//! The pacer's state for one budget and model (`PacerState`): its buckets,
//! what it learned of the provider, the tenants' fair tags, and its records —
//! the line of waiting turns (`Waiter`) and the calls in flight (`Flight`).
//! `shared/src/pacer/lua/state.lua` and `line.lua` keep the same state in Redis.

use crate::bucket::Bucket;
use crate::fair::{self, Tenant};
use crate::model::{Estimate, OwedReason, PacingConfig};
use crate::refund::RefundShare;
use crate::Millis;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A turn waiting in line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Waiter {
    /// Its place: companion turns first by arrival, then work turns by fair
    /// tag (ties by reservation id, as a Redis sorted set orders them).
    pub order: f64,
    /// Its estimate.
    pub est: Estimate,
    /// What it is expected to use (input plus the learned share of the output
    /// reservation): what it holds for the turns behind it.
    pub line: f64,
    /// Its tenant.
    pub tenant: String,
    /// When it may come back (never earlier): a checkpoint, at most when it
    /// is predicted clear.
    pub due_ms: Millis,
    /// When it is predicted clear (the refill it needs), as of its last ask.
    pub clear_ms: Millis,
    /// When it first waited.
    pub since_ms: Millis,
    /// Why it waits.
    pub reason: OwedReason,
}

impl Waiter {
    /// What it holds for the turns behind it, per bucket
    /// ([`PacerState::buckets`] order): its line cost, its requests, its
    /// input, the output it keeps (`kept`: [`PacerState::output_kept`]).
    pub(crate) fn holds(&self, kept: f64) -> [f64; BUCKETS] {
        let costs = self.est.costs();
        [self.line, costs[1], costs[2], costs[3] * kept]
    }
}

/// A call cleared and not yet settled.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Flight {
    /// What it reserved (zero on a bucket whose limit was unknown then).
    pub est: Estimate,
    /// The worker's own estimate of its input (before the input ratio; 0
    /// when the estimate did not split input and output), to learn the ratio from.
    pub input: u64,
    /// The token bucket's `refunded` when it was sent.
    pub mark: f64,
    /// The token bucket's `sent` when it was sent (its own charge included).
    #[serde(default)]
    pub sent: f64,
    /// What it reserved on the separate input and output buckets (where the
    /// provider reports them: Anthropic), 0 where they are not known.
    #[serde(default)]
    pub held_input: u64,
    /// See `held_input`.
    #[serde(default)]
    pub held_output: u64,
    /// The output bucket's `refunded` when it was sent.
    #[serde(default)]
    pub omark: f64,
    /// The `sent` ledgers of the request, input and output buckets when it
    /// was sent (the token bucket's is `sent`).
    #[serde(default)]
    pub marks: [f64; 3],
    /// No other call was cleared within [`crate::model::BURST_GAP_MS`] of it: its headers
    /// and its `sent` see the same calls (in a burst, calls cleared after it
    /// may reach the provider before it), so the refund learner may read them.
    #[serde(default)]
    pub alone: bool,
    /// When the reservation lapses unsettled.
    pub expiry_ms: Millis,
}

impl Flight {
    /// What it holds of each bucket, in [`PacerState::buckets`] order.
    pub(crate) fn held(&self) -> [f64; BUCKETS] {
        [self.est.tokens as f64, self.est.requests as f64, self.held_input as f64, self.held_output as f64]
    }
}

/// The whole pacer state for one budget and model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PacerState {
    /// The token bucket.
    pub tokens: Bucket,
    /// The request bucket.
    pub requests: Bucket,
    /// A separate input token bucket, where the provider reports one
    /// (`anthropic-ratelimit-input-tokens-*`): charged a call's input.
    #[serde(default)]
    pub input: Bucket,
    /// A separate output token bucket (`anthropic-ratelimit-output-tokens-*`):
    /// charged a call's output reservation, its unused part given back when
    /// the answer is done (Anthropic estimates output from `max_tokens` and
    /// corrects it at the end, as documented).
    #[serde(default)]
    pub output: Bucket,
    /// A 429 closed the window until then: nothing is admitted before.
    pub blocked_until_ms: Millis,
    /// With nothing known yet, a probe call is out until then.
    pub probe_until_ms: Millis,
    /// A call was answered without rate-limit headers while nothing was known
    /// or configured: no proactive pacing (every call is clear) until headers
    /// arrive.
    #[serde(default)]
    pub headerless: bool,
    /// The token bucket of a budget without headers is learned from its 429s
    /// (`learn_headerless`): the tokens its answered calls used since
    /// `hl_since_ms` (the last cut, or the first call), …
    #[serde(default)]
    pub hl_used: f64,
    /// … since when, …
    #[serde(default)]
    pub hl_since_ms: Millis,
    /// … when the learned rate was last cut (a 429 of a call cleared before
    /// was sent at the old rate and cuts nothing), …
    #[serde(default)]
    pub hl_cut_ms: Millis,
    /// … when an answer last grew it, …
    #[serde(default)]
    pub hl_grow_ms: Millis,
    /// … the most one answered call used (no bucket is smaller than two), …
    #[serde(default)]
    pub hl_max: f64,
    /// … and, after the first cut, what the calls cleared before it that
    /// were answered after it used, over the span they were sent in (ms; 0:
    /// none): a cold fleet's first 429 comes before most of its first wave's
    /// answers, which lift the rate as they come.
    #[serde(default)]
    pub hl_prev: f64,
    /// See `hl_prev`.
    #[serde(default)]
    pub hl_prev_span: f64,
    /// When headers were last read.
    pub observed_at_ms: Millis,
    /// When a call was last cleared (the watchdog's "time since admission").
    pub last_admit_ms: Millis,
    /// Which call that was (a call cleared right after it is not alone, nor is it).
    #[serde(default)]
    pub last_admit_id: String,
    /// Output tokens used / output tokens reserved, averaged over settled
    /// calls (0 = not yet known, read as 1). A waiter holds the input plus this
    /// share of its output reservation for the turns behind it: a call
    /// reserves its whole `max_output_tokens` but usually gives most of it
    /// back, and a line spaced by reservations would leave the refunds idle.
    pub usage_ratio: f64,
    /// Input tokens the provider counted / input tokens estimated, learned
    /// at every settle (0 = not yet known, read as 1). Each process's worker
    /// estimates with its own tokenizer; the provider charges by its own
    /// count. Asks are charged by the provider's count: a model that charged
    /// less than the provider would sit below it after every header seen while
    /// such a call was in flight, for good (headers only lower the level).
    /// Shared by every process, and taught by the probe before the first wave.
    #[serde(default)]
    pub input_ratio: f64,
    /// How long an answered call takes from its clearance to its settle, ms,
    /// averaged (0 = not yet known): what a turn waits for when what it is
    /// short of is coming back from the calls in flight.
    #[serde(default)]
    pub call_ms: f64,
    /// Whether, and how much of, the unused output the provider gives back
    /// (`refund.rs`), learned from the headers.
    #[serde(default)]
    pub refunds: RefundShare,
    /// Fair admission's system virtual time (see `fair.rs`).
    pub fair_time: f64,
    /// Each tenant's fair-admission state.
    pub tenants: BTreeMap<String, Tenant>,
    /// The line: turns owed time, by reservation id.
    pub waiters: BTreeMap<String, Waiter>,
    /// Calls in flight, by reservation id.
    pub flights: BTreeMap<String, Flight>,
}

/// The buckets a budget may know, in one order: the combined token bucket,
/// requests, and the separate input and output token buckets.
pub(crate) const BUCKETS: usize = 4;

impl PacerState {
    /// Every bucket, in the order of `Estimate::costs`.
    pub fn buckets(&self) -> [&Bucket; BUCKETS] {
        [&self.tokens, &self.requests, &self.input, &self.output]
    }

    /// See [`PacerState::buckets`].
    pub(crate) fn buckets_mut(&mut self) -> [&mut Bucket; BUCKETS] {
        [&mut self.tokens, &mut self.requests, &mut self.input, &mut self.output]
    }

    /// Whether any bucket's limit is known (and so the budget is paced).
    pub fn any_known(&self) -> bool {
        self.buckets().iter().any(|b| b.known())
    }

    /// The share of its output reservation a call is expected to keep on the
    /// output bucket (which gives the unused part back).
    pub(crate) fn output_kept(&self) -> f64 {
        if self.usage_ratio > 0.0 {
            self.usage_ratio.clamp(0.05, 1.0)
        } else {
            1.0
        }
    }

    /// What the provider will charge for `est`: its input part at the
    /// learned input ratio (an estimate that does not split is taken as is).
    pub fn charged(&self, est: Estimate) -> Estimate {
        if self.input_ratio <= 0.0 || est.output == 0 {
            return est;
        }
        let output = est.output.min(est.tokens);
        let input = (est.tokens - output) as f64;
        Estimate { tokens: (input * self.input_ratio).ceil() as u64 + output, ..est }
    }

    /// The share of unused output the provider gives back, credited to the
    /// level: none until learned (the documented rule, which cannot overdraw).
    pub fn refund_share(&self) -> f64 {
        self.learned_share().unwrap_or(0.0)
    }

    /// The refund share once known. A token bucket never described by
    /// headers (configured by `PACELINE_TPM`, or learned from 429s by
    /// `learn_headerless`) is the workers' own: it is charged what a call
    /// used, so the unused output comes back whole.
    pub fn learned_share(&self) -> Option<f64> {
        if self.observed_at_ms == 0 && self.tokens.known() {
            return Some(1.0);
        }
        self.refunds.share(self.tokens.limit)
    }

    /// What a turn of `est` is expected to use (its line cost): its input,
    /// the output it uses, and the unused output the provider keeps.
    pub fn line_cost(&self, est: Estimate) -> f64 {
        let ratio = if self.usage_ratio > 0.0 { self.usage_ratio.clamp(0.05, 1.0) } else { 1.0 };
        // A prediction: until the share is learned, the refunds are assumed.
        let share = self.learned_share().unwrap_or(1.0);
        let kept = ratio + (1.0 - ratio) * (1.0 - share);
        let (input, output) = est.split();
        (input + output * kept).ceil()
    }

    /// Whether waits are slept whole and re-timed by pull-ins
    /// ([`PacingConfig::whole_waits`]): not while a bucket is guessed — learned
    /// without headers, or its limit inferred from `remaining` alone — whose
    /// predictions are only as good as the guess (a pull-in would send a
    /// burst into a bucket that is not there).
    pub fn waits_whole(&self, cfg: &PacingConfig) -> bool {
        cfg.whole_waits && !self.headerless && !self.buckets().iter().any(|b| b.known() && b.assumed)
    }

    /// The least work tag still in line.
    pub(crate) fn least_work_tag(&self) -> Option<f64> {
        self.waiters.values().map(|w| w.order).filter(|o| fair::is_work(*o)).min_by(f64::total_cmp)
    }

    /// What the turns ahead of `(order, id)` hold. A waiter more than
    /// `late_ms` past its due time holds nothing.
    pub(crate) fn ahead_of(&self, order: f64, id: &str, tenant: &str, now: Millis, late_ms: u64) -> Ahead {
        let mut ahead = Ahead::default();
        let kept = self.output_kept();
        for (other, w) in &self.waiters {
            let before = match w.order.total_cmp(&order) {
                std::cmp::Ordering::Less => true,
                std::cmp::Ordering::Equal => other.as_str() < id,
                std::cmp::Ordering::Greater => false,
            };
            if before && other != id && now <= w.due_ms + late_ms as Millis {
                for (sum, held) in ahead.held.iter_mut().zip(w.holds(kept)) {
                    *sum += held;
                }
                ahead.other_tenant |= fair::is_work(w.order) && w.tenant != tenant;
                ahead.last_clear_ms = ahead.last_clear_ms.max(w.clear_ms);
            }
        }
        ahead
    }

    /// The age of the oldest waiter (watchdog), 0 when none waits.
    pub fn oldest_wait_ms(&self, now: Millis) -> Millis {
        self.waiters.values().map(|w| now - w.since_ms).max().unwrap_or(0).max(0)
    }
}

/// What the turns ahead of one in line hold.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ahead {
    /// What they are expected to use of each bucket ([`PacerState::buckets`]
    /// order): their line cost, their requests, their input, the output they keep.
    pub(crate) held: [f64; BUCKETS],
    /// Another tenant's work turn is among them.
    pub(crate) other_tenant: bool,
    /// The latest predicted clear time among them (0: none).
    pub(crate) last_clear_ms: Millis,
}
