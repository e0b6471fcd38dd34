//! The worker's heartbeat: renews its leases and registration, reclaims the
//! expired leases of dead workers, finds leases taken back, and ends the
//! shutdown grace.

use super::*;
use shared::queue::Register;

/// Renews each of this worker's leases a third of the lease after it was
/// leased or last renewed, and its registration every [`REGISTER_EVERY`]
/// beats, or while idle at least every `beat_ms` (a registration lives two
/// leases, or two `beat_ms`: it is renewed well within that), reclaims expired
/// leases of dead workers, and ends the shutdown grace.
///
/// Between those beats it looks for leases to reclaim with one command (the
/// first lease's expiry, [`TurnQueue::first_lease_expiry`]) against the
/// server's clock as its last beat read it, and runs the reclaiming beat only
/// when one has expired. It looks again [`RECLAIM_SLACK`] third of the lease
/// after that expiry, or after a lease taken now would expire, whichever is
/// sooner — no lease can expire before then — so each worker on its own finds
/// a dead worker's lease within a third of the lease of its expiry: a
/// killed worker's turns back within 4/3 of the lease (4 s), whatever the
/// fleet's size. (A turn that ends within a third of the lease, most of
/// them, is never renewed: a beat at every third of the lease whatever the
/// leases' age was most of a busy fleet's beats.) A worker whose next
/// renewal comes within that third skips the look: the renewal reclaims too,
/// as soon (a worker holding long calls looked once a beat for nothing).
pub(super) async fn heartbeat_loop(queue: TurnQueue, shared: Arc<BackendState>, worker: WorkerContext) {
    let every = queue.config().heartbeat_every();
    let lease_ms = queue.config().lease_ms as i64;
    // The loop's tick is taken off, so a look comes within the slack.
    let slack = every.mul_f64(RECLAIM_SLACK).saturating_sub(TICK);
    let grace = Duration::from_millis(queue.config().grace_ms);
    let mut started_at_ms = None;
    let mut last_beat: Option<Instant> = None;
    let mut beats: u64 = 0;
    let mut registered_at: Option<Instant> = None;
    let mut shutdown_seen: Option<Instant> = None;
    // Leases the last beat found no longer this worker's. A lease its handler
    // settled while the beat was under way reads so too; one still held a beat
    // later was lost for real (it expired and was taken back).
    let mut suspects: Vec<(String, u64)> = vec![];
    // The server's clock as the last beat read it, and when its reply came.
    let mut clock: Option<(Instant, i64)> = None;
    // When to look for an expired lease next (None: at the next tick).
    let mut look_at: Option<Instant> = None;
    // The info the last registration wrote, and how many registrations.
    let mut sent: Option<WorkerInfo> = None;
    let mut registrations: u64 = 0;
    // After Redis did not answer a beat or a look (a restart, a failover), no
    // lease is reclaimed until a lease has passed since it answers again:
    // every lease in the fleet expired while nobody could renew it, and its
    // holders — cut off too, alive — renew it in that time. A dead worker's
    // are taken a lease later. An answer slower than a beat counts as Redis
    // failing too: a cluster client retries a command through a failover and
    // answers late, not in error.
    let mut cut_off = false;
    let mut hold_reclaims_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let renew = shared.oldest_renewal().is_some_and(|at| now >= at + every);
        // An idle worker registers every `beat_ms` (less a tick, so it is not
        // late); a reader counts it alive for two of those, 32 s at the
        // default lease.
        let beat_span = every.mul_f64(IDLE_BEAT_SCALE);
        let register_due = registered_at.is_none_or(|at| now + TICK >= at + beat_span);
        let suspects_due = !suspects.is_empty() && last_beat.is_none_or(|at| now >= at + every);
        let mut beat = renew || register_due || suspects_due;
        // Whether the beat looks for expired leases: a beat that only
        // registers leaves that to the looks, whose schedule it keeps.
        let mut reclaim = renew || suspects_due || clock.is_none();
        // A worker whose next renewal — a reclaiming beat — comes within the slack
        // leaves the look to it: that beat finds what a look would, as soon.
        let beat_soon = shared.oldest_renewal().is_some_and(|at| at + every <= now + slack);
        if !beat && !beat_soon && look_at.is_none_or(|at| now >= at) {
            let looked = queue.first_lease_expiry().await;
            cut_off |= looked.as_ref().is_err_and(redis_down) || now.elapsed() > every;
            match (clock, looked) {
                (Some((at, server_ms)), Ok(first)) => {
                    let server_now = server_ms + now.saturating_duration_since(at).as_millis() as i64;
                    let clear_until = first.map_or(server_now + lease_ms, |e| e.min(server_now + lease_ms));
                    beat = clear_until <= server_now;
                    reclaim = beat;
                    let ahead = Duration::from_millis(clear_until.saturating_sub(server_now).max(0) as u64);
                    look_at = Some(now + ahead + slack);
                }
                _ => {
                    (beat, reclaim) = (true, true);
                    // (Not again at the next tick while Redis is away.)
                    look_at = Some(now + slack);
                }
            }
        }
        if cut_off || hold_reclaims_until.is_some_and(|until| now < until) {
            reclaim = false;
        }
        if beat {
            last_beat = Some(now);
            if reclaim {
                look_at = Some(now + slack);
            }
            if started_at_ms.is_none() {
                started_at_ms = queue.server_time_ms().await.ok();
            }
            let leases = shared.leases();
            let info = WorkerInfo {
                identity: shared.identity.clone(),
                host: shared::queue::host_name(),
                pid: std::process::id(),
                concurrency: shared.concurrency,
                in_flight: leases.len(),
                started_at_ms: started_at_ms.unwrap_or_default(),
                lease_ms: queue.config().lease_ms,
                beat_ms: beat_span.as_millis() as u64,
                last_heartbeat_ms: 0,
            };
            // The first beat registers, a busy one every REGISTER_EVERY-th after
            // it, and an idle one when due (above).
            let register = register_due || !leases.is_empty() && beats.is_multiple_of(REGISTER_EVERY);
            // A registration writes the info only when it changed (or the
            // script says it is gone), and takes the census (forgets silent
            // workers, counts the fleet) on every CENSUS_EVERY-th.
            let registration = if !register {
                Register::No
            } else {
                registered_at = Some(now);
                registrations += 1;
                let census = registrations % CENSUS_EVERY == 1;
                if sent.as_ref() == Some(&info) {
                    Register::Unchanged { census }
                } else {
                    Register::With { info: &info, census }
                }
            };
            let writes_info = matches!(registration, Register::With { .. });
            beats += 1;
            // A reclaiming beat must run within two beats of being sent (the server's
            // clock then, from the last beat's reading), or it reclaims nothing: one the
            // client retried through a failover lands when every lease has expired and
            // their holders, alive, are about to renew them.
            let sent_at = Instant::now();
            let not_after = match clock {
                Some((at, server_ms)) => {
                    server_ms + sent_at.saturating_duration_since(at).as_millis() as i64 + 2 * every.as_millis() as i64
                }
                None => i64::MAX,
            };
            let beaten = queue.beat(&shared.identity, registration, &leases, reclaim.then_some(not_after)).await;
            cut_off |= sent_at.elapsed() > every;
            match beaten {
                Ok(report) => {
                    if std::mem::take(&mut cut_off) {
                        hold_reclaims_until = Some(Instant::now() + Duration::from_millis(lease_ms as u64));
                        info!(
                            message = "Redis answers again; reclaiming no lease for one lease, so holders renew theirs",
                            lease_ms
                        );
                    }
                    if report.resend {
                        sent = None;
                    } else if writes_info {
                        sent = Some(info);
                    }
                    clock = (report.now_ms > 0).then(|| (Instant::now(), report.now_ms));
                    shared.renewed(&leases, now);
                    if let Some(fleet) = report.fleet {
                        shared.fleet.store(fleet.max(1), Ordering::Relaxed);
                    }
                    if report.reclaimed > 0 || report.buried > 0 {
                        info!(
                            message = "expired leases reclaimed",
                            reclaimed = report.reclaimed,
                            buried = report.buried
                        );
                    }
                    for (id, epoch) in suspects.drain(..) {
                        // Still held a beat later: lost for real; its handler stops
                        // (no more calls or tool calls on a stale lease).
                        if shared.lost(&id, epoch) {
                            warn!(message = shared::queue::LEASE_LOST_MESSAGE, queue.id = %id);
                        }
                    }
                    suspects = leases.into_iter().filter(|(id, _)| report.lost.contains(id)).collect();
                }
                Err(error) => {
                    cut_off |= redis_down(&error);
                    warn!(message = "heartbeat failed; retrying", %error);
                }
            }
        }
        if shutdown_seen.is_none() && worker.is_shutting_down() {
            info!(
                message = "draining: no more fetches; in-flight turns get the grace period",
                grace_ms = grace.as_millis() as u64
            );
            shutdown_seen = Some(now);
        }
        if let Some(seen) = shutdown_seen {
            if now >= seen + grace && !*shared.grace.borrow() {
                warn!(message = "shutdown grace over: handing back turns still running");
                shared.grace.send_replace(true);
            }
        }
        // Short ticks to notice shutdown (and a first lease) promptly; Redis is
        // touched once per beat or look.
        tokio::time::sleep(TICK).await;
    }
}

