//! The reactive ladder: how long to wait before the next attempt, and when to stop.
