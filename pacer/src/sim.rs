//! A deterministic discrete-event simulator: a fleet of worker slots, the
//! turn queue and an exact provider bucket around the pacer's policy, on an
//! injected clock, seeded. The property tests drive thousands of random
//! workloads through it and check what must hold on every one of them
//! (docs/pacing.md, "Liveness is a property, not a case"):
//!
//! - **never stalls**: whenever turns wait, a slot is free and the provider's
//!   bucket could take the head turn (its estimate above the pacer's floor),
//!   some turn is admitted within [`STALL_BOUND_MS`];
//! - **never overdraws**: no call the pacer cleared found the provider's bucket
//!   short by more than one request's size, and with estimates that are right
//!   none is refused at all (against a fixed-window provider, at most one per
//!   window: while the shape is learned, or a boundary is found);
//! - **never early**: a turn that asks again before its due time is not clear;
//! - **stays fair** (see [`Report::jain`]) and gives a lone tenant the refill.
//!
//! The simulator only needs [`Policy`]: the pure model implements it, and the
//! integration tests implement it over the Redis script, so the same workloads
//! check both. Faults it throws in: runs cancelled while waiting (a booking
//! that never comes back), workers that die with a call in flight (a
//! reservation that never settles; the turn comes back later as a new
//! attempt), turns that come back late or early, settles (headers) that arrive
//! late and out of order, estimates too high or too low, 429s, and a learned
//! usage ratio that moves a lot (runs whose used output differs widely).

use super::release::{Host, Move};
use super::{CallOutcome, Decision, Estimate, Mode, Observation, PacingConfig, Who};
use crate::Millis;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

/// The longest time the fleet may go without an admission while turns wait,
/// a slot is free and the provider's bucket could take the head turn. It
/// covers what the pacer cannot see at once: a waiter past its due time stops
/// holding budget for the turns behind it only after `late_ms`
/// (1 s by default), a settle (with its refund) may arrive up to 1 s late in
/// the simulation, and an owed turn returns after the in-place wait or the
/// queue's lateness.
pub const STALL_BOUND_MS: Millis = 4_000;

/// How long a cleared call takes to reach the provider.
const SEND_DELAY_MS: std::ops::RangeInclusive<Millis> = 1..=40;

/// What a pacer must do for the simulator: answer asks and take settles, by
/// reservation id, at a given time. Each op weighs the line (`release.rs`:
/// before an ask, after a settle or a forget): the turns it lets go and the
/// head's timer are told to `host`, the simulator's queue.
pub trait Policy {
    /// Asks to reserve `est` at `now`; `jitter_u` in [0, 1) is the caller's draw.
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &mut self,
        now: Millis,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
        jitter_u: f64,
        host: &mut dyn Host,
    ) -> Decision;
    /// Settles reservation `id` at `now`.
    fn settle(&mut self, now: Millis, id: &str, outcome: &CallOutcome, host: &mut dyn Host);
    /// Turn `id` leaves the line (its run was cancelled while it waited).
    fn forget(&mut self, now: Millis, id: &str, host: &mut dyn Host);
    /// The reservation id at the head of the policy's line, if it keeps one
    /// (the liveness check then asks whether the bucket could take that turn;
    /// otherwise whether it could take every waiting turn).
    fn head(&self, _now: Millis) -> Option<String> {
        None
    }
    /// A line for the simulator's trace (`PACER_SIM_TRACE`).
    fn describe(&self, _now: Millis) -> String {
        String::new()
    }
}

/// A tenant of the workload.
#[derive(Debug, Clone)]
pub struct Tenant {
    /// Its name.
    pub name: String,
    /// Its weight.
    pub weight: f64,
    /// Its cap (0: none).
    pub cap: f64,
}

/// One run of the workload.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// Index into [`Workload::tenants`].
    pub tenant: usize,
    /// Work or companion.
    pub mode: Mode,
    /// When it is submitted (ms after the start).
    pub start_ms: Millis,
    /// Turns it takes.
    pub turns: u32,
    /// Input tokens of its first turn …
    pub input: u64,
    /// … growing by this much per turn (the history).
    pub growth: u64,
    /// `max_output_tokens`.
    pub max_output: u64,
    /// The share of `max_output` a call really uses.
    pub used_frac: f64,
}

/// The faults thrown in, as probabilities per event.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// A run waiting for budget is cancelled (its booking never comes back).
    pub cancel_waiting: f64,
    /// The worker dies with the call in flight: never settled; the turn is
    /// delivered again 5 s later as a new attempt.
    pub die_in_flight: f64,
    /// A requeued turn comes back up to `late_max_ms` late.
    pub late: f64,
    /// See `late`.
    pub late_max_ms: Millis,
    /// A requeued turn is also delivered early (a redelivery): it must not be clear.
    pub early: f64,
    /// The worker's input estimate is off by up to this fraction either way.
    pub est_error: f64,
    /// … and systematically this fraction low (a tokenizer that counts fewer
    /// tokens than the provider; 0.18 is tiktoken against a chars/4 count).
    pub est_low: f64,
    /// A turn's ask predicted a prompt cache that expired before its call
    /// (an Anthropic input bucket charges no cache reads, so a cached prefix
    /// is not asked for): it asks for a tenth of the input the provider then
    /// charges. The settle corrects it — never a stall, never an overdraft.
    pub cache_expired: f64,
    /// A settle arrives up to this long after the call ended.
    pub settle_delay_max_ms: Millis,
    /// Of the runs cancelled while waiting, the share whose cancel the
    /// pacer hears of (the fetch that meets the cancelled turn forgets it);
    /// the others it finds gone when it next moves them (a head's timer, a
    /// release) — or, a head whose own entry was its line's timer, when an op
    /// weighs it after its timer passed.
    pub cancel_told: f64,
    /// A release the pacer made is lost (a failover that lost the last
    /// writes: the release and its queue move are one script, so its
    /// reservation is lost with it): the turn comes back at its safety
    /// deadline instead, and asks anew.
    pub lose_release: f64,
}

/// A whole simulated workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The seed of its randomness (also of the faults' draws).
    pub seed: u64,
    /// The provider's token limit …
    pub limit: u64,
    /// The share of a call's unused output the provider gives back when the
    /// answer is done: 1 refunds it (our mock's default), 0 keeps it
    /// (OpenAI's documented admission rule).
    pub refund_share: f64,
    /// … refilled over this period: continuously, or whole at its boundaries.
    pub period_ms: Millis,
    /// The provider's bucket refills whole at window boundaries (Azure-style
    /// and many gateways) instead of continuously (OpenAI).
    pub window: bool,
    /// What its headers tell.
    pub headers: SimHeaders,
    /// Separate input and output buckets of these limits (Anthropic) instead
    /// of the one token bucket of `limit`.
    pub split: Option<(u64, u64)>,
    /// Worker slots in the fleet.
    pub slots: usize,
    /// Call latency, uniform in this range.
    pub latency_ms: (Millis, Millis),
    /// Time the tools take between turns.
    pub tool_ms: (Millis, Millis),
    /// The tenants.
    pub tenants: Vec<Tenant>,
    /// The runs.
    pub runs: Vec<RunPlan>,
    /// The faults.
    pub faults: Faults,
    /// The pacer's config.
    pub config: PacingConfig,
    /// The simulation stops here, finished or not.
    pub until_ms: Millis,
}

