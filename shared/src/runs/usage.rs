//! What the calls used and cost, per tenant, model and UTC day (SPEC §3,
//! `GET /v1/usage`). A worker adds each answered call to an in-memory book
//! ([`UsageBook::add`]) and writes the book to Redis every
//! [`FLUSH_EVERY`] and when it stops (one `HINCRBY` per count that moved, one
//! hash per day), so the counts cost Redis a command a second or so per
//! worker, not a write per call; a worker killed outright loses at most that
//! long of its counts (a run's own `usage` and `cost_usd` are its record's,
//! written with each commit, and are never lost). The API reads the days asked for and sums
//! them by tenant, model or day.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use super::record::Usage;
use crate::keys::Keys;

/// How often a worker writes its book (and once more when it stops): at 8
/// workers a 2-s period cost the pacing trial ~2 Redis commands a turn, 10 s
/// costs ~0.4.
pub const FLUSH_EVERY: Duration = Duration::from_secs(10);

/// How long a day's counts are kept: a year and a bit.
pub const KEEP_DAYS: u64 = 400;

/// The most days one `GET /v1/usage` reads.
pub const MAX_DAYS: u64 = 366;

/// One UTC day, ms.
const DAY_MS: u64 = 86_400_000;

/// The counts of one tenant, model and day (or their sums).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageTotals {
    /// Calls answered.
    pub calls: u64,
    /// Input tokens, cached or not.
    pub input_tokens: u64,
    /// Of them, read from the prompt cache.
    pub cached_input_tokens: u64,
    /// Of them, written to the prompt cache.
    pub cache_write_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Of them, reasoning.
    pub reasoning_tokens: u64,
    /// What they cost at the model's price, USD; `null` when a model among
    /// them has no known price (its calls' cost is unknown, never 0).
    pub cost_usd: Option<f64>,
}

impl UsageTotals {
    /// Nothing yet, at a known cost of 0.
    pub fn zero() -> Self {
        Self { cost_usd: Some(0.0), ..Self::default() }
    }

    /// These and `other` together (the cost unknown if either's is).
    pub fn plus(self, other: &Self) -> Self {
        Self {
            calls: self.calls + other.calls,
            input_tokens: self.input_tokens + other.input_tokens,
            cached_input_tokens: self.cached_input_tokens + other.cached_input_tokens,
            cache_write_tokens: self.cache_write_tokens + other.cache_write_tokens,
            output_tokens: self.output_tokens + other.output_tokens,
            reasoning_tokens: self.reasoning_tokens + other.reasoning_tokens,
            cost_usd: self.cost_usd.zip(other.cost_usd).map(|(a, b)| ((a + b) * 1e6).round() / 1e6),
        }
    }
}

/// The kinds a day's hash counts, by field suffix.
const KINDS: [&str; 7] = ["calls", "input", "cached", "written", "output", "reasoning", "cost_micros"];

/// A worker's counts not yet written, by (day, tenant, model), and the last
/// day whose hash this process gave its expiry (0: none yet).
#[derive(Debug, Default)]
pub struct UsageBook(Mutex<HashMap<(u64, String, String), [u64; 7]>>, std::sync::atomic::AtomicU64);

impl UsageBook {
    /// Adds one answered call of `tenant` on `model` at `now_ms`.
    pub fn add(&self, tenant: &str, model: &str, now_ms: u64, usage: &Usage) {
        let cost = crate::models::price(model).map_or(u64::MAX, |p| super::spend::micros(p.cost_usd(usage)));
        let mut book = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let counts = book.entry((now_ms / DAY_MS, tenant.to_owned(), model.to_owned())).or_default();
        let add = [
            1,
            usage.input_tokens,
            usage.cached_input_tokens,
            usage.cache_write_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            cost,
        ];
        merge(counts, add);
    }

    /// Writes what the book holds and empties it; on failure the counts go
    /// back in, to be written with the next flush.
    pub async fn flush(&self, conn: &mut crate::redis_util::RedisConn, keys: &Keys) -> Result<(), redis::RedisError> {
        let taken = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        if taken.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        let mut days = std::collections::BTreeSet::new();
        for ((day, tenant, model), counts) in &taken {
            let key = keys.usage_day(*day);
            days.insert(*day);
            for (kind, n) in KINDS.iter().zip(counts) {
                // An unknown cost is written as -1 once: any negative reads as unknown.
                let n: i64 = if *n == u64::MAX { -1 } else { *n as i64 };
                if n != 0 {
                    pipe.cmd("HINCRBY").arg(&key).arg(format!("{tenant}|{model}|{kind}")).arg(n).ignore();
                }
            }
        }
        // A day's hash expires KEEP_DAYS after the day ends: one fixed instant,
        // set once a day by each process (not at every write).
        use std::sync::atomic::Ordering::Relaxed;
        let last = days.iter().copied().max().unwrap_or_default();
        for &day in days.iter().filter(|&&d| d > self.1.load(Relaxed)) {
            pipe.cmd("PEXPIREAT").arg(keys.usage_day(day)).arg((day + 1 + KEEP_DAYS) * DAY_MS).ignore();
        }
        if let Err(error) = pipe.query_async::<()>(conn).await {
            let mut book = self.0.lock().unwrap_or_else(|e| e.into_inner());
            for (k, counts) in taken {
                merge(book.entry(k).or_default(), counts);
            }
            return Err(error);
        }
        self.1.fetch_max(last, Relaxed);
        Ok(())
    }
}

