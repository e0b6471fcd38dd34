//! Building and running the API: `Application::build(config)` binds the
//! listener (port 0 allowed) and connects lazily to Redis, so the API starts
//! while Redis is down and answers 503 until it is back.

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context as _;
use shared::pacer::{PacingConfig, SharedPacer};
use shared::queue::QueueConfig;
use shared::runs::{RunStore, SubmitPolicy};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::Auth;
use crate::config::ApiConfig;
use crate::state::{AppState, Inner};

/// A bound, not yet serving, API.
pub struct Application {
    listener: TcpListener,
    addr: SocketAddr,
    router: axum::Router,
    limits: crate::serve::Limits,
    stop: watch::Sender<bool>,
}

impl std::fmt::Debug for Application {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Application").field("addr", &self.addr).finish()
    }
}

impl Application {
    /// Binds `config.serve.listen` and prepares the routes.
    pub async fn build(config: ApiConfig) -> anyhow::Result<Self> {
        config.redis.check().map_err(anyhow::Error::msg)?;
        let conn = shared::redis_util::connect(&config.redis, config.serve.redis_timeout())
            .with_context(|| "the Redis URL is not valid".to_string())?;
        // A Redis that evicts keys (or is too old for the scripts) is refused
        // before anything is served; one not up yet is waited for.
        shared::redis_util::refuse_unfit(&mut conn.clone(), &config.redis, std::time::Duration::from_secs(2))
            .await
            .map_err(anyhow::Error::msg)?;
        let keys = config.redis.keys();
        let queue = shared::runs::run_queue(&config.redis, QueueConfig::default()).context("the turn queue")?;
        // The API only reads the pacer: its snapshot lists every budget under the prefix.
        let pacer = SharedPacer::new(conn.clone(), keys.clone(), "default", PacingConfig::default());
        let runs = RunStore::new(conn.clone(), keys, config.runs.retention).with_quotas(config.quotas.clone());
        config.runs.use_prices();
        crate::config::check_access(config.serve.listen, &config.serve.tokens, &config.access)
            .map_err(anyhow::Error::msg)?;
        let auth = Auth::new(&config.serve.tokens, config.access.operator());
        match &auth {
            Auth::Open => tracing::warn!(
                message = "PACELINE_API_TOKENS is not set: open development mode, every request is tenant `default`"
            ),
            Auth::Tokens { tenants, operator } => tracing::info!(
                message = "bearer tokens configured",
                tenants = tenants.len(),
                operator = operator.is_some()
            ),
        }
        let policy = SubmitPolicy {
            tool_endpoints: config.runs.tool_endpoints.clone(),
            providers: config.providers.names(),
            companion_tenants: config.access.companion_tenants(),
            models: config.runs.models.clone(),
            webhook_endpoints: config.runs.webhook_endpoints.clone(),
            mcp_endpoints: config.runs.mcp_endpoints.clone(),
            mcp_header_vars: config.runs.mcp_header_vars.clone(),
        };
        let _ = crate::metrics::handle();
        let listener = TcpListener::bind(config.serve.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.serve.listen))?;
        let addr = listener.local_addr()?;
        let (stop, shutdown) = watch::channel(false);
        let streams = Default::default();
        // The event reader blocks on a connection of its own (a blocking read
        // on the shared one would hold up every other request).
        let reader = shared::redis_util::connect(
            &config.redis,
            std::time::Duration::from_secs(2) + config.serve.redis_timeout(),
        )
        .context("the event reader's connection")?;
        let hub = crate::hub::EventHub::start(
            RunStore::new(reader, config.redis.keys(), config.runs.retention),
            config.serve.redis_timeout(),
            shutdown.clone(),
        );
        let limits = config.serve.connection_limits().fitted(crate::serve::raise_fd_limit());
        let state = AppState::new(Inner { runs, queue, pacer, conn, auth, policy, config, shutdown, streams, hub });
        let router = crate::routes::router(state);
        Ok(Self { listener, addr, router, limits, stop })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown` resolves; then open event streams end, requests
    /// in flight finish, and it returns. Each connection is bounded
    /// (`serve.rs`).
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let Self { listener, addr, router, limits, stop } = self;
        tracing::info!(message = "api listening", %addr, dashboard = %format!("http://{addr}/"),
            header_timeout = ?limits.header_timeout, max_connections = limits.max_connections,
            max_client_connections = limits.max_per_client);
        crate::serve::serve(listener, router, limits, async move {
            shutdown.await;
            let _ = stop.send(true);
        })
        .await;
        tracing::info!(message = "api stopped");
        Ok(())
    }
}
