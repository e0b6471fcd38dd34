//! Sending completion webhooks (README, "Webhooks"): each worker process
//! claims due deliveries from the queue in Redis (`shared::runs::webhooks`),
//! signs them by the Standard Webhooks scheme with `PACELINE_WEBHOOK_SECRET`,
//! POSTs them and finishes each.
//!
//! Deliveries have their own slots, apart from the turns': at most
//! [`SLOTS`] at once in a process, and [`PER_ORIGIN`] to one receiver, so a
//! slow receiver holds a few of them and never a turn. A receiver's answer
//! body is never read (its status is all a delivery needs). Claims are made
//! when a slot is free and a delivery is due: when a wake-up token comes (the
//! script that makes an event due pushes one; each process's sender waits on
//! them with `BLPOP` on a connection of its own, so one sender wakes per
//! token, whoever ended the run — a worker, the API's cancel, the queue), at
//! the due time of a retry its last claim saw, and at least every
//! [`IDLE_LOOK`] (a token lost with a sender that died holding it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use shared::config::Secret;
use shared::runs::webhooks::{self, Attempt, Claimed, WebhookQueue};
use shared::runs::{RunStore, ToolEndpoints};
use shared::telemetry::metric;
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// The variable holding the signing secret (`whsec_` + base64).
pub const WEBHOOK_SECRET_ENV: &str = "PACELINE_WEBHOOK_SECRET";

/// Deliveries one process sends at once.
pub const SLOTS: usize = 16;

/// Deliveries one process sends at once to one receiver (scheme and authority).
pub const PER_ORIGIN: usize = 4;

/// The longest a process goes without looking for due deliveries.
pub const IDLE_LOOK: Duration = Duration::from_secs(30);

/// How long one `BLPOP` for a wake-up token waits before it is made again.
const WAKE_WAIT: Duration = Duration::from_secs(60);

/// How a worker sends webhooks. Declared once, flattened into `paceline
/// worker` and `paceline up`.
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    /// How long one delivery attempt may take, s (connect, send, the answer's
    /// status); longer counts as a failed attempt, retried.
    #[arg(long = "webhook-timeout-s", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub timeout_s: u64,
    /// Tests only: the retry schedule scaled by this (1: Standard Webhooks').
    #[arg(long = "webhook-retry-scale", hide = true, default_value_t = 1.0)]
    pub retry_scale: f64,
}

impl Default for WebhookArgs {
    fn default() -> Self {
        Self { timeout_s: 15, retry_scale: 1.0 }
    }
}

/// The signer from `PACELINE_WEBHOOK_SECRET`: `None` when unset; an error,
/// saying why, when it is not `whsec_` + base64 of 24 to 64 bytes (the
/// Standard Webhooks form): a process refuses to start on it rather than
/// sign with a key no receiver holds.
pub fn signer(secret: Option<&Secret>) -> Result<Option<standardwebhooks::Webhook>, String> {
    let Some(secret) = secret else { return Ok(None) };
    let text = secret.expose().trim();
    let Some(encoded) = text.strip_prefix("whsec_") else {
        return Err(format!("{WEBHOOK_SECRET_ENV} must start with whsec_ (whsec_ + base64 of 24 to 64 random bytes)"));
    };
    let key = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| format!("{WEBHOOK_SECRET_ENV}: what follows whsec_ is not base64"))?;
    if !(24..=64).contains(&key.len()) {
        return Err(format!("{WEBHOOK_SECRET_ENV} holds {} bytes; it must hold 24 to 64", key.len()));
    }
    standardwebhooks::Webhook::new(text).map(Some).map_err(|e| format!("{WEBHOOK_SECRET_ENV}: {e}"))
}

/// One process's sender of webhooks.
pub struct Deliverer {
    queue: WebhookQueue,
    store: RunStore,
    http: reqwest::Client,
    signer: standardwebhooks::Webhook,
    allowed: ToolEndpoints,
    timeout: Duration,
    retry_scale: f64,
    retention: Duration,
    /// Where Redis is, and the key of the wake-up tokens (read on a connection of its own).
    redis: shared::config::RedisArgs,
    wake_key: String,
    /// Notified when a wake-up token came.
    wake: Arc<Notify>,
}

