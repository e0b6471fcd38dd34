//! `paceline worker`: one worker process. Start as many as you like, on any
//! machine that reaches Redis and the provider.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;

/// Arguments of `paceline worker`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: worker::WorkerConfig,
    /// Serve this process's Prometheus metrics (`GET /metrics`) on this address.
    #[arg(long = "metrics-listen", env = "PACELINE_WORKER_METRICS")]
    metrics_listen: Option<SocketAddr>,
}

/// Runs a worker until SIGINT/SIGTERM, then drains and exits 0.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Logs, and traces when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when `_traces` goes).
    let _traces = worker::traces::init("info", "paceline-worker")?;
    let shutdown = super::shutdown_signal();
    if let Some(addr) = args.metrics_listen {
        // The same recorder (and histogram buckets) as the API's /metrics.
        let handle = api::metrics::handle();
        let app = axum::Router::new().route("/metrics", axum::routing::get(move || async move { handle.render() }));
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind {addr}"))?;
        tracing::info!(message = "worker metrics", listen = %addr);
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    worker::run(args.config, shutdown).await?;
    Ok(ExitCode::SUCCESS)
}
