//! One module per subcommand (or family of client subcommands).

pub mod api;
pub mod bench;
pub mod client;
pub mod mock;
pub mod queue_probe;
pub mod up;
pub mod worker;

use std::process::ExitCode;

/// What a subcommand whose issue is not done yet answers: a clear line, exit 2.
pub fn not_built(what: &str) -> anyhow::Result<ExitCode> {
    eprintln!("paceline: `{what}` is not built yet");
    Ok(ExitCode::from(2))
}

/// Resolves on SIGINT or SIGTERM: the shutdown future every long-running
/// subcommand is given.
#[allow(dead_code)] // used by the long-running subcommands as they land
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
