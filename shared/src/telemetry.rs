//! One place that builds the tracing subscriber: `RUST_LOG` filters,
//! `LOG_FORMAT=json` switches to JSON lines. Logs go to stderr so the CLI's
//! progress bars and output on stdout do not fight with them.

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global subscriber once; later calls are no-ops.
pub fn init(default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("LOG_FORMAT").map(|v| v == "json").unwrap_or(false);
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
