//! Completion webhooks (SPEC §3, "Webhooks"; README, "Webhooks"): the queue
//! of deliveries and what a delivery says. The worker sends them
//! (`worker::webhooks`).
//!
//! A run whose spec names a `webhook_url` gets one event when it ends
//! (`run.completed`, `run.failed`, `run.cancelled`). The script that ends the
//! run enqueues the event in the same step (`hooks.lua` `webhook_enqueue`,
//! called by `run_retire`, which every end goes through): a run never ends
//! without its delivery. Deliveries are leased like turns: a worker claims the
//! due ones ([`WebhookQueue::claim`], one script), sends each, and finishes it
//! ([`WebhookQueue::finish`]); a worker killed mid-send leaves a lease that
//! expires, and the next claim takes the delivery back. Every attempt of one
//! event sends the same `webhook-id` and the same body (kept with the event at
//! the first finish).
//!
//! Retries follow [`SCHEDULE`] (the Standard Webhooks one: 0 s, 5 s, 5 min,
//! 30 min, 2 h, 5 h, 10 h, 10 h — 27 h 35 min in all) with ±20 % jitter; a 2xx
//! ends an event, a 410 stops it, anything else retries; past the last
//! attempt it is dead-lettered (`GET /v1/dead`), and an operator re-drives it
//! (`POST /v1/webhooks/{event}/retry`).

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use crate::redis_util::RedisConn;
use serde::{Deserialize, Serialize};

use super::record::{rfc3339_ms, Run};
use crate::keys::Keys;

static SCRIPT: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("webhooks.lua")));

/// The delays before each attempt of one event, from its run's end (the
/// first) or the attempt before: Standard Webhooks' schedule, over 24 h.
pub const SCHEDULE: [Duration; 8] = [
    Duration::ZERO,
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(10 * 3600),
];

/// How long a dead-lettered event is kept for an operator to see and re-drive.
pub const DEAD_KEPT: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long an event lives that may still be sent: its retries' 27.6 h and a
/// dead letter's [`DEAD_KEPT`], with a margin — also when no worker ever sends
/// it. `hooks.lua` (`WH_KEEP_MS`) gives it at the enqueue, which knows no
/// configuration; a test holds the two to one value.
pub const EVENT_KEPT: Duration = Duration::from_secs(9 * 24 * 3600);

/// The delay before the attempt after attempt `made` (1-based), with `scale`
/// (1 in production; tests shrink the schedule) and a jitter `draw` in
/// [0, 1): ±20 %. `None`: that was the last attempt.
pub fn next_delay(made: u32, scale: f64, draw: f64) -> Option<Duration> {
    let base = SCHEDULE.get(made as usize)?;
    let jitter = 0.8 + 0.4 * draw.clamp(0.0, 1.0);
    Some(base.mul_f64((scale * jitter).max(0.0)))
}

/// A delivery a worker claimed: send it, then [`WebhookQueue::finish`] it.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    /// The event's id: the `webhook-id` of every attempt.
    pub event: String,
    /// The run it tells of.
    pub run: String,
    /// `run.completed`, `run.failed` or `run.cancelled`.
    pub kind: String,
    /// When the run ended, ms (the Redis clock): the body's `timestamp`.
    pub at_ms: i64,
    /// Where it goes (the run's `webhook_url`).
    pub url: String,
    /// The run's tenant (the worker checks the URL against its allow-list).
    pub tenant: String,
    /// This attempt's number, from 1 (a re-drive counts again from 1): where
    /// the schedule stands.
    pub attempt: u32,
    /// The body an earlier attempt sent, to send again; `None` on the first.
    pub body: Option<String>,
    /// The claim's fence: the event's count of claims, never reset.
    pub claim: u64,
    /// The URL's scheme and authority (`https://hooks.acme.com:8443`, as the
    /// enqueue wrote it: `hooks.lua`), what the per-receiver bound counts.
    pub origin: String,
}

/// How one attempt went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// A 2xx: done.
    Delivered(u16),
    /// A 410: the receiver wants no more.
    Gone,
    /// Anything else: a status, or no answer (`None`) and why.
    Failed(Option<u16>, String),
}

/// A dead-lettered delivery (`GET /v1/dead`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeadDelivery {
    /// The event's id (`webhook-id`).
    pub event_id: String,
    /// The run it tells of.
    pub run_id: String,
    /// `run.completed`, `run.failed` or `run.cancelled`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Where it went.
    pub url: String,
    /// Attempts made.
    pub attempts: u32,
    /// The last answer's HTTP status; `None`: no answer.
    pub last_status: Option<u16>,
    /// What went wrong last.
    pub last_error: String,
    /// When it gave up (RFC 3339, ms).
    pub dead_at: String,
}

