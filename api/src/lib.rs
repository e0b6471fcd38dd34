//! paceline's HTTP API: takes runs and reports their progress (README,
//! "Submitting a run"; the OpenAPI document at `/v1/openapi.json`).
//!
//! - `startup.rs` — `Application::build(config)`, `.local_addr()`,
//!   `.run_until_stopped(shutdown)`; `serve.rs` — the connections, bounded
//!   (header timeout, caps per process and per client).
//! - `config.rs` — `ApiConfig` (clap, env fallbacks).
//! - `routes/` — the handlers: runs, events (SSE), pacer/queue/workers, probes.
//! - `auth.rs` — bearer tokens → tenants; `error.rs` — the one `ApiError`.
//! - `openapi.rs` — the generated document; `metrics.rs` — `/metrics`.
//!
//! Runs are read and written only through `shared::runs::RunStore`, the same
//! store (and state machine) the worker uses.

mod auth;
pub mod config;
mod error;
mod hub;
pub mod metrics;
mod openapi;
mod routes;
pub mod serve;
mod startup;
mod state;

pub use config::ApiConfig;
pub use error::ApiError;
pub use openapi::{document as openapi_document, ApiDoc};
pub use routes::runs::RunList;
pub use startup::Application;
