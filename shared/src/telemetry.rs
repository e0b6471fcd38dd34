//! One place that builds the tracing subscriber: `RUST_LOG` filters,
//! `LOG_FORMAT=json` switches to JSON lines. Logs go to stderr so the CLI's
//! progress bars and output on stdout do not fight with them.

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{fmt, EnvFilter, Layer, Registry};

/// A layer beside the logs' (the worker's trace export), with its own filter.
pub type ExtraLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// Installs the global subscriber once; later calls are no-ops.
pub fn init(default_filter: &str) {
    init_with(default_filter, None);
}

/// [`init`] with `extra` beside the logs. `RUST_LOG` filters the logs
/// alone: the extra layer keeps its own filter (a trace export is not
/// silenced by `RUST_LOG=warn`).
pub fn init_with(default_filter: &str, extra: Option<ExtraLayer>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // The trace export's spans (worker::traces) are not log lines.
    let filter = match "paceline::trace=off".parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let json = std::env::var("LOG_FORMAT").map(|v| v == "json").unwrap_or(false);
    let (plain, json) = if json {
        (None, Some(fmt::layer().json().with_writer(std::io::stderr).with_filter(filter)))
    } else {
        (Some(fmt::layer().with_writer(std::io::stderr).with_filter(filter)), None)
    };
    let _ = tracing_subscriber::registry().with(extra).with(plain).with(json).try_init();
}

/// The most distinct `model` label values one process gives its metrics;
/// models seen after them are counted under `other`, so the number of series
/// stays bounded whatever names runs give (Prometheus keeps every series).
pub const MAX_MODEL_LABELS: usize = 64;

/// The `model` label of `model` in this process's metrics: itself for a model
/// of the price table (or of `PACELINE_PRICES`), and for others while fewer
/// than [`MAX_MODEL_LABELS`] of them have been labelled; `other` after (names
/// a tenant made up cannot crowd out the models a fleet runs).
pub fn model_label(model: &str) -> String {
    if crate::models::price(model).is_some() {
        return model.to_owned();
    }
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.iter().any(|m| m == model) {
        return model.to_owned();
    }
    if seen.len() < MAX_MODEL_LABELS {
        seen.push(model.to_owned());
        return model.to_owned();
    }
    "other".to_owned()
}

/// Metric names: the worker records them, the API
/// exports them; one list so the two cannot drift.
pub mod metric {
    /// Counter, label `outcome` (`completed`, `continued`, `requeued`, `failed`, `stopped`).
    pub const TURNS: &str = "paceline_turns_total";
    /// Counter, label `status` (HTTP status, or `none` for a failure with no status).
    pub const PROVIDER_CALLS: &str = "paceline_provider_calls_total";
    /// Counter: 429 answers from the provider.
    pub const RATE_LIMITED: &str = "paceline_rate_limited_total";
    /// Counter: turns the pacer owed time (requeued for budget).
    pub const BUDGET_WAITS: &str = "paceline_budget_waits_total";
    /// Counter: a worker found `CLIENT UNBLOCK` forbidden and watches due times with `BLPOP` timeouts instead.
    pub const QUEUE_UNBLOCK_FALLBACKS: &str = "paceline_queue_unblock_fallbacks_total";
    /// Histogram (seconds), label `reason` (`budget`, `rate_limited`, `retry`): how long turns were requeued for.
    pub const REQUEUE_DELAY: &str = "paceline_requeue_delay_seconds";
    /// Gauge, labels `budget`, `model`: the shared estimate of tokens left.
    pub const PACER_REMAINING_TOKENS: &str = "paceline_pacer_remaining_tokens";
    /// Gauge, labels `budget`, `model`: how long the oldest turn in a budget's line has waited (watchdog).
    pub const PACER_OLDEST_WAIT: &str = "paceline_pacer_oldest_wait_seconds";
    /// Gauge, labels `budget`, `model`: time since a budget last cleared a call (watchdog).
    pub const PACER_SINCE_ADMISSION: &str = "paceline_pacer_since_admission_seconds";
    /// Gauge, label `state` (`ready`, `delayed`, `in_flight`, `dead`).
    pub const QUEUE_DEPTH: &str = "paceline_queue_depth";
    /// Gauge: Redis's `used_memory` over its `maxmemory` (absent without one).
    pub const REDIS_MEMORY_USED_RATIO: &str = "paceline_redis_memory_used_ratio";
    /// Gauge: 1 when Redis is at 90 % of its `maxmemory` or over (with `noeviction` it
    /// refuses every write at the limit), else 0.
    pub const REDIS_MEMORY_PRESSURE: &str = "paceline_redis_memory_pressure";
    /// Gauge, labels `budget`, `model`, `tenant`: tokens admitted to the tenant.
    pub const TENANT_ADMITTED_TOKENS: &str = "paceline_tenant_admitted_tokens";
    /// Gauge, labels `budget`, `model`, `tenant`: tokens of its turns waiting.
    pub const TENANT_WAITING_TOKENS: &str = "paceline_tenant_waiting_tokens";
    /// Gauge, labels `budget`, `model`, `tenant`: times its turns waited in its line.
    pub const TENANT_WAITS: &str = "paceline_tenant_waits";
    /// Histogram (seconds): a turn from its start to its commit.
    pub const TURN_LATENCY: &str = "paceline_turn_seconds";
    /// Counter, labels `model`, `kind` (`input`, `cached_input`, `cache_write`,
    /// `output`, `reasoning`): tokens the provider reported (cached and written
    /// input are parts of `input`, reasoning of `output`).
    pub const TOKENS: &str = "paceline_tokens_total";
    /// Counter, label `model`: what the calls cost at the model's price, in
    /// micro-USD (a model without a price adds nothing).
    pub const COST: &str = "paceline_cost_micro_usd_total";
    /// Counter, label `outcome` (`delivered`, `stopped`, `retrying`, `failed`):
    /// webhook delivery attempts.
    pub const WEBHOOK_DELIVERIES: &str = "paceline_webhook_deliveries_total";
}

#[cfg(test)]
mod tests {
    #[test]
    fn model_labels_are_bounded() {
        let labels: Vec<String> =
            (0..3 * super::MAX_MODEL_LABELS).map(|i| super::model_label(&format!("m-{i}"))).collect();
        let named = labels.iter().filter(|l| *l != "other").count();
        assert!(named <= super::MAX_MODEL_LABELS, "{named}");
        assert_eq!(labels.last().map(String::as_str), Some("other"));
        assert_eq!(super::model_label(&labels[0]), labels[0], "a labelled model keeps its label");
    }
}
