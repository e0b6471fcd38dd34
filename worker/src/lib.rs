//! paceline's worker: runs a run's turns from the queue, each call paced by the
//! shared pacer, each turn committed exactly once.
//!
//! - `turn.rs` — one turn end to end (the heart of the worker).
//! - `provider/` — our thin client for the providers' APIs (Responses, Chat
//!   Completions, Anthropic Messages; streaming), which never retries or
//!   sleeps on its own.
//! - `routes.rs` — the named providers, each with its client and its budget.
//! - `request.rs` — the request body from the transcript, in each wire format.
//! - `estimate.rs` — the call's token estimate (tiktoken, o200k_base).
//! - `tools.rs` — calling the run's tool endpoint.
//!
//! A worker is `worker::run(config, shutdown)`: apalis's worker runtime over
//! our Redis queue (`shared::queue`), `concurrency` turns at once.

pub mod backend;
pub mod cancels;
pub mod config;
pub mod context;
pub mod estimate;
pub mod pacing;
pub mod provider;
pub mod request;
pub mod routes;
pub mod tools;
pub mod traces;
pub mod turn;
pub mod webhooks;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{KeySource, ProviderArgs};
use anyhow::Context as _;
use shared::config::{PacerArgs, RedisArgs};
use shared::queue::apalis_core::error::BoxDynError;
use shared::queue::apalis_core::task::data::Data;
use shared::queue::apalis_core::worker::builder::WorkerBuilder;
use shared::queue::{Lease, QueueConfig, TurnQueue};
use shared::runs::RunArgs;
use shared::runs::{RunStore, Turn};

pub use turn::{Runner, TurnConfig, TurnOutcome};

/// A worker process's configuration (flag > env > default).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerConfig {
    /// Redis.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Tool endpoints and retention, as the API reads them.
    #[command(flatten)]
    pub runs: RunArgs,
    /// The provider.
    #[command(flatten)]
    pub provider: ProviderArgs,
    /// The pacer.
    #[command(flatten)]
    pub pacer: PacerArgs,
    /// The queue's leases and batches.
    #[command(flatten)]
    pub queue: QueueConfig,
    /// Slots and history depth.
    #[command(flatten)]
    pub slots: SlotArgs,
    /// Tenants' spend caps per day.
    #[command(flatten)]
    pub spend: SpendArgs,
    /// How completion webhooks are sent.
    #[command(flatten)]
    pub webhooks: webhooks::WebhookArgs,
    /// Where the providers' keys and `PACELINE_TOOL_SECRET` are read (the
    /// environment; tests give them in code). Never a flag: a secret on a
    /// command line is in every `ps`.
    #[arg(skip)]
    pub keys: KeySource,
    /// Bench only (`paceline bench` passes it to the worker processes it
    /// starts, `Keys::bench_deliveries`): a Redis list this worker pushes one
    /// line per delivery to. Hidden: no deployment sets it.
    #[arg(long = "bench-deliveries-key", hide = true)]
    pub bench_deliveries_key: Option<String>,
}

/// How much one worker process takes on. Declared once, flattened into
/// `paceline worker` and `paceline up`.
#[derive(Debug, Clone, clap::Args)]
pub struct SlotArgs {
    /// Worker slots in this process: turns run at once (1 to 1024; start more
    /// processes for more).
    #[arg(long, alias = "workers", env = "PACELINE_CONCURRENCY", default_value_t = DEFAULT_CONCURRENCY,
          value_parser = parse_concurrency)]
    pub concurrency: usize,
    /// History depth sent to the model, in turns (one number for every transport).
    #[arg(long = "max-history", env = "PACELINE_MAX_HISTORY", default_value_t = crate::context::DEFAULT_MAX_HISTORY)]
    pub max_history: usize,
}

