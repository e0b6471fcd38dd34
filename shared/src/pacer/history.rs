//! The pacer's short history, for the dashboard's chart (`GET /v1/pacer/history`).
//!
//! The script (`lua/state.lua`, `hist`) counts, per second, the tokens it cleared
//! (`a`), the 429s settled (`r`) and the turns it told to wait (`w`): the current
//! second's in the state hash (fields `h_s`, `h_a`, `h_r`, `h_w`, written with the
//! state), earlier ones in one hash per budget, model and minute that expires after
//! 16 minutes (the first call of a later second moves them there). These counters
//! are kept beside the policy, never read by it. Reading them is one `TIME` and one
//! pipeline of 17 commands (and the refill rate, read from the state by the
//! script's snapshot).

use crate::keys::Keys;
use crate::redis_util::RedisConn;
use serde::Serialize;
use std::collections::HashMap;

use super::PacerError;

/// How many seconds the history covers (the last 15 minutes, the current one included).
pub const SECONDS: usize = 900;

/// One budget and model's last [`SECONDS`], one point a second, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = PacerHistory))]
pub struct History {
    /// The budget name.
    pub budget: String,
    /// The model.
    pub model: String,
    /// The Unix second (Redis clock) of the first point; point `i` is second `start_s + i`.
    pub start_s: i64,
    /// Tokens cleared (reservations admitted) in each second.
    pub admitted_tokens: Vec<u64>,
    /// Calls settled as rate limited (429) in each second.
    pub rate_limited: Vec<u64>,
    /// Turns told to wait (budget, fair share, a closed window) in each second.
    pub waits: Vec<u64>,
    /// The token limit's refill rate, tokens per second, as the pacer last
    /// learned it (the input bucket's where the provider splits them); null
    /// while no limit is known. For a window that refills at its boundary, the
    /// average over the window.
    pub refill_tokens_per_s: Option<f64>,
}

/// Builds the history ending at `now_s` from the minute hashes' fields
/// (`<second>:<a|r|w>` → count); fields outside the span are left out.
pub fn assemble<'a>(
    budget: &str,
    model: &str,
    now_s: i64,
    fields: impl IntoIterator<Item = (&'a str, i64)>,
    refill_tokens_per_s: Option<f64>,
) -> History {
    let start_s = now_s - SECONDS as i64 + 1;
    let mut h = History {
        budget: budget.to_owned(),
        model: model.to_owned(),
        start_s,
        admitted_tokens: vec![0; SECONDS],
        rate_limited: vec![0; SECONDS],
        waits: vec![0; SECONDS],
        refill_tokens_per_s,
    };
    for (field, n) in fields {
        let Some((sec, kind)) = field.split_once(':') else { continue };
        let Ok(sec) = sec.parse::<i64>() else { continue };
        let i = sec - start_s;
        if !(0..SECONDS as i64).contains(&i) {
            continue;
        }
        let series = match kind {
            "a" => &mut h.admitted_tokens,
            "r" => &mut h.rate_limited,
            "w" => &mut h.waits,
            _ => continue,
        };
        series[i as usize] += n.max(0) as u64;
    }
    h
}

/// The refill rate per second of a state: the token bucket's, else the input
/// bucket's; none while neither has a limit and a rate.
pub fn refill_per_s(state: &super::model::PacerState) -> Option<f64> {
    [&state.tokens, &state.input].into_iter().find_map(|b| (b.limit > 0.0 && b.rate > 0.0).then_some(b.rate * 1000.0))
}

