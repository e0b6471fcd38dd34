//! Back-pressure on what a turn sends (not built yet).
