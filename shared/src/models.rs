//! What paceline knows of models by name (SPEC §4a): their context windows.
//! A model is found by the longest known name it starts with, so a dated
//! snapshot (`gpt-4o-2024-08-06`, `claude-sonnet-4-5-20250929`) is its
//! family's; a model this table does not know has no window here (a run may
//! give one, `context_window_tokens`), and only the provider's own
//! context-length error says it overflowed.
//!
//! The figures are the providers' published context windows (input and
//! output together) as of 2026-12.

/// Context windows in tokens, by name prefix.
const CONTEXT_WINDOWS: &[(&str, u64)] = &[
    ("gpt-5", 400_000),
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 8_192),
    ("gpt-3.5-turbo", 16_385),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
    ("claude-", 200_000),
];

/// The context window of `model`, in tokens, when this table knows it.
pub fn context_window(model: &str) -> Option<u64> {
    CONTEXT_WINDOWS
        .iter()
        .filter(|(prefix, _)| model.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|&(_, window)| window)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_is_its_longest_known_prefix() {
        assert_eq!(context_window("gpt-4o-2024-08-06"), Some(128_000));
        assert_eq!(context_window("gpt-4o-mini"), Some(128_000));
        assert_eq!(context_window("gpt-4"), Some(8_192));
        assert_eq!(context_window("gpt-4.1-mini"), Some(1_047_576));
        assert_eq!(context_window("gpt-5-mini"), Some(400_000));
        assert_eq!(context_window("claude-sonnet-4-5-20250929"), Some(200_000));
        assert_eq!(context_window("o3-mini"), Some(200_000));
        assert_eq!(context_window("llama-3.1-8b"), None);
        assert_eq!(context_window(""), None);
    }
}
