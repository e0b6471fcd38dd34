//! The request body from the transcript (not built yet).
