//! The shared pacer's ops as its script reads them (`lua/ops.lua`): one
//! typed value per op, written out as the script's arguments in one place
//! ([`Op::argv`]), and its answer read in one place ([`decision`]). The
//! worker's batch loop, the run store's fetch and its commit all send these.

use super::model::{CallOutcome, Decision, Estimate, Mode, OwedReason, Who};
use serde::Serialize;

/// One op of a `batch` call of the pacer's script.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Ask to reserve a call's estimate (→ [`decision`]).
    Acquire(AcquireOp),
    /// Settle a call's reservation with what it reported.
    Settle(SettleOp),
    /// Reservation `id` was never asked for (a commit's ask for its next
    /// turn): its ask reads no waiter record.
    Fresh(String),
    /// A waiting turn whose run ended leaves the line (`release.rs`, `forget`).
    Forget(String),
    /// What this script call's releases moved: `{id, at, 1 released | 0
    /// retimed, …}` (tests of the line).
    Moves,
}

/// An ask: reservation `id` for `est`, in `mode`, for a tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct AcquireOp {
    /// The reservation id (`run:turn:attempt`).
    pub id: String,
    /// What the call is expected to cost.
    pub est: Estimate,
    /// Work or companion.
    pub mode: Mode,
    /// The tenant (its line and share).
    pub tenant: String,
    /// Its weight (`PACELINE_TENANT_WEIGHTS`).
    pub weight: f64,
    /// Its cap as a share of the budget (0: none).
    pub cap: f64,
    /// A uniform number in [0, 1) for the owed time's jitter.
    pub jitter_u: f64,
}

impl AcquireOp {
    /// The ask of reservation `id` for `est` in `mode`, for `who`.
    pub fn new(id: &str, est: Estimate, mode: Mode, who: &Who<'_>, jitter_u: f64) -> Self {
        Self { id: id.to_owned(), est, mode, tenant: who.tenant.to_owned(), weight: who.weight, cap: who.cap, jitter_u }
    }
}

/// A call's report: reservation `id` settles with `outcome`.
#[derive(Debug, Clone, PartialEq)]
pub struct SettleOp {
    /// The reservation id.
    pub id: String,
    /// What the call reported (usage, headers, a 429).
    pub outcome: CallOutcome,
}

impl Op {
    /// The op as the script reads it: its name, then its arguments, in the
    /// order `lua/ops.lua` documents (a missing number is -1).
    pub fn argv(&self) -> Vec<String> {
        match self {
            Self::Acquire(a) => vec![
                "acquire".to_owned(),
                a.id.clone(),
                a.est.tokens.to_string(),
                a.est.requests.to_string(),
                a.jitter_u.to_string(),
                a.mode.as_str().to_owned(),
                a.weight.to_string(),
                a.cap.to_string(),
                a.tenant.clone(),
                a.est.output.to_string(),
            ],
            Self::Settle(s) => {
                let o = &s.outcome;
                let opt = |v: Option<u64>| v.map(|v| v as i64).unwrap_or(-1).to_string();
                vec![
                    "settle".to_owned(),
                    s.id.clone(),
                    opt(o.used_tokens),
                    opt(o.rate_limited_ms),
                    opt(o.tokens.limit),
                    opt(o.tokens.remaining),
                    opt(o.tokens.reset_ms),
                    opt(o.requests.limit),
                    opt(o.requests.remaining),
                    opt(o.requests.reset_ms),
                    o.headers_age_ms.to_string(),
                    opt(o.input_tokens),
                    opt(o.input.limit),
                    opt(o.input.remaining),
                    opt(o.input.reset_ms),
                    opt(o.output.limit),
                    opt(o.output.remaining),
                    opt(o.output.reset_ms),
                ]
            }
            Self::Fresh(id) => vec!["fresh".to_owned(), id.clone()],
            Self::Forget(id) => vec!["forget".to_owned(), id.clone()],
            Self::Moves => vec!["moves".to_owned()],
        }
    }
}

/// Another script carries an op as its argv (a JSON array of strings).
impl Serialize for Op {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.argv().serialize(s)
    }
}

/// Reads the script's answer to an ask: `{0}` clear, `{1, due_ms, reason,
/// eta_ms}` owed (reason: 1 budget, 2 rate_limited, 3 probe, 4 fair_share).
/// `None` for anything else.
pub fn decision(reply: &[i64]) -> Option<Decision> {
    match reply {
        [0] => Some(Decision::Clear),
        [1, ms, reason, eta] => Some(Decision::Owed {
            ms: (*ms).max(0) as u64,
            reason: OwedReason::from_code(*reason),
            eta_ms: (*eta).max(0) as u64,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacer::Observation;

    #[test]
    fn an_ops_argv_has_the_length_the_script_reads() {
        // ops.lua reads an acquire's 9 arguments and a settle's 17 after the name.
        let ask = Op::Acquire(AcquireOp::new(
            "r:1:1",
            Estimate { tokens: 10, requests: 1, output: 4 },
            Mode::Work,
            &Who::DEFAULT,
            0.5,
        ));
        assert_eq!(ask.argv().len(), 10);
        let outcome = CallOutcome {
            used_tokens: Some(7),
            tokens: Observation { limit: Some(100), remaining: Some(50), reset_ms: None },
            ..CallOutcome::default()
        };
        let settle = Op::Settle(SettleOp { id: "r:1:1".into(), outcome });
        let argv = settle.argv();
        assert_eq!(argv.len(), 18);
        assert_eq!(&argv[2..7], ["7", "-1", "100", "50", "-1"]);
        assert_eq!(serde_json::to_value(&settle).unwrap(), serde_json::json!(argv));
    }

    #[test]
    fn answers_are_read_once() {
        assert_eq!(decision(&[0]), Some(Decision::Clear));
        assert_eq!(
            decision(&[1, 60_000, 4, 9_000]),
            Some(Decision::Owed { ms: 60_000, reason: OwedReason::FairShare, eta_ms: 9_000 })
        );
        assert_eq!(decision(&[1, -3, 1, -3]), Some(Decision::Owed { ms: 0, reason: OwedReason::Budget, eta_ms: 0 }));
        assert_eq!(decision(&[2]), None);
    }
}
