//! One Redis reader for every event stream of an API process. Each open
//! stream subscribes to its run here; one task follows all the runs with a
//! single blocking `XREAD` over their streams and hands each new event to the
//! streams of its run. So a thousand open streams hold one Redis connection
//! between them, not a thousand, and Redis sees one read per batch of events
//! (or per `BLOCK` when nothing happens), however many streams are open.
//!
//! Each stream's share is bounded: at most [`BUFFER`] events wait for it.
//! A stream that falls that far behind (its client reads slowly, or has
//! stopped reading and its connection's buffers are full) is dropped from
//! the run: the hub holds nothing more for it, and the stream, if it is
//! polled again, catches up from Redis itself and subscribes anew (`events.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shared::runs::events::stream_id_after;
use shared::runs::{RunEvent, RunStore};
use tokio::sync::{mpsc, watch, Notify};

/// How long the reader's `XREAD` blocks: the longest a newly followed run
/// waits to join the read (its backlog is read at once by its stream).
const BLOCK: Duration = Duration::from_millis(500);
/// Events read per run at once.
const COUNT: usize = 200;
/// Events waiting for one stream at most: five full reads' worth. A stream
/// past it is dropped from its run and catches up from Redis.
pub const BUFFER: usize = 5 * COUNT;

/// The process's reader (cheap to clone).
#[derive(Clone)]
pub struct EventHub(Arc<Inner>);

struct Inner {
    state: Mutex<State>,
    /// Wakes the reader when it follows nothing and a stream subscribes.
    wake: Notify,
}

#[derive(Default)]
struct State {
    next: u64,
    runs: HashMap<String, Followed>,
}

/// A run the reader follows: the last event id it read, and the streams to hand events to.
struct Followed {
    after: String,
    streams: HashMap<u64, mpsc::Sender<RunEvent>>,
}

impl EventHub {
    /// Starts the reader on `store` (a connection of its own, with a timeout
    /// longer than [`BLOCK`]); it ends when `shutdown` turns true.
    pub fn start(store: RunStore, timeout: Duration, mut shutdown: watch::Receiver<bool>) -> Self {
        let hub = Self(Arc::new(Inner { state: Mutex::default(), wake: Notify::new() }));
        let reader = hub.clone();
        tokio::spawn(async move {
            loop {
                if *shutdown.borrow() {
                    return;
                }
                let from = reader.positions();
                if from.is_empty() {
                    tokio::select! {
                        () = reader.0.wake.notified() => {}
                        _ = shutdown.changed() => {}
                    }
                    continue;
                }
                let read = tokio::time::timeout(BLOCK + timeout, store.read_many(&from, Some(BLOCK), COUNT));
                let result = tokio::select! {
                    r = read => r,
                    _ = shutdown.changed() => continue,
                };
                match result {
                    Ok(Ok(batches)) => reader.hand_out(batches),
                    Ok(Err(error)) => {
                        tracing::warn!(message = "the event reader's read failed; retrying", %error);
                        tokio::time::sleep(BLOCK).await;
                    }
                    Err(_) => tracing::warn!(message = "the event reader's read timed out; retrying"),
                }
            }
        });
        hub
    }

    /// Follows run `id` for one stream, from event `after` (`0-0`: the
    /// start) if the reader does not follow it yet. The stream reads what it
    /// missed itself (see `events.rs`) and skips what it has seen.
    pub fn subscribe(&self, id: &str, after: &str) -> Subscription {
        let (tx, rx) = mpsc::channel(BUFFER);
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        state.next += 1;
        let key = state.next;
        let was_idle = state.runs.is_empty();
        let followed = state
            .runs
            .entry(id.to_owned())
            .or_insert_with(|| Followed { after: after.to_owned(), streams: HashMap::new() });
        followed.streams.insert(key, tx);
        drop(state);
        if was_idle {
            self.0.wake.notify_one();
        }
        Subscription { rx, hub: self.clone(), id: id.to_owned(), key }
    }

    /// Every followed run and the id to read after.
    fn positions(&self) -> Vec<(String, String)> {
        let state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        state.runs.iter().map(|(id, f)| (id.clone(), f.after.clone())).collect()
    }

