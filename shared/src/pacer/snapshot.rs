//! What the workers see of a budget: its snapshot (`GET /v1/pacer`, the
//! dashboard, `/metrics`), read from the script's `snapshot` op, whose flat
//! field list `state_from_fields` decodes into the model's state.

use super::bucket;
use super::fair::Tenant;
use super::model::{Estimate, Flight, OwedReason, PacerState, Waiter};
use super::refund::RefundShare;
use crate::clock::Millis;
use serde::Serialize;
use std::collections::HashMap;

/// One budget and model as the workers see it: `GET /v1/pacer` serialises it
/// as it is (the field names are the API's), with the time of the last
/// headers and the tenants' lines added as the caller may see them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetSnapshot {
    /// The budget name (`PACELINE_BUDGET`).
    pub budget: String,
    /// The model (providers report limits per model).
    pub model: String,
    /// Estimated tokens available now.
    pub remaining_tokens: Option<i64>,
    /// Token limit.
    pub limit_tokens: Option<u64>,
    /// Time until the token bucket is full again, ms.
    #[serde(rename = "reset_in_ms")]
    pub reset_tokens_in_ms: Option<u64>,
    /// Tokens reserved by calls in flight.
    pub reserved_tokens: u64,
    /// Tokens the turns waiting in line are expected to use.
    pub booked_tokens: u64,
    /// Turns waiting in line.
    pub waiting_turns: u64,
    /// How long the oldest turn in line has waited (watchdog), ms.
    pub oldest_wait_ms: u64,
    /// Time since a call was last cleared (watchdog), ms; None if never.
    pub since_admission_ms: Option<u64>,
    /// Estimated requests available now.
    pub remaining_requests: Option<i64>,
    /// Request limit.
    pub limit_requests: Option<u64>,
    /// Time until the request bucket is full again.
    pub reset_requests_in_ms: Option<u64>,
    /// Requests reserved by calls in flight.
    pub reserved_requests: u64,
    /// A 429 closed the window for this long from now.
    pub blocked_for_ms: u64,
    /// When headers were last read (ms since the epoch, Redis clock); None if
    /// never. The API shows it as `observed_at` (RFC 3339).
    #[serde(skip)]
    pub observed_at_ms: Option<Millis>,
    /// The share of a call's unused output the provider gives back, as learned
    /// from its headers (1 refunds, 0 keeps); None until learned.
    pub refund_share: Option<f64>,
    /// Each tenant's line (fair admission). The API shows the caller's own,
    /// and every line to the operator only.
    #[serde(skip)]
    pub tenants: Vec<TenantShare>,
    /// What the pacer learned of the provider's buckets.
    pub shape: BudgetShape,
}

/// What the pacer learned of a budget's buckets from the headers (docs/pacing.md,
/// "Provider shapes").
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BudgetShape {
    /// How the token bucket refills: `continuous`, `window` (whole at its
    /// boundaries) or `unknown` (not decided yet); for separate input and
    /// output buckets, the input bucket's.
    pub refill: bucket::Refill,
    /// The token limit was inferred from `remaining` alone (Azure): at least
    /// what remained plus a call's own charge, refilling per minute.
    pub limit_assumed: bool,
    /// Separate input and output buckets (Anthropic): estimated tokens left
    /// and the limit of each; null where the provider has no such bucket.
    pub remaining_input_tokens: Option<i64>,
    /// See `remaining_input_tokens`.
    pub limit_input_tokens: Option<u64>,
    /// See `remaining_input_tokens`.
    pub remaining_output_tokens: Option<i64>,
    /// See `remaining_input_tokens`.
    pub limit_output_tokens: Option<u64>,
}

/// One tenant's line in a budget (`GET /v1/pacer`, `/metrics`).
// `TenantView` is its published name in the API's OpenAPI document.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = TenantView))]
pub struct TenantShare {
    /// The tenant.
    pub tenant: String,
    /// Its weight (`PACELINE_TENANT_WEIGHTS`), as last seen.
    pub weight: f64,
    /// Tokens admitted (expected use) since the state began.
    pub admitted_tokens: u64,
    /// Tokens of its turns waiting in line (of the first waiters the
    /// snapshot reads), not yet sent.
    pub waiting_tokens: u64,
    /// Times one of its turns waited in its line (for its fair share).
    pub waits: u64,
}

