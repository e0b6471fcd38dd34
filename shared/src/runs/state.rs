//! A run's state machine, in one place (ARCHITECTURE.md, "Runs and turns"):
//! `queued` → `running` ⇄ `waiting` → `completed` | `failed` | `cancelled`.
//!
//! This table is the reference: the run store's scripts (`store.lua`) make
//! these moves atomically in Redis, where Rust cannot be called, and the test
//! `run_store::every_move_the_store_makes_is_one_the_state_table_allows` holds
//! them to it. A finished run never
//! moves again — that is what makes a late, redelivered turn harmless and what
//! makes cancelling a finished run a 409 — but for one deliberate move: a
//! `failed` run that its tenant or the operator retries is `queued` again
//! (`POST /v1/runs/{id}/retry`).

use serde::{Deserialize, Serialize};

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum RunStatus {
    /// Accepted; its first turn is queued.
    Queued,
    /// A worker is running one of its turns.
    Running,
    /// Its next turn is requeued until `next_attempt_at` (see [`WaitReason`]).
    Waiting,
    /// The model answered without tool calls.
    Completed,
    /// It failed; `error.kind` says why.
    Failed,
    /// Cancelled by its tenant.
    Cancelled,
}

/// Why a `waiting` run waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum WaitReason {
    /// The shared budget owes it time.
    Budget,
    /// Its tenant's fair share of a scarce budget owes it time.
    FairShare,
    /// The provider answered 429.
    RateLimited,
    /// A transient error: retrying on the backoff ladder.
    Retry,
    /// Its tenant's spend cap for the day is reached: until the next day.
    SpendCap,
}

impl WaitReason {
    /// The name used in the API and in Redis (its serde name).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Budget => "budget",
            Self::FairShare => "fair_share",
            Self::RateLimited => "rate_limited",
            Self::Retry => "retry",
            Self::SpendCap => "spend_cap",
        }
    }
}

/// What happens to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// A worker starts a turn.
    Start,
    /// The turn is requeued to wait (budget, fair share, 429, retry).
    Wait(WaitReason),
    /// A turn committed and the next one is queued.
    Continue,
    /// The last turn committed: the run is done.
    Complete,
    /// The run fails.
    Fail,
    /// The tenant cancels it.
    Cancel,
    /// Its tenant or the operator re-drives a failed run from its last committed turn.
    Retry,
}

/// A move the state machine does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a {from:?} run cannot {transition:?}")]
pub struct InvalidTransition {
    /// Where the run was.
    pub from: RunStatus,
    /// What was asked.
    pub transition: Transition,
}

impl RunStatus {
    /// Completed, failed or cancelled: it never moves again.
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }

    /// The status after `t`, or why not.
    pub fn apply(self, t: Transition) -> Result<RunStatus, InvalidTransition> {
        use RunStatus::*;
        use Transition::*;
        let to = match (self, t) {
            (Failed, Retry) => Some(Queued),
            (from, _) if from.is_finished() => None,
            (Queued | Waiting, Start) => Some(Running),
            // A turn may be told to wait before it is started (the pacer owes
            // it time at once) or while it runs (a 429 mid-turn).
            (Queued | Running | Waiting, Wait(_)) => Some(Waiting),
            (Running, Continue) => Some(Queued),
            (Running, Complete) => Some(Completed),
            (_, Fail) => Some(Failed),
            (_, Cancel) => Some(Cancelled),
            _ => None,
        };
        to.ok_or(InvalidTransition { from: self, transition: t })
    }

    /// The name used in the API and in Redis.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Waiting => "waiting",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the name used in the API and in Redis.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "waiting" => Self::Waiting,
            "completed" => Self::Completed,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }
}

/// The event types of a run's stream, as they are named on the wire.
pub mod event {
    /// The run was accepted.
    pub const RUN_QUEUED: &str = "run.queued";
    /// A worker started a turn.
    pub const TURN_STARTED: &str = "turn.started";
    /// The pacer owed the turn time (`owed_ms`).
    pub const TURN_PACED: &str = "turn.paced";
    /// The provider answered 429 (`attempt`, `retry_after_ms`).
    pub const TURN_RATE_LIMITED: &str = "turn.rate_limited";
    /// A transient error: retrying (`attempt`, `delay_ms`, `reason`).
    pub const TURN_RETRY: &str = "turn.retry";
    /// Streamed model text.
    pub const TURN_OUTPUT_TEXT_DELTA: &str = "turn.output_text.delta";
    /// The model asked for a tool call.
    pub const TURN_TOOL_CALL: &str = "turn.tool_call";
    /// A tool answered (`clipped`).
    pub const TURN_TOOL_RESULT: &str = "turn.tool_result";
    /// A turn committed (`usage`).
    pub const TURN_COMPLETED: &str = "turn.completed";
    /// The run completed.
    pub const RUN_COMPLETED: &str = "run.completed";
    /// The run failed.
    pub const RUN_FAILED: &str = "run.failed";
    /// The run was cancelled.
    pub const RUN_CANCELLED: &str = "run.cancelled";

    /// Every event type.
    pub const ALL: [&str; 12] = [
        RUN_QUEUED,
        TURN_STARTED,
        TURN_PACED,
        TURN_RATE_LIMITED,
        TURN_RETRY,
        TURN_OUTPUT_TEXT_DELTA,
        TURN_TOOL_CALL,
        TURN_TOOL_RESULT,
        TURN_COMPLETED,
        RUN_COMPLETED,
        RUN_FAILED,
        RUN_CANCELLED,
    ];
}

