//! `paceline api`: the HTTP API alone, until SIGINT/SIGTERM. Thin: the
//! config and the server live in the `api` crate, where the tests use them too.

use std::process::ExitCode;

/// Arguments of this subcommand.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: api::ApiConfig,
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("info");
    let shutdown = super::shutdown_signal();
    let mut config = args.config;
    // A run's first turn gets its pacer ask at submit, counted as the workers count.
    config.first_ask = Some(worker::turn::first_ask(&config.providers.providers));
    let app = api::Application::build(config).await?;
    app.run_until_stopped(shutdown).await?;
    Ok(ExitCode::SUCCESS)
}
