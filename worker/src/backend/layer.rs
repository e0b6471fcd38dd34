//! The backend's layer around each handler: it caps the slots, stops at the
//! shutdown grace, and settles the delivery when the handler returns (complete
//! on `Ok`, retry on `Err` or panic, dead on an abort, hand back at the grace).

use super::*;

/// What the layer does with a delivery whose handler returned.
pub(super) enum Settlement {
    Complete,
    Retry { delay_ms: u64, reason: String },
    Dead { reason: String },
    Release,
}

/// Settles `lease`, retrying Redis errors with backoff for about two leases
/// (after that the lease has expired and the turn comes back on its own).
pub(super) async fn settle_patiently(queue: &TurnQueue, lease: &Lease, outcome: Settlement) {
    let deadline = Instant::now() + Duration::from_millis(queue.config().lease_ms * 2);
    let mut failures = 0;
    loop {
        let result = match &outcome {
            Settlement::Complete => queue.complete(lease).await.map(|()| Settled::Done),
            Settlement::Retry { delay_ms, reason } => queue.retry(lease, *delay_ms, reason).await,
            Settlement::Dead { reason } => queue.dead(lease, reason).await.map(|()| Settled::Dead),
            Settlement::Release => queue.release(lease).await.map(|()| Settled::Done),
        };
        match result {
            Ok(Settled::Dead) => {
                warn!(message = "turn went dead", queue.id = %lease.id, deliveries = lease.deliveries);
                return;
            }
            Ok(Settled::Done) => return,
            Err(QueueError::Fenced { why, .. }) => {
                warn!(message = "settle fenced: the turn is no longer ours", queue.id = %lease.id, epoch = lease.epoch, why = %why);
                return;
            }
            Err(error) => {
                failures += 1;
                if Instant::now() > deadline {
                    warn!(message = "giving up settling; the lease will expire and bring the turn back", %error, queue.id = %lease.id);
                    return;
                }
                warn!(message = "settle failed; retrying", %error, queue.id = %lease.id, attempt = failures);
                tokio::time::sleep(backoff(failures)).await;
            }
        }
    }
}

/// The backend's layer (apalis puts it around the user's middleware and handler).
#[derive(Clone)]
pub struct LeaseLayer {
    pub(super) queue: TurnQueue,
    pub(super) shared: Arc<BackendState>,
}

impl std::fmt::Debug for LeaseLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseLayer")
    }
}

impl<S> tower::Layer<S> for LeaseLayer {
    type Service = LeaseService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaseService { inner, queue: self.queue.clone(), shared: self.shared.clone() }
    }
}

/// Caps running handlers at the worker's concurrency and settles each delivery
/// by how its handler returned (see [`QueueBackend`]).
#[derive(Clone)]
pub struct LeaseService<S> {
    inner: S,
    queue: TurnQueue,
    shared: Arc<BackendState>,
}

impl<S> std::fmt::Debug for LeaseService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseService")
    }
}

/// Aborts its task when dropped (a handle alone would let it run on).
struct AbortOnDrop<R>(tokio::task::JoinHandle<R>);

impl<R> Drop for AbortOnDrop<R> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Frees a slot when a handler's future ends, however it ends.
struct SlotGuard(Arc<BackendState>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        self.0.slot_waker.wake();
        self.0.slot_freed.notify_one();
    }
}

impl<S, T> tower::Service<Task<T>> for LeaseService<S>
where
    S: tower::Service<Task<T>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError> + Send + 'static,
    S::Response: Send + 'static,
    T: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<S::Response, BoxDynError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.shared.running.load(Ordering::SeqCst) >= self.shared.concurrency {
            self.shared.slot_waker.register(cx.waker());
            // Re-check after registering, so a slot freed in between is not missed.
            if self.shared.running.load(Ordering::SeqCst) >= self.shared.concurrency {
                return Poll::Pending;
            }
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<T>) -> Self::Future {
        let lease = task.ctx().data().get::<Lease>().cloned();
        self.shared.running.fetch_add(1, Ordering::SeqCst);
        // Started: its slot moves from handed to running (saturating: a task
        // built elsewhere was never handed).
        let _ = self.shared.handed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| h.checked_sub(1));
        let guard = SlotGuard(self.shared.clone());
        let fut = self.inner.call(task);
        let queue = self.queue.clone();
        let shared = self.shared.clone();
        async move {
            let _guard = guard;
            let Some(lease) = lease else {
                return fut.await.map_err(Into::into);
            };
            let mut grace = shared.grace.subscribe();
            let grace_over = async move {
                if grace.wait_for(|over| *over).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            // The handler runs in a task of its own, so the slots' handlers
            // spread over the runtime's threads (apalis polls every handler in
            // the worker's one task); dropped here (the grace over), it is aborted.
            let mut handler = AbortOnDrop(tokio::spawn(AssertUnwindSafe(fut).catch_unwind()));
            let returned = tokio::select! {
                r = &mut handler.0 => Some(r.unwrap_or_else(|gone| Err(Box::new(gone.to_string())))),
                () = grace_over => None,
            };
            let (outcome, result) = match returned {
                None => (Some(Settlement::Release), Err(BoxDynError::from("handed back: shutdown grace over"))),
                Some(Ok(Ok(response))) => (Some(Settlement::Complete), Ok(response)),
                Some(Ok(Err(error))) => {
                    let error: BoxDynError = error.into();
                    let reason = error.to_string();
                    let outcome = if error.downcast_ref::<AbortError>().is_some() {
                        Settlement::Dead { reason }
                    } else if let Some(after) = error.downcast_ref::<RetryAfterError>() {
                        Settlement::Retry { delay_ms: after.get_duration().as_millis() as u64, reason }
                    } else {
                        Settlement::Retry { delay_ms: queue.config().retry_delay_ms(lease.deliveries), reason }
                    };
                    (Some(outcome), Err(error))
                }
                Some(Err(panic)) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".into());
                    let reason = format!("handler panicked: {what}");
                    let delay_ms = queue.config().retry_delay_ms(lease.deliveries);
                    (Some(Settlement::Retry { delay_ms, reason: reason.clone() }), Err(BoxDynError::from(reason)))
                }
            };
            if let Err(error) = &result {
                warn!(message = "turn handler failed", %error, queue.id = %lease.id, epoch = lease.epoch, deliveries = lease.deliveries);
            }
            if let Some(outcome) = outcome {
                if !lease.is_settled() {
                    settle_patiently(&queue, &lease, outcome).await;
                }
            }
            shared.forget(&lease);
            result
        }
        .boxed()
    }
}
