//! The worker's heartbeat: renews its leases and registration, reclaims the
//! expired leases of dead workers, finds leases taken back, and ends the
//! shutdown grace.

use super::*;

/// Renews each of this worker's leases a third of the lease after it was
/// leased or last renewed, and its registration every [`REGISTER_EVERY`]
/// beats, or while idle at least every `beat_ms` (a registration lives two
/// leases, or two `beat_ms`: it is renewed well within that), reclaims expired
/// leases of dead workers, and ends the shutdown grace.
/// Between renewals it beats as an idle worker does: less often, the more so
/// the larger the fleet (up to 8×), so the fleet's idle beats, and so its
/// reclaims of dead workers' leases, stay about as frequent as two workers'
/// would (each beats at least every two thirds of the lease while the fleet
/// is 4 or fewer: a killed worker's turns back within 5/3 of it, 5 s). (A turn that ends within a third of the lease, most of them, is
/// never renewed: a beat at every third of the lease whatever the leases' age
/// was most of a busy fleet's beats.)
pub(super) async fn heartbeat_loop(queue: TurnQueue, shared: Arc<BackendState>, worker: WorkerContext) {
    let every = queue.config().heartbeat_every();
    let idle_every = |fleet: usize| every.mul_f64((fleet as f64 / 2.0).clamp(1.0, IDLE_GAP_SCALE));
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
    loop {
        let now = Instant::now();
        let gap = idle_every(shared.fleet.load(Ordering::Relaxed));
        let oldest = shared.oldest_renewal();
        let renew = oldest.is_some_and(|at| now >= at + every);
        if renew || last_beat.is_none_or(|at| now >= at + gap) {
            last_beat = Some(now);
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
                beat_ms: every.mul_f64(IDLE_BEAT_SCALE).as_millis() as u64,
                last_heartbeat_ms: 0,
            };
            // The first beat registers, a busy one every REGISTER_EVERY-th after
            // it, and any beat whose next (half a gap early, as the 100-ms tick
            // makes gaps a little longer) would come later than `beat_ms` after
            // the last registration (a reader counts it alive for two of
            // those, 32 s at the default lease): every other idle beat of a
            // fleet of 16 or more, every eighth of 4 workers. (Compared without the half gap, the tick's slack made
            // nearly every idle beat register.)
            let beat_span = every.mul_f64(IDLE_BEAT_SCALE);
            let due = registered_at.is_none_or(|at| now + gap / 2 > at + beat_span);
            let register = due || !leases.is_empty() && beats.is_multiple_of(REGISTER_EVERY);
            if register {
                registered_at = Some(now);
            }
            beats += 1;
            match queue.heartbeat(&shared.identity, register.then_some(&info), &leases).await {
                Ok(report) => {
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
                Err(error) => warn!(message = "heartbeat failed; retrying", %error),
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
        // touched once per beat.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A busy worker registers (its info, the fleet's count, forgetting
/// registrations silent for long) on every this many beats; the beats between
/// renew its leases and reclaim expired ones only: four commands a beat, not
/// eight. At the default 3-s lease it registers every 3 s (an idle worker at
/// each of its sparser beats); the reader calls it alive for two leases, or
/// two idle beats.
const REGISTER_EVERY: u64 = 3;

/// How many times longer than [`QueueConfig::heartbeat_every`] an idle worker
/// goes between registrations (16 s at the default lease: a registration is
/// the beat's costliest part, and only `GET /v1/workers`, the fleet's count
/// and the look for a turn left due, heartbeat.lua, ride on it).
const IDLE_BEAT_SCALE: f64 = 16.0;

/// How many times longer than [`QueueConfig::heartbeat_every`] an idle worker
/// of a large fleet goes between beats.
const IDLE_GAP_SCALE: f64 = 8.0;