    /// Hands each run's new events to its streams. A stream whose buffer is
    /// full, or that is gone, is dropped; a run left with none is followed no more.
    fn hand_out(&self, batches: Vec<(String, Vec<RunEvent>)>) {
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        for (id, events) in batches {
            let Some(followed) = state.runs.get_mut(&id) else { continue };
            for event in events {
                if !stream_id_after(&event.id, &followed.after) {
                    continue;
                }
                followed.after = event.id.clone();
                followed.streams.retain(|_, tx| tx.try_send(event.clone()).is_ok());
            }
            if followed.streams.is_empty() {
                state.runs.remove(&id);
            }
        }
    }
}

/// One stream's share of the reader; it stops following when dropped.
pub struct Subscription {
    rx: mpsc::Receiver<RunEvent>,
    hub: EventHub,
    id: String,
    key: u64,
}

/// What a subscription has next.
#[derive(Debug)]
pub enum Next {
    /// The run's next event.
    Event(RunEvent),
    /// Nothing came within the wait.
    Quiet,
    /// The stream fell [`BUFFER`] events behind and was dropped: the events
    /// after the ones it got are in Redis only.
    Dropped,
}

impl Subscription {
    /// The next event of the run, or what stands in its place after `wait`.
    pub async fn next(&mut self, wait: Duration) -> Next {
        match tokio::time::timeout(wait, self.rx.recv()).await {
            Ok(Some(event)) => Next::Event(event),
            // The hub let go of this stream's sender: only a full buffer does that.
            Ok(None) => Next::Dropped,
            Err(_) => Next::Quiet,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut state = self.hub.0.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(followed) = state.runs.get_mut(&self.id) {
            followed.streams.remove(&self.key);
            if followed.streams.is_empty() {
                state.runs.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub() -> EventHub {
        EventHub(Arc::new(Inner { state: Mutex::default(), wake: Notify::new() }))
    }

    fn events(from: u64, n: u64) -> Vec<(String, Vec<RunEvent>)> {
        let list = (from..from + n)
            .map(|i| RunEvent {
                id: format!("{i}-0"),
                kind: "turn.output_text.delta".into(),
                data: serde_json::json!({}),
            })
            .collect();
        vec![("run_1".to_owned(), list)]
    }

    #[tokio::test]
    async fn a_stream_that_stops_reading_holds_at_most_its_buffer_and_is_dropped_past_it() {
        let hub = hub();
        let mut stopped = hub.subscribe("run_1", "0-0");
        let mut reading = hub.subscribe("run_1", "0-0");
        let mut next = 1;
        for _ in 0..(BUFFER as u64 / COUNT as u64 + 2) {
            hub.hand_out(events(next, COUNT as u64));
            next += COUNT as u64;
            // One stream keeps up; the other reads nothing.
            while let Next::Event(_) = reading.next(Duration::ZERO).await {}
        }
        assert_eq!(hub.0.state.lock().unwrap().runs["run_1"].streams.len(), 1, "the stopped stream was dropped");
        // It got its buffer's worth, in order, then learns it was dropped.
        for i in 1..=BUFFER as u64 {
            match stopped.next(Duration::ZERO).await {
                Next::Event(e) => assert_eq!(e.id, format!("{i}-0")),
                other => panic!("event {i}: {other:?}"),
            }
        }
        assert!(matches!(stopped.next(Duration::ZERO).await, Next::Dropped));
        drop(reading);
        assert!(hub.0.state.lock().unwrap().runs.is_empty(), "a run no stream follows is not read");
        // Dropped and subscribed anew, it follows again.
        drop(stopped);
        let mut again = hub.subscribe("run_1", &format!("{}-0", next - 1));
        hub.hand_out(events(next, 1));
        assert!(matches!(again.next(Duration::ZERO).await, Next::Event(e) if e.id == format!("{next}-0")));
    }

    #[test]
    fn stream_ids_compare_as_numbers() {
        assert!(stream_id_after("10-0", "9-5"));
        assert!(stream_id_after("10-10", "10-9"));
        assert!(!stream_id_after("10-9", "10-9"));
        assert!(stream_id_after("1-0", "0-0"));
    }
}
