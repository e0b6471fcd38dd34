//! Runs: the state machine (`state.rs`). The run store (record, transcript,
//! event stream, and the commit script built on the queue's `LUA_LIB`) comes
//! with the worker issue.

pub mod backpressure;
pub mod record;
pub mod spec;
pub mod state;
pub mod transcript;

pub use record::{PacingCounters, Run, RunError, Usage};
pub use spec::{RunSpec, SpecError, SubmitPolicy};
pub use state::{InvalidTransition, RunStatus, Transition, WaitReason};
pub use transcript::{ApiStyle, TranscriptEntry};