impl Workload {
    /// A random workload from `seed`: limits from 10 000 per minute to 2
    /// million, per-minute and scaled-down windows, one to four tenants with
    /// weights and caps, companion runs, and every fault at random strength.
    pub fn random(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let period_ms = *[10_000, 60_000, 60_000].get(rng.random_range(0..3)).unwrap_or(&60_000);
        let limit = [10_000, 30_000, 40_000, 150_000, 2_000_000][rng.random_range(0..5)];
        let refund_share = [1.0, 1.0, 0.0, 0.5][rng.random_range(0..4)];
        let window = rng.random_bool(0.25);
        // A provider that sends `remaining` alone refills per minute (Azure's
        // limits are per minute; the pacer takes them so).
        let headers = if rng.random_bool(0.1) { SimHeaders::RemainingOnly } else { SimHeaders::Full };
        let period_ms = if headers == SimHeaders::RemainingOnly { 60_000 } else { period_ms };
        let split = rng.random_bool(0.15).then(|| (limit, limit / rng.random_range(2..=5)));
        // One in twenty of the others sends no headers at all (drawn apart,
        // so that the workloads before this shape stay what they were); not
        // a split provider: separate input and output buckets are
        // Anthropic's, which always sends headers.
        let headers = match StdRng::seed_from_u64(seed ^ 0x4e0d).random_bool(0.05) {
            true if headers == SimHeaders::Full && split.is_none() => SimHeaders::None,
            _ => headers,
        };
        // A split provider gives the unused output back (as Anthropic documents
        // and the pacer takes it to).
        let refund_share = if split.is_some() { 1.0 } else { refund_share };
        let n_tenants = rng.random_range(1..=4);
        let tenants: Vec<Tenant> = (0..n_tenants)
            .map(|i| Tenant {
                name: format!("t{i}"),
                weight: rng.random_range(1..=3) as f64,
                cap: if rng.random_bool(0.15) { rng.random_range(0.2..0.6) } else { 0.0 },
            })
            .collect();
        // Enough runs that the budget is scarce for a while (a few refills).
        let max_output = [100, 300, 1_000, 2_000][rng.random_range(0..4)];
        let n_runs = rng.random_range(5..=60);
        let mut runs = Vec::with_capacity(n_runs);
        for _ in 0..n_runs {
            let input_max = (limit / 8).clamp(400, 6_000);
            runs.push(RunPlan {
                tenant: rng.random_range(0..n_tenants),
                mode: if rng.random_bool(0.1) { Mode::Companion } else { Mode::Work },
                start_ms: if rng.random_bool(0.6) { 0 } else { rng.random_range(0..20_000) },
                turns: rng.random_range(1..=6),
                input: rng.random_range(200..input_max),
                growth: rng.random_range(0..300),
                max_output: max_output.min(limit / 10),
                used_frac: if rng.random_bool(0.5) { rng.random_range(0.0..0.3) } else { rng.random_range(0.0..1.0) },
            });
        }
        let strong = rng.random_bool(0.5);
        let p = |rng: &mut StdRng, x: f64| if strong && rng.random_bool(0.5) { x } else { 0.0 };
        let faults = Faults {
            cancel_waiting: p(&mut rng, 0.05),
            die_in_flight: p(&mut rng, 0.03),
            late: p(&mut rng, 0.1),
            late_max_ms: 5_000,
            early: p(&mut rng, 0.05),
            est_error: p(&mut rng, 0.2),
            est_low: p(&mut rng, 0.18),
            settle_delay_max_ms: if rng.random_bool(0.5) { 1_000 } else { 50 },
            cancel_told: 1.0,
            lose_release: 0.0,
            cache_expired: 0.0,
        };
        // The faults of the parked line, drawn apart (the draws above make the
        // same workloads as before there was a line to fault): a cancel
        // reschedules a parked turn's entry now, and the fetch that meets it
        // has the pacer forget it (runs/store.lua `cancel`) — most are told,
        // some runs end with their entry lost to the pacer; a release lost
        // with a failover's last writes.
        let mut line_rng = StdRng::seed_from_u64(seed ^ 0x11fe);
        let faults = Faults {
            cancel_told: if line_rng.random_bool(0.5) { 1.0 } else { 0.9 },
            lose_release: if strong && line_rng.random_bool(0.5) { 0.05 } else { 0.0 },
            ..faults
        };
        // A prompt cache predicted and expired, drawn apart too (the workloads
        // without it stay as they were).
        let mut cache_rng = StdRng::seed_from_u64(seed ^ 0xcac4e);
        let faults = Faults { cache_expired: if strong && cache_rng.random_bool(0.5) { 0.1 } else { 0.0 }, ..faults };
        let config = PacingConfig { jitter_frac: 0.02, ..PacingConfig::default() };
        let total: u64 =
            runs.iter().map(|r| (0..r.turns as u64).map(|t| r.input + r.growth * t + r.max_output).sum::<u64>()).sum();
        let refill = limit as f64 / period_ms as f64;
        // Time enough for the whole budget's work, and for each capped
        // tenant's at its capped rate.
        let mut until_ms = 60_000 + 4 * (total as f64 / refill) as Millis;
        // A capped tenant's work at its capped rate, every run of it (its
        // companion runs pass its cap too). Without headers the rate is
        // learned, and may settle at half of 0.9 of the provider's
        // (`HL_CUT_MIN`, `HL_CUT`): more slack there.
        let capped_slack: Millis = if headers == SimHeaders::None { 10 } else { 4 };
        for (i, t) in tenants.iter().enumerate().filter(|(_, t)| t.cap > 0.0) {
            let mine: u64 = runs
                .iter()
                .filter(|r| r.tenant == i)
                .map(|r| (0..r.turns as u64).map(|t| r.input + r.growth * t + r.max_output).sum::<u64>())
                .sum();
            until_ms = until_ms.max(60_000 + capped_slack * (mine as f64 / (refill * t.cap)) as Millis);
        }
        // A release lost, or a run whose cancel the pacer did not hear of,
        // comes back at a safety deadline (acquire.rs, `safety_ms`).
        if faults.lose_release > 0.0 || faults.cancel_told < 1.0 {
            until_ms += 6 * crate::acquire::SAFETY_MIN_MS + crate::acquire::SAFETY_UNKNOWN_MS;
        }
        Self {
            seed,
            limit,
            refund_share,
            period_ms,
            window,
            headers,
            split,
            slots: [8, 16, 48, 64][rng.random_range(0..4)],
            latency_ms: (100, rng.random_range(300..4_000)),
            tool_ms: (0, rng.random_range(1..800)),
            tenants,
            runs,
            faults,
            config,
            until_ms,
        }
    }

    /// The one-tenant case that once stalled at a real per-minute limit (README,
    /// "Measured", one tenant at a real per-minute limit): 4 × 16 slots,
    /// 40 000 tokens per minute, 150 one-turn runs of ~2 000 characters
    /// (500 tokens) with `max_output_tokens` 300, of which little is used.
    pub fn one_tenant_per_minute(seed: u64) -> Self {
        let runs = (0..150)
            .map(|_| RunPlan {
                tenant: 0,
                mode: Mode::Work,
                start_ms: 0,
                turns: 1,
                input: 500,
                growth: 0,
                max_output: 300,
                used_frac: 0.15,
            })
            .collect();
        Self {
            seed,
            limit: 40_000,
            refund_share: 1.0,
            period_ms: 60_000,
            window: false,
            headers: SimHeaders::Full,
            split: None,
            slots: 64,
            latency_ms: (200, 600),
            tool_ms: (0, 50),
            tenants: vec![Tenant { name: "alpha".into(), weight: 1.0, cap: 0.0 }],
            runs,
            // The worker's count 18 % below what the provider charges (the
            // mock counts chars / 4; the pacer's input ratio corrects it).
            faults: Faults { settle_delay_max_ms: 20, est_low: 0.18, ..Faults::default() },
            config: PacingConfig { jitter_frac: 0.02, ..PacingConfig::default() },
            until_ms: 600_000,
        }
    }

    /// `paceline bench --scenario pacing`'s default trial: 8 × 16 slots, 120
    /// runs of 5 turns at once against a continuous 60 000-token bucket
    /// refilled over 10 s (or over `period_ms`, at the same rate per window),
    /// `max_output_tokens` 256 of which about half is used, 200 ms calls.
    pub fn bench_pacing(seed: u64, period_ms: Millis) -> Self {
        let runs = (0..120)
            .map(|_| RunPlan {
                tenant: 0,
                mode: Mode::Work,
                start_ms: 0,
                turns: 5,
                input: 250,
                growth: 120,
                max_output: 256,
                used_frac: 0.5,
            })
            .collect();
        Self {
            seed,
            limit: 60_000,
            refund_share: 1.0,
            period_ms,
            window: false,
            headers: SimHeaders::Full,
            split: None,
            slots: 128,
            latency_ms: (200, 230),
            tool_ms: (0, 20),
            tenants: vec![Tenant { name: "default".into(), weight: 1.0, cap: 0.0 }],
            runs,
            faults: Faults { settle_delay_max_ms: 20, ..Faults::default() },
            config: PacingConfig { jitter_frac: 0.02, ..PacingConfig::default() },
            until_ms: 3_600_000,
        }
    }

    /// Backlogged tenants with random weights sharing a scarce budget (for
    /// the fairness property): every tenant has more runs than the budget
    /// serves at once, all submitted at the start.
    pub fn backlogged(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xfa17);
        let n = rng.random_range(2..=4);
        let tenants: Vec<Tenant> = (0..n)
            .map(|i| Tenant { name: format!("t{i}"), weight: rng.random_range(1..=3) as f64, cap: 0.0 })
            .collect();
        let mut runs = vec![];
        for t in 0..n {
            for _ in 0..30 {
                runs.push(RunPlan {
                    tenant: t,
                    mode: Mode::Work,
                    start_ms: 0,
                    turns: 4,
                    input: rng.random_range(400..1_200),
                    growth: 100,
                    max_output: 300,
                    used_frac: rng.random_range(0.1..0.5),
                });
            }
        }
        Self {
            seed,
            limit: 30_000,
            refund_share: 1.0,
            period_ms: [10_000, 60_000][rng.random_range(0..2)],
            window: false,
            headers: SimHeaders::Full,
            split: None,
            slots: 64,
            latency_ms: (200, 1_500),
            tool_ms: (0, 200),
            tenants,
            runs,
            faults: Faults { settle_delay_max_ms: 50, ..Faults::default() },
            config: PacingConfig { jitter_frac: 0.02, ..PacingConfig::default() },
            until_ms: 3_600_000,
        }
    }
}

