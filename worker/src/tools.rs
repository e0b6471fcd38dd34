//! Calling the run's tool endpoint (not built yet).