/// A run's delivery as its run object shows it (`Run::webhook`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WebhookState {
    /// Where it goes.
    pub url: String,
    /// The current event's id (`webhook-id`); `None` before the run ends.
    pub event_id: Option<String>,
    /// `pending`, `retrying`, `delivered`, `stopped` (410) or `failed` (dead-lettered).
    pub state: Option<String>,
    /// Attempts made.
    pub attempts: u32,
    /// The last answer's HTTP status.
    pub last_status: Option<u16>,
    /// What went wrong last.
    pub last_error: Option<String>,
    /// When the next attempt is due (RFC 3339, ms).
    pub next_attempt_at: Option<String>,
}

impl WebhookState {
    /// From a run record's fields (`record.rs` `field::WEBHOOK_*`); `None`
    /// for a run with no webhook.
    pub fn from_fields(f: &HashMap<String, String>) -> Option<Self> {
        use super::record::field;
        let get = |k: &str| f.get(k).map(String::as_str).filter(|v| !v.is_empty());
        let url = get(field::WEBHOOK_URL)?.to_owned();
        let state = get(field::WEBHOOK_STATE).map(str::to_owned);
        let waiting = matches!(state.as_deref(), Some("pending" | "retrying"));
        Some(Self {
            url,
            event_id: get(field::WEBHOOK_EVENT).map(str::to_owned),
            state,
            attempts: get(field::WEBHOOK_ATTEMPTS).and_then(|v| v.parse().ok()).unwrap_or(0),
            last_status: get(field::WEBHOOK_LAST_STATUS).and_then(|v| v.parse().ok()),
            last_error: get(field::WEBHOOK_ERROR).map(str::to_owned),
            next_attempt_at: if waiting {
                get(field::WEBHOOK_NEXT_MS).and_then(|v| v.parse().ok()).map(rfc3339_ms)
            } else {
                None
            },
        })
    }
}

/// The body of an event: `{"type", "timestamp", "data": <the run object>}`.
pub fn event_body(kind: &str, at_ms: i64, run: &Run) -> String {
    serde_json::json!({"type": kind, "timestamp": rfc3339_ms(at_ms), "data": run}).to_string()
}

/// The deliveries' queue, in the runs' slot.
#[derive(Clone)]
pub struct WebhookQueue {
    conn: RedisConn,
    keys: Keys,
}

impl WebhookQueue {
    /// The queue under `keys`' prefix.
    pub fn new(conn: RedisConn, keys: Keys) -> Self {
        Self { conn, keys }
    }

