//! The buckets one provider shape keeps, and one admission over all of them:
//! OpenAI's token and request buckets, or Anthropic's input, output and
//! request buckets. Pure over the injected clock, like `bucket.rs`, so the
//! all-or-nothing rule is tested without a server.

use crate::bucket::{Bucket, BucketMode, Refusal};
use crate::config::MockConfig;

/// A daily cap's window: a fixed day, so nothing returns until it ends.
pub const DAY_US: u64 = 86_400 * 1_000_000;

/// Which bucket a decision is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The request bucket (`--rpm`).
    Requests,
    /// The one bucket of input plus output tokens (`--tpm`).
    Tokens,
    /// Anthropic's input token bucket (`--itpm`).
    InputTokens,
    /// Anthropic's output token bucket (`--otpm`).
    OutputTokens,
}

/// What one request costs at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// Input tokens counted from the body.
    pub input: u64,
    /// The output limit reserved (`max_output_tokens`, or the default).
    pub output: u64,
}

impl Charge {
    /// Input plus output limit: what one shared token bucket is charged.
    pub fn total(&self) -> u64 {
        self.input + self.output
    }
}

/// Why a request was not admitted. Nothing was taken from any bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// More than the bucket's whole capacity: no wait makes it fit.
    TooLarge {
        /// The bucket.
        limit: Limit,
        /// Its capacity per window.
        capacity: u64,
        /// What the request needs from it.
        requested: u64,
    },
    /// Not now. Of the buckets that refused, the one that refills last, so a
    /// retry after `wait_us` finds every bucket able to take its part.
    Wait {
        /// The bucket.
        limit: Limit,
        /// Microseconds until it holds the request's part.
        wait_us: u64,
        /// Its capacity per window.
        capacity: u64,
        /// What is taken from it now (capacity minus remaining).
        used: u64,
        /// What the request needs from it.
        requested: u64,
    },
}

/// One bucket as the rate-limit headers describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Level {
    /// Capacity per window.
    pub limit: u64,
    /// Whole units available.
    pub remaining: u64,
    /// Microseconds until the bucket is full again.
    pub reset_us: u64,
}

impl Level {
    fn of(bucket: &Bucket) -> Self {
        Self { limit: bucket.capacity(), remaining: bucket.remaining(), reset_us: bucket.reset_us() }
    }

    /// Of two buckets, the one with the smaller share left (remaining / limit);
    /// `self` on a tie. Anthropic's `tokens-*` headers describe this one.
    pub fn scarcer(self, other: Self) -> Self {
        // remaining_a / limit_a <= remaining_b / limit_b, without division.
        if self.remaining as u128 * other.limit as u128 <= other.remaining as u128 * self.limit as u128 {
            self
        } else {
            other
        }
    }
}

/// Every bucket right after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// The request bucket.
    pub requests: Level,
    /// The token bucket; with split buckets, the scarcer of input and output.
    pub tokens: Level,
    /// The input token bucket, when input and output are split.
    pub input: Option<Level>,
    /// The output token bucket, when input and output are split.
    pub output: Option<Level>,
}

/// Where the tokens go.
#[derive(Debug, Clone)]
enum TokenBuckets {
    /// One bucket for input plus output limit (OpenAI, Azure).
    Shared(Bucket),
    /// Input and output apart (Anthropic's ITPM and OTPM).
    Split { input: Bucket, output: Bucket },
}

/// The buckets of an enforcing mock, decided together.
#[derive(Debug, Clone)]
pub struct RateLimits {
    requests: Bucket,
    tokens: TokenBuckets,
}

impl RateLimits {
    /// Full buckets at time 0 for `cfg`: split input and output buckets when
    /// `cfg.headers` is Anthropic's, one token bucket otherwise. A daily cap
    /// turns every token bucket into a fixed 24 h window.
    pub fn new(cfg: &MockConfig) -> Self {
        let window_us = cfg.window.as_micros().max(1) as u64;
        let token_bucket = |capacity| {
            if cfg.daily_cap {
                Bucket::new(capacity, DAY_US, BucketMode::Window)
            } else {
                Bucket::new(capacity, window_us, cfg.bucket)
            }
        };
        let tokens = if cfg.headers.splits_tokens() {
            TokenBuckets::Split {
                input: token_bucket(cfg.input_capacity()),
                output: token_bucket(cfg.output_capacity()),
            }
        } else {
            TokenBuckets::Shared(token_bucket(cfg.tpm))
        };
        Self { requests: Bucket::new(cfg.rpm, window_us, cfg.bucket), tokens }
    }

    /// Brings every bucket up to `now_us`.
    pub fn refill(&mut self, now_us: u64) {
        self.requests.refill(now_us);
        match &mut self.tokens {
            TokenBuckets::Shared(tokens) => tokens.refill(now_us),
            TokenBuckets::Split { input, output } => {
                input.refill(now_us);
                output.refill(now_us);
            }
        }
    }

