//! Classifying a failed provider call: rate limit, quota, too large, transient, terminal.
