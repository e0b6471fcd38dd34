//! `paceline worker`: one worker process. Start as many as you like, on any
//! machine that reaches Redis and the provider.

use std::process::ExitCode;

/// Arguments of `paceline worker`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: worker::WorkerConfig,
}

/// Runs a worker until SIGINT/SIGTERM, then drains and exits 0.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("info");
    worker::run(args.config, super::shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}
