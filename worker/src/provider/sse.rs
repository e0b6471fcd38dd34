//! An incremental Server-Sent Events parser: bytes in, whole events out.
//!
//! Follows the WHATWG event-stream rules that matter for model providers:
//! lines end in LF, CRLF or a lone CR (and a CRLF may be split across two
//! chunks); `data:` lines of one event are joined with `\n`; one space after
//! the colon is dropped; lines starting with `:` are comments (keepalives);
//! a blank line dispatches the event, and an event without data is not
//! dispatched. Unknown fields are ignored.
//!
//! One deliberate deviation: [`SseParser::finish`] hands back an event whose
//! blank line never came when the stream closes. The standard drops it, but a
//! server that closes right after its terminal `response.completed` frame
//! would otherwise turn a finished answer into a "stream ended early" retry.
//!
//! Bytes are split into lines before they are decoded, so a multi-byte UTF-8
//! character cut across two network chunks is decoded whole.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, when the server sent one (Responses does; chat does not).
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
    /// The `id:` field, when the server sent one.
    pub id: Option<String>,
}

/// Why the parser refused a stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// One event (or one line) grew past the parser's limit: a broken or
    /// hostile server, not an answer.
    #[error("an event is larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
}

/// The default limit on one event's size. A `response.completed` frame holds
/// the whole answer, so this is generous; it only bounds memory against a
/// server that never ends a line.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// Incremental parser state. Feed it chunks with [`SseParser::push`].
#[derive(Debug)]
pub struct SseParser {
    /// Bytes of a line not yet ended.
    line: Vec<u8>,
    /// The last chunk ended in CR: an LF at the start of the next chunk
    /// belongs to that line end, not to a new (blank) line.
    after_cr: bool,
    /// No line has ended yet: a UTF-8 byte-order mark at its start is not
    /// part of it (checked on the whole line, so a BOM split across chunks
    /// is still found).
    first_line: bool,
    /// The event being built.
    event: Option<String>,
    data: String,
    has_data: bool,
    id: Option<String>,
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new()
    }
}

