//! paceline's contract, shared by the worker, the API and the CLI.
//!
//! What belongs here: the run and turn types, the pacer (its policy as pure
//! functions and its shared state in Redis), the turn queue, the run store,
//! Redis key names, config pieces (the fleet's named providers among them)
//! and telemetry. What does not: HTTP handlers
//! (the `api` crate) and the logic of running a turn (the `worker` crate).
//! This crate depends on neither.

pub mod clock;
pub mod config;
pub mod keys;
pub mod models;
pub mod pacer;
pub mod providers;
pub mod queue;
pub mod redis_server;
pub mod redis_util;
pub mod runs;
pub mod telemetry;

/// Runs CPU-bound work (building a long body, counting its tokens) without
/// holding one of the runtime's worker threads: on a multi-threaded runtime
/// the thread's other tasks move to another thread meanwhile. (A
/// current-thread runtime, as some tests use, runs it in place.)
pub fn cpu_bound<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}
