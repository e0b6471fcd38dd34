//! The prompt cache (`--cache`): which prefixes are stored and until when, and
//! what one request reads and writes. Pure over the injected clock, like the
//! buckets, so lookback, TTLs and minimums are tested without a server.
//!
//! A request's part is decided in two steps under the server's lock:
//! [`PromptCache::lookup`] before the buckets (Anthropic's charge depends on
//! it), [`PromptCache::commit`] once the request is admitted — a refused
//! request neither writes nor refreshes anything.
//!
//! - Anthropic: for each breakpoint, the longest live entry at its boundary or
//!   at one of the [`LOOKBACK_BLOCKS`] boundaries before it; the longest hit
//!   over all breakpoints is read. The prefix up to the last breakpoint is
//!   written when it is at least the minimum and longer than the read (what it
//!   adds is the write), with an entry at each breakpoint of at least the
//!   minimum, by that breakpoint's TTL.
//! - OpenAI: the longest live step is read; every step is stored (or refreshed)
//!   for the configured TTL. OpenAI reports no writes.
//!
//! A hit refreshes the entry by its own TTL. The store is bounded: when full,
//! expired entries go first, then the ones closest to expiring.

use crate::prefix::{Boundary, Prefix, LOOKBACK_BLOCKS};
use std::collections::HashMap;
use std::time::Duration;

/// How many entries the store keeps at most, so a long benchmark cannot grow
/// the mock without bound (an entry is a few dozen bytes).
pub const MAX_ENTRIES: usize = 50_000;

/// What the prompt cache did for one request, as the usage reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// Input tokens read from the cache (Anthropic `cache_read_input_tokens`,
    /// OpenAI `cached_tokens`).
    pub read: u64,
    /// Input tokens written to it (Anthropic `cache_creation_input_tokens`;
    /// always 0 for OpenAI, which reports no writes).
    pub write: u64,
}

/// The rules the configuration sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Anthropic: the shortest prefix written (`--cache-min-tokens`).
    pub min_tokens: u64,
    /// OpenAI: how long an entry lives without a hit (`--cache-ttl-s`).
    pub ttl: Duration,
}

/// One request's part, decided but not yet applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    /// What the usage will report.
    pub usage: CacheUsage,
    /// Entries that hit, refreshed on commit.
    hits: Vec<u64>,
    /// Entries stored on commit, with their TTL.
    writes: Vec<(u64, Duration)>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    expires_us: u64,
    ttl_us: u64,
}

/// The stored prefixes of every model and partition.
#[derive(Debug, Clone)]
pub struct PromptCache {
    entries: HashMap<u64, Entry>,
    capacity: usize,
}

