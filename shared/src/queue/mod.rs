//! The turn queue (see issue: the turn queue). Not built yet.