/// Tenants' spend caps per day (SPEC §4a). Declared once, flattened into
/// `paceline worker` and `paceline up`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SpendArgs {
    /// Spend caps per tenant and UTC day, USD: `alpha=50,beta=5`. A tenant's
    /// calls that would cross its cap are not sent; its runs wait
    /// (`wait_reason: "spend_cap"`) until the next day.
    #[arg(long = "tenant-budgets", env = "PACELINE_TENANT_BUDGETS", default_value = "", value_name = "LIST")]
    pub tenant_budgets: shared::runs::spend::TenantBudgets,
    /// Tests only: a "day" of this many seconds instead of a UTC day.
    #[arg(long = "spend-day-s", hide = true)]
    pub day_s: Option<u64>,
}

impl SpendArgs {
    /// How long a day of the ledger is, ms.
    pub fn day_ms(&self) -> u64 {
        self.day_s.map_or(shared::runs::spend::DAY_MS, |s| s.max(1) * 1000)
    }
}

/// Default of `--concurrency`.
pub const DEFAULT_CONCURRENCY: usize = 16;

/// The most slots one worker process may have. A process's leases travel
/// together in one Redis script (its fetch and heartbeat pass them to one
/// command, two arguments a lease, and a Lua `unpack` holds about 8 000), and
/// one process with thousands of calls in flight is one crash away from
/// handing them all back at once: more processes scale further.
pub const MAX_CONCURRENCY: usize = 1024;

/// Reads `--concurrency`: 1 to [`MAX_CONCURRENCY`].
fn parse_concurrency(s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().ok().filter(|n| (1..=MAX_CONCURRENCY).contains(n)).ok_or_else(|| {
        format!("must be a number from 1 to {MAX_CONCURRENCY} (start more worker processes for more slots)")
    })
}

impl Default for SlotArgs {
    fn default() -> Self {
        Self { concurrency: DEFAULT_CONCURRENCY, max_history: crate::context::DEFAULT_MAX_HISTORY }
    }
}

impl WorkerConfig {
    /// A config built in code (tests, `paceline up`): defaults everywhere else.
    pub fn new(redis: RedisArgs, provider_url: impl Into<String>) -> Self {
        Self {
            redis,
            runs: RunArgs::default(),
            provider: ProviderArgs::single(provider_url, shared::runs::ApiStyle::Responses),
            pacer: PacerArgs::default(),
            queue: QueueConfig::default(),
            slots: SlotArgs::default(),
            spend: SpendArgs::default(),
            webhooks: webhooks::WebhookArgs::default(),
            // Hermetic: a config built in code reads no environment.
            keys: KeySource::Given(Default::default()),
            bench_deliveries_key: None,
        }
    }
}

/// Builds what every turn of this process shares.
pub async fn runner(config: &WorkerConfig) -> anyhow::Result<(Runner, TurnQueue)> {
    let queue = shared::runs::run_queue(&config.redis, config.queue.clone()).context("the turn queue")?;
    let conn =
        shared::redis_util::connect(&config.redis, shared::redis_util::COMMAND_TIMEOUT).context("connect to Redis")?;
    let keys = config.redis.keys();
    let store = RunStore::new(conn.clone(), keys.clone(), config.runs.retention);
    config.runs.use_prices();
    let spend = (!config.spend.tenant_budgets.is_empty()).then(|| turn::Spend {
        ledger: shared::runs::spend::SpendLedger::new(conn.clone(), keys.clone(), config.spend.day_ms()),
        budgets: config.spend.tenant_budgets.clone(),
    });
    let usage = Arc::new(shared::runs::usage::UsageBook::default());
    spawn_usage_writer(usage.clone(), conn.clone(), keys.clone());
    let routes = routes::Routes::build(&config.provider, &config.pacer, &config.keys, conn, &keys)?;
    let turn_config = TurnConfig {
        max_history: config.slots.max_history.max(1),
        in_place_wait: Duration::from_millis(config.pacer.in_place_wait_ms),
        ..TurnConfig::default()
    };
    let secret = config.keys.get(crate::config::TOOL_SECRET_ENV);
    let tools = tools::ToolClient::new(config.runs.tool_endpoints.clone(), secret, tools::DEFAULT_TOOL_TIMEOUT)?
        .with_mcp(config.runs.mcp_endpoints.clone(), config.runs.mcp_header_vars.clone());
    tracing::info!(message = "tool calls", endpoints = %config.runs.tool_endpoints, mcp_servers = %config.runs.mcp_endpoints,
        signed = tools.signs());
    let tenants = config.pacer.tenant_policy().map_err(anyhow::Error::msg)?;
    crate::estimate::warm_up();
    let runner = Runner {
        store,
        routes,
        tools,
        config: Arc::new(turn_config),
        tenants: Arc::new(tenants),
        cancels: cancels::Cancels::default(),
        spend: spend.map(Arc::new),
        usage,
        bench_deliveries_key: config.bench_deliveries_key.clone(),
    };
    Ok((runner, queue))
}