impl Default for PromptCache {
    fn default() -> Self {
        Self::with_capacity(MAX_ENTRIES)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl PromptCache {
    /// An empty store of at most `capacity` entries.
    pub fn with_capacity(capacity: usize) -> Self {
        Self { entries: HashMap::new(), capacity: capacity.max(1) }
    }

    /// Entries stored, live or not yet swept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn live(&self, key: u64, now_us: u64) -> bool {
        self.entries.get(&key).is_some_and(|e| e.expires_us > now_us)
    }

    /// What `prefix` would read and write at `now_us`; changes nothing.
    pub fn lookup(&self, now_us: u64, prefix: &Prefix, rules: Rules) -> Lookup {
        match prefix {
            Prefix::None => Lookup::default(),
            Prefix::Marked { boundaries, breakpoints } => {
                let Some(last) = breakpoints.last() else { return Lookup::default() };
                let mut out = Lookup::default();
                for bp in breakpoints {
                    let first = bp.block.saturating_sub(LOOKBACK_BLOCKS);
                    let hit = boundaries[first..=bp.block].iter().rev().find(|b| self.live(b.key, now_us));
                    if let Some(hit) = hit {
                        out.hits.push(hit.key);
                        out.usage.read = out.usage.read.max(hit.tokens);
                    }
                }
                let end = boundaries[last.block].tokens;
                if end >= rules.min_tokens && end > out.usage.read {
                    out.usage.write = end - out.usage.read;
                    out.writes = breakpoints
                        .iter()
                        .map(|bp| (boundaries[bp.block], bp.ttl))
                        .filter(|(b, _)| b.tokens >= rules.min_tokens)
                        .map(|(b, ttl)| (b.key, ttl))
                        .collect();
                }
                out
            }
            Prefix::Automatic { steps } => {
                let hit = steps.iter().rev().find(|s| self.live(s.key, now_us));
                Lookup {
                    usage: CacheUsage { read: hit.map_or(0, |s: &Boundary| s.tokens), write: 0 },
                    hits: hit.map(|s| s.key).into_iter().collect(),
                    writes: steps.iter().map(|s| (s.key, rules.ttl)).collect(),
                }
            }
        }
    }

    /// Applies an admitted request's lookup at `now_us`: refreshes its hits,
    /// stores its writes. Returns its usage.
    pub fn commit(&mut self, now_us: u64, lookup: Lookup) -> CacheUsage {
        for key in &lookup.hits {
            if let Some(entry) = self.entries.get_mut(key) {
                entry.expires_us = now_us.saturating_add(entry.ttl_us);
            }
        }
        for (key, ttl) in lookup.writes {
            if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
                self.make_room(now_us);
            }
            let ttl_us = micros(ttl);
            self.entries.insert(key, Entry { expires_us: now_us.saturating_add(ttl_us), ttl_us });
        }
        lookup.usage
    }

