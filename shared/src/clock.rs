//! Time as the policy sees it: milliseconds on one clock, injectable in tests.
//!
//! Shared state always uses the Redis server's clock (`TIME`), so workers on
//! different hosts agree; the pure policy functions take `now_ms` as an argument
//! and never read a clock themselves.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// Milliseconds since the Unix epoch (the policy's own type).
pub use pacer::Millis;

/// A source of "now" in milliseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> Millis;
}

/// The host's wall clock (used only where no shared clock is involved).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        d.as_millis() as Millis
    }
}

/// A clock that moves only when told to; for tests of time-dependent policy.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock stopped at `start_ms`.
    pub fn new(start_ms: Millis) -> Self {
        Self(Arc::new(AtomicI64::new(start_ms)))
    }

    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: Millis) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the clock to `ms`.
    pub fn set(&self, ms: Millis) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}
