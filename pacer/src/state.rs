//! The pacer's state for one budget and model (`PacerState`): its buckets,
//! what it learned of the provider, the tenants' fair tags, and its records —
//! the line of waiting turns (`Waiter`) and the calls in flight (`Flight`).
//! `shared/src/pacer/lua/state.lua` and `line.lua` keep the same state in Redis.

use crate::bucket::Bucket;
use crate::fair::Tenant;
use crate::model::{Estimate, OwedReason};
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
    /// Its estimate as the worker counted it (charged at the input ratio
    /// when it is weighed).
    pub est: Estimate,
    /// What it is expected to use (input plus the learned share of the output
    /// reservation): its tenant's share is charged this when it goes.
    pub line: f64,
    /// Its tenant.
    pub tenant: String,
    /// When its queue entry is due (it is owed time until then): the head's
    /// timer, or behind it a safety deadline (the pacer releases it before);
    /// the baseline's waiters come back then to ask again.
    pub due_ms: Millis,
    /// When it is expected clear, as of its last ask or weighing (what its
    /// run shows; nothing is decided by it).
    pub clear_ms: Millis,
    /// When it first waited.
    pub since_ms: Millis,
    /// Why it waits.
    pub reason: OwedReason,
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
    /// When the reservation lapses unsettled: `reservation_ttl_ms` after it
    /// was cleared, or, released by the line, after its worker started it.
    pub expiry_ms: Millis,
    /// Its worker has it: cleared when it asked, or, released by the line
    /// (cleared while its turn waited in the queue), started since
    /// ([`crate::release::start`]). A call not started has reached no
    /// provider yet: no headers have seen it.
    #[serde(default = "started")]
    pub started: bool,
}

fn started() -> bool {
    true
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
    /// Counts again, on each bucket, what the line released that no worker
    /// has sent yet ([`Bucket::unsent`]): after each change to the calls in flight.
    pub fn count_unsent(&mut self) {
        let mut unsent = [0.0; BUCKETS];
        for f in self.flights.values().filter(|f| !f.started) {
            for (sum, held) in unsent.iter_mut().zip(f.held()) {
                *sum += held;
            }
        }
        for (bucket, unsent) in self.buckets_mut().into_iter().zip(unsent) {
            bucket.unsent = unsent;
        }
    }

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

    /// The head of the line: the waiter first by place, then reservation id
    /// (as a Redis sorted set orders them).
    pub fn head(&self) -> Option<(&str, &Waiter)> {
        self.waiters
            .iter()
            .min_by(|a, b| a.1.order.total_cmp(&b.1.order).then_with(|| a.0.cmp(b.0)))
            .map(|(id, w)| (id.as_str(), w))
    }

    /// Whether reservation `id`, at `order`, is (or would be) the head of the line.
    pub fn is_head(&self, id: &str, order: f64) -> bool {
        match self.head() {
            None => true,
            Some((head, _)) if head == id => true,
            Some((head, h)) => order.total_cmp(&h.order).then_with(|| id.cmp(head)).is_lt(),
        }
    }

    /// The age of the oldest waiter (watchdog), 0 when none waits.
    pub fn oldest_wait_ms(&self, now: Millis) -> Millis {
        self.waiters.values().map(|w| now - w.since_ms).max().unwrap_or(0).max(0)
    }
}
