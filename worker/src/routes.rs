//! The providers one worker calls, by name (`PACELINE_PROVIDERS`, or the one
//! provider of `PACELINE_PROVIDER_URL`): each with its client and its own
//! pacer budget, so a 429 from one never pauses the turns of another.

use std::sync::Arc;

use crate::config::{KeySource, ProviderArgs};
use anyhow::Context as _;
use shared::config::PacerArgs;
use shared::keys::Keys;
use shared::pacer::Pacer;

use crate::provider::Provider;

/// One provider: where a run's turns go when it names it.
#[derive(Debug, Clone)]
pub struct Route {
    /// The provider's name (`default` for a single-provider fleet).
    pub name: String,
    /// The client.
    pub provider: Provider,
    /// Its pacer, over its own budget.
    pub pacer: Pacer,
    /// The budget's name (`/v1/pacer`, metric labels).
    pub budget: String,
    /// When this process last heard its pacer owe a call time.
    pub owed: OwedLately,
}

/// When a process last heard a route's pacer owe a call time: a scarce
/// budget. While it is, a turn asks the pacer for the next one as it commits
/// (its first wait then costs no round of its own); while the budget has room
/// it does not, as that ask would only add a round trip before every commit.
#[derive(Debug, Clone, Default)]
pub struct OwedLately(Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl OwedLately {
    /// How long a budget counts as scarce after the pacer last owed a call time.
    pub const SCARCE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

    /// The pacer owed a call time just now, for `reason`. (A cold budget's
    /// probe holds calls for its headers: that says nothing of the budget.)
    pub fn note(&self, reason: shared::pacer::OwedReason) {
        if reason != shared::pacer::OwedReason::Probe {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        }
    }

    /// Whether it did within [`Self::SCARCE_FOR`].
    pub fn scarce(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|at| at.elapsed() < Self::SCARCE_FOR)
    }
}

/// Every provider of this worker, in order: the first is the default.
#[derive(Debug, Clone)]
pub struct Routes(Arc<Vec<Route>>);

impl Routes {
    /// Builds one client and one pacer per provider; fails on a provider that
    /// cannot be called (a bad URL, a named key variable that is unset).
    pub fn build(
        providers: &ProviderArgs,
        pacer: &PacerArgs,
        keys: &KeySource,
        conn: redis::aio::ConnectionManager,
        redis_keys: &Keys,
    ) -> anyhow::Result<Self> {
        let resolved = providers.resolve(&pacer.budget, pacer, keys).map_err(anyhow::Error::msg)?;
        let mut routes = Vec::with_capacity(resolved.len());
        for p in resolved {
            let provider = Provider::new(p.style, &p.url, &p.key).with_context(|| format!("provider {}", p.name))?;
            tracing::info!(message = "provider", provider.name = %p.name, api.style = ?p.style,
                url = %crate::provider::shown_url(&p.url),
                budget = %p.budget, key = if p.key.is_empty() { "none" } else { "set" }, key.from = %p.key_source);
            let pacer = pacer.build_for(conn.clone(), redis_keys.clone(), &p.budget, p.tpm, p.rpm);
            routes.push(Route { name: p.name, provider, pacer, budget: p.budget, owed: OwedLately::default() });
        }
        anyhow::ensure!(!routes.is_empty(), "no provider to call");
        Ok(Self(Arc::new(routes)))
    }

    /// Routes built in code (tests).
    pub fn from_routes(routes: Vec<Route>) -> Self {
        Self(Arc::new(routes))
    }

    /// The provider a run names, or the default (the first) when it names none.
    pub fn get(&self, name: Option<&str>) -> Option<&Route> {
        match name {
            None => self.0.first(),
            Some(name) => self.0.iter().find(|r| r.name == name),
        }
    }

    /// The worker's fetch asked a pacer and it owed a turn time: each budget
    /// the fetch asks counts as scarce (the fetch does not say which owed).
    pub fn note_fetch_owed(&self) {
        for r in self.0.iter() {
            if matches!(&r.pacer, Pacer::Shared(p) if p.scriptable()) {
                r.owed.note(shared::pacer::OwedReason::Budget);
            }
        }
    }

    /// What the fetch needs to ask the shared pacers itself
    /// (`RunStore::fetch_script_asking`): the routes whose pacer is shared,
    /// and those that pace nothing. `None` when none is either.
    /// `in_place` is the worker's in-place wait ([`shared::runs::FetchAsks::in_place_ms`]).
    pub fn fetch_asks(
        &self,
        tenants: &shared::config::TenantPolicy,
        in_place: std::time::Duration,
    ) -> Option<shared::runs::FetchAsks> {
        let routes: std::collections::BTreeMap<String, serde_json::Value> = self
            .0
            .iter()
            .filter_map(|r| match &r.pacer {
                Pacer::Shared(p) => p.script_route().map(|route| (r.name.clone(), route)),
                _ => None,
            })
            .collect();
        let unpaced: Vec<String> =
            self.0.iter().filter(|r| matches!(r.pacer, Pacer::Off)).map(|r| r.name.clone()).collect();
        if routes.is_empty() && unpaced.is_empty() {
            return None;
        }
        Some(shared::runs::FetchAsks {
            routes,
            unpaced,
            first: self.0.first().map(|r| r.name.clone()).unwrap_or_default(),
            weights: tenants.weights().map(|(t, w)| (t.to_owned(), w)).collect(),
            caps: tenants.caps().map(|(t, c)| (t.to_owned(), c)).collect(),
            in_place_ms: in_place.as_millis() as u64,
        })
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(|r| r.name.as_str()).collect()
    }
}
