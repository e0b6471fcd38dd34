//! A cancel reaching a turn in flight: the API's cancel script publishes the
//! run id on the prefix's cancel channel (`Keys::cancel_channel`) when the run's
//! turn is leased; each worker process listens on one connection and wakes
//! the turn of that run it holds, which drops its provider call (the stream
//! is aborted) and runs no tool after it. The run itself was cancelled by the
//! script; the turn only stops sooner than its fenced commit would stop it.

use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The turns of this process that a cancel can reach, by run id.
#[derive(Debug, Clone, Default)]
pub struct Cancels(Arc<Mutex<Registry>>);

#[derive(Debug, Default)]
struct Registry {
    next: u64,
    turns: HashMap<String, (u64, watch::Sender<bool>)>,
}

impl Cancels {
    /// Registers the turn of run `id` that this process runs now; the
    /// registration ends when the returned [`Cancel`] is dropped.
    pub fn watch(&self, id: &str) -> Cancel {
        self.watch_lease(id, None)
    }

    /// [`Cancels::watch`] for a turn that also stops when `lease` is taken
    /// back (its worker's heartbeat found it expired and delivered again): no
    /// more calls or tool calls on a stale lease.
    pub fn watch_lease(&self, id: &str, lease: Option<shared::queue::Lease>) -> Cancel {
        let (tx, rx) = watch::channel(false);
        let mut reg = self.0.lock().unwrap_or_else(|e| e.into_inner());
        reg.next += 1;
        let generation = reg.next;
        reg.turns.insert(id.to_owned(), (generation, tx));
        Cancel { rx, cancels: self.clone(), id: id.to_owned(), generation, lease }
    }

    /// Wakes the turn of run `id`, if this process runs it.
    pub fn fire(&self, id: &str) {
        let reg = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, tx)) = reg.turns.get(id) {
            tx.send_replace(true);
        }
    }

    /// Listens on `channel` for as long as the task runs, resubscribing after
    /// a lost connection (a cancel published meanwhile is missed: its turn is
    /// still stopped by its fenced commit, only later). On a cluster it
    /// subscribes on one seed node, the next one after each loss: a
    /// `PUBLISH` reaches the subscribers of every node.
    pub async fn listen(self, redis: shared::config::RedisArgs, channel: String) {
        let urls = if redis.is_cluster() { redis.cluster_nodes.0.clone() } else { vec![redis.url.clone()] };
        for url in urls.iter().cycle() {
            match subscribe(url, &channel).await {
                Ok(pubsub) => {
                    let mut messages = pubsub.into_on_message();
                    while let Some(msg) = messages.next().await {
                        if let Ok(id) = msg.get_payload::<String>() {
                            self.fire(&id);
                        }
                    }
                    tracing::warn!(message = "the cancel channel closed; subscribing again");
                }
                Err(error) => tracing::warn!(message = "cannot subscribe to the cancel channel; retrying", %error),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

async fn subscribe(url: &str, channel: &str) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = redis::Client::open(url)?.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    Ok(pubsub)
}

/// One turn's view of its run's cancel.
#[derive(Debug)]
pub struct Cancel {
    rx: watch::Receiver<bool>,
    cancels: Cancels,
    id: String,
    generation: u64,
    lease: Option<shared::queue::Lease>,
}

impl Cancel {
    /// Whether the run was cancelled, or the turn's lease taken back, while it ran.
    pub fn is_cancelled(&self) -> bool {
        *self.rx.borrow() || self.lease.as_ref().is_some_and(|l| l.is_lost())
    }

    /// Resolves when the run is cancelled or the lease taken back (never, otherwise).
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let cancelled = async {
            if rx.wait_for(|cancelled| *cancelled).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        match &self.lease {
            Some(lease) => tokio::select! {
                () = cancelled => {}
                () = lease.lost() => {}
            },
            None => cancelled.await,
        }
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        let mut reg = self.cancels.0.lock().unwrap_or_else(|e| e.into_inner());
        // A later delivery of the same run in this process keeps its own.
        if reg.turns.get(&self.id).is_some_and(|(g, _)| *g == self.generation) {
            reg.turns.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cancel_wakes_the_turn_of_its_run_only_while_it_runs() {
        let cancels = Cancels::default();
        let a = cancels.watch("run_a");
        let b = cancels.watch("run_b");
        cancels.fire("run_a");
        assert!(a.is_cancelled() && !b.is_cancelled());
        tokio::time::timeout(Duration::from_secs(1), a.wait()).await.expect("woken");
        // A second delivery of run_b replaces the first; the first's end leaves it.
        let b2 = cancels.watch("run_b");
        drop(b);
        cancels.fire("run_b");
        assert!(b2.is_cancelled());
        drop((a, b2));
        assert!(cancels.0.lock().unwrap().turns.is_empty());
    }
}