impl BudgetSnapshot {
    /// The snapshot of `s` at `now`.
    pub fn from_state(budget: &str, model: &str, s: &PacerState, now: Millis) -> Self {
        let level = |b: &bucket::Bucket| b.known().then(|| b.level_at(now).floor() as i64);
        let limit = |b: &bucket::Bucket| b.known().then_some(b.limit as u64);
        let reset =
            |b: &bucket::Bucket| b.known().then(|| ((b.limit - b.level_at(now)).max(0.0) / b.rate).ceil() as u64);
        Self {
            budget: budget.to_owned(),
            model: model.to_owned(),
            remaining_tokens: level(&s.tokens),
            limit_tokens: limit(&s.tokens),
            reset_tokens_in_ms: reset(&s.tokens),
            reserved_tokens: s.tokens.in_flight.max(0.0) as u64,
            booked_tokens: s.waiters.values().map(|w| w.line).sum::<f64>() as u64,
            waiting_turns: s.waiters.len() as u64,
            oldest_wait_ms: s.oldest_wait_ms(now) as u64,
            since_admission_ms: (s.last_admit_ms > 0).then(|| (now - s.last_admit_ms).max(0) as u64),
            remaining_requests: level(&s.requests),
            limit_requests: limit(&s.requests),
            reset_requests_in_ms: reset(&s.requests),
            reserved_requests: s.requests.in_flight.max(0.0) as u64,
            blocked_for_ms: (s.blocked_until_ms - now).max(0) as u64,
            observed_at_ms: (s.observed_at_ms > 0).then_some(s.observed_at_ms),
            refund_share: s.learned_share(),
            shape: BudgetShape {
                refill: if s.tokens.known() || !s.input.known() { s.tokens.refill } else { s.input.refill },
                limit_assumed: s.tokens.assumed,
                remaining_input_tokens: level(&s.input),
                limit_input_tokens: limit(&s.input),
                remaining_output_tokens: level(&s.output),
                limit_output_tokens: limit(&s.output),
            },
            tenants: s
                .tenants
                .iter()
                .map(|(tenant, t)| TenantShare {
                    tenant: tenant.clone(),
                    weight: t.weight,
                    admitted_tokens: t.admitted.max(0.0) as u64,
                    waiting_tokens: s.waiters.values().filter(|w| &w.tenant == tenant).map(|w| w.line).sum::<f64>()
                        as u64,
                    waits: t.waits.max(0.0) as u64,
                })
                .collect(),
        }
    }
}

impl BudgetSnapshot {
    /// The snapshot of a line of `waiting` turns of which the state held the
    /// first (the script reads no more): what they are expected to use is
    /// scaled to the whole line.
    pub fn of_line(mut self, waiting: u64) -> Self {
        let seen = self.waiting_turns.max(1);
        if waiting > self.waiting_turns {
            let scale = waiting as f64 / seen as f64;
            self.booked_tokens = (self.booked_tokens as f64 * scale) as u64;
            for t in &mut self.tenants {
                t.waiting_tokens = (t.waiting_tokens as f64 * scale) as u64;
            }
            self.waiting_turns = waiting;
        }
        self
    }

    /// The watchdog: turns have waited longer than `after_ms` and nothing was
    /// admitted for as long, while the token bucket is nearly full and no 429
    /// closed the window. The pacer should never be in this state.
    pub fn stalled(&self, after_ms: u64) -> bool {
        let full = match (self.remaining_tokens, self.limit_tokens) {
            (Some(r), Some(l)) => r as f64 >= 0.9 * l as f64,
            _ => false,
        };
        full && self.blocked_for_ms == 0
            && self.waiting_turns > 0
            && self.oldest_wait_ms > after_ms
            && self.since_admission_ms.is_none_or(|ms| ms > after_ms)
    }
}

