//! An OpenAI-compatible provider simulator for paceline's tests, demo and benchmark.
//! (Docs to come.)

pub mod bucket;
pub mod cli;
pub mod config;
pub mod duration;
pub mod fault;
pub mod script;
pub mod server;
pub mod stats;
pub mod wire;

pub use bucket::BucketMode;
pub use cli::MockArgs;
pub use config::MockConfig;
pub use fault::Fault;
pub use server::MockServer;
pub use stats::{LogEntry, Stats};