/// Whether `error` says Redis was away (not a bad reply, not a fenced lease).
fn redis_down(error: &QueueError) -> bool {
    matches!(error, QueueError::Redis(e) if shared::redis_util::unavailable(e))
}

/// A busy worker registers (its info, the fleet's count, forgetting
/// registrations silent for long) on every this many beats; the beats between
/// renew its leases and reclaim expired ones only: four commands a beat, not
/// eight. At the default 3-s lease it registers every 3 s (an idle worker at
/// each of its sparser beats); the reader calls it alive for two leases, or
/// two idle beats.
const REGISTER_EVERY: u64 = 3;

/// A registration forgets workers silent for an hour and counts the fleet on
/// every this many (the first included).
const CENSUS_EVERY: u64 = 4;

/// How many times longer than [`QueueConfig::heartbeat_every`] an idle worker
/// goes between registrations (16 s at the default lease: a registration is
/// the beat's costliest part, and only `GET /v1/workers`, the fleet's count
/// and the look for a turn left due, heartbeat.lua, ride on it).
const IDLE_BEAT_SCALE: f64 = 16.0;

/// A lease is found expired within this many [`QueueConfig::heartbeat_every`]
/// of its expiry (one: with a lease expiring at most a lease after its
/// worker's last renewal, a killed worker's turns are back within 4/3 of the
/// lease, 4 s at the default, inside the 5 s SPEC §2 promises).
const RECLAIM_SLACK: f64 = 1.0;

/// The loop's tick.
const TICK: Duration = Duration::from_millis(100);