/// Reads the script's flat field list into the model's state: the state
/// hash's fields, then each record as `rec:<id>` (see `decode_record`).
pub(crate) fn state_from_fields(flat: &[String]) -> (PacerState, Millis, u64) {
    let mut map: HashMap<&str, f64> = HashMap::new();
    let mut state = PacerState::default();
    for kv in flat.chunks(2) {
        let [k, v] = kv else { continue };
        if let Some(id) = k.strip_prefix("rec:") {
            match decode_record(v) {
                Some(Record::Waiter(w)) => {
                    state.waiters.insert(id.to_owned(), w);
                }
                Some(Record::Flight(f)) => {
                    state.flights.insert(id.to_owned(), f);
                }
                None => tracing::warn!(message = "unreadable pacer record", record.id = %id),
            }
        } else if let Ok(x) = v.parse() {
            map.insert(k.as_str(), x);
        }
    }
    let f = |k: &str| map.get(k).copied().unwrap_or(0.0);
    let bucket = |p: &str| bucket::Bucket {
        limit: f(&format!("{p}limit")),
        rate: f(&format!("{p}rate")),
        level: f(&format!("{p}level")),
        at_ms: f(&format!("{p}at")) as Millis,
        refunded: f(&format!("{p}refunded")),
        full_at_ms: f(&format!("{p}full_at")) as Millis,
        charged_since: f(&format!("{p}charged_since")),
        rated: f(&format!("{p}rated")) > 0.0,
        full_seen_ms: f(&format!("{p}full_seen")) as Millis,
        in_flight: f(&format!("{p}inflight")),
        sent: f(&format!("{p}sent")),
        withheld: f(&format!("{p}withheld")),
        votes: f(&format!("{p}votes")),
        refill: bucket::Refill::from_code(f(&format!("{p}refill"))),
        max_reset_ms: f(&format!("{p}max_reset")),
        obs_at_ms: f(&format!("{p}obs_at")) as Millis,
        obs_missing: f(&format!("{p}obs_missing")),
        obs_reset_ms: f(&format!("{p}obs_reset")),
        boundary_ms: f(&format!("{p}boundary")) as Millis,
        probed_ms: f(&format!("{p}probed")) as Millis,
        unknown_credit: f(&format!("{p}unknown_credit")),
        assumed: f(&format!("{p}assumed")) > 0.0,
        unsent: 0.0,
    };
    state.tokens = bucket("t_");
    state.requests = bucket("r_");
    state.input = bucket("i_");
    state.output = bucket("o_");
    state.count_unsent();
    state.blocked_until_ms = f("blocked_until") as Millis;
    state.probe_until_ms = f("probe_until") as Millis;
    state.headerless = f("headerless") > 0.0;
    state.hl_used = f("hl_used");
    state.hl_since_ms = f("hl_since") as Millis;
    state.hl_cut_ms = f("hl_cut") as Millis;
    state.hl_grow_ms = f("hl_grow") as Millis;
    state.hl_max = f("hl_max");
    state.hl_prev = f("hl_prev");
    state.hl_prev_span = f("hl_prev_span");
    state.observed_at_ms = f("observed_at") as Millis;
    state.last_admit_ms = f("last_admit") as Millis;
    state.usage_ratio = f("usage_ratio");
    state.input_ratio = f("input_ratio");
    state.call_ms = f("call_ms");
    state.refunds = RefundShare {
        given: f("rs_given"),
        unused: f("rs_unused"),
        pairs: f("rs_pairs"),
        at_ms: f("rs_at") as Millis,
        remaining: f("rs_remaining"),
        sent: f("rs_sent"),
        refunded: f("rs_refunded"),
        seen_ms: f("rs_seen") as Millis,
        until_ms: f("rs_until") as Millis,
        full: f("rs_full") > 0.0,
    };
    state.fair_time = f("fair_time");
    state.tenants = map
        .keys()
        .filter_map(|k| k.strip_prefix("tw:"))
        .map(|t| {
            let g = |p: &str| map.get(format!("{p}:{t}").as_str()).copied().unwrap_or(0.0);
            let tenant = Tenant {
                weight: g("tw"),
                finish: g("tf"),
                cap_due_ms: g("tc") as Millis,
                admitted: g("tadm"),
                waits: g("twait"),
            };
            (t.to_owned(), tenant)
        })
        .collect();
    // (How many wait: the script hands over the first of a long line only.)
    let waiting = (f("nw") as u64).max(state.waiters.len() as u64);
    (state, f("now") as Millis, waiting)
}

