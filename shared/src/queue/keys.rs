//! The queue's Redis keys (all under one hash tag, built by `crate::keys`).

/// The names of the queue's keys.
#[derive(Debug, Clone)]
pub struct QueueKeys {
    /// ZSET id → due ms.
    pub due: String,
    /// ZSET id → lease deadline ms.
    pub lease: String,
    /// HASH id → record.
    pub jobs: String,
    /// ZSET id → died at ms.
    pub dead: String,
    /// HASH id → reason it died.
    pub reasons: String,
    /// LIST of wake-up tokens.
    pub notify: String,
    /// STRING `due_ms|worker`: the idle worker that sleeps towards the next due turn.
    pub timer: String,
    /// STRING: the epoch a record never leased was last given (fetch.lua
    /// `q_next_epochs`).
    pub epoch_given: String,
    /// HASH of the queue's own counters (`empty_fetches:<cause>`: fetches that
    /// found nothing due, a worker woken for nothing, by what made it fetch —
    /// `FetchWhy`; `empty_fetches` when its caller did not say).
    pub stats: String,
    /// ZSET worker identity → last heartbeat ms.
    pub workers: String,
    /// HASH worker identity → JSON registration.
    pub worker_info: String,
}

impl QueueKeys {
    /// The keys under `keys`'s prefix.
    pub fn new(keys: &crate::keys::Keys) -> Self {
        Self {
            due: keys.queue_key("due"),
            lease: keys.queue_key("lease"),
            jobs: keys.queue_key("jobs"),
            dead: keys.queue_key("dead"),
            reasons: keys.queue_key("reasons"),
            notify: keys.queue_key("notify"),
            timer: keys.queue_key("timer"),
            epoch_given: keys.queue_key("epoch"),
            stats: keys.queue_key("stats"),
            workers: keys.queue_key("workers"),
            worker_info: keys.queue_key("worker_info"),
        }
    }

    /// How many keys [`Self::script_keys`] gives (the library's `Q_NKEYS`).
    pub const COUNT: usize = 7;

    /// `KEYS[1..7]` of any script built on [`LUA_LIB`](super::LUA_LIB), in order.
    pub fn script_keys(&self) -> [&str; Self::COUNT] {
        [&self.due, &self.lease, &self.jobs, &self.dead, &self.reasons, &self.notify, &self.timer]
    }
}