    /// Each bucket with what `charge` takes from it, in the order they are
    /// asked (requests first, as a 429 names it first on a tie).
    fn parts(&mut self, charge: Charge) -> Vec<(Limit, &mut Bucket, u64)> {
        let mut parts = vec![(Limit::Requests, &mut self.requests, 1)];
        match &mut self.tokens {
            TokenBuckets::Shared(tokens) => parts.push((Limit::Tokens, tokens, charge.total())),
            TokenBuckets::Split { input, output } => {
                parts.push((Limit::InputTokens, input, charge.input));
                parts.push((Limit::OutputTokens, output, charge.output));
            }
        }
        parts
    }

    /// Admits `charge` at `now_us` on every bucket, or on none: each bucket is
    /// asked before any is taken from.
    pub fn admit(&mut self, now_us: u64, charge: Charge) -> Result<(), Refused> {
        self.refill(now_us);
        let mut parts = self.parts(charge);
        let mut refused: Option<Refused> = None;
        for (limit, bucket, amount) in &parts {
            let (capacity, amount) = (bucket.capacity(), *amount);
            match bucket.check(amount) {
                Ok(()) => {}
                // No wait helps, whatever the others say.
                Err(Refusal::TooLarge) => return Err(Refused::TooLarge { limit: *limit, capacity, requested: amount }),
                Err(Refusal::Wait { wait_us }) => {
                    let longer = match refused {
                        Some(Refused::Wait { wait_us: before, .. }) => wait_us > before,
                        _ => true,
                    };
                    if longer {
                        let used = capacity - bucket.remaining();
                        refused = Some(Refused::Wait { limit: *limit, wait_us, capacity, used, requested: amount });
                    }
                }
            }
        }
        if let Some(refused) = refused {
            return Err(refused);
        }
        for (_, bucket, amount) in &mut parts {
            // Every bucket said yes at this very instant, so none refuses now.
            let taken = bucket.try_take(now_us, *amount);
            debug_assert!(taken.is_ok(), "a bucket refused what it had just allowed");
        }
        Ok(())
    }

    /// Gives back unused output (the shared bucket, or the output bucket).
    pub fn give_back(&mut self, now_us: u64, unused_output: u64) {
        match &mut self.tokens {
            TokenBuckets::Shared(tokens) => tokens.give_back(now_us, unused_output),
            TokenBuckets::Split { output, .. } => output.give_back(now_us, unused_output),
        }
    }

    /// Every bucket as of the last refill.
    pub fn snapshot(&self) -> Snapshot {
        let requests = Level::of(&self.requests);
        match &self.tokens {
            TokenBuckets::Shared(tokens) => Snapshot { requests, tokens: Level::of(tokens), input: None, output: None },
            TokenBuckets::Split { input, output } => {
                let (input, output) = (Level::of(input), Level::of(output));
                Snapshot { requests, tokens: input.scarcer(output), input: Some(input), output: Some(output) }
            }
        }
    }

    /// The bucket behind `limit`, if this shape has one. `Tokens` with split
    /// buckets is the scarcer of input and output, as in [`Snapshot::tokens`].
    pub fn bucket(&self, limit: Limit) -> Option<&Bucket> {
        match (limit, &self.tokens) {
            (Limit::Requests, _) => Some(&self.requests),
            (Limit::Tokens, TokenBuckets::Shared(tokens)) => Some(tokens),
            (Limit::Tokens, TokenBuckets::Split { input, output }) => {
                Some(if Level::of(input).scarcer(Level::of(output)) == Level::of(input) { input } else { output })
            }
            (Limit::InputTokens, TokenBuckets::Split { input, .. }) => Some(input),
            (Limit::OutputTokens, TokenBuckets::Split { output, .. }) => Some(output),
            (Limit::InputTokens | Limit::OutputTokens, TokenBuckets::Shared(_)) => None,
        }
    }

