//! paceline's integration tests: one binary, one module per area. Each test owns
//! a private redis-server and a unique key prefix (see the harness in `src/lib.rs`).

mod anthropic;
mod api;
mod bench;
mod bill;
mod cluster;
mod connections;
mod context;
mod dashboard;
mod dead;
mod fairness;
mod fixtures;
mod fuzz;
mod harness;
mod mcp;
mod mock_provider;
mod pacer;
mod process;
mod provider_client;
mod queue;
mod run_store;
mod shapes;
mod soak;
mod styles;
mod tools;
mod traces;
mod up;
mod webhooks;
mod worker;
mod workspace;
