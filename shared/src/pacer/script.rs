//! The shared pacer's Lua, assembled: the files of `lua/` in one order, the
//! one include step (as BullMQ keeps its `commands/*.lua` with `includes/`).
//!
//! Each file mirrors a part of the `pacer` crate: `state.lua` the state hash
//! (`PacerState`'s numbers, packed) and the call's knobs, `line.lua` the
//! records (the calls in flight, `PacerState::flights`, and the line,
//! `PacerState::waiters`, with its index), `bucket.lua` `bucket.rs`,
//! `refund.lua` `refund.rs`, `model.lua` and `acquire.lua`/`settle.lua`
//! `model.rs`'s steps, `ops.lua` the ops the script answers (its entry, last).
//! A later file may use what an earlier one defines, never the reverse.

/// The files, in the order they are assembled.
pub const FILES: [(&str, &str); 8] = [
    ("state.lua", include_str!("lua/state.lua")),
    ("line.lua", include_str!("lua/line.lua")),
    ("bucket.lua", include_str!("lua/bucket.lua")),
    ("refund.lua", include_str!("lua/refund.lua")),
    ("model.lua", include_str!("lua/model.lua")),
    ("acquire.lua", include_str!("lua/acquire.lua")),
    ("settle.lua", include_str!("lua/settle.lua")),
    ("ops.lua", include_str!("lua/ops.lua")),
];

/// The whole script (`KEYS`, `ARGV` as `lua/state.lua` and `lua/ops.lua` say).
pub fn source() -> String {
    let mut out = String::new();
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
