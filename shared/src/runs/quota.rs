//! Per-tenant quotas on submits (SPEC §1, `PACELINE_MAX_ACTIVE_RUNS`,
//! `PACELINE_SUBMITS_PER_MIN`): one tenant cannot fill Redis for the others.
//! Both are checked by the create script itself (runs/store.lua `create`),
//! before it writes anything: the tenant's unfinished runs are its `active`
//! set (kept in the same scripts that start and end runs), and its submit
//! rate is a GCRA — one key holding the time the tenant's next submit is
//! "due", so a burst of the whole minute's allowance is taken at once and
//! the rest come evenly.

use std::collections::BTreeMap;
use std::str::FromStr;

/// Default of `PACELINE_MAX_ACTIVE_RUNS`.
pub const DEFAULT_MAX_ACTIVE_RUNS: u64 = 10_000;
/// Default of `PACELINE_SUBMITS_PER_MIN`.
pub const DEFAULT_SUBMITS_PER_MIN: u64 = 6_000;

/// A number per tenant: `N` for every tenant, `TENANT=N` for one, both
/// comma-separated (`5000,alpha=20000`). A tenant not named gets the bare
/// number, or the quota's default when there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerTenant {
    every: Option<u64>,
    named: BTreeMap<String, u64>,
}

impl PerTenant {
    /// `n` for every tenant.
    pub fn every(n: u64) -> Self {
        Self { every: Some(n), named: BTreeMap::new() }
    }

    /// The number of `tenant`; `default` when the list names neither it nor every tenant.
    pub fn of(&self, tenant: &str, default: u64) -> u64 {
        self.named.get(tenant).copied().or(self.every).unwrap_or(default)
    }
}

impl FromStr for PerTenant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut every = None;
        let mut named = BTreeMap::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (tenant, n) = match part.split_once('=') {
                Some((t, n)) => (Some(t.trim()), n.trim()),
                None => (None, part),
            };
            let n: u64 = n.parse().map_err(|_| format!("`{part}`: `{n}` is not a whole number"))?;
            match tenant {
                Some("") => return Err(format!("`{part}`: the tenant is missing")),
                Some(t) => {
                    if named.insert(t.to_owned(), n).is_some() {
                        return Err(format!("`{part}`: {t} is given twice"));
                    }
                }
                None if every.is_some() => return Err(format!("`{part}`: one number for every tenant, not two")),
                None => every = Some(n),
            }
        }
        Ok(Self { every, named })
    }
}

/// The quotas of `paceline api` (and `up`). Declared once, flattened into
/// both.
#[derive(Debug, Clone, clap::Args)]
pub struct Quotas {
    /// Unfinished runs (queued, running, waiting) a tenant may have at once:
    /// `N` for every tenant, `TENANT=N` for one (`10000,alpha=50000`). One
    /// more submit answers 429.
    #[arg(long = "max-active-runs", env = "PACELINE_MAX_ACTIVE_RUNS", default_value = "10000", value_name = "LIST")]
    pub max_active_runs: PerTenant,
    /// Submits a tenant may make a minute (a burst of the whole minute's,
    /// then evenly): `N` or `TENANT=N`, as above. One more answers 429 with
    /// the seconds until the next is allowed.
    #[arg(long = "submits-per-min", env = "PACELINE_SUBMITS_PER_MIN", default_value = "6000", value_name = "LIST")]
    pub submits_per_min: PerTenant,
}

impl Default for Quotas {
    /// The SPEC's defaults: 10 000 unfinished runs and 6 000 submits a minute.
    fn default() -> Self {
        Self { max_active_runs: PerTenant::every(10_000), submits_per_min: PerTenant::every(6_000) }
    }
}

impl Quotas {
    /// No bound a benchmark's backlog reaches (the bench submits 100 000 runs
    /// at once, as one tenant).
    pub fn unbounded() -> Self {
        Self { max_active_runs: PerTenant::every(UNBOUNDED), submits_per_min: PerTenant::every(UNBOUNDED) }
    }

    /// The two numbers of `tenant`.
    pub fn of(&self, tenant: &str) -> TenantQuota {
        TenantQuota {
            max_active_runs: self.max_active_runs.of(tenant, DEFAULT_MAX_ACTIVE_RUNS),
            submits_per_min: self.submits_per_min.of(tenant, DEFAULT_SUBMITS_PER_MIN),
        }
    }
}

/// A quota nothing reaches (a number Lua's doubles hold exactly).
const UNBOUNDED: u64 = 1_000_000_000_000;

/// One tenant's quotas, as the create script takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantQuota {
    /// Unfinished runs it may have.
    pub max_active_runs: u64,
    /// Submits a minute.
    pub submits_per_min: u64,
}

/// Which quota a refused submit met, and when to try again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct QuotaExceeded {
    /// For a human: which quota, and its number.
    pub message: String,
    /// When a retry may pass, ms (at least 1 s for `Retry-After`).
    pub retry_after_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_gives_every_tenant_a_number_and_names_some() {
        let q: PerTenant = "5000,alpha=20000".parse().unwrap();
        assert_eq!((q.of("alpha", 7), q.of("beta", 7)), (20_000, 5_000));
        let q: PerTenant = "alpha=3".parse().unwrap();
        assert_eq!((q.of("alpha", 7), q.of("beta", 7)), (3, 7), "the others keep the default");
        assert_eq!("12".parse::<PerTenant>().unwrap().of("x", 7), 12);
        assert_eq!("0".parse::<PerTenant>().unwrap().of("x", 7), 0, "0 refuses every submit");
    }

    #[test]
    fn a_bad_list_says_what_is_wrong() {
        for (bad, says) in [
            ("ten", "not a whole number"),
            ("=5", "tenant is missing"),
            ("a=1,a=2", "given twice"),
            ("5,6", "not two"),
            ("a=-1", "not a whole number"),
        ] {
            let e = bad.parse::<PerTenant>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