/// Starts this process's webhook sender, when it holds the signing secret
/// (`run` refused a malformed one already). Without one it sends none, and
/// says so once: other workers (or this one restarted with it) do.
fn spawn_deliverer(
    config: &WorkerConfig,
    runner: &Runner,
    signer: Option<standardwebhooks::Webhook>,
) -> anyhow::Result<Option<(tokio::task::JoinHandle<()>, tokio::sync::watch::Sender<bool>)>> {
    let Some(signer) = signer else {
        if !config.runs.webhook_endpoints.is_empty() {
            tracing::warn!(message = "PACELINE_WEBHOOK_SECRET is not set: this worker sends no webhooks");
        }
        return Ok(None);
    };
    let deliverer = webhooks::Deliverer::new(
        runner.store.clone(),
        &config.redis,
        signer,
        config.runs.webhook_endpoints.clone(),
        &config.webhooks,
        config.runs.retention,
    )?;
    tracing::info!(message = "webhooks", endpoints = %config.runs.webhook_endpoints, signed = true);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    Ok(Some((tokio::spawn(Arc::new(deliverer).run(stopped)), stop)))
}

/// Writes the process's usage book to Redis every
/// [`shared::runs::usage::FLUSH_EVERY`], for as long as the process lives.
fn spawn_usage_writer(
    book: Arc<shared::runs::usage::UsageBook>,
    mut conn: shared::redis_util::RedisConn,
    keys: shared::keys::Keys,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(shared::runs::usage::FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(error) = book.flush(&mut conn, &keys).await {
                tracing::warn!(message = "could not write the usage counts; kept for the next write", %error);
            }
        }
    });
}

async fn handle_turn(turn: Turn, lease: Lease, runner: Data<Runner>) -> Result<(), BoxDynError> {
    use tracing::Instrument as _;
    let job = turn.job;
    let span = tracing::info_span!("turn", run.id = %lease.id, turn.index = job.turn, attempt = job.attempt);
    let result = runner.run_turn_asking(turn, &lease).instrument(span).await;
    // Bench-only (`paceline bench` passes `--bench-deliveries-key` to the worker
    // processes it starts): one RPUSH per delivery — run, turn, attempt, due and
    // leased ms (server clock), outcome — so the bench can tell requeued
    // deliveries and measure their lateness. Unset (always, outside the bench),
    // it costs nothing.
    if let Some(key) = &runner.bench_deliveries_key {
        let outcome = result.as_ref().map_or("error", |o| o.as_str());
        let line =
            format!("{} {} {} {} {} {outcome}", lease.id, job.turn, job.attempt, lease.due_ms, lease.fetched_at_ms);
        let _: Result<(), _> = redis::cmd("RPUSH").arg(key).arg(line).query_async(&mut runner.store.connection()).await;
    }
    match result {
        Ok(_) => Ok(()),
        Err(error) => {
            tracing::warn!(message = "turn failed; the queue retries it", %error, run.id = %lease.id);
            Err(Box::new(error))
        }
    }
}

