//! paceline's integration tests: one binary, one module per area. Each test owns
//! a private redis-server and a unique key prefix (see the harness in `src/lib.rs`).

mod harness;
mod mock_provider;
mod pacer;
mod queue;
mod context;
mod provider_client;
mod run_store;
mod worker;
mod api;
mod bench;
mod up;
mod fairness;