/// What a simulated provider's headers tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SimHeaders {
    /// Limit, remaining and reset (OpenAI, Anthropic).
    #[default]
    Full,
    /// Remaining alone (Azure OpenAI).
    RemainingOnly,
    /// None at all; a 429 tells its delay in its body (Gemini-style APIs,
    /// gateways in front of self-hosted models).
    None,
}

/// The start of the window `t` falls in.
fn window_start(origin: Millis, period: Millis, t: Millis) -> Millis {
    origin + (t - origin).div_euclid(period) * period
}

/// One exact bucket of the simulated provider. It refills continuously, or
/// (`window`) whole at `origin + k · period`, as the mock does; its reset
/// header is the time until it is full again, which for a window is the time
/// to the next boundary.
#[derive(Debug, Clone)]
struct PBucket {
    limit: f64,
    rate: f64,
    level: f64,
    at: Millis,
    window: Option<(Millis, Millis)>,
}

impl PBucket {
    fn level_at(&self, now: Millis) -> f64 {
        match self.window {
            Some((origin, period)) => {
                if window_start(origin, period, now) > window_start(origin, period, self.at) {
                    self.limit
                } else {
                    self.level
                }
            }
            None => (self.level + self.rate * (now - self.at).max(0) as f64).min(self.limit),
        }
    }

    fn refill(&mut self, now: Millis) {
        self.level = self.level_at(now);
        self.at = now.max(self.at);
    }

    /// Milliseconds from the last refill until `need` tokens are there.
    fn wait_for(&self, need: f64) -> f64 {
        if self.level >= need {
            return 0.0;
        }
        match self.window {
            Some((origin, period)) => (window_start(origin, period, self.at) + period - self.at) as f64,
            None => (need - self.level) / self.rate,
        }
    }

    fn observation(&self, style: SimHeaders) -> Observation {
        let remaining = Some(self.level.max(0.0).floor() as u64);
        match style {
            SimHeaders::Full => Observation {
                limit: Some(self.limit as u64),
                remaining,
                reset_ms: Some(self.wait_for(self.limit).ceil() as u64),
            },
            SimHeaders::RemainingOnly => Observation { remaining, ..Observation::default() },
            SimHeaders::None => Observation::default(),
        }
    }

    /// The least time this bucket needs to admit `used` tokens from the start.
    fn floor_ms(&self, t0: Millis, used: f64) -> f64 {
        let beyond = used - self.limit;
        match self.window {
            // The first boundary after the start, then one window per limit.
            Some((origin, period)) if beyond > 0.0 => {
                let first = window_start(origin, period, t0) + period - t0;
                (first + ((beyond / self.limit).ceil() as Millis - 1) * period) as f64
            }
            Some(_) => 0.0,
            None => (beyond / self.rate).max(0.0),
        }
    }
}

/// What a simulated answer's headers say, bucket by bucket.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    tokens: Observation,
    input: Observation,
    output: Observation,
}

/// The exact provider: charges `input + max_output` at admission to its
/// token bucket — or, split (Anthropic), the input to an input bucket and
/// `max_output` to an output bucket — refunds (its share of) the unused output
/// when the call ends, and refuses what does not fit.
#[derive(Debug, Clone)]
struct Provider {
    tokens: Option<PBucket>,
    split: Option<(PBucket, PBucket)>,
    headers: SimHeaders,
}

impl Provider {
    fn new(w: &Workload, t0: Millis) -> Self {
        // A window's boundaries fall at a random phase of the start.
        let phase = (w.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) % w.period_ms as u64) as Millis;
        let window = w.window.then_some((t0 - phase, w.period_ms));
        let bucket = |limit: u64| PBucket {
            limit: limit as f64,
            rate: limit as f64 / w.period_ms as f64,
            level: limit as f64,
            at: t0,
            window,
        };
        match w.split {
            Some((input, output)) => {
                Self { tokens: None, split: Some((bucket(input), bucket(output))), headers: w.headers }
            }
            None => Self { tokens: Some(bucket(w.limit)), split: None, headers: w.headers },
        }
    }

    /// Every bucket with the part of a call (input, output) it is charged.
    fn charged(&mut self, input: f64, output: f64) -> Vec<(&mut PBucket, f64)> {
        let mut out = vec![];
        if let Some(t) = self.tokens.as_mut() {
            out.push((t, input + output));
        }
        if let Some((i, o)) = self.split.as_mut() {
            out.push((i, input));
            out.push((o, output));
        }
        out
    }

    /// The window of the first bucket, if the provider refills at boundaries.
    fn window(&self) -> Option<(Millis, Millis)> {
        self.tokens.as_ref().or(self.split.as_ref().map(|s| &s.0)).and_then(|b| b.window)
    }

    fn seen(&self) -> Seen {
        Seen {
            tokens: self.tokens.as_ref().map(|b| b.observation(self.headers)).unwrap_or_default(),
            input: self.split.as_ref().map(|s| s.0.observation(self.headers)).unwrap_or_default(),
            output: self.split.as_ref().map(|s| s.1.observation(self.headers)).unwrap_or_default(),
        }
    }

    /// Admits a call, or says how short it was and how long until it would
    /// fit (the 429's `retry-after`): all buckets or none.
    fn admit(&mut self, now: Millis, input: f64, output: f64) -> Result<Seen, (f64, u64)> {
        let mut short: f64 = 0.0;
        let mut wait: f64 = 0.0;
        for (b, charge) in self.charged(input, output) {
            b.refill(now);
            if b.level < charge {
                short = short.max(charge - b.level);
                wait = wait.max(b.wait_for(charge));
            }
        }
        if short > 0.0 {
            return Err((short, wait.ceil() as u64));
        }
        for (b, charge) in self.charged(input, output) {
            b.level -= charge;
        }
        Ok(self.seen())
    }

    /// Gives back unused output (to the token bucket, or the output bucket).
    fn refund(&mut self, now: Millis, tokens: f64) {
        for (b, part) in self.charged(0.0, tokens) {
            b.refill(now);
            b.level = (b.level + part).min(b.limit);
        }
    }

    /// Whether every bucket holds a call of `input` and `output` above the floor.
    fn fits(&mut self, now: Millis, input: f64, output: f64, floor: f64) -> bool {
        self.charged(input, output)
            .into_iter()
            .all(|(b, charge)| b.level_at(now) >= (charge + floor * b.limit).min(b.limit))
    }

    /// The buckets' levels, for traces.
    fn describe(&self, now: Millis) -> String {
        match (&self.tokens, &self.split) {
            (Some(t), _) => format!("{:.0}", t.level_at(now)),
            (None, Some((i, o))) => format!("{:.0}/{:.0}", i.level_at(now), o.level_at(now)),
            (None, None) => String::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum RunState {
    NotYet,
    /// In the queue (requeued by the pacer or waiting for a slot).
    Queued,
    /// Holding a slot through an in-place wait.
    InPlace,
    /// A call is in flight (holding a slot).
    Calling,
    /// Between turns (tools).
    Tools,
    Done,
    Cancelled,
}

#[derive(Debug, Clone)]
struct Run {
    plan: RunPlan,
    state: RunState,
    turn: u32,
    attempt: u32,
    /// When the pacer said it may come back (for the "never early" check).
    due: Millis,
    /// When the queue delivers it (past `due` when the `late` fault hit it).
    back: Millis,
    /// This turn's input as the provider counts it, and as the worker estimates it.
    input: u64,
    estimate: u64,
    /// The pacer released it and the queue lost the move: it is not waiting
    /// for the pacer (it comes back at its safety deadline, cleared).
    lost: bool,
    /// The pacer released it and the queue moved it, cleared: its worker
    /// calls without asking (`worker/src/pacing.rs`, `pace_at_start`).
    cleared: bool,
}

impl Run {
    fn id(&self, index: usize) -> String {
        format!("r{index}:{}:{}", self.turn, self.attempt)
    }

    fn est(&self) -> Estimate {
        Estimate { tokens: self.estimate + self.plan.max_output, requests: 1, output: self.plan.max_output }
    }
}

#[derive(Debug, Clone)]
enum Event {
    Start(usize),
    /// A cleared call reaches the provider (a clearance and the provider's
    /// receipt are never one instant: the worker builds and sends the request).
    Arrive(usize, String),
    /// An in-place wait ends: ask again (the slot is held).
    Reask(usize),
    /// An early redelivery of a requeued turn (a duplicate).
    Early(usize, Millis),
    /// The call ends: refund, free the slot, run the tools.
    Done {
        run: usize,
        id: String,
        used: u64,
        headers: Seen,
        sent: Millis,
    },
    /// A settle reaches the pacer.
    Settle(String, CallOutcome),
    /// The tools are done: the next turn is queued.
    NextTurn(usize),
    /// A dead worker's turn is delivered again.
    Redeliver(usize),
    /// The provider gives back a call's unused output (its worker died: no settle).
    Refund(f64),
    /// A liveness check.
    Tick,
}

/// What one simulated workload did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The workload's seed.
    pub seed: u64,
    /// Runs that should finish (not cancelled) …
    pub runs: usize,
    /// … and those that did.
    pub completed: usize,
    /// Calls sent to the provider.
    pub calls: u64,
    /// Calls the provider refused (429).
    pub refused: u64,
    /// Of those, the calls that reached it before the first 429 could be
    /// known (within the send delay of it): a cold fleet's first wave against
    /// a provider whose limits nothing tells.
    pub refused_cold: u64,
    /// The largest shortfall of a refused call.
    pub max_shortfall: f64,
    /// The largest single charge of the workload.
    pub max_charge: f64,
    /// The longest time with turns waiting, a slot free, the bucket able to
    /// take the head turn, and no admission; and when it began.
    pub longest_stall_ms: Millis,
    /// See `longest_stall_ms`.
    pub stall_at_ms: Millis,
    /// Turns that were clear before their due time.
    pub early_clears: u64,
    /// Time from the first submit to the last completion.
    pub makespan_ms: Millis,
    /// Tokens the provider kept (charged, net of refunds).
    pub used_tokens: f64,
    /// Of which output (kept on a split provider's output bucket).
    pub used_output: f64,
    /// The least time the provider's bucket allows for those tokens.
    pub floor_ms: f64,
    /// Tokens charged per tenant, divided by its weight, while every tenant
    /// had turns waiting (after the first window).
    pub fair_shares: Vec<f64>,
    /// Asks answered.
    pub asks: u64,
    /// Turns the line released (cleared in their queue entry).
    pub releases: u64,
    /// Head timers moved.
    pub retimes: u64,
    /// Released turns started (their fetch's ask, within the fetch's script).
    pub starts: u64,
}

impl Report {
    /// floor / makespan.
    pub fn efficiency(&self) -> f64 {
        if self.makespan_ms <= 0 {
            return 1.0;
        }
        (self.floor_ms / self.makespan_ms as f64).min(1.0)
    }

    /// Jain's index of the weighted shares (1 = equal).
    pub fn jain(&self) -> f64 {
        let n = self.fair_shares.len() as f64;
        let sum: f64 = self.fair_shares.iter().sum();
        let sq: f64 = self.fair_shares.iter().map(|x| x * x).sum();
        if sq <= 0.0 {
            return 1.0;
        }
        sum * sum / (n * sq)
    }
}

/// The simulator's queue as the pacer's host: a turn is there to move while
/// its run waits for it (queued, or in an in-place wait) under that id.
struct SimHost<'a> {
    runs: &'a [Run],
    moves: Vec<Move>,
}

