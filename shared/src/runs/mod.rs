//! Runs: what a client submits (`spec.rs`, its generation parameters
//! `generation.rs`, the tool endpoints it may name `endpoints.rs`), the run object (`record.rs`), its
//! state machine (`state.rs`), its transcript (`transcript.rs`), and the store
//! that keeps them in Redis (`store.rs` + `store.lua`, built on the queue's Lua
//! library). What a turn sends the model is bounded by the worker
//! (`worker::context`).

pub mod config;
pub mod endpoints;
pub mod events;
pub mod generation;
pub mod pacing;
pub mod quota;
pub mod record;
pub mod spec;
pub mod spend;
pub mod state;
pub mod store;
pub mod transcript;
pub mod turn;
pub mod usage;
pub mod webhooks;

pub use config::{RunArgs, DEFAULT_RETENTION};
pub use endpoints::{forbidden_address, valid_tenant, ToolEndpoint, ToolEndpoints};
pub use events::{stream_id_after, valid_stream_id, RunEvent};
pub use generation::{Effort, Format, Generation, JsonSchema, PromptCache, ServiceTier, ToolChoice, Truncation};
pub use pacing::{BudgetWait, CommitPacing, FetchAsks, FirstAsk, PacedAsk};
pub use quota::{PerTenant, QuotaExceeded, Quotas, TenantQuota};
pub use record::{ErrorKind, PacingCounters, Run, RunError, Usage};
pub use spec::{
    valid_model, ContextOverflow, McpHeaderVars, McpServer, ModelAllowList, Refusal, RunSpec, SpecError, SubmitPolicy,
    MCP_SEPARATOR,
};
pub use state::{InvalidTransition, RunStatus, Transition, WaitReason};
pub use store::{pacer_host, run_queue, Created, Idempotency, RunStore, StoreError, TenantCounts, QUEUE_HOOKS};
pub use transcript::{ApiStyle, TranscriptEntry};
pub use turn::{Committed, Fence, ModelOutput, Next, Phase, Started, StopReason, Turn, TurnContext, TurnJob};
