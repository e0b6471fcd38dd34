//! A turn as the queue carries it and as the run store's fenced steps see
//! it: its job and payload, where it stands (`Phase`), what a start found,
//! how a commit leaves the run (`Next`), and what a fenced write found
//! (`Fence`, `StopReason`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::pacing::{BudgetWait, PacedAsk};
use super::record::{ErrorKind, Usage};
use super::spec::RunSpec;
use super::state::RunStatus;
use super::transcript::TranscriptEntry;

/// The version of the run record's format this code reads; a record of a
/// later one (field `format`) is not run by this version's workers. A run is
/// written in the oldest format that holds it: 2 for a run with MCP servers
/// (a worker of format 1 would run it without their tools), 1 otherwise.
pub const RECORD_FORMAT: u32 = 2;

/// The version of the queue payload's format ([`TurnJob`], field `v`) this
/// code writes and reads; a later one is buried as undecodable with its
/// reason, never run wrong.
pub const PAYLOAD_FORMAT: u32 = 1;

/// The queue payload of a run's next turn. The queue item's id is the run id:
/// a run has at most one turn queued at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TurnJobWire", into = "TurnJobWire")]
pub struct TurnJob {
    /// The turn's index (= turns completed before it).
    pub turn: u32,
    /// The call's attempt (1-based; raised by 429s and transient errors, not
    /// by budget waits).
    pub attempt: u32,
}

/// [`TurnJob`] as stored, with its format's version (absent: 1, as the
/// retry script writes it).
#[derive(Serialize, Deserialize)]
struct TurnJobWire {
    turn: u32,
    attempt: u32,
    #[serde(default = "first_format")]
    v: u32,
}

fn first_format() -> u32 {
    1
}

impl From<TurnJob> for TurnJobWire {
    fn from(j: TurnJob) -> Self {
        Self { turn: j.turn, attempt: j.attempt, v: PAYLOAD_FORMAT }
    }
}

impl TryFrom<TurnJobWire> for TurnJob {
    type Error = String;
    fn try_from(w: TurnJobWire) -> Result<Self, String> {
        if w.v > PAYLOAD_FORMAT {
            return Err(format!(
                "turn payload format {} is newer than this paceline reads ({PAYLOAD_FORMAT}): run it with a newer worker",
                w.v
            ));
        }
        Ok(Self { turn: w.turn, attempt: w.attempt })
    }
}

/// A turn as the queue carries it: its job and, after a budget wait, the ask
/// it makes again first. (The payload's format stays 1: a worker that does
/// not know `ask` ignores it and starts the turn as before.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// Which turn, which attempt.
    #[serde(flatten)]
    pub job: TurnJob,
    /// The pacer's ask of a turn that waited for budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask: Option<PacedAsk>,
    /// The pacer cleared this turn's call when the turn before it committed
    /// (its reservation, `run:turn:attempt`, is held): it calls without asking.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cleared: bool,
    /// The fetch asked for it and the pacer owed it no longer than the
    /// worker's in-place wait ([`super::FetchAsks::in_place_ms`]): the worker waits
    /// this long, then asks again, and starts it once clear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
    /// Until when (ms since the epoch) the prompt cache the turn before
    /// wrote is expected to hold: a call after it counts its input in full,
    /// as it will be charged, and asks again if it was cleared for less.
    /// `None`: the turn goes at once (or the worker that queued it predates it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_until_ms: Option<u64>,
}

/// What a fenced worker write found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Written.
    Ok,
    /// Not written, and why. The turn ends here for this worker.
    Stop(StopReason),
}

/// Why a fenced script wrote nothing: its `{'stop', why}` answer, as a type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The turn was delivered again since this lease (`stale`).
    Stale,
    /// Its lease expired and the turn went back to the queue (`not_leased`).
    NotLeased,
    /// No such turn, or its run is gone (`gone`).
    Gone,
    /// This turn was committed already: a redelivery (`committed`).
    Committed,
    /// The run passed its wall-clock deadline and failed (`deadline`).
    Deadline,
    /// The run finished or was cancelled while the turn was out (its status).
    Finished(RunStatus),
    /// A reason this version does not know (a newer script wrote it).
    Other(String),
}

impl StopReason {
    /// Reads a script's reason.
    pub fn parse(why: &str) -> Self {
        match why {
            "stale" => Self::Stale,
            "not_leased" => Self::NotLeased,
            "gone" => Self::Gone,
            "committed" => Self::Committed,
            "deadline" => Self::Deadline,
            other => RunStatus::parse(other).map_or_else(|| Self::Other(other.to_owned()), Self::Finished),
        }
    }