impl SimHost<'_> {
    fn holds(&self, id: &str) -> bool {
        run_index(id)
            .and_then(|i| self.runs.get(i).map(|r| (i, r)))
            .is_some_and(|(i, r)| matches!(r.state, RunState::Queued | RunState::InPlace) && r.id(i) == id)
    }
}

impl Host for SimHost<'_> {
    fn release(&mut self, id: &str) -> bool {
        let held = self.holds(id);
        if held {
            self.moves.push(Move::Release(id.to_owned()));
        }
        held
    }

    fn retime(&mut self, id: &str, at: Millis) -> bool {
        let held = self.holds(id);
        if held {
            self.moves.push(Move::Retime(id.to_owned(), at));
        }
        held
    }

    fn holds(&mut self, id: &str) -> bool {
        SimHost::holds(self, id)
    }
}

/// The run a reservation id (`r<run>:<turn>:<attempt>`) belongs to.
fn run_index(id: &str) -> Option<usize> {
    id.strip_prefix('r')?.split(':').next()?.parse().ok()
}

/// Runs `workload` against `policy` and reports what happened.
pub fn simulate(workload: &Workload, policy: &mut dyn Policy) -> Report {
    let mut sim = Sim::new(workload);
    sim.run(policy);
    sim.report
}

struct Sim<'w> {
    w: &'w Workload,
    rng: StdRng,
    now: Millis,
    t0: Millis,
    provider: Provider,
    runs: Vec<Run>,
    events: BinaryHeap<Reverse<(Millis, u64, usize)>>,
    payloads: Vec<Option<Event>>,
    seq: u64,
    /// The queue: (due, seq, run).
    ready: BTreeSet<(Millis, u64, usize)>,
    free_slots: usize,
    /// A 429 closed the provider until then (the pacer may legitimately wait).
    closed_until: Millis,
    /// When the provider first refused a call.
    first_refused: Option<Millis>,
    stall_since: Option<Millis>,
    /// A window provider: the start of the window of the last admission.
    admitted_window: Millis,
    /// A settle reached the pacer (it knows the limits from then on).
    settled: bool,
    /// `PACER_SIM_TRACE` is set: print every ask, settle and refusal.
    trace: bool,
    last_done: Millis,
    report: Report,
}

impl<'w> Sim<'w> {
    fn new(w: &'w Workload) -> Self {
        let t0: Millis = 1_800_000_000_000;
        let provider = Provider::new(w, t0);
        let runs: Vec<Run> = w
            .runs
            .iter()
            .map(|p| Run {
                plan: p.clone(),
                state: RunState::NotYet,
                turn: 0,
                attempt: 0,
                due: 0,
                back: 0,
                input: 0,
                estimate: 0,
                lost: false,
                cleared: false,
            })
            .collect();
        let max_charge = w
            .runs
            .iter()
            .map(|r| ((r.input + r.growth * r.turns as u64) as f64 * (1.0 + w.faults.est_error)) + r.max_output as f64)
            .fold(0.0, f64::max);
        Self {
            w,
            rng: StdRng::seed_from_u64(w.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed),
            now: t0,
            t0,
            provider,
            runs,
            events: BinaryHeap::new(),
            payloads: vec![],
            seq: 0,
            ready: BTreeSet::new(),
            free_slots: w.slots,
            closed_until: 0,
            first_refused: None,
            stall_since: None,
            admitted_window: 0,
            settled: false,
            trace: std::env::var_os("PACER_SIM_TRACE").is_some(),
            last_done: t0,
            report: Report { seed: w.seed, max_charge, ..Report::default() },
        }
    }

    fn at(&mut self, t: Millis, ev: Event) {
        self.seq += 1;
        self.payloads.push(Some(ev));
        self.events.push(Reverse((t, self.seq, self.payloads.len() - 1)));
    }

    fn enqueue(&mut self, run: usize, due: Millis) {
        self.seq += 1;
        self.runs[run].state = RunState::Queued;
        self.runs[run].back = due;
        self.ready.insert((due, self.seq, run));
    }

    fn run(&mut self, policy: &mut dyn Policy) {
        for i in 0..self.runs.len() {
            let t = self.t0 + self.runs[i].plan.start_ms;
            self.at(t, Event::Start(i));
        }
        let mut t = self.t0;
        while t < self.t0 + self.w.until_ms {
            t += 100;
            self.at(t, Event::Tick);
        }
        loop {
            let next_event = self.events.peek().map(|Reverse((t, _, _))| *t);
            let next_due =
                if self.free_slots > 0 { self.ready.first().map(|(d, _, _)| (*d).max(self.now)) } else { None };
            let t = match (next_event, next_due) {
                (Some(e), Some(d)) => e.min(d),
                (Some(e), None) => e,
                (None, Some(d)) => d,
                (None, None) => break,
            };
            if t >= self.t0 + self.w.until_ms {
                break;
            }
            self.now = t.max(self.now);
            if next_due == Some(t) && next_event.is_none_or(|e| t < e) {
                let (d, s, run) = *self.ready.first().expect("a due turn");
                self.ready.remove(&(d, s, run));
                self.free_slots -= 1;
                self.deliver(run, policy);
            } else {
                let Reverse((_, _, slot)) = self.events.pop().expect("an event");
                let ev = self.payloads[slot].take().expect("each event once");
                self.handle(ev, policy);
            }
            self.check_liveness(policy);
            if self.runs.iter().all(|r| matches!(r.state, RunState::Done | RunState::Cancelled)) {
                break;
            }
        }
        let r = &mut self.report;
        r.runs = self.runs.iter().filter(|r| r.state != RunState::Cancelled).count();
        r.completed = self.runs.iter().filter(|r| r.state == RunState::Done).count();
        r.makespan_ms = self.last_done - self.t0;
        r.floor_ms = match (&self.provider.tokens, &self.provider.split) {
            (Some(t), _) => t.floor_ms(self.t0, r.used_tokens),
            (None, Some((i, o))) => {
                i.floor_ms(self.t0, r.used_tokens - r.used_output).max(o.floor_ms(self.t0, r.used_output))
            }
            (None, None) => 0.0,
        };
    }

