//! The call's token estimate (not built yet).