/// Runs a worker until `shutdown` resolves: stops taking turns, finishes or
/// hands back the ones in flight, and returns.
pub async fn run(config: WorkerConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    // A malformed signing secret is said before anything else starts.
    let signer =
        webhooks::signer(config.keys.get(webhooks::WEBHOOK_SECRET_ENV).as_ref()).map_err(anyhow::Error::msg)?;
    config.redis.check().map_err(anyhow::Error::msg)?;
    let (runner, queue) = runner(&config).await?;
    // A Redis too old for the scripts, or one that evicts keys, is said at
    // once (a Redis that is not up yet is not: the worker starts and waits for it).
    let mut conn = runner.store.connection();
    shared::redis_util::refuse_unfit(&mut conn, &config.redis, Duration::from_secs(2))
        .await
        .map_err(anyhow::Error::msg)?;
    let listener =
        tokio::spawn(runner.cancels.clone().listen(config.redis.clone(), config.redis.keys().cancel_channel()));
    let deliveries = spawn_deliverer(&config, &runner, signer)?;
    // Each turn is started by the fetch that leases it (one script a batch),
    // and one back from a budget wait is asked for there first.
    let asks = runner.routes.fetch_asks(&runner.tenants, runner.config.in_place_wait);
    let fetch = runner.store.fetch_script_asking(config.slots.max_history, asks.as_ref());
    let routes = runner.routes.clone();
    let backend = backend::QueueBackend::<Turn>::new(queue, config.slots.concurrency.max(1))
        .fetching_with(fetch)
        // A turn the fetch's ask owed time says the budget is scarce, as the worker's own ask would.
        .on_held(move || routes.note_fetch_owed());
    let name = backend.identity().to_owned();
    let stopping = backend.stopping();
    tracing::info!(message = "worker started", worker.id = %name, concurrency = config.slots.concurrency,
        pacer = ?config.pacer.kind, providers = ?runner.routes.names());
    let (usage, mut usage_conn) = (runner.usage.clone(), runner.store.connection());
    let worker = WorkerBuilder::new(name.as_str()).backend(backend).data(runner).build(handle_turn);
    // The shutdown grace is one for the turns and the webhook deliveries in flight.
    let grace = Duration::from_millis(config.queue.grace_ms);
    let stop_deliveries = deliveries.as_ref().map(|(_, stop)| stop.clone());
    let drain_by = Arc::new(std::sync::OnceLock::<tokio::time::Instant>::new());
    let drain_from = drain_by.clone();
    let ran = worker
        .run_until(async move {
            shutdown.await;
            stopping.stop();
            if let Some(stop) = stop_deliveries {
                let _ = stop.send(true);
            }
            let _ = drain_from.set(tokio::time::Instant::now() + grace);
            Ok::<(), std::io::Error>(())
        })
        .await
        .context("worker");
    listener.abort();
    if let Some((handle, stop)) = deliveries {
        // The deliveries in flight finish within the shutdown grace, counted from the
        // shutdown as the turns' is; past it they are cut off, and sent again once their
        // leases lapse.
        let _ = stop.send(true);
        let by = drain_by.get().copied().unwrap_or_else(tokio::time::Instant::now);
        let abort = handle.abort_handle();
        if tokio::time::timeout_at(by, handle).await.is_err() {
            abort.abort();
        }
    }
    // The counts since the last write, before the process goes.
    if let Err(error) = usage.flush(&mut usage_conn, &config.redis.keys()).await {
        tracing::warn!(message = "could not write the last usage counts", %error);
    }
    ran?;
    tracing::info!(message = "worker stopped", worker.id = %name);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Slots {
        #[command(flatten)]
        slots: SlotArgs,
    }

    #[test]
    fn concurrency_is_1_to_1024_and_anything_else_is_a_clear_error() {
        let parse = |n: &str| Slots::try_parse_from(["worker", "--concurrency", n]).map(|s| s.slots.concurrency);
        assert_eq!(parse("1").unwrap(), 1);
        assert_eq!(parse("1024").unwrap(), MAX_CONCURRENCY);
        for bad in ["0", "1025", "100000", "x", "18446744073709551616"] {
            let error = parse(bad).unwrap_err().to_string();
            assert!(error.contains("must be a number from 1 to 1024"), "{bad}: {error}");
        }
        assert_eq!(Slots::try_parse_from(["worker"]).unwrap().slots.concurrency, DEFAULT_CONCURRENCY);
    }
}