    fn start_turn(&mut self, run: usize) {
        let err = self.w.faults.est_error;
        let r = &mut self.runs[run];
        r.input = r.plan.input + r.plan.growth * r.turn as u64;
        let factor = if err > 0.0 { self.rng.random_range(1.0 - err..1.0 + err) } else { 1.0 };
        r.estimate = (r.input as f64 * factor * (1.0 - self.w.faults.est_low)).round() as u64;
        let expired = self.w.faults.cache_expired;
        if expired > 0.0 && self.rng.random_bool(expired) {
            r.estimate /= 10;
        }
        r.attempt = 0;
        let now = self.now;
        self.enqueue(run, now);
    }

    fn handle(&mut self, ev: Event, policy: &mut dyn Policy) {
        match ev {
            Event::Start(run) => self.start_turn(run),
            Event::Reask(run) => self.answer(run, policy),
            Event::Arrive(run, id) => self.send(run, id),
            Event::Early(run, due) => {
                // A duplicate delivery before the turn's due time.
                if self.runs[run].state == RunState::Queued && self.runs[run].due == due && self.now < due {
                    let (id, decision) = self.ask(run, policy, false);
                    // (Unless the line released it with this very ask: it is
                    // clear, and its entry due now.)
                    if decision == Decision::Clear && self.now < self.runs[run].due {
                        if self.trace {
                            eprintln!("{:>8} EARLY CLEAR {id} due {}", self.now - self.t0, due - self.t0);
                        }
                        self.report.early_clears += 1;
                    }
                }
            }
            Event::Done { run, id, used, headers, sent } => {
                let charged = (self.runs[run].input + self.runs[run].plan.max_output) as f64;
                let refund = (charged - used as f64) * self.w.refund_share;
                self.provider.refund(self.now, refund);
                self.report.used_tokens += charged - refund;
                self.report.used_output += self.runs[run].plan.max_output as f64 - refund;
                self.free_slots += 1;
                let outcome = CallOutcome {
                    used_tokens: Some(used),
                    input_tokens: Some(self.runs[run].input),
                    rate_limited_ms: None,
                    tokens: headers.tokens,
                    requests: Observation::default(),
                    input: headers.input,
                    output: headers.output,
                    headers_age_ms: (self.now - sent) as u64,
                };
                let delay = self.rng.random_range(0..=self.w.faults.settle_delay_max_ms);
                let t = self.now + delay;
                let outcome = CallOutcome { headers_age_ms: outcome.headers_age_ms + delay as u64, ..outcome };
                self.at(t, Event::Settle(id, outcome));
                let r = &mut self.runs[run];
                r.turn += 1;
                if r.turn >= r.plan.turns {
                    r.state = RunState::Done;
                    self.last_done = self.last_done.max(self.now);
                } else {
                    r.state = RunState::Tools;
                    let (lo, hi) = self.w.tool_ms;
                    let t = self.now + self.rng.random_range(lo..=hi);
                    self.at(t, Event::NextTurn(run));
                }
            }
            Event::Settle(id, outcome) => {
                let mut host = SimHost { runs: &self.runs, moves: vec![] };
                policy.settle(self.now, &id, &outcome, &mut host);
                let moves = host.moves;
                self.apply(moves);
                self.settled = true;
                if self.trace {
                    eprintln!(
                        "{:>8} settle {id:<9} used {:?} 429 {:?} remaining {:?} age {} provider {} | {}",
                        self.now - self.t0,
                        outcome.used_tokens,
                        outcome.rate_limited_ms,
                        outcome.tokens.remaining,
                        outcome.headers_age_ms,
                        self.provider.describe(self.now),
                        policy.describe(self.now)
                    );
                }
            }
            Event::NextTurn(run) => self.start_turn(run),
            Event::Redeliver(run) => {
                let now = self.now;
                self.enqueue(run, now);
            }
            Event::Refund(tokens) => self.provider.refund(self.now, tokens),
            Event::Tick => {}
        }
    }

    /// Asks the pacer for run `run`'s current turn.
    /// Asks for run `run`'s turn: the worker's ask, or, for a turn the line
    /// released (`started`), its fetch's (`runs/fetch.lua`: in the script
    /// that leases it, no round trip of its own), which starts it.
    fn ask(&mut self, run: usize, policy: &mut dyn Policy, started: bool) -> (String, Decision) {
        let r = &self.runs[run];
        let (id, est, mode) = (r.id(run), r.est(), r.plan.mode);
        let tenant = &self.w.tenants[r.plan.tenant];
        let who = Who { tenant: &tenant.name, weight: tenant.weight, cap: tenant.cap };
        let u = self.rng.random::<f64>();
        if started {
            self.report.starts += 1;
        } else {
            self.report.asks += 1;
        }
        let mut host = SimHost { runs: &self.runs, moves: vec![] };
        let decision = policy.acquire(self.now, &id, est, mode, &who, u, &mut host);
        let moves = host.moves;
        self.apply(moves);
        (id, decision)
    }

    /// What the pacer's release told the queue: a released turn is due now
    /// (cleared), the head's timer moves its entry.
    fn apply(&mut self, moves: Vec<Move>) {
        for m in moves {
            let (id, at, cleared) = match m {
                Move::Release(id) => {
                    self.report.releases += 1;
                    if self.w.faults.lose_release > 0.0 && self.rng.random_bool(self.w.faults.lose_release) {
                        // Its entry not moved, its reservation gone (given back
                        // unsent): it comes back at its safety deadline (and is
                        // not waiting for the pacer).
                        if let Some(i) = run_index(&id) {
                            self.runs[i].due = self.now;
                            self.runs[i].lost = true;
                        }
                        self.at(self.now, Event::Settle(id, CallOutcome::default()));
                        continue;
                    }
                    (id, self.now, true)
                }
                Move::Retime(id, at) => {
                    self.report.retimes += 1;
                    (id, at, false)
                }
            };
            if self.trace {
                eprintln!("{:>8} move {id} to {}", self.now - self.t0, at - self.t0);
            }
            let Some(i) = run_index(&id) else { continue };
            if self.runs[i].state == RunState::InPlace {
                // It asks again at the end of its in-place wait (a release has
                // cleared it by then).
                self.runs[i].due = self.runs[i].due.min(at);
                continue;
            }
            // (A turn being delivered, out of the queue, asks at once.)
            self.runs[i].due = self.runs[i].due.min(at);
            if let Some(entry) = self.ready.iter().find(|(_, _, x)| *x == i).copied() {
                self.ready.remove(&entry);
                self.runs[i].due = at;
                self.runs[i].cleared = cleared;
                let mut back = at + self.rng.random_range(0..5);
                let f = &self.w.faults;
                if f.late > 0.0 && self.rng.random_bool(f.late) {
                    back += self.rng.random_range(0..=f.late_max_ms);
                }
                self.seq += 1;
                self.runs[i].back = back;
                self.ready.insert((back, self.seq, i));
            }
        }
    }

    /// A turn the queue delivered.
    fn deliver(&mut self, run: usize, policy: &mut dyn Policy) {
        self.runs[run].lost = false;
        self.answer(run, policy);
    }

