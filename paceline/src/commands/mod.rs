//! One module per subcommand (or family of client subcommands).

pub mod api;
pub mod bench;
pub mod client;
pub mod mock;
pub mod queue_probe;
pub mod up;
pub mod worker;

/// Resolves on SIGINT or SIGTERM: the shutdown future every long-running
/// subcommand is given.
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
