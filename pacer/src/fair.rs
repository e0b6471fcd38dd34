//! Fair admission: where a turn stands in its budget's line.
//!
//! Every budget keeps one line of waiting turns, ordered by a number each turn
//! is given once, when it first asks:
//! - companion turns (a person listening) first, in the order they arrived
//!   ([`COMPANION_BASE`] + arrival time, always below any work tag);
//! - work turns by start-time fair queuing: a turn's tag is its tenant's
//!   virtual time, `max(system virtual time, the tenant's finish tag)`, and the
//!   tenant's finish tag then moves on by the turn's expected use over the
//!   tenant's weight. While tenants are backlogged, their turns interleave in
//!   the ratio of their weights; a tenant back from idle starts at the system's
//!   virtual time, so idleness earns no credit, and budget it used while no one
//!   else could earns no debt.
//!
//! A cap (`PACELINE_TENANT_CAPS`) is a rate of its own (GCRA on the tenant's
//! expected use): a turn of a capped tenant joins the line only when the cap
//! has paid for the tenant's earlier turns. A companion turn passes the cap and
//! moves its tenant's finish tag as a work turn does: it goes first, but its
//! tokens count in its tenant's cap and share (`model.rs`, `fresh_place`).
//!
//! Nothing here is a count that must be kept in step with the waiting turns:
//! the tags are stored on the turns themselves (a counter kept in step with a
//! sum drifts on the path nobody tested: docs/pacing.md, "One line per budget,
//! summed anew on every ask").

use crate::Millis;
use serde::{Deserialize, Serialize};

/// Companion turns are ordered at `COMPANION_BASE + arrival ms`: negative for any
/// time before the year 2286, so below every work tag (which are >= 0).
pub const COMPANION_BASE: f64 = -1e13;

/// One tenant's fair-admission state in a budget.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Tenant {
    /// Its weight (`PACELINE_TENANT_WEIGHTS`), as last seen.
    pub weight: f64,
    /// Its finish tag: the virtual time after its latest turn's expected use.
    pub finish: f64,
    /// With a cap: when the cap has paid for the tenant's turns so far.
    pub cap_due_ms: Millis,
    /// Expected use of its turns admitted so far (for `GET /v1/pacer`, `/metrics`).
    pub admitted: f64,
    /// Times one of its turns had to wait.
    pub waits: f64,
}

/// The tag of a tenant's next work turn, with its finish tag moved past it.
pub fn place_work(tenant: &mut Tenant, weight: f64, virtual_time: f64, line: f64) -> f64 {
    tenant.weight = weight;
    let start = virtual_time.max(tenant.finish);
    tenant.finish = start + line / weight.max(0.001);
    start
}

/// The order of a companion turn that arrives at `now`.
pub fn place_companion(now: Millis) -> f64 {
    COMPANION_BASE + now as f64
}

/// Whether an order belongs to a work turn.
pub fn is_work(order: f64) -> bool {
    order >= 0.0
}

/// The cap's gate for a new turn of a capped tenant: `Some(ms)` it must wait
/// before joining the line, or `None` (and the cap is charged for `line`
/// tokens at `refill × cap`).
pub fn cap_gate(tenant: &mut Tenant, cap: f64, refill_per_ms: f64, line: f64, now: Millis) -> Option<f64> {
    if cap <= 0.0 || refill_per_ms <= 0.0 {
        return None;
    }
    if tenant.cap_due_ms > now {
        return Some((tenant.cap_due_ms - now) as f64);
    }
    tenant.cap_due_ms = now + (line / (refill_per_ms * cap)).ceil() as Millis;
    None
}

/// The system's virtual time after a work turn of tag `admitted` goes, with
/// `least_waiting` the least work tag still in line: it never moves back, and
/// never past a turn that still waits.
pub fn virtual_time_after(virtual_time: f64, admitted: f64, least_waiting: Option<f64>) -> f64 {
    virtual_time.max(least_waiting.map_or(admitted, |least| least.min(admitted)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlogged_tenants_interleave_by_weight() {
        let (mut a, mut b) = (Tenant::default(), Tenant::default());
        let mut tags = vec![];
        for _ in 0..6 {
            tags.push((place_work(&mut a, 2.0, 0.0, 100.0), 'a'));
            tags.push((place_work(&mut b, 1.0, 0.0, 100.0), 'b'));
        }
        tags.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        let first: String = tags.iter().take(9).map(|t| t.1).collect();
        assert_eq!(first.matches('a').count(), 6, "{first}");
    }

    #[test]
    fn a_tenant_back_from_idle_starts_at_the_system_virtual_time() {
        let mut t = Tenant { finish: 10.0, ..Tenant::default() };
        assert_eq!(place_work(&mut t, 1.0, 500.0, 100.0), 500.0);
        assert_eq!(t.finish, 600.0);
    }

    #[test]
    fn a_cap_spaces_a_tenants_turns_at_its_rate() {
        let mut t = Tenant::default();
        // 1 token/ms refill, 25 % cap: 1 000 tokens pay for 4 000 ms.
        assert_eq!(cap_gate(&mut t, 0.25, 1.0, 1_000.0, 0), None);
        assert_eq!(cap_gate(&mut t, 0.25, 1.0, 1_000.0, 1_000), Some(3_000.0));
        assert_eq!(cap_gate(&mut t, 0.25, 1.0, 1_000.0, 4_000), None);
    }

    #[test]
    fn companion_turns_order_before_every_work_turn() {
        assert!(place_companion(4_000_000_000_000) < 0.0);
        assert!(!is_work(place_companion(1_800_000_000_000)) && is_work(0.0));
    }
}
