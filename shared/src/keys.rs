//! Every Redis key paceline uses, in one place.
//!
//! Keys start with the configured prefix (`PACELINE_PREFIX`, default `paceline`)
//! and carry a hash tag (`{...}`) wherever one script touches several keys, so
//! they share a Redis Cluster slot. Names are constants, never derived from Rust
//! type paths, so a rename cannot move a queue.

/// The key namespace of one deployment (or of one test).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix`.
    pub fn new(prefix: impl Into<String>) -> Self {
        Self { prefix: prefix.into() }
    }

    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The pacer's state hash for one budget and model. The hash tag is the
    /// budget, so one budget's keys (state, reservations, fairness) share a slot.
    pub fn pacer_state(&self, budget: &str, model: &str) -> String {
        format!("{}:pacer:{{{}}}:state:{}", self.prefix, budget, model)
    }

    /// The pacer's expiry set for one budget and model: reservation id ->
    /// when its record lapses (a waiter's due time plus the grace, a call's TTL).
    pub fn pacer_expiry(&self, budget: &str, model: &str) -> String {
        format!("{}:pacer:{{{}}}:expiry:{}", self.prefix, budget, model)
    }

    /// The pacer's records for one budget and model: reservation id -> a
    /// waiter or a call in flight (`rec_encode` in `scripts.lua`).
    pub fn pacer_records(&self, budget: &str, model: &str) -> String {
        format!("{}:pacer:{{{}}}:records:{}", self.prefix, budget, model)
    }

    /// The pacer's line for one budget and model: reservation id -> its place.
    pub fn pacer_line(&self, budget: &str, model: &str) -> String {
        format!("{}:pacer:{{{}}}:line:{}", self.prefix, budget, model)
    }

    /// The base of the pacer's history for one budget and model (the
    /// dashboard's chart): the script writes one hash per minute,
    /// `<base>:<minute>`, with per-second counters. Same hash tag as the
    /// budget's other keys, so the script's writes stay in its slot.
    pub fn pacer_history(&self, budget: &str, model: &str) -> String {
        format!("{}:pacer:{{{}}}:hist:{}", self.prefix, budget, model)
    }

    /// One minute of the pacer's history (`minute` = Unix seconds / 60).
    pub fn pacer_history_minute(&self, budget: &str, model: &str, minute: i64) -> String {
        format!("{}:{}", self.pacer_history(budget, model), minute)
    }

    /// The set of models known under one budget (for `GET /v1/pacer`).
    pub fn pacer_models(&self, budget: &str) -> String {
        format!("{}:pacer:{{{}}}:models", self.prefix, budget)
    }

    /// The set of budget names known to this deployment.
    pub fn pacer_budgets(&self) -> String {
        format!("{}:pacer:budgets", self.prefix)
    }

    /// The hash tag of everything that one turn-commit script touches: the
    /// prefix itself (`{paceline}`). The queue's keys carry it, and the run
    /// store's keys may too, so a script can commit a turn and enqueue the next
    /// in one slot.
    pub fn slot_tag(&self) -> String {
        format!("{{{}}}", self.prefix)
    }

    /// The pub/sub channel a cancel is announced on (the run id), so a worker
    /// holding that run's turn aborts its call: `prefix:{prefix}:cancels`.
    pub fn cancel_channel(&self) -> String {
        format!("{}:{}:cancels", self.prefix, self.slot_tag())
    }

    /// One key of the turn queue: `prefix:{prefix}:q:name` (see `queue::QueueKeys`).
    pub fn queue_key(&self, name: &str) -> String {
        format!("{}:{}:q:{}", self.prefix, self.slot_tag(), name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_start_with_the_prefix_and_tag_the_budget() {
        let k = Keys::new("pl");
        assert_eq!(k.pacer_state("default", "gpt-4.1"), "pl:pacer:{default}:state:gpt-4.1");
        assert_eq!(k.pacer_line("b", "m"), "pl:pacer:{b}:line:m");
        assert_eq!(k.queue_key("due"), "pl:{pl}:q:due");
        assert_eq!(k.pacer_history_minute("b", "m", 7), "pl:pacer:{b}:hist:m:7");
    }
}