impl Deliverer {
    /// A sender over `store`'s Redis, signing with `signer`, sending only to
    /// what `allowed` allows the run's tenant.
    pub fn new(
        store: RunStore,
        redis: &shared::config::RedisArgs,
        signer: standardwebhooks::Webhook,
        allowed: ToolEndpoints,
        args: &WebhookArgs,
        retention: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(crate::tools::resolve::PublicOnly::WEBHOOKS))
            .user_agent("paceline-webhooks")
            .build()?;
        let keys = redis.keys();
        Ok(Self {
            redis: redis.clone(),
            wake_key: keys.webhooks_wake(),
            queue: WebhookQueue::new(store.connection(), keys),
            store,
            http,
            signer,
            allowed,
            timeout: Duration::from_secs(1).max(Duration::from_secs(args.timeout_s)),
            retry_scale: args.retry_scale.max(0.0),
            retention,
            wake: Arc::new(Notify::new()),
        })
    }

    /// How long a claim holds a delivery: its attempt's time and a margin.
    fn lease(&self) -> Duration {
        self.timeout + Duration::from_secs(5)
    }

    /// Claims and sends deliveries until `stop` turns true, then finishes the
    /// ones in flight (each within its timeout) and returns. A delivery cut
    /// off all the same (the caller's bound, a killed process) is claimed
    /// again once its lease lapses, with the same `webhook-id`.
    pub async fn run(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        // The listener takes tokens only while this process has a free slot: a full one
        // leaves them to the others.
        let (open, opened) = tokio::sync::watch::channel(true);
        let listener = tokio::spawn(listen(self.redis.clone(), self.wake_key.clone(), self.wake.clone(), opened));
        // (Aborted with this task: the listener goes too.)
        let listener = AbortOnDrop(listener);
        let mut sending: JoinSet<()> = JoinSet::new();
        // Each task's origin, by its id: a task that panicked still gives its slot back.
        let mut origins: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut per_origin: HashMap<String, usize> = HashMap::new();
        while !*stop.borrow() {
            let free = SLOTS.saturating_sub(sending.len());
            let mut wait = IDLE_LOOK;
            // After a claim that found deliveries due and could take none (their
            // receivers at this process's bound), wake-ups wait out the pause.
            let mut deaf = false;
            if free > 0 {
                let counts: Vec<(&str, usize)> = per_origin.iter().map(|(o, n)| (o.as_str(), *n)).collect();
                match self.queue.claim(self.lease(), free, PER_ORIGIN, &counts).await {
                    Ok((claimed, next_due, now)) => {
                        let took = claimed.len();
                        for c in claimed {
                            let origin = c.origin.clone();
                            *per_origin.entry(origin.clone()).or_default() += 1;
                            let this = self.clone();
                            let task = sending.spawn(async move { this.deliver(c).await });
                            origins.insert(task.id(), origin);
                        }
                        // Due later: look then (a retry, or the first lease to lapse). Due
                        // now and taken: look again at once for more. Due now and none
                        // taken: another process may take them — the token goes back —
                        // and this one looks again in a second or when a send ends.
                        if let Some(due) = next_due {
                            let in_ms = due.saturating_sub(now);
                            if in_ms > 0 {
                                wait = wait.min(Duration::from_millis(in_ms));
                            } else if took > 0 {
                                wait = Duration::ZERO;
                            } else {
                                wait = Duration::from_secs(1);
                                deaf = true;
                                if let Err(error) = self.queue.pass_on_wake().await {
                                    tracing::debug!(message = "could not pass a webhook wake-up on", %error);
                                }
                            }
                        }
                    }
                    Err(error) => {
                        tracing::warn!(message = "could not claim webhook deliveries; trying again", %error);
                        wait = Duration::from_secs(1);
                    }
                }
            }
            open.send_replace(sending.len() < SLOTS);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.wake.notified(), if !deaf => {}
                changed = stop.changed() => {
                    // A sender gone is a stop too.
                    if changed.is_err() {
                        break;
                    }
                }
                Some(done) = sending.join_next_with_id(), if !sending.is_empty() => {
                    let id = match done {
                        Ok((id, ())) => id,
                        Err(error) => {
                            tracing::warn!(message = "a webhook delivery task ended abnormally; its lease lapses and it is sent again", %error);
                            error.id()
                        }
                    };
                    if let Some(origin) = origins.remove(&id) {
                        if let Some(n) = per_origin.get_mut(&origin) {
                            *n = n.saturating_sub(1);
                            if *n == 0 {
                                per_origin.remove(&origin);
                            }
                        }
                    }
                }
            }
        }
        // Stopping: no more tokens taken (the others' to have), no more claims; what is
        // in flight finishes.
        drop(listener);
        while sending.join_next().await.is_some() {}
    }

    /// Sends one attempt of `c` and finishes it.
    async fn deliver(&self, c: Claimed) {
        let body = match &c.body {
            Some(body) => Ok(body.clone()),
            None => self.body_of(&c).await,
        };
        let (attempt, body) = match body {
            Ok(body) if !self.allowed.allows(&c.tenant, &c.url) => (
                Attempt::Failed(
                    None,
                    "not sent: this worker's PACELINE_WEBHOOK_ENDPOINTS does not allow the URL to the run's tenant"
                        .to_owned(),
                ),
                body,
            ),
            Ok(body) => (self.send(&c, &body).await, body),
            Err(why) => (Attempt::Failed(None, why), String::new()),
        };
        let retry_in = match &attempt {
            Attempt::Failed(..) => webhooks::next_delay(c.attempt, self.retry_scale, rand::random::<f64>()),
            _ => None,
        };
        match self.queue.finish(&c, &attempt, retry_in, &body, self.retention).await {
            Ok(state) => {
                metrics::counter!(metric::WEBHOOK_DELIVERIES, "outcome" => state_label(&state)).increment(1);
                let status = match &attempt {
                    Attempt::Delivered(s) => Some(*s),
                    Attempt::Gone => Some(410),
                    Attempt::Failed(s, _) => *s,
                };
                let why = if let Attempt::Failed(_, why) = &attempt { why.as_str() } else { "" };
                tracing::info!(message = "webhook attempt", run.id = %c.run, webhook.id = %c.event, attempt = c.attempt,
                    state = %state, status = ?status, error = why, retry_in_ms = ?retry_in.map(|d| d.as_millis()));
            }
            Err(error) => {
                tracing::warn!(message = "could not record a webhook attempt; its lease lapses and it is sent again",
                    run.id = %c.run, webhook.id = %c.event, %error)
            }
        }
    }

    /// The event's body, from the run as it ended: `Err` (retried) when
    /// Redis cannot be read. A run already past its retention is told by
    /// its id alone.
    async fn body_of(&self, c: &Claimed) -> Result<String, String> {
        match self.store.get(&c.tenant, &c.run).await {
            Ok(Some(run)) => Ok(webhooks::event_body(&c.kind, c.at_ms, &run)),
            Ok(None) => Ok(serde_json::json!({
                "type": c.kind,
                "timestamp": shared::runs::record::rfc3339_ms(c.at_ms),
                "data": {"id": c.run},
            })
            .to_string()),
            Err(error) => Err(format!("not sent: could not read the run ({error})")),
        }
    }

    /// One POST of `body`, signed now.
    async fn send(&self, c: &Claimed, body: &str) -> Attempt {
        let timestamp = time_now_s();
        let signature = match self.signer.sign(&c.event, timestamp, body.as_bytes()) {
            Ok(s) => s,
            Err(error) => return Attempt::Failed(None, format!("not sent: could not sign ({error})")),
        };
        let sent = self
            .http
            .post(&c.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(standardwebhooks::HEADER_WEBHOOK_ID, &c.event)
            .header(standardwebhooks::HEADER_WEBHOOK_TIMESTAMP, timestamp.to_string())
            .header(standardwebhooks::HEADER_WEBHOOK_SIGNATURE, signature)
            .body(body.to_owned())
            .timeout(self.timeout)
            .send()
            .await;
        match sent {
            // The answer's body is not read: a receiver cannot make us hold a large one.
            Ok(answer) => match answer.status().as_u16() {
                s @ 200..=299 => Attempt::Delivered(s),
                410 => Attempt::Gone,
                s => Attempt::Failed(Some(s), format!("HTTP {s}")),
            },
            Err(error) => Attempt::Failed(None, describe(&error)),
        }
    }
}