    /// Asks for run `run`'s turn and acts on the answer.
    fn answer(&mut self, run: usize, policy: &mut dyn Policy) {
        let cleared = std::mem::take(&mut self.runs[run].cleared);
        let (id, decision) = self.ask(run, policy, cleared);
        if self.trace {
            eprintln!(
                "{:>8} ask {id:<12} {decision:?} provider {} free {} | {}",
                self.now - self.t0,
                self.provider.describe(self.now),
                self.free_slots,
                policy.describe(self.now)
            );
        }
        match decision {
            Decision::Clear => {
                if self.now < self.runs[run].due {
                    self.report.early_clears += 1;
                }
                self.stall_since = None;
                if let Some((origin, period)) = self.provider.window() {
                    self.admitted_window = window_start(origin, period, self.now);
                }
                self.runs[run].state = RunState::Calling;
                let t = self.now + self.rng.random_range(SEND_DELAY_MS);
                self.at(t, Event::Arrive(run, id));
            }
            Decision::Owed { ms, .. } if ms <= 250 => {
                self.runs[run].state = RunState::InPlace;
                self.runs[run].due = self.now + ms as Millis;
                self.at(self.now + ms as Millis, Event::Reask(run));
            }
            Decision::Owed { ms, .. } => {
                self.free_slots += 1;
                let f = &self.w.faults;
                if f.cancel_waiting > 0.0 && self.rng.random_bool(f.cancel_waiting) {
                    self.runs[run].state = RunState::Cancelled;
                    if f.cancel_told > 0.0 && self.rng.random_bool(f.cancel_told) {
                        let mut host = SimHost { runs: &self.runs, moves: vec![] };
                        policy.forget(self.now, &id, &mut host);
                        let moves = host.moves;
                        self.apply(moves);
                    }
                    return;
                }
                let due = self.now + ms as Millis;
                self.runs[run].due = due;
                let mut back = due + self.rng.random_range(0..5);
                if f.late > 0.0 && self.rng.random_bool(f.late) {
                    back += self.rng.random_range(0..=f.late_max_ms);
                }
                if f.early > 0.0 && ms > 2 && self.rng.random_bool(f.early) {
                    let t = self.now + self.rng.random_range(1..ms as Millis);
                    self.at(t, Event::Early(run, due));
                }
                self.enqueue(run, back);
            }
        }
    }

    fn send(&mut self, run: usize, id: String) {
        self.report.calls += 1;
        self.runs[run].state = RunState::Calling;
        let (input, output) = (self.runs[run].input as f64, self.runs[run].plan.max_output as f64);
        let charge = input + output;
        match self.provider.admit(self.now, input, output) {
            Ok(headers) => {
                let (lo, hi) = self.w.latency_ms;
                let latency = self.rng.random_range(lo..=hi);
                let f = &self.w.faults;
                if f.die_in_flight > 0.0 && self.rng.random_bool(f.die_in_flight) {
                    // The call is made and charged, the worker dies: no settle,
                    // the turn comes back after its lease as a new attempt.
                    let r = &mut self.runs[run];
                    let used = r.input + (r.plan.max_output as f64 * r.plan.used_frac) as u64;
                    let refund = (charge - used as f64) * self.w.refund_share;
                    self.report.used_tokens += charge - refund;
                    self.report.used_output += output - refund;
                    r.attempt += 1;
                    self.free_slots += 1;
                    let t = self.now + 5_000;
                    self.at(t, Event::Redeliver(run));
                    self.at(self.now + latency, Event::Refund(refund));
                    return;
                }
                let r = &self.runs[run];
                let used = r.input + (r.plan.max_output as f64 * r.plan.used_frac).round() as u64;
                self.count_share(run, used as f64);
                let t = self.now + latency;
                self.at(t, Event::Done { run, id, used, headers, sent: self.now });
            }
            Err((short, retry_ms)) => {
                if self.trace {
                    eprintln!("{:>8} REFUSED {id} short {short:.0}", self.now - self.t0);
                }
                self.report.refused += 1;
                let first = *self.first_refused.get_or_insert(self.now);
                if self.now <= first + SEND_DELAY_MS.end() {
                    self.report.refused_cold += 1;
                }
                self.report.max_shortfall = self.report.max_shortfall.max(short);
                self.closed_until = self.closed_until.max(self.now + retry_ms as Millis);
                let seen = self.provider.seen();
                let outcome = CallOutcome {
                    used_tokens: None,
                    input_tokens: None,
                    rate_limited_ms: Some(retry_ms),
                    tokens: seen.tokens,
                    requests: Observation::default(),
                    input: seen.input,
                    output: seen.output,
                    headers_age_ms: 0,
                };
                self.at(self.now + 1, Event::Settle(id, outcome));
                self.free_slots += 1;
                self.runs[run].attempt += 1;
                let back = self.now + retry_ms as Millis + self.rng.random_range(1..100);
                self.runs[run].due = 0;
                self.enqueue(run, back);
            }
        }
    }

    /// Counts `tokens` to its tenant's fair share while every tenant has a
    /// turn waiting for the pacer (all are backlogged).
    fn count_share(&mut self, run: usize, tokens: f64) {
        let n = self.w.tenants.len();
        if self.report.fair_shares.len() < n {
            self.report.fair_shares = vec![0.0; n];
        }
        let mut waiting = vec![false; n];
        for (i, r) in self.runs.iter().enumerate() {
            if i != run && matches!(r.state, RunState::Queued | RunState::InPlace) && r.plan.mode == Mode::Work {
                waiting[r.plan.tenant] = true;
            }
        }
        // Not in the first window: the full bucket at the start is budget no
        // one waited for (see `fair.rs`: it earns no debt).
        if waiting.iter().all(|w| *w) && self.now - self.t0 >= self.w.period_ms {
            let t = self.runs[run].plan.tenant;
            self.report.fair_shares[t] += tokens / self.w.tenants[t].weight;
        }
    }

    /// Whether the fleet is held with budget available: turns wait for the
    /// pacer, a slot is free (or in an in-place wait), no 429 closed the
    /// provider, and its bucket holds the cheapest waiting turn above the floor.
    fn check_liveness(&mut self, policy: &dyn Policy) {
        let slot = self.free_slots > 0 || self.runs.iter().any(|r| r.state == RunState::InPlace);
        // The head "fits" when every bucket holds it whatever the estimate's
        // error: its input as the provider counts it, or as the pacer may
        // (the estimate, corrected for a systematic bias, at its worst noise).
        let f = &self.w.faults;
        let now = self.now;
        let mut provider = self.provider.clone();
        let mut fits = |r: &Run| {
            let floor = self.w.config.floor(r.plan.mode);
            let corrected = r.estimate as f64 / (1.0 - f.est_low);
            let input = (r.input as f64).max(corrected) * (1.0 + f.est_error);
            provider.fits(now, input, r.plan.max_output as f64, floor)
        };
        // Waiting for the pacer: in an in-place wait, or queued — but not a
        // turn the `late` fault holds past its due time (it is not there to
        // be admitted; the turns behind it take its place after `late_ms`).
        let now = self.now;
        let waiting = |r: &&Run| match r.state {
            RunState::InPlace => true,
            RunState::Queued => !(r.lost || r.due <= now && now < r.back),
            _ => false,
        };
        // The head the policy names, when it is a companion turn of this workload;
        // else every waiting turn must fit (capped tenants' turns may wait).
        let named = policy.head(self.now).and_then(|id| run_index(&id)).and_then(|i| self.runs.get(i));
        // A head lost without a word (its run cancelled, its cancel unheard):
        // the pacer cannot know until an op weighs it past its timer, or
        // another turn's safety deadline comes: not a stall of the pacer's.
        if named.is_some_and(|r| r.state == RunState::Cancelled) {
            self.stall_since = None;
            return;
        }
        let head = named.filter(|r| waiting(r));
        let head_fits = match head {
            Some(r) => fits(r),
            None => {
                let mut w = self.runs.iter().filter(waiting).filter(|r| self.w.tenants[r.plan.tenant].cap == 0.0);
                let mut any = false;
                w.all(|r| {
                    any = true;
                    fits(r)
                }) && any
            }
        };
        // A window provider's level between boundaries is known only as far
        // as the headers show it: what the pacer must not miss is a boundary.
        // Its stall clock runs while a window has begun with no admission yet.
        let boundary_passed = match self.provider.window() {
            Some((origin, period)) => window_start(origin, period, self.now) > self.admitted_window,
            None => true,
        };
        // Before the first settle nothing is known: the pacer holds the fleet
        // for its probe's headers by design (cold start).
        if slot && head_fits && boundary_passed && self.now >= self.closed_until && self.settled {
            let since = *self.stall_since.get_or_insert(self.now);
            let stalled = self.now - since;
            if stalled > self.report.longest_stall_ms {
                self.report.longest_stall_ms = stalled;
                self.report.stall_at_ms = since - self.t0;
            }
        } else {
            self.stall_since = None;
        }
    }
}

/// The pure model as a [`Policy`] (one budget and model, jitter from the simulator).
#[derive(Debug, Default)]
pub struct ModelPolicy {
    /// The model's state.
    pub state: super::PacerState,
    /// Its config.
    pub config: PacingConfig,
}

impl ModelPolicy {
    /// A fresh state with `config`.
    pub fn new(config: PacingConfig) -> Self {
        Self { state: super::PacerState::default(), config }
    }
}

impl Policy for ModelPolicy {
    fn acquire(
        &mut self,
        now: Millis,
        id: &str,
        est: Estimate,
        mode: Mode,
        who: &Who<'_>,
        jitter_u: f64,
        host: &mut dyn Host,
    ) -> Decision {
        let ask = super::model::Ask { id, est, mode, who: *who };
        super::release::release(&mut self.state, &self.config, now, host);
        super::model::acquire(&mut self.state, &self.config, now, &ask, jitter_u)
    }

