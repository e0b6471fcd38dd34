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
pub mod pacer;
pub mod providers;
pub mod queue;
pub mod redis_server;
pub mod redis_util;
pub mod runs;
pub mod telemetry;