    fn invocation(&self, op: &str) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.prepare_invoke();
        inv.key(self.keys.webhooks_due())
            .key(self.keys.webhooks_leased())
            .key(self.keys.webhooks_dead())
            .key(self.keys.webhooks_wake());
        inv.arg(op).arg(self.keys.run_base());
        inv
    }

    /// Claims up to `n` due deliveries for `lease`, at most `per_origin` in
    /// flight to one origin counting what `sending` says this worker has in
    /// flight to each. Also: when to look next (ms, Redis clock: the first
    /// due event, or the first lease to lapse) and the Redis clock now.
    pub async fn claim(
        &self,
        lease: Duration,
        n: usize,
        per_origin: usize,
        sending: &[(&str, usize)],
    ) -> redis::RedisResult<(Vec<Claimed>, Option<u64>, u64)> {
        let mut inv = self.invocation("claim");
        inv.arg(lease.as_millis() as u64)
            .arg(n.max(1))
            .arg(per_origin.max(1))
            .arg(DEAD_KEPT.as_millis() as u64)
            .arg(SCHEDULE.len());
        for (origin, count) in sending {
            inv.arg(*origin).arg(*count);
        }
        let (rows, next, now): (Vec<Vec<String>>, String, String) = inv.invoke_async(&mut self.conn.clone()).await?;
        let claimed = rows
            .into_iter()
            .filter_map(|r| match r.as_slice() {
                [event, run, kind, at, url, tenant, attempt, body, claim, origin] => Some(Claimed {
                    event: event.clone(),
                    run: run.clone(),
                    kind: kind.clone(),
                    at_ms: at.parse().unwrap_or(0),
                    url: url.clone(),
                    tenant: tenant.clone(),
                    attempt: attempt.parse().unwrap_or(1),
                    body: (!body.is_empty()).then(|| body.clone()),
                    claim: claim.parse().unwrap_or(0),
                    origin: origin.clone(),
                }),
                _ => None,
            })
            .collect();
        Ok((claimed, next.parse::<f64>().ok().map(|ms| ms as u64), now.parse().unwrap_or(0)))
    }

    /// Ends attempt `c` as `attempt` went, with the `body` it sent; a failed
    /// one is due again after `retry_in` (`None`: dead). Returns the
    /// event's state now (`delivered`, `stopped`, `retrying`, `failed`), or
    /// `stale` when the claim had lapsed and another worker holds it.
    pub async fn finish(
        &self,
        c: &Claimed,
        attempt: &Attempt,
        retry_in: Option<Duration>,
        body: &str,
        retention: Duration,
    ) -> redis::RedisResult<String> {
        let (outcome, status, error) = match attempt {
            Attempt::Delivered(s) => ("delivered", Some(*s), String::new()),
            Attempt::Gone => ("stopped", Some(410), String::new()),
            Attempt::Failed(s, why) => ("retry", *s, why.chars().take(300).collect()),
        };
        let kept = if retry_in.is_none() && matches!(attempt, Attempt::Failed(..)) { DEAD_KEPT } else { retention };
        let mut inv = self.invocation("finish");
        inv.arg(&c.event)
            .arg(c.claim)
            .arg(outcome)
            .arg(status.map(|s| s.to_string()).unwrap_or_default())
            .arg(error)
            .arg(retry_in.map(|d| d.as_millis().to_string()).unwrap_or_default())
            .arg(if c.body.is_some() { "" } else { body })
            .arg(kept.as_millis().max(1) as u64);
        let reply: Vec<String> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(reply.into_iter().next().unwrap_or_default())
    }

    /// Gives a wake-up token back (at most 64 kept): this process found
    /// deliveries due that it could not take; another may.
    pub async fn pass_on_wake(&self) -> redis::RedisResult<()> {
        let key = self.keys.webhooks_wake();
        redis::pipe()
            .atomic()
            .cmd("RPUSH")
            .arg(&key)
            .arg(1)
            .ignore()
            .cmd("LTRIM")
            .arg(&key)
            .arg(-64)
            .arg(-1)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The newest `n` dead-lettered deliveries.
    pub async fn dead(&self, n: usize) -> redis::RedisResult<Vec<DeadDelivery>> {
        let mut inv = self.invocation("dead");
        inv.arg(n.max(1));
        let rows: Vec<Vec<String>> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| match r.as_slice() {
                [event, run, kind, url, attempts, status, error, at] => Some(DeadDelivery {
                    event_id: event.clone(),
                    run_id: run.clone(),
                    kind: kind.clone(),
                    url: url.clone(),
                    attempts: attempts.parse().unwrap_or(0),
                    last_status: status.parse().ok(),
                    last_error: error.clone(),
                    dead_at: rfc3339_ms(at.parse::<f64>().map_or(0, |ms| ms as i64)),
                }),
                _ => None,
            })
            .collect())
    }

    /// Makes dead-lettered `event` due again now, its attempts counted from
    /// 0. `None` when it is not dead (unknown, pending, delivered); else the run it tells of.
    pub async fn redrive(&self, event: &str) -> redis::RedisResult<Option<String>> {
        if !valid_event_id(event) {
            return Ok(None);
        }
        let mut inv = self.invocation("redrive");
        inv.arg(event).arg(EVENT_KEPT.as_millis() as u64);
        let reply: Vec<String> = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(match reply.as_slice() {
            [state, run] if state == "pending" => Some(run.clone()),
            _ => None,
        })
    }
}

/// Whether `s` may be an event id (`evt_` + a run's ULID + `_` + a count):
/// anything else is refused before it reaches Redis.
pub fn valid_event_id(s: &str) -> bool {
    s.len() <= 64 && s.starts_with("evt_") && s[4..].chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_retries_for_more_than_a_day_with_jitter_and_then_stops() {
        let total: Duration = SCHEDULE.iter().sum();
        assert!(total > Duration::from_secs(24 * 3600), "{total:?}");
        assert_eq!(next_delay(1, 1.0, 0.5), Some(Duration::from_secs(5)));
        assert_eq!(next_delay(1, 1.0, 0.0), Some(Duration::from_secs(4)));
        assert_eq!(next_delay(1, 1.0, 1.0), Some(Duration::from_secs(6)));
        assert_eq!(next_delay(2, 0.01, 0.5), Some(Duration::from_secs(3)));
        assert_eq!(next_delay(SCHEDULE.len() as u32, 1.0, 0.5), None);
    }

    #[test]
    fn the_enqueue_keeps_an_event_as_long_as_the_queue_does() {
        let ms = EVENT_KEPT.as_millis();
        assert_eq!(ms, 9 * 24 * 3600 * 1000);
        assert!(include_str!("hooks.lua").contains("local WH_KEEP_MS = 9 * 24 * 3600 * 1000 --"));
        assert!(EVENT_KEPT > DEAD_KEPT + SCHEDULE.iter().sum::<Duration>());
    }

    #[test]
    fn event_ids_are_checked_before_they_reach_redis() {
        assert!(valid_event_id("evt_01JABCDEF0123456789ABCDEFG_1"));
        for bad in ["", "run_01", "evt_a:b", "evt_*", &format!("evt_{}", "a".repeat(80))] {
            assert!(!valid_event_id(bad), "{bad}");
        }
    }
}