/// A reservation record as the script keeps it.
enum Record {
    Waiter(Waiter),
    Flight(Flight),
}

/// Reads one record of the script (`rec_encode` in `lua/line.lua`):
/// `w|order|tokens|requests|output|line|due|clear|since|reason|tenant` or
/// `f|tokens|requests|output|mark|expiry|input|sent|alone|held_input|held_output|omark|rsent|isent|osent`.
fn decode_record(s: &str) -> Option<Record> {
    // A waiter's last field, its tenant, is the rest of the record.
    let fields = if s.starts_with("w|") { 11 } else { 17 };
    let mut parts = s.splitn(fields, '|');
    let kind = parts.next()?;
    let mut num = || parts.next()?.parse::<f64>().ok();
    match kind {
        "w" => {
            let order = num()?;
            let est = Estimate { tokens: num()? as u64, requests: num()? as u64, output: num()? as u64 };
            let (line, due, clear, since, reason) = (num()?, num()?, num()?, num()?, num()?);
            let tenant = parts.next()?.to_owned();
            Some(Record::Waiter(Waiter {
                order,
                est,
                line,
                tenant,
                due_ms: due as Millis,
                clear_ms: clear as Millis,
                since_ms: since as Millis,
                reason: OwedReason::from_code(reason as i64),
            }))
        }
        "f" => {
            let est = Estimate { tokens: num()? as u64, requests: num()? as u64, output: num()? as u64 };
            let (mark, expiry, input, sent, alone) = (num()?, num()?, num()?, num()?, num()?);
            let (held_input, held_output, omark) = (num()?, num()?, num()?);
            let marks = [num()?, num()?, num()?];
            let started = num()?;
            Some(Record::Flight(Flight {
                est,
                input: input as u64,
                mark,
                sent,
                held_input: held_input as u64,
                held_output: held_output as u64,
                omark,
                marks,
                alone: alone > 0.0,
                expiry_ms: expiry as Millis,
                started: started > 0.0,
            }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    /// The Lua keeps the state's numbers as one packed field in the order of
    /// its `FIXED` list (`lua/state.lua`); this decoder reads them by name.
    /// The two lists are one: every number the script keeps is read here, and
    /// every name read here is one the script keeps (but `ttl_at`, the keys'
    /// expiry bookkeeping, which is no part of the model).
    #[test]
    fn the_lua_state_fields_and_the_decoder_are_one_list() {
        let lua = include_str!("lua/state.lua");
        let start = lua.find("local FIXED = {").expect("FIXED in state.lua");
        let end = start + lua[start..].find('}').expect("FIXED ends");
        let fixed: std::collections::BTreeSet<String> =
            lua[start..end].split('\'').skip(1).step_by(2).map(str::to_owned).collect();
        let rust = include_str!("snapshot.rs");
        let code = rust.split("#[cfg(test)]").next().unwrap();
        let mut read = std::collections::BTreeSet::new();
        for piece in code.split("f(&format!(\"{p}").skip(1) {
            let name = &piece[..piece.find('"').unwrap()];
            for p in ["t_", "r_", "i_", "o_"] {
                read.insert(format!("{p}{name}"));
            }
        }
        for piece in code.split(" f(\"").skip(1).chain(code.split("(f(\"").skip(1)) {
            read.insert(piece[..piece.find('"').unwrap()].to_owned());
        }
        read.remove("now");
        // (`nw`, the line's length, is a field of its own, kept by the line's writes.)
        read.remove("nw");
        let storage_only: std::collections::BTreeSet<String> = ["ttl_at".to_owned()].into();
        let kept: std::collections::BTreeSet<String> = fixed.difference(&storage_only).cloned().collect();
        assert!(kept.len() > 100, "read {} names of FIXED", kept.len());
        let unread: Vec<_> = kept.difference(&read).collect();
        let unknown: Vec<_> = read.difference(&kept).collect();
        assert!(unread.is_empty(), "the script keeps numbers the decoder does not read: {unread:?}");
        assert!(unknown.is_empty(), "the decoder reads numbers the script does not keep: {unknown:?}");
    }
}
