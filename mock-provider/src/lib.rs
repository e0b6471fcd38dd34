//! An OpenAI-compatible provider simulator for paceline's tests, demo and
//! benchmark: exact rate-limit buckets, the rate-limit headers and 429s of
//! several providers (OpenAI, Anthropic, Azure, none), a scripted model, and
//! fault knobs. Nothing in production depends on it.
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
//! - `POST /v1/messages` — Anthropic's Messages API, JSON or `stream: true`:
//!   `message_start`, `content_block_start` / `_delta` (`text_delta`,
//!   `input_json_delta`; `thinking_delta` + `signature_delta` when the
//!   request turns `thinking` on) / `_stop`, `ping`, `message_delta` with the
//!   `stop_reason` and usage, `message_stop`; `tool_use` blocks carry the
//!   scripted calls (`toolu_…` ids), `tool_result` blocks count as tool
//!   outputs, and the output limit is `max_tokens`. Its errors are
//!   Anthropic's: `{"type":"error","error":{"type":"rate_limit_error" |
//!   "overloaded_error" (529) | "api_error" | "invalid_request_error",
//!   "message"}}`; the quota fault is Anthropic's 400 "credit balance is too
//!   low"; a request the real API refuses (temperature over 1, thinking
//!   beside temperature or a forced tool choice, a tool turn without its
//!   thinking block while thinking is on) is a 400 here too. A mid-stream
//!   failure is an `error` event (`overloaded_error` or `rate_limit_error`).
//! - `GET /_mock/stats` (`?log=false` to skip the log and bodies) — see [`Stats`].
//! - `POST /_mock/reset` — zero the counters and logs, refill the buckets,
//!   empty the prompt cache.
//! - `POST /_mock/faults` — queue [`Fault`]s (one object or a list) for the
//!   next requests, e.g. `{"fault":"rate_limited","retry_after_ms":1500}`.
//!
//! # Buckets
//!
//! A token bucket of `tpm` and a request bucket of `rpm` per `window`;
//! `continuous` refills at capacity/window all the time, `window` refills fully
//! at multiples of the window since start. Admission is decided under one lock,
//! in integer arithmetic, on every bucket or none: each is asked before any is
//! taken from. A request is charged its
//! input tokens plus its output limit (`max_output_tokens`; chat:
//! `max_completion_tokens`, else `max_tokens`; messages: `max_tokens`; none set: `--default-max-output-tokens`,
//! which defaults to `--output-tokens`), and the unused part of that limit is
//! refunded when the answer is done (unless `--charge keep`). Input tokens are `ceil(chars / 4)` over
//! every string value of `instructions` and `input` (chat: `messages`;
//! Anthropic: `system` and `messages`) —
//! text, tool outputs, function-call arguments — plus the compact JSON of
//! `tools`; one word of output is one token.
//!
//! Under `--cache`, a Messages request's input charge leaves out what it
//! read from the prompt cache (see below).
//!
//! With `--headers anthropic` the token bucket is split, as Anthropic's limits
//! are: an input bucket of `--itpm` (default `--tpm`) charged the input (never
//! given back) and an output bucket of `--otpm` (default `--tpm / 5`) charged
//! the output limit, whose unused part comes back at the end of the answer.
//! `--limits none` keeps no buckets at all: every request is admitted (as by
//! vLLM, Ollama or TGI) and no answer carries rate-limit headers; usage and
//! the stats' token counts are still reported.
//!
//! # Provider shapes (`--headers`)
//!
//! Every answer (200, 429, 5xx, 400) carries the chosen style's headers
//! describing the buckets right after the decision, and a 429 over a limit
//! says when to retry in that style's way:
//!
//! | style | on every answer | a 429's wait |
//! | --- | --- | --- |
//! | `openai` (default) | `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets as Go durations (`6m0s`, `1.5s`, `13ms`) until full | `retry-after` (s, rounded up), `retry-after-ms` |
//! | `anthropic` | `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-{limit,remaining,reset}`, resets as RFC 3339 instants (`2026-12-01T20:00:05.123Z`) when full; `tokens-*` is whichever of input and output has the smaller share left | `retry-after` (s, rounded up, at least 1) |
//! | `azure` | `x-ratelimit-remaining-{requests,tokens}` only | `retry-after` (s, rounded up), `retry-after-ms` |
//! | `none` | nothing | only in the body: the message, and `"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1.500s"}]` |
//!
//! `--no-headers` is a hidden old spelling of `--headers none`. Over a limit
//! the body is OpenAI's (whichever the style):
//! `{"error":{"message":"Rate limit reached for MODEL in
//! organization org-mock on tokens per min (TPM): Limit L, Used U, Requested R.
//! Please try again in 1.146s. …","type":"tokens","param":null,"code":"rate_limit_exceeded"}}`
//! (`requests` / RPM for the request bucket; the Anthropic shape names `input
//! tokens per minute (ITPM)` or `output tokens per minute (OTPM)`). When several
//! buckets refuse, the wait is the longest of theirs, and it is exact: a retry after
//! it is admitted if nothing else took the budget. More than a bucket's whole limit:
//! 429 "Request too large for MODEL … Limit L, Requested R." without a retry-after.
//!
//! # Prompt caching (`--cache`) and the context window (`--context-window N`)
//!
//! Without `--cache` nothing is cached: every usage reports 0 read and 0
//! written. With it, each API caches as its provider does (`prefix.rs` reads a
//! prompt's prefixes, `cache.rs` keeps them; both decided at admission, under
//! the lock):
//!
//! - **Anthropic**, opt-in: the prompt is its blocks in order — each tool
//!   definition, the `system` blocks, every content block of every message —
//!   and `cache_control: {"type": "ephemeral"}` (`"ttl": "5m"` by default, or
//!   `"1h"`) on a block makes its end a breakpoint. A block boundary's token
//!   position is `ceil(chars / 4)` of everything up to it, so the last one is
//!   the input tokens; a prefix's identity is its content without any
//!   `cache_control` (moving a marker keeps it) and the model. For each
//!   breakpoint the longest live entry at it or at one of the 20 boundaries
//!   before it is found; the longest of those is read. The prefix up to the
//!   last breakpoint is written when it is at least `--cache-min-tokens`
//!   (default 1 024) and longer than the read, with an entry at each
//!   breakpoint of at least the minimum, living its TTL; a hit refreshes an
//!   entry by its own TTL. Usage: `cache_read_input_tokens` (the read),
//!   `cache_creation_input_tokens` (the last breakpoint minus the read), and
//!   `input_tokens` (the rest), in the JSON body and in `message_start`. The
//!   input bucket (or the one token bucket) is charged `input_tokens +
//!   cache_creation_input_tokens`: reads are free, as Anthropic's ITPM does
//!   not count them. More than 4 markers is a 400 "A maximum of 4 blocks with
//!   cache_control may be provided. Found N." — with or without `--cache`,
//!   as is a marker whose type is not `ephemeral` or whose ttl is not `5m` or
//!   `1h`.
//! - **OpenAI**, automatic: the prompt is read as one text (instructions, or
//!   chat's leading system and developer messages; the tools' JSON; the input
//!   items or other messages: every string counted for the input, in order).
//!   A prompt of at least 1 024 tokens stores its prefixes of 1 024, 1 152,
//!   1 280, … tokens (4 characters each), per model and `prompt_cache_key`
//!   (none is a partition of its own), each living `--cache-ttl-s` (default
//!   300) from its last use. The longest stored prefix that matches is
//!   `usage.input_tokens_details.cached_tokens` (chat:
//!   `prompt_tokens_details.cached_tokens`), in the JSON and the streamed
//!   final usage; `input_tokens` stays the whole prompt, and the token bucket
//!   is charged in full, cached or not, as OpenAI's is.
//!
//! The store holds at most [`cache::MAX_ENTRIES`] entries (expired ones go
//! first, then those closest to expiring); a reset empties it.
//!
//! `--context-window N`: a request of more than N input tokens is refused
//! with the provider's 400 before the faults and the buckets (not admitted;
//! logged with code `context_length_exceeded`): chat's "This model's maximum
//! context length is N tokens. However, your messages resulted in M tokens.
//! …" (`param: "messages"`), Responses' "Your input exceeds the context
//! window of this model. Please adjust your input and try again." (`param:
//! "input"`), both `code: "context_length_exceeded"`; Anthropic's
//! `invalid_request_error` "prompt is too long: M tokens > N maximum".
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
//! retry-afters hours away, messages say TPD; with `--headers anthropic` both
//! token buckets are daily), `--stall-ms N` (every stream pauses after some
//! text), `--latency-ms N` (before the first byte of an admitted answer).
//!
//! # Stats
//!
//! Counts (requests, `2xx`, by status, 429s by code, mid-stream errors, stalls),
//! tokens charged / refunded / admitted and the admitted input and output
//! apart (what an input and an output bucket let through), the tokens read
//! from and written to the prompt cache,
//! `largest_overdraft` (computed from every bucket's level; 0 unless
//! admission is broken), the buckets now (`input` and `output` too when they
//! exist) with the header style and limits mode, a log of
//! the latest `--log-limit` requests (arrival in µs and ms since start, status,
//! code, tokens charged (and their input part) and refunded and when, cache
//! tokens read and written) and the latest `--keep-bodies`
//! request bodies, so a test can see what the mock was sent.
//!
//! Any `Authorization` header (or none) is accepted; the mock holds no secrets.

pub mod bucket;
pub mod cache;
pub mod cli;
pub mod config;
pub mod duration;
pub mod fault;
pub mod limits;
pub mod messages;
pub mod prefix;
pub mod script;
pub mod server;
pub mod shape;
pub mod stats;
pub mod wire;

pub use bucket::{BucketMode, ChargeMode};
pub use cache::CacheUsage;
pub use cli::MockArgs;
pub use config::MockConfig;
pub use fault::Fault;
pub use server::MockServer;
pub use shape::{HeaderStyle, LimitsMode};
pub use stats::{LogEntry, Stats};