/// Adds `add` to `counts`; `u64::MAX` (a cost unknown: a model without a
/// price) stays unknown for good.
fn merge(counts: &mut [u64; 7], add: [u64; 7]) {
    for (c, a) in counts.iter_mut().zip(add) {
        *c = if *c == u64::MAX || a == u64::MAX { u64::MAX } else { *c + a };
    }
}

/// How [`read`] groups its sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupBy {
    /// By tenant.
    Tenant,
    /// By model.
    Model,
    /// By UTC day (`YYYY-MM-DD`).
    Day,
}

impl GroupBy {
    /// Reads `tenant`, `model` or `day`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tenant" => Some(Self::Tenant),
            "model" => Some(Self::Model),
            "day" => Some(Self::Day),
            _ => None,
        }
    }
}

/// The UTC day number of `YYYY-MM-DD`.
pub fn parse_day(s: &str) -> Option<u64> {
    let f = time::macros::format_description!("[year]-[month]-[day]");
    let date = time::Date::parse(s, &f).ok()?;
    let days = date.to_julian_day() - time::Date::from_ordinal_date(1970, 1).ok()?.to_julian_day();
    u64::try_from(days).ok()
}

/// `YYYY-MM-DD` of UTC day number `day`.
pub fn format_day(day: u64) -> String {
    super::record::rfc3339_ms((day * DAY_MS) as i64)[..10].to_owned()
}

/// The UTC day of `ms`.
pub fn day_of(ms: u64) -> u64 {
    ms / DAY_MS
}

/// The sums of days `from..=to` by `group_by`, of `tenant`'s calls only when
/// given: key (tenant, model or `YYYY-MM-DD`) -> totals.
pub async fn read(
    conn: &mut crate::redis_util::RedisConn,
    keys: &Keys,
    from: u64,
    to: u64,
    group_by: GroupBy,
    tenant: Option<&str>,
) -> Result<BTreeMap<String, UsageTotals>, redis::RedisError> {
    let mut pipe = redis::pipe();
    for day in from..=to {
        pipe.cmd("HGETALL").arg(keys.usage_day(day));
    }
    let days: Vec<HashMap<String, i64>> = pipe.query_async(conn).await?;
    let mut out: BTreeMap<String, UsageTotals> = BTreeMap::new();
    for (day, fields) in (from..=to).zip(days) {
        for (field, n) in fields {
            let mut parts = field.rsplitn(3, '|');
            let (Some(kind), Some(model), Some(who)) = (parts.next(), parts.next(), parts.next()) else { continue };
            if tenant.is_some_and(|t| t != who) {
                continue;
            }
            let key = match group_by {
                GroupBy::Tenant => who.to_owned(),
                GroupBy::Model => model.to_owned(),
                GroupBy::Day => format_day(day),
            };
            let t = out.entry(key).or_insert(UsageTotals::zero());
            let n_u = n.max(0) as u64;
            match kind {
                "calls" => t.calls += n_u,
                "input" => t.input_tokens += n_u,
                "cached" => t.cached_input_tokens += n_u,
                "written" => t.cache_write_tokens += n_u,
                "output" => t.output_tokens += n_u,
                "reasoning" => t.reasoning_tokens += n_u,
                "cost_micros" if n < 0 => t.cost_usd = None,
                "cost_micros" => t.cost_usd = t.cost_usd.map(|c| c + n as f64 / 1e6),
                _ => {}
            }
        }
    }
    for t in out.values_mut() {
        t.cost_usd = t.cost_usd.map(|c| (c * 1e6).round() / 1e6);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_read_and_print_as_utc_dates() {
        assert_eq!(parse_day("1970-01-01"), Some(0));
        assert_eq!(parse_day("2026-12-05"), Some(20_792));
        assert_eq!(format_day(20_792), "2026-12-05");
        assert_eq!(day_of(20_792 * DAY_MS + 5), 20_792);
        for bad in ["2026-13-01", "2026-12-5", "yesterday", "1969-12-31", ""] {
            assert_eq!(parse_day(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_book_adds_per_day_tenant_and_model_and_an_unknown_price_stays_unknown() {
        let book = UsageBook::default();
        let u = Usage { input_tokens: 1000, output_tokens: 10, cached_input_tokens: 600, ..Usage::default() };
        book.add("alpha", "gpt-4.1", 5, &u);
        book.add("alpha", "gpt-4.1", 6, &u);
        book.add("alpha", "house-model-x", 7, &u);
        let b = book.0.lock().unwrap();
        let priced = b[&(0, "alpha".to_owned(), "gpt-4.1".to_owned())];
        assert_eq!(priced[..6], [2, 2000, 1200, 0, 20, 0]);
        // gpt-4.1: 400 uncached at $2, 600 read at $0.5, 10 out at $8 per million.
        assert_eq!(priced[6], 2 * 1_180);
        assert_eq!(b[&(0, "alpha".to_owned(), "house-model-x".to_owned())][6], u64::MAX);
    }
}
