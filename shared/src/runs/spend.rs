//! Tenants' spend caps per day (SPEC §4a, `PACELINE_TENANT_BUDGETS`): what a
//! tenant's calls cost on one day, and what its calls in flight may still
//! cost, in one Redis hash per tenant and day, so every worker sees the same
//! ledger. A call reserves its estimated cost before it is sent, as tokens are
//! reserved with the pacer; it is refused when what was spent and what is
//! reserved would cross the cap with it; its real cost replaces the
//! reservation when it is answered. Concurrent calls of one tenant can thus
//! overshoot the cap by no more than the estimates were off — and the
//! estimates err high. A reservation whose settle never comes (its worker
//! died) lapses after [`RESERVATION_TTL_MS`].

use std::collections::BTreeMap;
use std::str::FromStr;

use crate::keys::Keys;

/// How long a reservation holds without its settle.
pub const RESERVATION_TTL_MS: u64 = 15 * 60 * 1000;

/// A UTC day, ms.
pub const DAY_MS: u64 = 24 * 3600 * 1000;

/// `PACELINE_TENANT_BUDGETS`: USD per tenant and day, `alpha=50,beta=5`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantBudgets(pub BTreeMap<String, f64>);

impl TenantBudgets {
    /// The cap of `tenant`, if it has one.
    pub fn cap(&self, tenant: &str) -> Option<f64> {
        self.0.get(tenant).copied()
    }

    /// Whether no tenant has a cap.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromStr for TenantBudgets {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut caps = BTreeMap::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (tenant, usd) = part.split_once('=').ok_or_else(|| format!("`{part}`: write TENANT=USD"))?;
            let tenant = tenant.trim();
            if tenant.is_empty() {
                return Err(format!("`{part}`: the tenant is missing"));
            }
            let usd: f64 =
                usd.trim().parse().map_err(|_| format!("`{part}`: `{}` is not a number of USD", usd.trim()))?;
            if !(usd.is_finite() && usd > 0.0) {
                return Err(format!("`{part}`: a day's cap is a number of USD above 0"));
            }
            if caps.insert(tenant.to_owned(), usd).is_some() {
                return Err(format!("`{part}`: {tenant} is given twice"));
            }
        }
        Ok(Self(caps))
    }
}

/// USD as the ledger keeps it: whole micro-USD, rounded up.
pub fn micros(usd: f64) -> u64 {
    (usd.max(0.0) * 1e6).ceil() as u64
}

/// The ledger's script: `reserve` (KEYS[1] the day's hash; ARGV: op, id,
/// amount, cap, now ms, reservation expiry ms, key ttl ms) answers `{1}`
/// when spent + live reservations + amount fit the cap (and books it), else
/// `{0}`; `settle` (ARGV: op, id, actual, -, -, -, key ttl ms) drops the
/// reservation and adds the actual cost.
const SCRIPT: &str = r"
local key, op, id = KEYS[1], ARGV[1], 'r:' .. ARGV[2]
local amount = tonumber(ARGV[3])
if op == 'reserve' then
  local now = tonumber(ARGV[5])
  local fields = redis.call('HGETALL', key)
  local spent, held = 0, 0
  for i = 1, #fields, 2 do
    local f, v = fields[i], fields[i + 1]
    if f == 'spent' then
      spent = tonumber(v)
    elseif string.sub(f, 1, 2) == 'r:' and f ~= id then
      local booked, expiry = string.match(v, '^(%d+)|(%d+)$')
      if tonumber(expiry) <= now then
        redis.call('HDEL', key, f)
      else
        held = held + tonumber(booked)
      end
    end
  end
  if spent + held + amount > tonumber(ARGV[4]) then
    return {0, spent, held}
  end
  redis.call('HSET', key, id, string.format('%d|%d', amount, tonumber(ARGV[6])))
  redis.call('PEXPIRE', key, ARGV[7])
  return {1, spent, held}
