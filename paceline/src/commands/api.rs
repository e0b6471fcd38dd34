//! `paceline api` (not built yet).

use std::process::ExitCode;

/// Arguments of this subcommand.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the subcommand.
pub async fn run(_args: Args) -> anyhow::Result<ExitCode> {
    super::not_built("api")
}
