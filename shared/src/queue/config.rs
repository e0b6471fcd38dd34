//! How the queue behaves: its clap arguments and their defaults.

use std::time::Duration;

/// Default retention of the dead set (`PACELINE_DEAD_RETENTION_MS`): 7 days.
pub const DEFAULT_DEAD_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;

/// Most turns one fetch script leases; bounds each script's run time.
pub const MAX_FETCH_BATCH: usize = 1000;

/// Default of `--queue-lease-ms`.
pub const DEFAULT_LEASE_MS: u64 = 3000;
/// Default of `--queue-max-deliveries`.
pub const DEFAULT_MAX_DELIVERIES: u32 = 3;
/// Default of `--queue-fetch-batch`.
pub const DEFAULT_FETCH_BATCH: usize = 64;
/// Default of `--queue-idle-ms`.
pub const DEFAULT_IDLE_MS: u64 = 2000;
/// Default of `--shutdown-grace-ms`.
pub const DEFAULT_GRACE_MS: u64 = 10_000;
/// Default of `--queue-retry-ms`.
pub const DEFAULT_RETRY_BASE_MS: u64 = 1000;

/// How the queue behaves; clap arguments with env fallbacks (flag > env > default).
/// Each variable is `PACELINE_` and its flag's name (`--queue-lease-ms`:
/// `PACELINE_QUEUE_LEASE_MS`).
#[derive(Debug, Clone, clap::Args)]
pub struct QueueConfig {
    /// Lease of a delivered turn, ms; renewed by the worker's heartbeat every third of it.
    /// A killed worker's turns come back within about 4/3 of it.
    #[arg(long = "queue-lease-ms", env = "PACELINE_QUEUE_LEASE_MS", default_value_t = DEFAULT_LEASE_MS)]
    pub lease_ms: u64,
    /// Deliveries a turn may use without a verdict (lease expired, handler error) before it goes dead.
    #[arg(long = "queue-max-deliveries", env = "PACELINE_QUEUE_MAX_DELIVERIES", default_value_t = DEFAULT_MAX_DELIVERIES)]
    pub max_deliveries: u32,
    /// Most turns one fetch leases (also bounded by free worker slots).
    #[arg(long = "queue-fetch-batch", env = "PACELINE_QUEUE_FETCH_BATCH", default_value_t = DEFAULT_FETCH_BATCH)]
    pub fetch_batch: usize,
    /// Longest an idle worker blocks before it looks again (a safety net; wake-ups are pushed).
    #[arg(long = "queue-idle-ms", env = "PACELINE_QUEUE_IDLE_MS", default_value_t = DEFAULT_IDLE_MS)]
    pub idle_ms: u64,
    /// On shutdown, how long in-flight handlers may run before their turns are handed back.
    #[arg(long = "shutdown-grace-ms", alias = "queue-grace-ms", env = "PACELINE_SHUTDOWN_GRACE_MS", default_value_t = DEFAULT_GRACE_MS)]
    pub grace_ms: u64,
    /// First retry delay after a handler error, ms (doubles per delivery, capped at 30 s).
    #[arg(long = "queue-retry-ms", env = "PACELINE_QUEUE_RETRY_MS", default_value_t = DEFAULT_RETRY_BASE_MS)]
    pub retry_base_ms: u64,
    /// How long a dead turn stays in the dead set (`GET /v1/dead`), ms; older
    /// ones leave it whenever a turn is buried (0 keeps them all).
    #[arg(
        long = "queue-dead-retention-ms",
        env = "PACELINE_QUEUE_DEAD_RETENTION_MS",
        default_value_t = DEFAULT_DEAD_RETENTION_MS
    )]
    pub dead_retention_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            lease_ms: DEFAULT_LEASE_MS,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            fetch_batch: DEFAULT_FETCH_BATCH,
            idle_ms: DEFAULT_IDLE_MS,
            grace_ms: DEFAULT_GRACE_MS,
            retry_base_ms: DEFAULT_RETRY_BASE_MS,
            dead_retention_ms: DEFAULT_DEAD_RETENTION_MS,
        }
    }
}

impl QueueConfig {
    /// How often a worker heartbeats (renews its leases, reclaims expired ones).
    pub fn heartbeat_every(&self) -> Duration {
        Duration::from_millis((self.lease_ms / 3).max(50))
    }

    /// A registration older than this is a dead worker.
    pub fn worker_ttl_ms(&self) -> u64 {
        self.lease_ms * 2
    }

    /// Retry delay after a failed delivery number `deliveries` (1-based).
    pub fn retry_delay_ms(&self, deliveries: u32) -> u64 {
        let exp = deliveries.saturating_sub(1).min(16);
        (self.retry_base_ms.saturating_mul(1 << exp)).min(30_000)
    }
}