    /// The largest overdraft any bucket ever reached (0 unless admission is broken).
    pub fn largest_overdraft(&self) -> u64 {
        let tokens = match &self.tokens {
            TokenBuckets::Shared(tokens) => tokens.largest_overdraft(),
            TokenBuckets::Split { input, output } => input.largest_overdraft().max(output.largest_overdraft()),
        };
        tokens.max(self.requests.largest_overdraft())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::HeaderStyle;
    use std::time::Duration;

    const SEC: u64 = 1_000_000;

    fn anthropic(itpm: u64, otpm: u64, rpm: u64) -> RateLimits {
        RateLimits::new(&MockConfig {
            headers: HeaderStyle::Anthropic,
            itpm: Some(itpm),
            otpm: Some(otpm),
            rpm,
            window: Duration::from_secs(60),
            ..MockConfig::default()
        })
    }

    #[test]
    fn openai_charges_input_plus_output_on_one_bucket() {
        let mut l = RateLimits::new(&MockConfig { tpm: 1000, ..MockConfig::default() });
        l.admit(0, Charge { input: 100, output: 300 }).unwrap();
        let snap = l.snapshot();
        assert_eq!((snap.tokens.remaining, snap.requests.remaining), (600, 599));
        assert_eq!((snap.input, snap.output), (None, None));
        l.give_back(0, 200);
        assert_eq!(l.snapshot().tokens.remaining, 800);
    }

    #[test]
    fn anthropic_charges_input_and_output_on_their_own_buckets() {
        let mut l = anthropic(1000, 200, 10);
        l.admit(0, Charge { input: 100, output: 150 }).unwrap();
        let snap = l.snapshot();
        assert_eq!(snap.input.unwrap().remaining, 900);
        assert_eq!(snap.output.unwrap().remaining, 50);
        assert_eq!(snap.tokens, snap.output.unwrap(), "50/200 left is scarcer than 900/1000");
        l.give_back(0, 100);
        let snap = l.snapshot();
        assert_eq!(snap.output.unwrap().remaining, 150, "unused output comes back");
        assert_eq!(snap.input.unwrap().remaining, 900, "input never does");
    }

    #[test]
    fn a_refusal_on_one_bucket_takes_nothing_from_the_others() {
        let mut l = anthropic(1000, 200, 10);
        l.admit(0, Charge { input: 10, output: 150 }).unwrap();
        let refused = l.admit(0, Charge { input: 10, output: 100 }).unwrap_err();
        assert!(matches!(refused, Refused::Wait { limit: Limit::OutputTokens, used: 150, requested: 100, .. }));
        let snap = l.snapshot();
        assert_eq!(snap.input.unwrap().remaining, 990, "the input part was not taken");
        assert_eq!(snap.requests.remaining, 9, "nor the request slot");
    }

    #[test]
    fn the_wait_is_the_longest_of_the_buckets_that_refuse() {
        // A 60 s window: input refills 100 tokens/s, output 1 token/s.
        let mut l = anthropic(6000, 60, 10);
        l.admit(0, Charge { input: 6000, output: 60 }).unwrap();
        match l.admit(0, Charge { input: 100, output: 5 }) {
            // Input: 100 tokens at 100/s = 1 s; output: 5 tokens at 1/s = 5 s.
            Err(Refused::Wait { limit, wait_us, .. }) => assert_eq!((limit, wait_us), (Limit::OutputTokens, 5 * SEC)),
            other => panic!("{other:?}"),
        }
        assert!(l.admit(5 * SEC - 1, Charge { input: 100, output: 5 }).is_err());
        assert!(l.admit(5 * SEC, Charge { input: 100, output: 5 }).is_ok(), "on time, every bucket has room");
    }

    #[test]
    fn more_than_a_bucket_holds_is_too_large_on_that_bucket() {
        let mut l = anthropic(1000, 200, 10);
        assert_eq!(
            l.admit(0, Charge { input: 1001, output: 1 }),
            Err(Refused::TooLarge { limit: Limit::InputTokens, capacity: 1000, requested: 1001 })
        );
        assert_eq!(
            l.admit(0, Charge { input: 1, output: 201 }),
            Err(Refused::TooLarge { limit: Limit::OutputTokens, capacity: 200, requested: 201 })
        );
        let mut shared = RateLimits::new(&MockConfig { tpm: 1000, ..MockConfig::default() });
        assert_eq!(
            shared.admit(0, Charge { input: 600, output: 401 }),
            Err(Refused::TooLarge { limit: Limit::Tokens, capacity: 1000, requested: 1001 })
        );
    }

    #[test]
    fn the_scarcer_bucket_is_the_smaller_share_left() {
        let a = Level { limit: 1000, remaining: 100, reset_us: 1 };
        let b = Level { limit: 100, remaining: 50, reset_us: 2 };
        assert_eq!(a.scarcer(b), a);
        assert_eq!(b.scarcer(a), a);
        assert_eq!(a.scarcer(a), a);
    }

    #[test]
    fn a_daily_cap_makes_every_token_bucket_a_day() {
        let l =
            RateLimits::new(&MockConfig { headers: HeaderStyle::Anthropic, daily_cap: true, ..MockConfig::default() });
        for limit in [Limit::InputTokens, Limit::OutputTokens] {
            let b = l.bucket(limit).unwrap();
            assert_eq!((b.window_us(), b.mode()), (DAY_US, BucketMode::Window));
        }
        assert_eq!(l.bucket(Limit::Requests).unwrap().window_us(), 60 * SEC);
    }
}
