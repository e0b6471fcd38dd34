//! `GET /metrics`: Prometheus text from the process's `metrics` recorder.
//!
//! The worker records most families through the `metrics` facade (in
//! `paceline up` they share this process's recorder); the API sets the queue
//! depth and the pacer's gauges (remaining tokens, the watchdog's, the
//! tenants') itself, from Redis, when scraped. The families whose labels are
//! known beforehand (turns, provider calls, 429s, budget waits, the requeue
//! delay, turn latency, queue depth) are registered at start so a scrape lists
//! them even before the first turn; the per-budget and per-tenant gauges appear
//! once a budget is known, the unblock fallbacks once one is counted.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// Metric names, shared with the worker.
pub use shared::telemetry::metric as name;

/// Buckets of the requeue-delay histogram (seconds): 50 ms to 2 min.
const DELAY_BUCKETS: [f64; 12] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];
/// Buckets of the turn-latency histogram (seconds): 100 ms to 5 min.
const LATENCY_BUCKETS: [f64; 12] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process's Prometheus handle. The first call installs the global
/// recorder; later calls (a second app in one test process) share it. If
/// another recorder was installed first, the API renders its own families only.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = || {
                PrometheusBuilder::new()
                    .set_buckets_for_metric(Matcher::Full(name::REQUEUE_DELAY.into()), &DELAY_BUCKETS)
                    .and_then(|b| b.set_buckets_for_metric(Matcher::Full(name::TURN_LATENCY.into()), &LATENCY_BUCKETS))
                    .expect("non-empty bucket lists")
            };
            let handle = match builder().install_recorder() {
                Ok(handle) => handle,
                Err(error) => {
                    tracing::warn!(message = "a metrics recorder was already installed; /metrics shows the API's own", %error);
                    builder().build_recorder().handle()
                }
            };
            register();
            handle
        })
        .clone()
}

/// Describes every family and registers a series of each, so a scrape lists
/// them before anything has happened.
fn register() {
    use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
    describe_counter!(name::TURNS, "Turns finished, by outcome");
    describe_counter!(name::PROVIDER_CALLS, "Provider calls, by HTTP status");
    describe_counter!(name::RATE_LIMITED, "429 answers from the provider");
    describe_counter!(name::BUDGET_WAITS, "Turns the shared pacer owed time and requeued");
    describe_counter!(name::TOKENS, "Tokens the provider reported, by model and kind");
    describe_counter!(name::COST, "What the calls cost at the model's price, micro-USD, by model");
    describe_counter!(
        name::QUEUE_UNBLOCK_FALLBACKS,
        "Workers that found CLIENT UNBLOCK forbidden and watch due times with BLPOP timeouts"
    );
    describe_histogram!(name::REQUEUE_DELAY, Unit::Seconds, "How long turns were requeued for, by reason");
    describe_gauge!(name::PACER_REMAINING_TOKENS, "The shared estimate of tokens left, per budget and model");
    describe_gauge!(name::PACER_OLDEST_WAIT, "How long the oldest turn in line has waited, per budget and model");
    describe_gauge!(name::PACER_SINCE_ADMISSION, "Time since the pacer last cleared a call, per budget and model");
    describe_gauge!(name::QUEUE_DEPTH, "Turns in the queue, by state");
    describe_gauge!(name::REDIS_MEMORY_USED_RATIO, "Redis used_memory over its maxmemory");
    describe_gauge!(name::REDIS_MEMORY_PRESSURE, "1 when Redis is at 90 % of its maxmemory or over");
    describe_histogram!(name::TURN_LATENCY, Unit::Seconds, "A turn from its start to its commit");
    counter!(name::TURNS, "outcome" => "completed").increment(0);
    counter!(name::PROVIDER_CALLS, "status" => "200").increment(0);
    counter!(name::RATE_LIMITED).increment(0);
    counter!(name::BUDGET_WAITS).increment(0);
    let _ = histogram!(name::REQUEUE_DELAY, "reason" => "budget");
    let _ = histogram!(name::TURN_LATENCY);
    for state in ["ready", "delayed", "in_flight", "dead"] {
        gauge!(name::QUEUE_DEPTH, "state" => state).set(0.0);
    }
}

/// Sets the gauges the API owns from fresh reads.
pub fn set_queue_depth(c: &shared::queue::QueueCounts) {
    for (state, n) in [("ready", c.ready), ("delayed", c.delayed), ("in_flight", c.in_flight), ("dead", c.dead)] {
        metrics::gauge!(name::QUEUE_DEPTH, "state" => state).set(n as f64);
    }
}

/// Sets the Redis memory gauges (none without a `maxmemory`).
pub fn set_redis_memory(memory: Option<crate::routes::health::RedisMemory>) {
    if let Some(m) = memory {
        metrics::gauge!(name::REDIS_MEMORY_USED_RATIO).set(m.used_bytes as f64 / m.max_bytes as f64);
        metrics::gauge!(name::REDIS_MEMORY_PRESSURE).set(if m.pressure { 1.0 } else { 0.0 });
    }
}

/// A full bucket with turns waiting this long and nothing admitted logs a warning.
const STALL_WARN_MS: u64 = 30_000;

/// Sets the pacer gauges from a snapshot.
pub fn set_pacer(snapshots: &[shared::pacer::BudgetSnapshot]) {
    for s in snapshots {
        let labels = [("budget", s.budget.clone()), ("model", shared::telemetry::model_label(&s.model))];
        metrics::gauge!(name::PACER_OLDEST_WAIT, &labels).set(s.oldest_wait_ms as f64 / 1000.0);
        if let Some(ms) = s.since_admission_ms {
            metrics::gauge!(name::PACER_SINCE_ADMISSION, &labels).set(ms as f64 / 1000.0);
        }
        // The watchdog: a full bucket with turns waiting and nothing admitted
        // for a while is a pacer bug; say so with what is needed to find it.
        if s.stalled(STALL_WARN_MS) {
            tracing::warn!(
                message = "pacer: turns have waited with a full bucket and nothing admitted",
                budget = %s.budget,
                model = %s.model,
                remaining_tokens = ?s.remaining_tokens,
                limit_tokens = ?s.limit_tokens,
                waiting_turns = s.waiting_turns,
                line_tokens = s.booked_tokens,
                oldest_wait_ms = s.oldest_wait_ms,
                since_admission_ms = ?s.since_admission_ms,
            );
        }
        if let Some(remaining) = s.remaining_tokens {
            metrics::gauge!(name::PACER_REMAINING_TOKENS, "budget" => s.budget.clone(), "model" => shared::telemetry::model_label(&s.model))
                .set(remaining as f64);
        }
        for t in &s.tenants {
            let labels = [
                ("budget", s.budget.clone()),
                ("model", shared::telemetry::model_label(&s.model)),
                ("tenant", t.tenant.clone()),
            ];
            metrics::gauge!(name::TENANT_ADMITTED_TOKENS, &labels).set(t.admitted_tokens as f64);
            metrics::gauge!(name::TENANT_WAITING_TOKENS, &labels).set(t.waiting_tokens as f64);
            metrics::gauge!(name::TENANT_WAITS, &labels).set(t.waits as f64);
        }
    }
}
