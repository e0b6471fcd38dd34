//! The `paceline` binary: a thin clap front. Each subcommand lives in
//! `commands/<name>.rs` with its own `Args` and an async `run` that calls the
//! library doing the work.

mod api_client;
#[cfg(feature = "mock")]
mod bench;
mod commands;
#[cfg(feature = "mock")]
mod demo;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "paceline",
    version,
    about = "A background job runner for long agentic LLM work runs, paced by one shared budget in Redis"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// All-in-one on one machine: the API and a worker pool in one process.
    #[command(after_help = shared::config::SECRETS_HELP)]
    Up(commands::up::Args),
    /// The HTTP API alone.
    #[command(after_help = shared::config::SECRETS_HELP)]
    Api(commands::api::Args),
    /// One worker process.
    #[command(after_help = shared::config::SECRETS_HELP)]
    Worker(commands::worker::Args),
    /// Submit a run spec (JSON file, or - for stdin) to the API; prints the run id.
    Submit(commands::client::SubmitArgs),
    /// Follow a run live from its event stream.
    Watch(commands::client::WatchArgs),
    /// A table of runs.
    Runs(commands::client::RunsArgs),
    /// One run.
    Status(commands::client::StatusArgs),
    /// The shared budget state(s), as the workers see them.
    Pacer(commands::client::PacerViewArgs),
    /// Tokens by kind and cost per tenant, model or UTC day.
    Usage(commands::client::UsageArgs),
    /// Dead-lettered turns, newest first (the operator's token).
    Dead(commands::client::DeadArgs),
    /// Re-drive a failed or dead-lettered run from its last committed turn.
    Retry(commands::client::RetryArgs),
    /// An OpenAI-compatible provider simulator (tests, demos, benchmarks).
    #[cfg(feature = "mock")]
    MockProvider(commands::mock::Args),
    /// The pacing benchmark.
    #[cfg(feature = "mock")]
    Bench(commands::bench::Args),
    /// A no-op turn consumer on the queue, for the queue's tests and benchmark.
    #[cfg(feature = "mock")]
    #[command(hide = true)]
    QueueProbe(commands::queue_probe::Args),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => commands::up::run(args).await,
        Command::Api(args) => commands::api::run(args).await,
        Command::Worker(args) => commands::worker::run(args).await,
        Command::Submit(args) => commands::client::submit(args).await,
        Command::Watch(args) => commands::client::watch(args).await,
        Command::Runs(args) => commands::client::runs(args).await,
        Command::Status(args) => commands::client::status(args).await,
        Command::Pacer(args) => commands::client::pacer(args).await,
        Command::Dead(args) => commands::client::dead(args).await,
        Command::Usage(args) => commands::client::usage(args).await,
        Command::Retry(args) => commands::client::retry(args).await,
        #[cfg(feature = "mock")]
        Command::MockProvider(args) => commands::mock::run(args).await,
        #[cfg(feature = "mock")]
        Command::Bench(args) => {
            // Stopped by a signal, it ends its own Redis and worker processes
            // (dropped with the trial), rather than leave them running.
            let stop = commands::shutdown_signal();
            tokio::select! {
                done = commands::bench::run(args) => done,
                () = stop => Err(anyhow::anyhow!("stopped by a signal: its Redis and worker processes are ended")),
            }
        }
        #[cfg(feature = "mock")]
        Command::QueueProbe(args) => commands::queue_probe::run(args).await,
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("paceline: {error:#}");
            ExitCode::FAILURE
        }
    }
}
