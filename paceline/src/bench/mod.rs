//! The machinery of paceline's benchmarks (`paceline bench`, and the queue's
//! own `paceline queue-probe bench`): a private Redis with command counts,
//! worker processes of this binary, an in-process mock provider, tool
//! endpoint and API, and the figures they yield.
//!
//! - `redis.rs` — a private `redis-server`; `INFO commandstats` deltas.
//! - `fleet.rs` — `paceline worker` processes: start, peak RSS, stop.
//! - `workload.rs` — the run bodies, the tool endpoint, the in-process API and submits.
//! - `trial.rs` — one configuration measured on its own (fresh prefix, fresh mock).
//! - `pacing.rs` — the pacing scenario: one trial per pacer, same workload.
//! - `backlog.rs` — the backlog scenario: the cost of waiting as the backlog grows, and of a call in flight by the second.
//! - `shapes.rs` — the provider shapes `--shape` runs the pacing scenario against.
//! - `fairness.rs` — the fairness scenario: companion turns first, tenants' shares, weights.
//! - `long_runs.rs` — the long-runs scenario: long runs with prompt caching on and off (work per minute, cached share, cost).
//! - `throughput.rs` — the throughput scenario: an unlimited instant mock, one worker.
//! - `report.rs` — the figures, the floor's formula, the table.

pub mod backlog;
pub mod fairness;
pub mod fleet;
pub mod long_runs;
pub mod pacing;
pub mod redis;
pub mod report;
pub mod shapes;
pub mod throughput;
pub mod trial;
pub mod workload;