/// Waits for wake-up tokens, while `open` says this process can take a
/// delivery, and notifies `wake` for each, until `open`'s sender goes; a
/// failed read is tried again, backing off to 5 s.
async fn listen(
    redis: shared::config::RedisArgs,
    key: String,
    wake: Arc<Notify>,
    mut open: tokio::sync::watch::Receiver<bool>,
) {
    // Its own connection (a BLPOP holds it), which reconnects by itself.
    let mut conn = match shared::redis_util::connect(&redis, WAKE_WAIT + Duration::from_secs(5)) {
        Ok(conn) => conn,
        Err(error) => {
            tracing::warn!(message = "no webhook wake-up connection; deliveries are looked for every 30 s", %error);
            return;
        }
    };
    let mut failures = 0u32;
    while open.wait_for(|can| *can).await.is_ok() {
        let popped: redis::RedisResult<Option<(String, String)>> =
            redis::cmd("BLPOP").arg(&key).arg(WAKE_WAIT.as_secs_f64()).query_async(&mut conn).await;
        match popped {
            Ok(got) => {
                failures = 0;
                if got.is_some() {
                    wake.notify_one();
                }
            }
            Err(error) => {
                failures += 1;
                if failures >= 3 {
                    tracing::warn!(message = "webhook wake-ups keep failing; deliveries are looked for every 30 s meanwhile", %error);
                }
                tokio::time::sleep(Duration::from_millis((100u64 << failures.min(6)).min(5_000))).await;
            }
        }
    }
}

