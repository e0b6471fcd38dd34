//! The client subcommands that talk to the API: submit, watch, runs, status, pacer
//! (not built yet).

use std::process::ExitCode;

/// `paceline submit FILE|-`.
#[derive(Debug, clap::Args)]
pub struct SubmitArgs {}
/// `paceline watch RUN_ID`.
#[derive(Debug, clap::Args)]
pub struct WatchArgs {}
/// `paceline runs`.
#[derive(Debug, clap::Args)]
pub struct RunsArgs {}
/// `paceline status RUN_ID`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {}
/// `paceline pacer`.
#[derive(Debug, clap::Args)]
pub struct PacerArgs {}

/// Submits a run spec.
pub async fn submit(_args: SubmitArgs) -> anyhow::Result<ExitCode> {
    super::not_built("submit")
}
/// Follows a run.
pub async fn watch(_args: WatchArgs) -> anyhow::Result<ExitCode> {
    super::not_built("watch")
}
/// Lists runs.
pub async fn runs(_args: RunsArgs) -> anyhow::Result<ExitCode> {
    super::not_built("runs")
}
/// Shows one run.
pub async fn status(_args: StatusArgs) -> anyhow::Result<ExitCode> {
    super::not_built("status")
}
/// Shows the pacer state.
pub async fn pacer(_args: PacerArgs) -> anyhow::Result<ExitCode> {
    super::not_built("pacer")
}