    /// Drops the expired entries and, if the store is still full, those closest
    /// to expiring, down to three quarters of the capacity (so the next
    /// inserts do not sweep again).
    fn make_room(&mut self, now_us: u64) {
        self.entries.retain(|_, e| e.expires_us > now_us);
        let keep = self.capacity * 3 / 4;
        if self.entries.len() > keep {
            let mut expiries: Vec<u64> = self.entries.values().map(|e| e.expires_us).collect();
            let drop = expiries.len() - keep;
            let (_, cutoff, _) = expiries.select_nth_unstable(drop - 1);
            let cutoff = *cutoff;
            self.entries.retain(|_, e| e.expires_us > cutoff);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::{Breakpoint, TTL_1H, TTL_5M};

    const SEC: u64 = 1_000_000;
    const RULES: Rules = Rules { min_tokens: 1024, ttl: Duration::from_secs(300) };

    /// `n` blocks of 100 tokens each, keyed 1..=n (a prefix's identity).
    fn blocks(n: usize) -> Vec<Boundary> {
        (1..=n).map(|i| Boundary { tokens: 100 * i as u64, key: i as u64 }).collect()
    }

    fn marked(boundaries: &[Boundary], at: &[usize]) -> Prefix {
        Prefix::Marked {
            boundaries: boundaries.to_vec(),
            breakpoints: at.iter().map(|&block| Breakpoint { block, ttl: TTL_5M }).collect(),
        }
    }

    fn run(cache: &mut PromptCache, now: u64, prefix: &Prefix) -> CacheUsage {
        let lookup = cache.lookup(now, prefix, RULES);
        cache.commit(now, lookup)
    }

    #[test]
    fn a_breakpoint_looks_back_twenty_blocks() {
        let b = blocks(40);
        let mut cache = PromptCache::default();
        // Block 11 (1 100 tokens) is written.
        assert_eq!(run(&mut cache, 0, &marked(&b, &[10])), CacheUsage { read: 0, write: 1100 });
        // A breakpoint 20 blocks later finds it...
        let hit = cache.lookup(SEC, &marked(&b, &[30]), RULES);
        assert_eq!(hit.usage, CacheUsage { read: 1100, write: 3100 - 1100 });
        // ...one 21 blocks later does not.
        assert_eq!(cache.lookup(SEC, &marked(&b, &[31]), RULES).usage, CacheUsage { read: 0, write: 3200 });
        // Another breakpoint within reach brings it back: the longest hit of all.
        assert_eq!(cache.lookup(SEC, &marked(&b, &[12, 31]), RULES).usage, CacheUsage { read: 1100, write: 2100 });
    }

    #[test]
    fn an_entry_expires_by_its_ttl_and_a_hit_refreshes_it() {
        let b = blocks(12);
        let mut cache = PromptCache::default();
        run(&mut cache, 0, &marked(&b, &[11]));
        let again = marked(&b, &[11]);
        assert_eq!(run(&mut cache, 299 * SEC, &again), CacheUsage { read: 1200, write: 0 }, "alive at 299 s");
        // The hit at 299 s made it live until 599 s.
        assert_eq!(run(&mut cache, 598 * SEC, &again).read, 1200);
        assert_eq!(cache.lookup(598 * SEC + 300 * SEC, &again, RULES).usage.read, 0, "expired 300 s after");
        // A 1-hour breakpoint lives an hour.
        let long = Prefix::Marked { boundaries: b.clone(), breakpoints: vec![Breakpoint { block: 11, ttl: TTL_1H }] };
        let mut cache = PromptCache::default();
        run(&mut cache, 0, &long);
        assert_eq!(cache.lookup(3599 * SEC, &marked(&b, &[11]), RULES).usage.read, 1200);
        assert_eq!(cache.lookup(3600 * SEC, &marked(&b, &[11]), RULES).usage.read, 0);
    }

    #[test]
    fn a_prefix_under_the_minimum_is_not_cached() {
        let b = blocks(12);
        let mut cache = PromptCache::default();
        assert_eq!(run(&mut cache, 0, &marked(&b, &[9])), CacheUsage::default(), "1 000 tokens < 1 024");
        assert!(cache.is_empty());
        // Only the breakpoints of at least the minimum get entries.
        assert_eq!(run(&mut cache, 0, &marked(&b, &[2, 11])), CacheUsage { read: 0, write: 1200 });
        assert_eq!(cache.len(), 1);
        assert_eq!(run(&mut cache, 0, &marked(&b, &[2])), CacheUsage::default());
    }

    #[test]
    fn a_refused_request_changes_nothing() {
        let b = blocks(12);
        let cache = PromptCache::default();
        let lookup = cache.lookup(0, &marked(&b, &[11]), RULES);
        assert_eq!(lookup.usage.write, 1200);
        assert!(cache.is_empty(), "a lookup alone stores nothing");
    }

    fn steps(tokens: &[u64]) -> Prefix {
        Prefix::Automatic { steps: tokens.iter().map(|&t| Boundary { tokens: t, key: t }).collect() }
    }

    #[test]
    fn openai_reads_the_longest_stored_step() {
        let mut cache = PromptCache::default();
        assert_eq!(run(&mut cache, 0, &steps(&[1024, 1152])), CacheUsage::default(), "the first time, nothing");
        assert_eq!(run(&mut cache, SEC, &steps(&[1024, 1152, 1280])), CacheUsage { read: 1152, write: 0 });
        assert_eq!(run(&mut cache, 2 * SEC, &steps(&[1024, 1152, 1280])).read, 1280);
        assert_eq!(cache.lookup(302 * SEC, &steps(&[1024]), RULES).usage.read, 0, "300 s without use");
    }

    #[test]
    fn the_store_stays_bounded() {
        let mut cache = PromptCache::with_capacity(100);
        for i in 0..1000u64 {
            let prefix = Prefix::Automatic { steps: vec![Boundary { tokens: 1024, key: i }] };
            run(&mut cache, i, &prefix);
            assert!(cache.len() <= 100);
        }
        // The newest survive.
        assert_eq!(
            cache
                .lookup(1000, &Prefix::Automatic { steps: vec![Boundary { tokens: 1024, key: 999 }] }, RULES)
                .usage
                .read,
            1024
        );
    }
}
