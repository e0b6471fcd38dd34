//! A run's events as its stream keeps them: one entry per step, several
//! events to an entry (`RunEvent::from_entry`), and the stream ids a client
//! resumes from (`Last-Event-ID`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One event of a run's stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// The stream id (`1732960000000-0`): the SSE `id`, resumable with `Last-Event-ID`.
    pub id: String,
    /// The event type (`turn.completed`, …).
    pub kind: String,
    /// Its JSON data.
    pub data: Value,
}

impl RunEvent {
    /// The events of an entry of a run's events stream: `type` and `data`,
    /// then `type1`/`data1`, `type2`/`data2`, … when one step wrote several
    /// events at once (`store.lua` `event_entry`: one `XADD`, not one per
    /// event). The entry's last event has the entry's id; those before it the
    /// entry's id and their place, `<entry id>.<k>` (see [`valid_stream_id`]),
    /// so a client that got them all resumes after the entry, and one that
    /// stopped inside it resumes inside it.
    pub(crate) fn from_entry(entry: redis::streams::StreamId) -> Vec<Self> {
        let mut out = vec![];
        for k in 0.. {
            let suffix = if k == 0 { String::new() } else { k.to_string() };
            let Some(kind) = entry.get::<String>(&format!("type{suffix}")) else { break };
            let data: String = entry.get(&format!("data{suffix}")).unwrap_or_default();
            let id = format!("{}.{k}", entry.id);
            out.push(Self { id, kind, data: serde_json::from_str(&data).unwrap_or(Value::Null) });
        }
        if let Some(last) = out.last_mut() {
            last.id = entry.id;
        }
        out
    }
}

/// Event ids are the stream's ids: `1732960000000-0`, or the milliseconds
/// alone (`1732960000000`), and for an event that is not the last of its
/// entry, the entry's id and its place in it: `1732960000000-0.1` (see
/// [`RunEvent`]). [`super::RunStore::events`] reads from the start after anything
/// else; the API refuses it.
pub fn valid_stream_id(id: &str) -> bool {
    EventId::parse(id).is_some()
}

/// Whether event id `a` comes after `b` in their stream (compared as numbers:
/// the entry's milliseconds and sequence, then the place in the entry, the
/// entry's own id last). An id that is not one comes before every other.
pub fn stream_id_after(a: &str, b: &str) -> bool {
    EventId::parse(a) > EventId::parse(b)
}

/// An event id as numbers: its entry's `ms-seq`, and its place in the entry
/// (`u64::MAX` for the entry's own id: its last event).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct EventId {
    ms: u64,
    seq: u64,
    place: u64,
}

impl EventId {
    pub(crate) fn parse(id: &str) -> Option<Self> {
        fn number(s: &str) -> Option<u64> {
            ((1..=20).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok())?
        }
        let (entry, place) = match id.split_once('.') {
            Some((entry, place)) => (entry, number(place)?.min(u64::MAX - 1)),
            None => (id, u64::MAX),
        };
        let (ms, seq) = entry.split_once('-').unwrap_or((entry, "0"));
        Some(Self { ms: number(ms)?, seq: number(seq)?, place })
    }

    /// The id an `XREAD` reads after to get the events after this one: its
    /// entry's own for its last event, else the one before its entry (the
    /// entry is read again).
    pub(crate) fn read_from(self) -> String {
        match (self.place, self.seq, self.ms) {
            (u64::MAX, seq, ms) => format!("{ms}-{seq}"),
            (_, 0, 0) => "0-0".to_owned(),
            (_, 0, ms) => format!("{}-{}", ms - 1, u64::MAX),
            (_, seq, ms) => format!("{ms}-{}", seq - 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_are_checked() {
        for ok in ["1732960000000-0", "1-1", "1732960000000", "1732960000000-0.0", "1-1.12"] {
            assert!(valid_stream_id(ok), "{ok}");
        }
        for bad in
            ["", "-1", "1-", "abc", "1-2-3", "1 -2", "99999999999999999999999-0", "1-0.", "1-0.x", ".1", "1-0.1.2"]
        {
            assert!(!valid_stream_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_events_of_one_entry_come_in_order_and_before_the_next_entry() {
        // An entry of three events: 10-1.0, 10-1.1, then 10-1 itself.
        let order = ["9-5", "10-0", "10-1.0", "10-1.1", "10-1", "10-2.0", "10-2", "11-0"];
        for w in order.windows(2) {
            assert!(stream_id_after(w[1], w[0]) && !stream_id_after(w[0], w[1]), "{} then {}", w[0], w[1]);
        }
        assert!(!stream_id_after("10-1", "10-1"));
        // A read after an entry's last event starts after the entry; after one
        // inside it, before the entry (whose earlier events are then left out).
        let from = |id: &str| EventId::parse(id).unwrap().read_from();
        assert_eq!(from("10-1"), "10-1");
        assert_eq!(from("10-1.0"), "10-0");
        assert_eq!(from("10-0.3"), format!("9-{}", u64::MAX));
        assert_eq!(from("0-0.1"), "0-0");
        assert_eq!(from("1732960000000"), "1732960000000-0");
    }
}