    /// The script's word for it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Stale => "stale",
            Self::NotLeased => "not_leased",
            Self::Gone => "gone",
            Self::Committed => "committed",
            Self::Deadline => "deadline",
            Self::Finished(status) => status.as_str(),
            Self::Other(why) => why,
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What starting a turn found.
// Made once per turn and matched at once: boxing the context would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Started {
    /// The turn runs, with the run as it needs it.
    Run(TurnContext),
    /// It does not (cancelled, finished, already committed, a stale lease, gone): why.
    Stop(StopReason),
}

/// How a committed turn leaves the run.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Enqueue the next turn (due now); it asks the pacer when it starts.
    Continue,
    /// Enqueue the next turn, which asked the pacer at this commit: cleared
    /// (its reservation held: `Turn::cleared`), it is due now; owed, it is
    /// parked in the queue, the run `waiting` at once, until the pacer
    /// releases it (or it asks again at its line's timer or its safety
    /// deadline: `Turn::ask`). The first wait of a turn then costs no
    /// delivery, start or requeue of its own.
    Paced {
        /// The next turn as the queue carries it.
        turn: Turn,
        /// What it owes, if it is owed.
        wait: Option<BudgetWait>,
    },
    /// The model answered without tool calls: the run is done with this text.
    Complete(String),
    /// The run fails (e.g. `max_turns`).
    Fail {
        /// `error.kind`.
        kind: ErrorKind,
        /// `error.message`.
        message: String,
    },
}

/// What a commit did: its fence and, when it made the next turn's ask
/// ([`super::CommitPacing::ask`]), the pacer's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    /// Written, or why not.
    pub fence: Fence,
    /// The pacer's answer to the next turn's ask, if it was made.
    pub asked: Option<crate::pacer::Decision>,
    /// The step failed the run though the turn asked to go on (the run
    /// passed what one run may store): no next turn, so whatever the worker
    /// reserved for one goes back.
    pub ended: bool,
    /// The script's pacer ops failed with the call's settle among them (an
    /// error of the pacer's script: a trailing `'u'`): the settle was not
    /// made, and its caller sends it alone.
    pub unsettled: bool,
}

/// Where a turn stands when a delivery starts it (the record's `phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The model has not answered this turn yet (no `phase`): call it.
    Model,
    /// The model's output is committed (`tools`); its tool calls still have to
    /// run. A redelivery runs them without calling the model again.
    Tools,
}

impl Phase {
    /// Reads the record's `phase` field.
    pub fn parse(phase: &str) -> Self {
        if phase == "tools" {
            Self::Tools
        } else {
            Self::Model
        }
    }
}

/// A run as a worker needs it to run a turn.
#[derive(Debug, Clone)]
pub struct TurnContext {
    /// Its spec (instructions, tools, endpoint, limits).
    pub spec: RunSpec,
    /// Its tenant.
    pub tenant: String,
    /// The whole transcript.
    pub transcript: Vec<TranscriptEntry>,
    /// Where the current turn stands.
    pub phase: Phase,
    /// The run's trace context (`traceparent`; record.rs `field::TRACE`), when it has one.
    pub trace: Option<String>,
    /// The tools of its MCP servers as its first turn listed them (JSON;
    /// record.rs `field::MCP_TOOLS`), when they were.
    pub mcp_tools: Option<String>,
}

/// A model's output with tool calls to run: its items, its call's usage and
/// the events that announce its tool calls (see [`super::RunStore::commit_with_output`]).
#[derive(Debug, Clone, Copy)]
pub struct ModelOutput<'a> {
    /// The output items (function calls, messages, reasoning).
    pub items: &'a [Value],
    /// What the call used.
    pub usage: Usage,
    /// The `turn.tool_call` events (type, data).
    pub events: &'a [(&'a str, Value)],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_job_has_the_shape_the_retry_script_writes() {
        // store.lua `retry` writes '{"turn":%d,"attempt":1}'.
        let job: TurnJob = serde_json::from_str(r#"{"turn":7,"attempt":1}"#).unwrap();
        assert_eq!(job, TurnJob { turn: 7, attempt: 1 });
        // Written with its format's version; a later version is refused, by name.
        assert_eq!(serde_json::to_string(&job).unwrap(), r#"{"turn":7,"attempt":1,"v":1}"#);
        let newer = serde_json::from_str::<TurnJob>(r#"{"turn":7,"attempt":1,"v":2}"#).unwrap_err();
        assert!(newer.to_string().contains("payload format 2"), "{newer}");
    }
}
