//! A run's transcript: the Responses-API items the model has read and written,
//! each tagged with the turn that added it (turn 0 is the run's input).
//!
//! The items are kept in the Responses shape whatever the transport; the worker
//! converts them for Chat Completions and Anthropic's Messages API when it
//! sends, and converts their answers back. Tool outputs are stored
//! already clipped (see `worker::context`), so the transcript the API shows is
//! the text the model was allowed to read — one constant, not two.

use serde::{Deserialize, Serialize};

/// One item of the transcript.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TranscriptEntry {
    /// The turn that added it (0: the run's input).
    pub turn: u32,
    /// A Responses-API input item: a message (`{"role","content"}`), a
    /// `function_call` (`{"type","call_id","name","arguments"}`) or a
    /// `function_call_output` (`{"type","call_id","output"}`).
    pub item: serde_json::Value,
}

/// Which wire format the provider speaks (the providers' own: `crate::providers`).
pub use crate::providers::ApiStyle;