#[cfg(test)]
mod tests {
    use super::RunStatus::*;
    use super::Transition::*;
    use super::*;

    /// The Lua scripts write events by name; every name they write is one of
    /// [`event::ALL`] (a typo there would be an event no client knows).
    #[test]
    fn every_event_the_lua_scripts_write_is_a_known_event_type() {
        let sources = [
            ("runs/store.lua", include_str!("store.lua")),
            ("runs/lib.lua", include_str!("lib.lua")),
            ("queue/lib.lua", include_str!("../queue/lib.lua")),
            ("runs/hooks.lua", include_str!("hooks.lua")),
            ("queue/fetch.lua", include_str!("../queue/fetch.lua")),
            ("queue/settle.lua", include_str!("../queue/settle.lua")),
            ("queue/heartbeat.lua", include_str!("../queue/heartbeat.lua")),
            ("queue/admin.lua", include_str!("../queue/admin.lua")),
        ];
        let name = regex::Regex::new(r"'((?:run|turn)\.[a-z_.]+)'").unwrap();
        let mut seen = 0;
        for (file, text) in sources {
            for c in name.captures_iter(text) {
                assert!(event::ALL.contains(&&c[1]), "{file} writes event {:?}, not one of event::ALL", &c[1]);
                seen += 1;
            }
        }
        // The scripts write run.queued, turn.started, turn.completed, run.completed,
        // run.failed and run.cancelled themselves; the rest come from Rust.
        assert!(seen >= 6, "found only {seen} event names in the scripts");
    }

    /// The error kinds the scripts write (`error_kind`, `kind = …`) and the
    /// reasons their fences give (`return nil, '…'`, `{'stop', '…'}`) are the
    /// ones the Rust types name: [`crate::runs::ErrorKind`] and
    /// [`crate::runs::StopReason`] (where an unknown one would read as `Other`).
    #[test]
    fn every_error_kind_and_stop_reason_the_lua_scripts_write_has_a_name() {
        use crate::runs::{ErrorKind, StopReason};
        let sources = [
            ("runs/store.lua", include_str!("store.lua")),
            ("runs/lib.lua", include_str!("lib.lua")),
            ("queue/lib.lua", include_str!("../queue/lib.lua")),
            ("runs/hooks.lua", include_str!("hooks.lua")),
        ];
        let kind = regex::Regex::new(r"(?:'error_kind', |kind = )'([a-z_]+)'").unwrap();
        let stop = regex::Regex::new(r"(?:return nil, |return |\{'stop', )'([a-z_]+)'").unwrap();
        let (mut kinds, mut stops) = (0, 0);
        for (file, text) in sources {
            // (`'error_kind', 'error_message'` is an HDEL of both fields.)
            for c in kind.captures_iter(text).filter(|c| !c[1].starts_with("error_")) {
                assert!(ErrorKind::ALL.iter().any(|k| k.as_str() == &c[1]), "{file} writes error kind {:?}", &c[1]);
                kinds += 1;
            }
            for c in stop.captures_iter(text).filter(|c| c[0].contains("nil") || c[0].contains("stop")) {
                assert!(!matches!(StopReason::parse(&c[1]), StopReason::Other(_)), "{file} stops with {:?}", &c[1]);
                stops += 1;
            }
        }
        assert!(kinds >= 3 && stops >= 3, "found only {kinds} error kinds and {stops} stop reasons in the scripts");
    }

    const ALL: [RunStatus; 6] = [Queued, Running, Waiting, Completed, Failed, Cancelled];

    #[test]
    fn the_happy_path_of_a_run_with_tool_turns() {
        let mut s = Queued;
        for t in [Start, Wait(WaitReason::Budget), Start, Continue, Start, Complete] {
            s = s.apply(t).unwrap();
        }
        assert_eq!(s, Completed);
    }

    #[test]
    fn a_finished_run_never_moves_again() {
        for from in [Completed, Failed, Cancelled] {
            for t in [Start, Wait(WaitReason::Retry), Continue, Complete, Fail, Cancel] {
                assert!(from.apply(t).is_err(), "{from:?} accepted {t:?}");
            }
        }
    }

    #[test]
    fn only_a_failed_run_is_retried_and_it_is_queued_again() {
        assert_eq!(Failed.apply(Retry), Ok(Queued));
        for from in [Queued, Running, Waiting, Completed, Cancelled] {
            assert!(from.apply(Retry).is_err(), "{from:?} accepted a retry");
        }
    }

    #[test]
    fn any_unfinished_run_can_be_cancelled_or_failed() {
        for from in [Queued, Running, Waiting] {
            assert_eq!(from.apply(Cancel), Ok(Cancelled));
            assert_eq!(from.apply(Fail), Ok(Failed));
        }
    }

    #[test]
    fn only_a_running_turn_commits() {
        for from in [Queued, Waiting] {
            assert!(from.apply(Continue).is_err());
            assert!(from.apply(Complete).is_err());
        }
        assert!(Running.apply(Start).is_err(), "a turn is started once");
    }

    #[test]
    fn names_round_trip_and_match_serde() {
        for s in ALL {
            assert_eq!(RunStatus::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert_eq!(RunStatus::parse("done"), None);
        assert_eq!(serde_json::to_value(WaitReason::FairShare).unwrap(), "fair_share");
        assert_eq!(serde_json::to_value(WaitReason::RateLimited).unwrap(), "rate_limited");
    }
}