    fn settle(&mut self, now: Millis, id: &str, outcome: &CallOutcome, host: &mut dyn Host) {
        super::model::settle(&mut self.state, &self.config, now, id, outcome);
        super::release::release(&mut self.state, &self.config, now, host);
    }

    fn forget(&mut self, now: Millis, id: &str, host: &mut dyn Host) {
        super::release::forget(&mut self.state, id);
        super::release::release(&mut self.state, &self.config, now, host);
    }

    fn head(&self, _now: Millis) -> Option<String> {
        self.state.head().map(|(id, _)| id.to_owned())
    }

    fn describe(&self, now: Millis) -> String {
        let mut line: Vec<_> = self.state.waiters.iter().collect();
        line.sort_by(|a, b| a.1.order.total_cmp(&b.1.order).then(a.0.cmp(b.0)));
        let head: Vec<String> =
            line.iter().take(4).map(|(id, w)| format!("{id}@{}+{:.0}", w.due_ms - now, w.line)).collect();
        let t = &self.state.tokens;
        let shape = match t.refill {
            super::bucket::Refill::Window => "W",
            super::bucket::Refill::Continuous => "C",
            super::bucket::Refill::Unknown => "?",
        };
        let (i, o) = (&self.state.input, &self.state.output);
        let split = if i.known() || o.known() {
            let sh = |b: &super::bucket::Bucket| match b.refill {
                super::bucket::Refill::Window => "W",
                super::bucket::Refill::Continuous => "C",
                super::bucket::Refill::Unknown => "?",
            };
            let full = |b: &super::bucket::Bucket| if b.full_at_ms > 0 { b.full_at_ms - now } else { 0 };
            format!(
                "in {:.0}/{:.0} {}{} f{} out {:.0}/{:.0} {}{} f{} b{} w{:.0} ",
                i.level_at(now),
                i.limit,
                sh(i),
                i.votes,
                full(i),
                o.level_at(now),
                o.limit,
                sh(o),
                o.votes,
                full(o),
                if o.boundary_ms > 0 { o.boundary_ms - now } else { 0 },
                o.max_reset_ms
            )
        } else {
            String::new()
        };
        format!(
            "{split}{shape}{:+} rate {:.3} full {} bnd {} maxr {:.0} | level {:.0} withheld {:.0} flights {} ratio {:.2}/{:.2} refund {:.2} ({:.0}/{:.0}, {}) line {} [{}]",
            t.votes,
            t.rate,
            if t.full_at_ms > 0 { t.full_at_ms - now } else { 0 },
            if t.boundary_ms > 0 { t.boundary_ms - now } else { 0 },
            t.max_reset_ms,
            self.state.tokens.level_at(now),
            self.state.tokens.withheld,
            self.state.flights.len(),
            self.state.usage_ratio,
            self.state.input_ratio,
            self.state.refund_share(),
            self.state.refunds.given,
            self.state.refunds.unused,
            self.state.refunds.pairs,
            line.len(),
            head.join(" ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(w: &Workload) -> Report {
        let mut policy = ModelPolicy::new(w.config.clone());
        simulate(w, &mut policy)
    }

    /// The stated bound: [`STALL_BOUND_MS`] plus twice the refill time of the
    /// largest turn. Turns ahead that never come back (cancelled runs, dead
    /// workers) count in the predictions of the turns sleeping behind them
    /// until the last of them was predicted clear; with 5 % of waits cancelled
    /// and 10 % of returns up to 5 s late, two in a row happen.
    fn stall_bound(w: &Workload, r: &Report) -> Millis {
        STALL_BOUND_MS + 2 * (r.max_charge * w.period_ms as f64 / w.limit as f64) as Millis
    }

    #[test]
    fn the_bench_trial_asks_little_per_call() {
        for period in [10_000, 60_000] {
            let w = Workload::bench_pacing(1, period);
            let r = check(&w);
            eprintln!(
                "period {period}: efficiency {:.3}, {:.2} asks per call, {} releases, {} retimes, longest stall {} ms",
                r.efficiency(),
                r.asks as f64 / r.calls as f64,
                r.releases,
                r.retimes,
                r.longest_stall_ms
            );
            assert_eq!(r.completed, r.runs);
            assert!(r.asks as f64 <= 2.0 * r.calls as f64, "{r:?}");
        }
    }

    #[test]
    fn one_tenant_at_a_real_per_minute_limit() {
        let r = check(&Workload::one_tenant_per_minute(1));
        eprintln!("{r:?} efficiency {:.3}, {:.1} asks per call", r.efficiency(), r.asks as f64 / r.calls as f64);
        assert_eq!(r.completed, r.runs);
        assert!(r.longest_stall_ms <= STALL_BOUND_MS, "{r:?}");
        assert_eq!(r.refused, 0, "{r:?}");
        // 0.927 here (0.924 on average over seeds 1-20, none below 0.918):
        // the 5 % work floor keeps 2 000 tokens (3 s of refill at this tier)
        // that the physical floor counts as usable, and until the first
        // answers show the bucket refills continuously no refill is counted.
        assert!(r.efficiency() >= 0.92, "efficiency {:.3}: {r:?}", r.efficiency());
    }

    /// The same against a provider that keeps the unused output (OpenAI's
    /// documented admission rule): the pacer learns it from the headers and
    /// sends into no 429. Its floor counts the charges the provider keeps.
    #[test]
    fn one_tenant_against_a_provider_that_keeps_the_charge() {
        let w = Workload { refund_share: 0.0, ..Workload::one_tenant_per_minute(1) };
        let mut policy = ModelPolicy::new(w.config.clone());
        let r = simulate(&w, &mut policy);
        eprintln!("{r:?} efficiency {:.3}, share learned {:?}", r.efficiency(), policy.state.refunds.share(40_000.0));
        assert_eq!(r.completed, r.runs);
        assert_eq!(r.refused, 0, "{r:?}");
        assert_eq!(policy.state.refunds.share(40_000.0), Some(0.0));
        assert!(r.efficiency() >= 0.93, "efficiency {:.3}: {r:?}", r.efficiency());
    }

    /// The same against a fixed-window provider (its bucket refills whole
    /// each minute): the pacer tells the shape from the headers, spends each
    /// window and waits for the boundary, and sends at most one call per
    /// window that the provider refuses.
    #[test]
    fn one_tenant_against_a_window_provider() {
        let base = Workload::one_tenant_per_minute(1);
        let runs = [base.runs.clone(), base.runs.clone()].concat();
        let w = Workload { window: true, runs, ..base };
        let mut policy = ModelPolicy::new(w.config.clone());
        let r = simulate(&w, &mut policy);
        let windows = r.makespan_ms / w.period_ms + 1;
        eprintln!("{r:?} efficiency {:.3}, {windows} windows, shape {:?}", r.efficiency(), policy.state.tokens.refill);
        assert_eq!(r.completed, r.runs);
        assert_eq!(policy.state.tokens.refill, super::super::bucket::Refill::Window);
        assert!(r.refused <= windows as u64, "{} refused in {windows} windows: {r:?}", r.refused);
        // 0.997 (it was 0.625 before the refund probe: in a window the calls
        // go out as one burst at each boundary, none alone for the refund
        // learner, so no refund was ever credited).
        assert!(r.efficiency() >= 0.9, "efficiency {:.3}: {r:?}", r.efficiency());
    }

    /// The bench's window shape (`paceline bench --shape window`): 60 000
    /// tokens a 10-s window that refunds the unused output, 8 × 16 slots,
    /// 120 runs of 5 turns, the window's phase drawn by the seed. Each window
    /// can take its limit *net*: what the calls admitted at its boundary give
    /// back admits more before the next one. Two things left that idle: the
    /// turns short of those refunds slept the whole recheck horizon (2 s, a
    /// fifth of the window each round), and the first window withheld every
    /// refund (its share is learned from a pair, and its refund probe waited
    /// for a boundary the first window does not have). Before: 0 of 20 seeds
    /// at 0.9, each a window late (0.65-0.74); now 14 (0.97-0.98); the six
    /// below have a first window of under 2.5 s, too short for a refund round.
    #[test]
    fn a_refunding_window_is_used_net_from_its_first_window() {
        let plan = |_| RunPlan {
            tenant: 0,
            mode: Mode::Work,
            start_ms: 0,
            turns: 5,
            input: 120,
            growth: 90,
            max_output: 256,
            used_frac: 0.3,
        };
        let mut good = 0;
        for seed in 1..=20 {
            let w = Workload {
                seed,
                limit: 60_000,
                period_ms: 10_000,
                window: true,
                slots: 128,
                latency_ms: (200, 260),
                tool_ms: (0, 20),
                runs: (0..120).map(plan).collect(),
                faults: Faults { settle_delay_max_ms: 20, ..Faults::default() },
                ..Workload::one_tenant_per_minute(seed)
            };
            let mut policy = ModelPolicy::new(w.config.clone());
            let r = simulate(&w, &mut policy);
            eprintln!(
                "seed {seed}: efficiency {:.3}, makespan {} ms, floor {:.0} ms",
                r.efficiency(),
                r.makespan_ms,
                r.floor_ms
            );
            assert_eq!(r.completed, r.runs, "seed {seed}: {r:?}");
            assert_eq!(r.refused, 0, "seed {seed}: {r:?}");
            assert_eq!(policy.state.refunds.share(60_000.0), Some(1.0), "seed {seed}");
            good += usize::from(r.efficiency() >= 0.9);
        }
        assert!(good >= 12, "{good} of 20 seeds at 0.9 or more");
    }

    /// Against separate input and output buckets (Anthropic) whose output
    /// bucket is the tight one: the pacer paces both, the output bucket
    /// binds, and nothing is refused.
    #[test]
    fn one_tenant_against_split_buckets_with_a_tight_output_bucket() {
        // 300 output tokens reserved a call, 15 % of them used: the output
        // bucket of 8 000 a minute admits ~26 calls a minute at first, ~120
        // once the refunds are counted; the input bucket of 40 000, ~80.
        let w = Workload { split: Some((40_000, 8_000)), ..Workload::one_tenant_per_minute(1) };
        let mut policy = ModelPolicy::new(w.config.clone());
        let r = simulate(&w, &mut policy);
        let (i, o) = (&policy.state.input, &policy.state.output);
        eprintln!("{r:?} efficiency {:.3}, input {:?} output {:?}", r.efficiency(), i.refill, o.refill);
        assert_eq!(r.completed, r.runs);
        assert_eq!(r.refused, 0, "{r:?}");
        assert!(i.known() && o.known() && !policy.state.tokens.known());
        assert!(r.efficiency() >= 0.9, "efficiency {:.3}: {r:?}", r.efficiency());
    }

    /// Against a provider that sends `remaining` alone and keeps the charge
    /// (Azure OpenAI: its limit counts each request's estimated maximum,
    /// prompt and `max_tokens`, when it is received): the limit is read off
    /// the first answer, the refill taken per minute.
    #[test]
    fn one_tenant_against_remaining_only_headers() {
        let w =
            Workload { headers: SimHeaders::RemainingOnly, refund_share: 0.0, ..Workload::one_tenant_per_minute(1) };
        let mut policy = ModelPolicy::new(w.config.clone());
        let r = simulate(&w, &mut policy);
        eprintln!("{r:?} efficiency {:.3}, limit {:.0}", r.efficiency(), policy.state.tokens.limit);
        assert_eq!(r.completed, r.runs);
        assert_eq!(r.refused, 0, "{r:?}");
        assert!(r.efficiency() >= 0.9, "efficiency {:.3}: {r:?}", r.efficiency());
    }

    #[test]
    fn backlogged_tenants_share_by_weight() {
        let mut worst = (1.0, 0);
        for seed in 0..100 {
            let w = Workload::backlogged(seed);
            let r = check(&w);
            assert_eq!(r.completed, r.runs, "seed {seed}");
            if r.jain() < 0.97 {
                let weights: Vec<f64> = w.tenants.iter().map(|t| t.weight).collect();
                eprintln!("seed {seed}: jain {:.3} shares {:?} weights {weights:?}", r.jain(), r.fair_shares);
            }
            if r.jain() < worst.0 {
                worst = (r.jain(), seed);
            }
        }
        eprintln!("backlogged: worst Jain's index {:.3} (seed {})", worst.0, worst.1);
        assert!(worst.0 >= 0.95, "Jain's index {:.3} at seed {}", worst.0, worst.1);
    }

    /// Against a provider without rate-limit headers (its 429s tell their
    /// delay in the body): nothing says what fits but the 429s, and the
    /// first teaches a token bucket (`learn_headerless`) so that the fleet
    /// does not go back in one wave.
    #[test]
    fn one_tenant_against_a_provider_without_headers() {
        let w = Workload { headers: SimHeaders::None, ..Workload::one_tenant_per_minute(1) };
        let mut policy = ModelPolicy::new(w.config.clone());
        let r = simulate(&w, &mut policy);
        let t = &policy.state.tokens;
        eprintln!("{r:?} efficiency {:.3}, learned {:.0}/min", r.efficiency(), t.rate * 60_000.0);
        assert_eq!(r.completed, r.runs);
        assert!(t.known(), "a 429 teaches a bucket");
        let warm = r.refused - r.refused_cold;
        assert!(warm * 100 <= r.calls * HEADERLESS_REFUSED_PCT, "{warm} of {} refused after the first wave", r.calls);
    }

    /// How much longer than [`stall_bound`] a turn may wait against a
    /// provider without headers.
    const HEADERLESS_STALL_FACTOR: Millis = 4;

    /// The share of calls a provider without headers may refuse after the
    /// first wave, in percent: one 429 a cycle of the learned rate's growth
    /// (some 100 s), which against a slow bucket (10 000 tokens a minute,
    /// six calls) is one call in ten.
    const HEADERLESS_REFUSED_PCT: u64 = 12;

    /// 10 000 random workloads (`PACER_SIM_SEEDS` for more or fewer;
    /// `PACER_SIM_SEED=N PACER_SIM_TRACE=1` to trace one).
    #[test]
    fn random_workloads_never_stall_never_overdraw() {
        let seeds: u64 = std::env::var("PACER_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000);
        let mut failures = vec![];
        let (mut asks, mut calls, mut worst_stall) = (0u64, 0u64, 0f64);
        let only: Option<u64> = std::env::var("PACER_SIM_SEED").ok().and_then(|s| s.parse().ok());
        for seed in (0..seeds).filter(|s| only.is_none_or(|o| o == *s)) {
            if only.is_some() {
                eprintln!("{:#?}", Workload::random(seed));
            }
            let w = Workload::random(seed);
            let r = check(&w);
            asks += r.asks;
            calls += r.calls;
            let mut why = vec![];
            if r.completed < r.runs {
                why.push(format!("{} of {} runs finished", r.completed, r.runs));
            }
            // Without headers the bucket is learned from 429s, below the
            // provider's rate (the first per minute, whatever the provider's
            // period): a turn may wait a few times a refill's worth longer.
            let bound = if w.headers == SimHeaders::None {
                HEADERLESS_STALL_FACTOR * stall_bound(&w, &r)
            } else {
                stall_bound(&w, &r)
            };
            worst_stall = worst_stall.max(r.longest_stall_ms as f64 / bound as f64);
            if r.longest_stall_ms > bound {
                why.push(format!("stalled {} ms from {} ms", r.longest_stall_ms, r.stall_at_ms));
            }
            if r.early_clears > 0 {
                why.push(format!("{} early clears", r.early_clears));
            }
            // A window provider may refuse one call per window: while the
            // pacer learns the bucket's shape from the first answers, or when
            // the head goes to find a boundary no headers named.
            let allowed = if w.window { (r.makespan_ms / w.period_ms + 1) as u64 } else { 0 };
            if w.headers == SimHeaders::None {
                // Nothing tells the pacer what fits but the 429s themselves.
                let warm = r.refused - r.refused_cold;
                if warm * 100 > r.calls * HEADERLESS_REFUSED_PCT {
                    why.push(format!("{warm} of {} calls refused without headers after the first wave", r.calls));
                }
            } else if w.faults.est_error == 0.0
                && w.faults.est_low == 0.0
                && w.faults.cache_expired == 0.0
                && r.refused > allowed
            {
                why.push(format!("{} of {} calls refused with exact estimates", r.refused, r.calls));
            }
            if r.max_shortfall > r.max_charge {
                why.push(format!("short by {:.0}", r.max_shortfall));
            }
            if !why.is_empty() {
                failures.push(format!(
                    "seed {seed} ({}{}{}, refund share {}): {}",
                    if w.window { "window" } else { "continuous" },
                    if w.split.is_some() { ", split" } else { "" },
                    match w.headers {
                        SimHeaders::Full => "",
                        SimHeaders::RemainingOnly => ", remaining only",
                        SimHeaders::None => ", no headers",
                    },
                    w.refund_share,
                    why.join(", ")
                ));
            }
        }
        eprintln!(
            "{seeds} workloads: {:.2} asks per call, longest stall {:.2} of its bound",
            asks as f64 / calls.max(1) as f64,
            worst_stall
        );
        assert!(
            failures.is_empty(),
            "{} of {seeds} seeds failed:\n{}",
            failures.len(),
            failures[..failures.len().min(40)].join("\n")
        );
    }
}