/// A task aborted when this goes.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn state_label(state: &str) -> &'static str {
    match state {
        "delivered" => "delivered",
        "stopped" => "stopped",
        "retrying" => "retrying",
        "failed" => "failed",
        _ => "stale",
    }
}

/// A failed send in a few words, its causes included (reqwest's own text
/// says only "error sending request").
fn describe(error: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut text = if error.is_timeout() { "timed out".to_owned() } else { error.to_string() };
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn time_now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_must_be_whsec_and_base64_of_24_to_64_bytes() {
        let b64 = |n: usize| base64::engine::general_purpose::STANDARD.encode(vec![7u8; n]);
        assert!(signer(None).unwrap().is_none());
        assert!(signer(Some(&Secret::new(format!("whsec_{}", b64(32))))).unwrap().is_some());
        for (bad, says) in [
            (b64(32), "must start with whsec_"),
            ("whsec_!!not base64!!".to_owned(), "not base64"),
            (format!("whsec_{}", b64(8)), "holds 8 bytes"),
            (format!("whsec_{}", b64(100)), "holds 100 bytes"),
        ] {
            let why = signer(Some(&Secret::new(bad.clone()))).err().unwrap_or_default();
            assert!(why.contains(says) && why.contains(WEBHOOK_SECRET_ENV), "{bad}: {why}");
        }
    }

    #[test]
    fn a_signature_verifies_with_the_secret_and_not_with_another() {
        let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([1u8; 32]));
        let other = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([2u8; 32]));
        let ours = signer(Some(&Secret::new(secret))).unwrap().unwrap();
        let ts = time_now_s();
        let body = br#"{"type":"run.completed"}"#;
        let sig = ours.sign("evt_1_1", ts, body).unwrap();
        let mut headers = http_headers(&[("webhook-id", "evt_1_1"), ("webhook-timestamp", &ts.to_string())]);
        headers.insert("webhook-signature", sig.parse().unwrap());
        assert!(ours.verify(body, &headers).is_ok());
        assert!(standardwebhooks::Webhook::new(&other).unwrap().verify(body, &headers).is_err());
        assert!(ours.verify(br#"{"type":"run.failed"}"#, &headers).is_err(), "another body");
    }

    fn http_headers(pairs: &[(&'static str, &str)]) -> reqwest::header::HeaderMap {
        pairs.iter().map(|(k, v)| (reqwest::header::HeaderName::from_static(k), v.parse().unwrap())).collect()
    }
}
