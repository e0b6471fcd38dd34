//! `paceline mock-provider`: the OpenAI-compatible simulator of the
//! `mock-provider` crate, served until SIGINT/SIGTERM. Thin: the flags and
//! the server live in the crate, where the tests and the benchmark use them too.

use anyhow::Context;
use std::process::ExitCode;

/// Arguments of this subcommand.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    mock: mock_provider::MockArgs,
}

/// Runs the subcommand.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    shared::telemetry::init("info");
    let shutdown = super::shutdown_signal();
    let config = args.mock.into_config().map_err(anyhow::Error::msg)?;
    let listen = config.listen;
    let server =
        mock_provider::MockServer::start(config.clone()).await.with_context(|| format!("cannot listen on {listen}"))?;
    tracing::info!(
        message = "mock provider listening",
        base_url = %server.base_url(),
        tpm = config.tpm,
        rpm = config.rpm,
        window_s = config.window.as_secs_f64(),
        bucket = %config.bucket,
        headers = %config.headers,
        limits = %config.limits,
    );
    // The base URL on stdout, alone, so a script can read it.
    println!("{}", server.base_url());
    server.run_until_stopped(shutdown).await;
    tracing::info!(message = "mock provider stopped");
    Ok(ExitCode::SUCCESS)
}