/// Reads one budget and model's history (Redis clock); `refill_tokens_per_s`
/// is the state's ([`refill_per_s`]), read by the caller through the script.
pub async fn read(
    conn: &mut RedisConn,
    keys: &Keys,
    budget: &str,
    model: &str,
    refill_tokens_per_s: Option<f64>,
) -> Result<History, PacerError> {
    let (secs, _micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    let first_minute = (secs - SECONDS as i64 + 1).div_euclid(60);
    let last_minute = secs.div_euclid(60);
    let mut pipe = redis::pipe();
    for minute in first_minute..=last_minute {
        pipe.cmd("HGETALL").arg(keys.pacer_history_minute(budget, model, minute));
    }
    pipe.cmd("HMGET").arg(keys.pacer_state(budget, model)).arg(&PENDING_FIELDS);
    let mut replies = pipe.query_async::<Vec<redis::Value>>(conn).await?;
    let protocol = |e: redis::ParsingError| PacerError::Protocol(e.to_string());
    let pending =
        redis::from_redis_value::<Vec<Option<f64>>>(replies.pop().unwrap_or(redis::Value::Nil)).map_err(protocol)?;
    let minutes = replies
        .into_iter()
        .map(|v| redis::from_redis_value::<HashMap<String, i64>>(v).map_err(protocol))
        .collect::<Result<Vec<_>, _>>()?;
    let pending = pending_fields(&pending);
    let fields = minutes
        .iter()
        .flat_map(|m| m.iter().map(|(k, v)| (k.as_str(), *v)))
        .chain(pending.iter().map(|(k, v)| (k.as_str(), *v)));
    Ok(assemble(budget, model, secs, fields, refill_tokens_per_s))
}

/// The state's fields that hold the current second's counts: its second, then
/// the counts of `a`, `r` and `w`.
const PENDING_FIELDS: [&str; 4] = ["h_s", "h_a", "h_r", "h_w"];

/// The current second's counts (the state's [`PENDING_FIELDS`], as read) as
/// the minute hashes name them (`<second>:<kind>`).
fn pending_fields(values: &[Option<f64>]) -> Vec<(String, i64)> {
    let Some(Some(sec)) = values.first() else { return vec![] };
    ["a", "r", "w"]
        .iter()
        .zip(values.iter().skip(1))
        .filter_map(|(kind, n)| Some((format!("{}:{kind}", *sec as i64), (*n)? as i64)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_land_on_their_second_and_the_old_ones_are_left_out() {
        let now = 1_000_000;
        let fields = [
            (format!("{now}:a"), 500),
            (format!("{now}:a"), 20),
            (format!("{}:w", now - 1), 2),
            (format!("{}:r", now - 899), 1),
            (format!("{}:a", now - 900), 9999),
            (format!("{}:a", now + 1), 9999),
            ("garbage".to_owned(), 1),
            (format!("{now}:x"), 1),
        ];
        let h = assemble("b", "m", now, fields.iter().map(|(k, v)| (k.as_str(), *v)), Some(100.0));
        assert_eq!(h.start_s, now - 899);
        assert_eq!(h.admitted_tokens.len(), SECONDS);
        assert_eq!(h.admitted_tokens[SECONDS - 1], 520);
        assert_eq!(h.waits[SECONDS - 2], 2);
        assert_eq!(h.rate_limited[0], 1);
        assert_eq!(h.admitted_tokens.iter().sum::<u64>(), 520, "seconds outside the span are left out");
        assert_eq!(h.refill_tokens_per_s, Some(100.0));
    }

    #[test]
    fn the_current_seconds_counts_are_read_from_the_state() {
        let now = 1_000_000.0;
        let read = [Some(now), Some(520.0), None, Some(3.0)];
        assert_eq!(pending_fields(&read), [(format!("{now}:a"), 520), (format!("{now}:w"), 3)]);
        assert!(pending_fields(&[None, Some(1.0), None, None]).is_empty(), "no second, no counts");
    }

    #[test]
    fn the_refill_rate_is_the_token_buckets_else_the_input_buckets() {
        let mut state = super::super::model::PacerState::default();
        assert_eq!(refill_per_s(&state), None);
        state.input.limit = 600.0;
        state.input.rate = 0.02;
        assert_eq!(refill_per_s(&state), Some(20.0));
        state.tokens.limit = 600.0;
        state.tokens.rate = 0.01;
        assert_eq!(refill_per_s(&state), Some(10.0));
    }
}
