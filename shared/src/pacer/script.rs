//! The shared pacer's Lua, assembled: the files of `lua/` in one order, the
//! one include step (as BullMQ keeps its `commands/*.lua` with `includes/`).
//!
//! Each file mirrors a part of the `pacer` crate: `state.lua` the state hash
//! (`PacerState`'s numbers, packed) and the call's knobs, `line.lua` the
//! records (the calls in flight, `PacerState::flights`, and the line,
//! `PacerState::waiters`, with its index), `bucket.lua` `bucket.rs`,
//! `refund.lua` `refund.rs`, `model.lua` and `acquire.lua`/`settle.lua`
//! `model.rs`'s steps, `release.lua` `release.rs`, `ops.lua` the ops the
//! script answers (its entry, last).
//! A later file may use what an earlier one defines, never the reverse.

/// The files, in the order they are assembled.
pub const FILES: [(&str, &str); 9] = [
    ("state.lua", include_str!("lua/state.lua")),
    ("line.lua", include_str!("lua/line.lua")),
    ("bucket.lua", include_str!("lua/bucket.lua")),
    ("refund.lua", include_str!("lua/refund.lua")),
    ("model.lua", include_str!("lua/model.lua")),
    ("acquire.lua", include_str!("lua/acquire.lua")),
    ("settle.lua", include_str!("lua/settle.lua")),
    ("release.lua", include_str!("lua/release.lua")),
    ("ops.lua", include_str!("lua/ops.lua")),
];

/// No host: the script moves no queue entry (its releases are kept in `moves`).
pub const NO_HOST: &str = "local PACER_HOST = nil\n";

/// The whole script (`KEYS`, `ARGV` as `lua/state.lua` and `lua/ops.lua` say),
/// after `host`: Lua that defines `PACER_HOST` (`release(id, now)`,
/// `retime(id, at, now)`, each answering whether it still held the turn), or
/// [`NO_HOST`].
pub fn source(host: &str) -> String {
    let mut out = String::from(host);
    for (name, text) in FILES {
        out.push_str("-- lua/");
        out.push_str(name);
        out.push('\n');
        out.push_str(text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No file is a drawer: each stays a readable size.
    #[test]
    fn each_file_stays_readable() {
        for (name, text) in FILES {
            let lines = text.lines().count();
            assert!(lines <= 420, "lua/{name} is {lines} lines");
        }
    }
}
