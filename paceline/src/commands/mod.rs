//! One module per subcommand (or family of client subcommands).

pub mod api;
#[cfg(feature = "mock")]
pub mod bench;
pub mod client;
#[cfg(feature = "mock")]
pub mod mock;
#[cfg(feature = "mock")]
pub mod queue_probe;
pub mod up;
pub mod worker;

/// Resolves on SIGINT or SIGTERM: the shutdown future every long-running
/// subcommand is given. The handlers are installed when this is called, not
/// when the future is first polled, so call it before starting anything: a
/// signal that arrives during start-up then stops the process cleanly instead
/// of killing it.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    #[cfg(unix)]
    let int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    async move {
        #[cfg(unix)]
        {
            let term = async move {
                match term {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let int = async move {
                match int {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = term => {},
                _ = int => {},
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
