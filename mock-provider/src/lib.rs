//! An OpenAI-compatible provider simulator for paceline's tests, demo and
//! benchmark: exact rate-limit buckets, OpenAI's headers and errors, a
//! scripted model, and fault knobs. Nothing in production depends on it.
//!
//! # Starting it
//!
//! In-process (tests, the benchmark):
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use mock_provider::{MockConfig, MockServer};
//! use std::time::Duration;
//! let server = MockServer::start(MockConfig {
//!     tpm: 6000,
//!     window: Duration::from_secs(2), // a "minute" scaled down for a fast test
//!     ..MockConfig::default()          // listens on 127.0.0.1:0
//! })
//! .await?;
//! let base_url = server.base_url(); // http://127.0.0.1:PORT/v1
//! // ... drive it ...
//! let stats = server.stats(); // same data as GET /_mock/stats
//! assert_eq!(stats.largest_overdraft, 0);
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! From the shell: `paceline mock-provider --listen 127.0.0.1:8089 --tpm 40000
//! --rpm 600 --window-s 60 --latency-ms 200` (every flag has a `MOCK_*` env
//! fallback; `--help` lists them). It prints its base URL on stdout.
//!
//! # Routes
//!
//! - `POST /v1/responses` — JSON, or `stream: true`: `response.created`,
//!   `response.in_progress`, `response.output_item.added`, `content_part.added`,
//!   `output_text.delta`… / `function_call_arguments.delta`…, the `.done`
//!   events, then `response.completed` (or `response.incomplete` when
//!   `max_output_tokens` cut the answer) carrying the whole response and usage;
//!   every frame has a growing `sequence_number`. A mid-stream failure is an
//!   `error` event, nested shape `{"type":"error","error":{type,code,message,param}}`.
//! - `POST /v1/chat/completions` — JSON, or chunks with `tool_calls` deltas by
//!   `index`, a `finish_reason` chunk, a `choices: []` usage chunk when
//!   `stream_options.include_usage`, then `data: [DONE]`; a mid-stream failure
//!   is `data: {"error":{…}}` and no `[DONE]`.
//! - `GET /_mock/stats` (`?log=false` to skip the log and bodies) — see [`Stats`].
//! - `POST /_mock/reset` — zero the counters and logs, refill the buckets.
//! - `POST /_mock/faults` — queue [`Fault`]s (one object or a list) for the
//!   next requests, e.g. `{"fault":"rate_limited","retry_after_ms":1500}`.
//!
//! # Buckets
//!
//! A token bucket of `tpm` and a request bucket of `rpm` per `window`;
//! `continuous` refills at capacity/window all the time, `window` refills fully
//! at multiples of the window since start. Admission is decided under one lock,
//! in integer arithmetic, both buckets or neither. A request is charged its
//! input tokens plus its output limit (`max_output_tokens`; chat:
//! `max_completion_tokens`, else `max_tokens`; none set: `--default-max-output-tokens`,
//! which defaults to `--output-tokens`), and the unused part of that limit is
//! refunded when the answer is done. Input tokens are `ceil(chars / 4)` over
//! every string value of `instructions` and `input` (chat: `messages`) —
//! text, tool outputs, function-call arguments — plus the compact JSON of
//! `tools`; one word of output is one token.
//!
//! Every answer (200, 429, 5xx, 400) carries `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`
//! (unless `--no-headers`) describing the buckets right after the decision;
//! resets are the time until the bucket is full, in Go's shape (`6m0s`,
//! `1.5s`, `13ms`). Over a limit: 429, `retry-after` (seconds, rounded up),
//! `retry-after-ms`, and `{"error":{"message":"Rate limit reached for MODEL in
//! organization org-mock on tokens per min (TPM): Limit L, Used U, Requested R.
//! Please try again in 1.146s. …","type":"tokens","param":null,"code":"rate_limit_exceeded"}}`
//! (`requests` / RPM for the request bucket). The wait is exact: a retry after
//! it is admitted if nothing else took the budget. More than the whole limit:
//! 429 "Request too large for MODEL … Limit L, Requested R." without a retry-after.
//!
//! # The scripted model
//!
//! A request that offers a function tool (and not `tool_choice: "none"`) gets
//! `--calls-per-round` calls of the first tool (or the one `tool_choice` names) until the conversation holds
//! `--tool-rounds` tool outputs (`function_call_output` items, chat `tool`
//! messages); then a text answer of `--output-tokens` words. Ids (`fc_…`,
//! `call_…`) and words derive from a hash of the conversation, so a retried
//! turn gets the same answer; arguments fill the tool schema's top-level
//! properties with fitting values plus `round`.
//!
//! # Faults
//!
//! `--fail-rate F` (500/503/529 before admission, seeded by `--seed`),
//! `--midstream-error-rate F` (a stream breaks after some text;
//! `--midstream-error-code server_error|rate_limit_exceeded`),
//! `--quota-after N` (429 `insufficient_quota` after N admitted requests),
//! `--daily-cap` (`--tpm` becomes a cap per fixed 24 h window: resets and
//! retry-afters hours away, messages say TPD), `--stall-ms N` (every stream
//! pauses after some text), `--latency-ms N` (before the first byte of an
//! admitted answer), `--no-headers` (no `x-ratelimit-*`, like vLLM).
//!
//! # Stats
//!
//! Counts (requests, `2xx`, by status, 429s by code, mid-stream errors, stalls),
//! tokens charged / refunded / admitted, `largest_overdraft` (computed from the
//! bucket levels; 0 unless admission is broken), both buckets now, a log of
//! the latest `--log-limit` requests (arrival in µs and ms since start, status,
//! code, tokens charged and refunded and when) and the latest `--keep-bodies`
//! request bodies, so a test can see what the mock was sent.
//!
//! Any `Authorization` header (or none) is accepted; the mock holds no secrets.

pub mod bucket;
pub mod cli;
pub mod config;
pub mod duration;
pub mod fault;
pub mod script;
pub mod server;
pub mod stats;
pub mod wire;

pub use bucket::{BucketMode, ChargeMode};
pub use cli::MockArgs;
pub use config::MockConfig;
pub use fault::Fault;
pub use server::MockServer;
pub use stats::{LogEntry, Stats};
