//! The providers one worker calls, by name (`PACELINE_PROVIDERS`, or the one
//! provider of `PACELINE_PROVIDER_URL`): each with its client and its own
//! pacer budget, so a 429 from one never pauses the turns of another.

use std::sync::Arc;

use crate::config::{KeySource, ProviderArgs};
use anyhow::Context as _;
use shared::config::PacerArgs;
use shared::keys::Keys;
use shared::pacer::Pacer;

pub use crate::pacing::OwedLately;

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
    /// The context windows its errors taught this process.
    pub windows: crate::context::LearnedWindows,
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
        conn: shared::redis_util::RedisConn,
        redis_keys: &Keys,
    ) -> anyhow::Result<Self> {
        let resolved = providers.resolve(&pacer.budget, pacer, keys).map_err(anyhow::Error::msg)?;
        let mut routes = Vec::with_capacity(resolved.len());
        for p in resolved {
            let provider =
                Provider::new(p.style, &p.url, &p.key).with_context(|| format!("provider {}", p.name))?.with_timeouts(
                    crate::provider::DEFAULT_CONNECT_TIMEOUT,
                    std::time::Duration::from_secs(providers.idle_timeout_s),
                );
            tracing::info!(message = "provider", provider.name = %p.name, api.style = ?p.style,
                url = %crate::provider::shown_url(&p.url),
                budget = %p.budget, key = if p.key.is_empty() { "none" } else { "set" }, key.from = %p.key_source);
            // A shared pacer's line releases its turns into the run store's queue.
            let pacer = pacer
                .build_for(conn.clone(), redis_keys.clone(), &p.budget, p.tpm, p.rpm)
                .with_host(shared::runs::pacer_host(redis_keys));
            routes.push(Route {
                name: p.name,
                provider,
                pacer,
                budget: p.budget,
                owed: OwedLately::default(),
                windows: Default::default(),
            });
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

    /// Every route, the default first.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.0.iter()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(|r| r.name.as_str()).collect()
    }
}