impl SseParser {
    /// A parser with the default event size limit.
    pub fn new() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }

    /// A parser that refuses an event (or line) larger than `max_event_bytes`.
    pub fn with_limit(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            after_cr: false,
            first_line: true,
            event: None,
            data: String::new(),
            has_data: false,
            id: None,
            max_event_bytes,
        }
    }

    /// Feeds one chunk; returns the events it completed, in order.
    pub fn push(&mut self, mut chunk: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        let mut out = Vec::new();
        if self.after_cr {
            self.after_cr = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while let Some(pos) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&chunk[..pos]);
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, &mut out)?;
            let ended_in_cr = chunk[pos] == b'\r';
            chunk = &chunk[pos + 1..];
            if ended_in_cr {
                match chunk.first() {
                    Some(b'\n') => chunk = &chunk[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.line.extend_from_slice(chunk);
        if self.line.len() > self.max_event_bytes {
            return Err(SseError::TooLarge { limit: self.max_event_bytes });
        }
        Ok(out)
    }

    /// The stream closed: the event still being built, if it has data (see
    /// the module doc for why it is not dropped).
    pub fn finish(&mut self) -> Option<SseEvent> {
        let mut out = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            // A line this size already passed the limit check in `push`.
            let _ = self.line_done(&line, &mut out);
        }
        self.after_cr = false;
        out.pop().or_else(|| self.dispatch())
    }

    /// One complete line (without its terminator).
    fn line_done(&mut self, mut line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if std::mem::take(&mut self.first_line) {
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            out.extend(self.dispatch());
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(()); // a comment: `: keepalive`, `: OPENROUTER PROCESSING`
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
                if self.data.len() > self.max_event_bytes {
                    return Err(SseError::TooLarge { limit: self.max_event_bytes });
                }
            }
            "event" => self.event = Some(value.to_string()),
            // An id with a NUL is ignored, per the standard.
            "id" if !value.contains('\0') => self.id = Some(value.to_string()),
            _ => {} // `retry:` and unknown fields: nothing for us.
        }
        Ok(())
    }

    /// Ends the event being built; `None` when it had no data.
    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        let id = self.id.take();
        if !std::mem::take(&mut self.has_data) {
            self.data.clear();
            return None;
        }
        Some(SseEvent { event, data: std::mem::take(&mut self.data), id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent { event: event.map(str::to_string), data: data.to_string(), id: None }
    }

    /// Feeds `input` split at every possible pair of points and checks that
    /// the events never depend on where the network cut the bytes.
    fn parse_all_splits(input: &[u8]) -> Vec<SseEvent> {
        let mut whole = SseParser::new();
        let mut expected = whole.push(input).unwrap();
        expected.extend(whole.finish());
        for i in 0..=input.len() {
            for j in i..=input.len() {
                let mut p = SseParser::new();
                let mut got = p.push(&input[..i]).unwrap();
                got.extend(p.push(&input[i..j]).unwrap());
                got.extend(p.push(&input[j..]).unwrap());
                got.extend(p.finish());
                assert_eq!(got, expected, "split at {i}/{j}");
            }
        }
        expected
    }

    #[test]
    fn events_with_names_and_data() {
        let input = b"event: response.created\ndata: {\"a\":1}\n\nevent: done\ndata: x\n\n";
        assert_eq!(parse_all_splits(input), vec![ev(Some("response.created"), "{\"a\":1}"), ev(Some("done"), "x")]);
    }

    #[test]
    fn crlf_and_lone_cr_line_ends_even_when_split() {
        let input = b"data: one\r\n\r\ndata: two\r\rdata: three\n\r\n";
        assert_eq!(parse_all_splits(input), vec![ev(None, "one"), ev(None, "two"), ev(None, "three")]);
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        let input = b"data: first\ndata:second\ndata:  third\n\n";
        assert_eq!(parse_all_splits(input), vec![ev(None, "first\nsecond\n third")]);
    }

    #[test]
    fn comments_keepalives_and_empty_events_are_skipped() {
        let input = b": keepalive\n\n:\n\nevent: ping\n\nretry: 100\nfoo: bar\ndata: real\n\n";
        assert_eq!(parse_all_splits(input), vec![ev(None, "real")]);
    }

    #[test]
    fn utf8_split_across_chunks_is_decoded_whole() {
        let input = "data: héllo wörld ✓\n\n".as_bytes();
        assert_eq!(parse_all_splits(input), vec![ev(None, "héllo wörld ✓")]);
    }

    #[test]
    fn a_bom_and_an_id_field() {
        let input = b"\xEF\xBB\xBFid: 7\ndata: x\n\n";
        let events = parse_all_splits(input);
        assert_eq!(events, vec![SseEvent { event: None, data: "x".into(), id: Some("7".into()) }]);
    }

    #[test]
    fn a_field_without_colon_and_an_empty_data_line() {
        // `data` alone is a data line with an empty value.
        let input = b"data\ndata: x\n\n";
        assert_eq!(parse_all_splits(input), vec![ev(None, "\nx")]);
    }

    #[test]
    fn an_unterminated_last_event_is_kept_at_close() {
        let mut p = SseParser::new();
        assert!(p.push(b"event: response.completed\ndata: {}").unwrap().is_empty());
        assert_eq!(p.finish(), Some(ev(Some("response.completed"), "{}")));
        assert_eq!(p.finish(), None);
        // Only a name and no data: nothing to hand back.
        let mut p = SseParser::new();
        p.push(b"event: x\n").unwrap();
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn an_endless_line_is_refused() {
        let mut p = SseParser::with_limit(16);
        assert!(p.push(b"data: 0123456").is_ok());
        assert_eq!(p.push(b"789abcdefgh"), Err(SseError::TooLarge { limit: 16 }));
        let mut p = SseParser::with_limit(16);
        let err = p.push(b"data: 0123456789\ndata: 0123456789\n");
        assert_eq!(err, Err(SseError::TooLarge { limit: 16 }));
    }
}