end
redis.call('HDEL', key, id)
if amount > 0 then
  redis.call('HINCRBY', key, 'spent', amount)
  redis.call('PEXPIRE', key, ARGV[7])
end
return {1}
";

/// What [`SpendLedger::reserve`] answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// Booked: settle it on `day` when the call is answered.
    Held {
        /// The day it counts on.
        day: u64,
    },
    /// The cap is reached for the day: the next day begins at this ms.
    OverCap {
        /// When the next day begins, ms since the epoch.
        next_day_ms: u64,
        /// Spent so far that day, micro-USD.
        spent: u64,
    },
}

/// The tenants' day ledgers on Redis.
#[derive(Clone)]
pub struct SpendLedger {
    conn: crate::redis_util::RedisConn,
    keys: Keys,
    /// How long a "day" is (a UTC day; tests shorten it).
    day_ms: u64,
    script: redis::Script,
}

impl std::fmt::Debug for SpendLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpendLedger").field("day_ms", &self.day_ms).finish_non_exhaustive()
    }
}

impl SpendLedger {
    /// A ledger whose days are `day_ms` long ([`DAY_MS`] but in tests).
    pub fn new(conn: crate::redis_util::RedisConn, keys: Keys, day_ms: u64) -> Self {
        Self { conn, keys, day_ms: day_ms.max(1), script: redis::Script::new(SCRIPT) }
    }

    /// Books `usd` of `tenant`'s cap `cap_usd` for call `id` at `now_ms`.
    pub async fn reserve(
        &self,
        tenant: &str,
        id: &str,
        usd: f64,
        cap_usd: f64,
        now_ms: u64,
    ) -> Result<Reserved, redis::RedisError> {
        let day = now_ms / self.day_ms;
        let mut inv = self.script.key(self.keys.tenant_spend(tenant, day));
        inv.arg("reserve")
            .arg(id)
            .arg(micros(usd))
            .arg(micros(cap_usd))
            .arg(now_ms)
            .arg(now_ms + RESERVATION_TTL_MS)
            .arg(2 * self.day_ms + RESERVATION_TTL_MS);
        let answer: Vec<u64> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(match answer.as_slice() {
            [1, ..] => Reserved::Held { day },
            [_, spent, ..] => Reserved::OverCap { next_day_ms: self.next_day_ms(now_ms), spent: *spent },
            _ => Reserved::OverCap { next_day_ms: self.next_day_ms(now_ms), spent: 0 },
        })
    }

    /// Replaces call `id`'s reservation on `day` by what it cost, `usd`.
    pub async fn settle(&self, tenant: &str, day: u64, id: &str, usd: f64) -> Result<(), redis::RedisError> {
        let mut inv = self.script.key(self.keys.tenant_spend(tenant, day));
        inv.arg("settle").arg(id).arg(micros(usd)).arg(0).arg(0).arg(0).arg(2 * self.day_ms + RESERVATION_TTL_MS);
        let _: Vec<u64> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(())
    }

    /// When the day after the one of `now_ms` begins, ms.
    pub fn next_day_ms(&self, now_ms: u64) -> u64 {
        (now_ms / self.day_ms + 1) * self.day_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_read_strictly() {
        let b: TenantBudgets = "alpha=50, beta=5.5,".parse().unwrap();
        assert_eq!((b.cap("alpha"), b.cap("beta"), b.cap("gamma")), (Some(50.0), Some(5.5), None));
        assert!(TenantBudgets::from_str("").unwrap().is_empty());
        for (bad, says) in [
            ("alpha", "TENANT=USD"),
            ("=5", "tenant is missing"),
            ("alpha=five", "not a number"),
            ("alpha=0", "above 0"),
            ("alpha=-3", "above 0"),
            ("alpha=1,alpha=2", "given twice"),
        ] {
            let err = TenantBudgets::from_str(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert_eq!(micros(0.0000011), 2);
    }
}
