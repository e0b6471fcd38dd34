//! paceline's worker: runs a run's turns from the queue, each call paced by the
//! shared pacer, each turn committed exactly once.
//!
//! - `provider/` — our thin client for OpenAI-compatible APIs (Responses and
//!   Chat Completions, streaming), which never retries or sleeps on its own.
//! - `request.rs` — the request body from the transcript, in either wire format.
//! - `estimate.rs` — the call's token estimate (tiktoken, o200k_base).
//! - `tools.rs` — calling the run's tool endpoint.

pub mod estimate;
pub mod provider;
pub mod request;
pub mod tools;
