//! What every handler shares: the run store, the queue and pacer readers, the
//! auth table, the submit policy, and the Redis deadline of a request.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use shared::pacer::SharedPacer;
use shared::queue::TurnQueue;
use shared::redis_util::RedisConn;
use shared::runs::{RunStore, SubmitPolicy};
use tokio::sync::watch;

use crate::auth::Auth;
use crate::config::ApiConfig;
use crate::error::ApiError;

/// The handlers' state (cheap to clone).
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

/// See [`AppState`].
pub struct Inner {
    /// Runs: records, transcripts, events.
    pub runs: RunStore,
    /// The turn queue (counts, workers).
    pub queue: TurnQueue,
    /// The shared pacer's state (snapshots only).
    pub pacer: SharedPacer,
    /// A plain connection (PING).
    pub conn: RedisConn,
    /// Who may call.
    pub auth: Auth,
    /// Which tool endpoints runs may name.
    pub policy: SubmitPolicy,
    /// The config it was built from.
    pub config: ApiConfig,
    /// Flips to true when the server shuts down: open event streams end.
    pub shutdown: watch::Receiver<bool>,
    /// The event streams open now, per tenant and in all.
    pub streams: Arc<crate::routes::events::OpenStreams>,
    /// The one Redis reader every event stream of this process follows its run with.
    pub hub: crate::hub::EventHub,
}

impl AppState {
    /// The webhook deliveries' queue (dead letters, re-drives).
    pub fn webhooks(&self) -> shared::runs::webhooks::WebhookQueue {
        shared::runs::webhooks::WebhookQueue::new(self.conn.clone(), self.config.redis.keys())
    }
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Wraps the parts.
    pub fn new(inner: Inner) -> Self {
        Self(Arc::new(inner))
    }

    /// Runs one Redis-backed call under the request deadline: Redis down or
    /// slow is a 503, never a hang.
    pub async fn redis<T, E>(&self, what: &'static str, fut: impl Future<Output = Result<T, E>>) -> Result<T, ApiError>
    where
        ApiError: From<E>,
    {
        bounded(self.config.serve.redis_timeout(), what, fut).await
    }
}

/// [`AppState::redis`] without a state.
pub async fn bounded<T, E>(
    limit: Duration,
    what: &'static str,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, ApiError>
where
    ApiError: From<E>,
{
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result.map_err(ApiError::from),
        Err(_) => Err(ApiError::Unavailable(anyhow::anyhow!("{what}: redis did not answer within {limit:?}"))),
    }
}
