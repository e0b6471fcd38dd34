//! The provider client (not built yet).
