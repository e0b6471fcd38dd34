//! `paceline up`: everything on one machine — the API and a worker pool in one
//! process, with a Redis found or started for them.
//!
//! Which Redis: `REDIS_URL` (or `REDIS_URL_FILE`) when set; else a private
//! `redis-server` child (127.0.0.1, a free port, a generated password, data
//! and AOF under `./.paceline/redis`) that stops when `up` stops — never an
//! open Redis it cannot tell is its own (`up/redis.rs`). Each choice is said
//! on stderr. With no `redis-server` to start, `up` exits naming how to
//! install one.
//!
//! `--demo` adds the mock provider and a tool endpoint in-process (see
//! `crate::demo`), points the workers at them, submits the sample runs through
//! the API and shows them progressing, then keeps serving until Ctrl-C. A build
//! without the `mock` feature has no `--demo`.
//!
//! Shutdown (SIGINT/SIGTERM): the API stops taking requests, the workers finish
//! or hand back their turns, then the demo servers and a private Redis stop —
//! Redis last, so the drain can still commit. The child runs in its own process
//! group so a terminal's Ctrl-C does not reach it before the workers are done.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use shared::config::{PacerArgs, RedisArgs};
use shared::queue::QueueConfig;
use shared::runs::RunArgs;
use tokio::sync::watch;
use worker::config::{KeySource, ProviderArgs};

#[cfg(feature = "mock")]
use crate::demo::{self, DemoArgs};

/// Arguments of `paceline up`: what `paceline api` and `paceline worker` take,
/// from one set of flags — the same argument groups, flattened once each.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Redis URL: `REDIS_URL` or `REDIS_URL_FILE` in the environment only
    /// (`shared::config::env_only`). Unset: a private redis-server with a
    /// generated password.
    #[arg(skip = shared::config::env_only::<String>("REDIS_URL"))]
    redis_url: Option<String>,
    /// A Redis Cluster's seed nodes (`PACELINE_REDIS_CLUSTER_NODES`, the
    /// environment only): when given, `up` runs on that cluster and starts
    /// no Redis of its own.
    #[arg(skip = shared::config::env_only::<shared::config::ClusterNodes>("PACELINE_REDIS_CLUSTER_NODES").unwrap_or_default())]
    cluster_nodes: shared::config::ClusterNodes,
    /// Queue partitions: only 1 is built (`shared::config::RedisArgs::check`).
    #[arg(long = "queue-partitions", env = "PACELINE_QUEUE_PARTITIONS", default_value_t = 1)]
    partitions: u32,
    /// Prefix of every Redis key [default: paceline; paceline-demo with --demo, so demo runs never reach real workers].
    #[arg(long = "prefix", env = "PACELINE_PREFIX")]
    prefix: Option<String>,
    /// Where a private redis-server keeps its data (`DIR/redis`).
    #[arg(long = "data-dir", env = "PACELINE_DATA_DIR", default_value = ".paceline")]
    data_dir: PathBuf,
    /// The API: where it listens, tokens, body limit.
    #[command(flatten)]
    serve: api::config::ServeArgs,
    /// The operator's token, and the open-mode safety catch.
    #[command(flatten)]
    access: api::config::AccessArgs,
    /// Bounds on the API's event streams.
    #[command(flatten)]
    streams: api::config::StreamArgs,
    /// Per-tenant quotas on submits.
    #[command(flatten)]
    quotas: shared::runs::Quotas,
    /// Tool endpoints and retention (the API's and the workers').
    #[command(flatten)]
    runs: RunArgs,
    /// The provider.
    #[command(flatten)]
    provider: Box<ProviderArgs>,
    /// The pacer.
    #[command(flatten)]
    pacer: Box<PacerArgs>,
    /// The queue's leases and batches.
    #[command(flatten)]
    queue: Box<QueueConfig>,
    /// Worker slots and history depth.
    #[command(flatten)]
    slots: worker::SlotArgs,
    /// Tenants' spend caps per day.
    #[command(flatten)]
    spend: worker::SpendArgs,
    /// How completion webhooks are sent.
    #[command(flatten)]
    webhooks: worker::webhooks::WebhookArgs,
    /// Also start the mock provider and a demo tool endpoint, submit the sample runs, and show them progressing.
    #[cfg(feature = "mock")]
    #[arg(long)]
    demo: bool,
    #[cfg(feature = "mock")]
    #[command(flatten)]
    demo_args: Box<DemoArgs>,
    /// Where to look for a running Redis when REDIS_URL is unset (tests point it at a free port).
    #[arg(long = "local-redis-probe", hide = true, default_value = "127.0.0.1:6379")]
    local_redis_probe: SocketAddr,
}

impl Args {
    /// Whether `--demo` was given.
    #[cfg(feature = "mock")]
    fn demo(&self) -> bool {
        self.demo
    }

    /// Never, in a build without the `mock` feature.
    #[cfg(not(feature = "mock"))]
    fn demo(&self) -> bool {
        false
    }
}

/// A build without the `mock` feature has no demo: this stands in for
/// `crate::demo::Demo`, and no value of it can exist.
#[cfg(not(feature = "mock"))]
mod demo {
    pub enum Demo {}

    impl Demo {
        pub fn tool_endpoint(&self) -> String {
            match *self {}
        }
        pub fn mcp_server(&self) -> String {
            match *self {}
        }
        pub fn providers(&self) -> shared::providers::ProviderTable {
            match *self {}
        }
        pub fn describe(&self) -> String {
            match *self {}
        }
        pub async fn stop(self) {
            match self {}
        }
    }
}

/// Runs the subcommand until SIGINT/SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<ExitCode> {
    // The demo draws progress lines on stderr: only warnings interrupt them.
    // Logs, and traces when OTEL_EXPORTER_OTLP_ENDPOINT is set (flushed when `_traces` goes).
    let _traces = worker::traces::init(if args.demo() { "warn" } else { "info" }, "paceline")?;
    let (stop_tx, stop_rx) = watch::channel(false);
    {
        let stop_tx = stop_tx.clone();
        let signal = super::shutdown_signal();
        tokio::spawn(async move {
            signal.await;
            let _ = stop_tx.send(true);
        });
    }
    let prefix =
        args.prefix.clone().unwrap_or_else(|| if args.demo() { "paceline-demo" } else { "paceline" }.to_owned());
    // Partitions not built are refused before a Redis is started for them.
    shared::config::check_partitions(args.partitions).map_err(anyhow::Error::msg)?;
    let (mut redis_args, redis) = if args.cluster_nodes.0.is_empty() {
        let redis = tokio::select! {
            r = find_redis(&args) => r?,
            _ = stopped(stop_rx.clone()) => return Ok(ExitCode::SUCCESS),
        };
        (RedisArgs::new(redis.url(), prefix), Some(redis))
    } else {
        (RedisArgs::new(String::new(), prefix).on_cluster(args.cluster_nodes.0.clone()), None)
    };
    redis_args.partitions = args.partitions;
    let result = serve(&args, redis_args, stop_tx, stop_rx).await;
    // Last: the drain above may still have been committing into it.
    if let Some(redis) = redis {
        redis.stop().await;
    }
    result?;
    say("stopped");
    Ok(ExitCode::SUCCESS)
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn say(line: impl AsRef<str>) {
    eprintln!("paceline up: {}", line.as_ref());
}

/// The API, the worker pool and the demo, until `stop`.
async fn serve(
    args: &Args,
    redis: RedisArgs,
    stop_tx: watch::Sender<bool>,
    stop_rx: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    #[cfg(feature = "mock")]
    let demo = if args.demo { Some(demo::Demo::start(&args.demo_args).await?) } else { None };
    #[cfg(not(feature = "mock"))]
    let demo: Option<demo::Demo> = None;
    let mut runs = args.runs.clone();
    let mut provider = (*args.provider).clone();
    let mut keys = KeySource::Environment;
    if let Some(d) = &demo {
        runs.tool_endpoints = runs.tool_endpoints.with(None, d.tool_endpoint());
        runs.mcp_endpoints = runs.mcp_endpoints.with(None, d.mcp_server());
        // One provider per wire style, each its own mock and budget.
        provider = ProviderArgs::single(String::new(), shared::runs::ApiStyle::Responses);
        provider.named.providers = d.providers();
        // The mocks need no key: a real one is not sent to them.
        keys = KeySource::Given(Default::default());
    } else {
        warn_missing_keys(&provider, &args.pacer);
    }
    let api_config = api::ApiConfig {
        redis: redis.clone(),
        serve: args.serve.clone(),
        runs: runs.clone(),
        providers: provider.named.clone(),
        access: args.access.clone(),
        streams: args.streams.clone(),
        quotas: args.quotas.clone(),
        first_ask: Some(worker::turn::first_ask(&provider.named.providers)),
    };
    let worker_config = worker::WorkerConfig {
        redis: redis.clone(),
        runs,
        provider: provider.clone(),
        pacer: (*args.pacer).clone(),
        queue: (*args.queue).clone(),
        slots: args.slots.clone(),
        spend: args.spend.clone(),
        webhooks: args.webhooks.clone(),
        keys,
        bench_deliveries_key: None,
    };
    let providers = describe_providers(&provider);
    let app = match api::Application::build(api_config).await {
        Ok(app) => app,
        Err(e) => {
            if let Some(d) = demo {
                d.stop().await;
            }
            return Err(e);
        }
    };
    let addr = app.local_addr();
    // Either half ending on its own (an error) stops the other.
    let api_task = tokio::spawn({
        let (tx, rx) = (stop_tx.clone(), stop_rx.clone());
        async move {
            let r = app.run_until_stopped(stopped(rx)).await;
            let _ = tx.send(true);
            r
        }
    });
    let worker_task = tokio::spawn({
        let (tx, rx) = (stop_tx.clone(), stop_rx.clone());
        async move {
            let r = worker::run(worker_config, stopped(rx)).await;
            let _ = tx.send(true);
            r
        }
    });
    say(format!(
        "API on http://{addr}, {} worker slots, Redis {} (prefix {}), {providers}",
        args.slots.concurrency.max(1),
        redis.describe(),
        redis.prefix,
    ));
    say(format!("dashboard on http://{addr}/ (runs, the budget, the fleet, in a browser)"));
    let mut demo_result = Ok(());
    if let Some(d) = &demo {
        say(d.describe());
        demo_result = run_demo(args, d, addr, stop_rx.clone()).await;
        if demo_result.is_err() {
            let _ = stop_tx.send(true);
        }
    }
    if !*stop_rx.borrow() {
        say("serving until Ctrl-C (SIGINT) or SIGTERM");
    }
    stopped(stop_rx).await;
    say("stopping: the API closes, the workers finish or hand back their turns…");
    let api_result = api_task.await.context("the API task")?;
    let worker_result = worker_task.await.context("the worker task")?;
    if let Some(d) = demo {
        d.stop().await;
    }
    api_result.context("the API")?;
    worker_result.context("the worker pool")?;
    demo_result
}

/// Says which provider has no key where the real service needs one.
fn warn_missing_keys(provider: &ProviderArgs, pacer: &PacerArgs) {
    let Ok(resolved) = provider.resolve(&pacer.budget, pacer, &KeySource::Environment) else { return };
    for p in resolved.iter().filter(|p| p.key.is_empty()) {
        let service = ["api.openai.com", "api.anthropic.com"].into_iter().find(|host| p.url.contains(host));
        if let Some(host) = service {
            say(format!(
                "provider {}: {} is not set: turns sent to {host} will fail. Set it, point the provider at another \
                 server, or try `paceline up --demo`.",
                p.name, p.key_source
            ));
        }
    }
}

/// `provider https://…` or `providers a (responses, https://…), b (…)`.
fn describe_providers(provider: &ProviderArgs) -> String {
    let table = &provider.named.providers;
    if table.is_empty() {
        let style = provider.api_style;
        let url = provider.url.clone().unwrap_or_else(|| shared::providers::default_url(style).to_owned());
        return format!("provider {url} ({})", style.as_str());
    }
    let list: Vec<String> = table.0.iter().map(|p| format!("{} ({}, {})", p.name, p.style.as_str(), p.url)).collect();
    format!("providers {}", list.join(", "))
}

/// Without the `mock` feature there is no demo to run.
#[cfg(not(feature = "mock"))]
async fn run_demo(_: &Args, d: &demo::Demo, _: SocketAddr, _: watch::Receiver<bool>) -> anyhow::Result<()> {
    match *d {}
}

/// Submits the examples, follows them to the end, then says what to try next.
#[cfg(feature = "mock")]
async fn run_demo(args: &Args, d: &demo::Demo, addr: SocketAddr, stop: watch::Receiver<bool>) -> anyhow::Result<()> {
    let (mut examples, source) = demo::load_examples(&args.demo_args.examples, &d.tool_endpoint(), &d.mcp_server())?;
    demo::assign_providers(&mut examples);
    let token = args.serve.tokens.0.first().map(|(_, t)| t.clone());
    let client = crate::api_client::ApiClient::new(&format!("http://{addr}"), token)?;
    say(format!("submitting {} sample runs from {source} through the API:", examples.len()));
    let started = std::time::Instant::now();
    let finals = demo::drive(&client, &examples, stop.clone()).await?;
    if *stop.borrow() {
        return Ok(());
    }
    let completed = finals.values().filter(|s| **s == shared::runs::RunStatus::Completed).count();
    let (calls, limited) = d.provider_counts();
    say(format!(
        "all {} demo runs finished in {:.1} s ({completed} completed); the mock providers answered {calls} calls, {limited} of them 429s",
        finals.len(),
        started.elapsed().as_secs_f64()
    ));
    let bin = invocation();
    let api_flag = if args.serve.listen.to_string() == api::config::DEFAULT_LISTEN {
        String::new()
    } else {
        format!(" --api http://{addr}")
    };
    let example_file = args.demo_args.examples.join("browse-work.json");
    let submit = if example_file.is_file() && d.tool_endpoint() == demo::EXAMPLES_TOOL_ENDPOINT {
        format!("{bin} submit {}{api_flag} --watch", example_file.display())
    } else {
        format!("echo '{{\"model\":\"gpt-4.1-mini\",\"input\":\"Say hello\"}}' | {bin} submit -{api_flag} --watch")
    };
    eprintln!(
        "\nThe API stays up until Ctrl-C. Open the dashboard at http://{addr}/ or try:\n  \
         {bin} runs{api_flag}\n  \
         {submit}\n  \
         echo '{{\"model\":\"claude-sonnet-4-5\",\"provider\":\"anthropic\",\"input\":\"Say hello\"}}' | {bin} submit -{api_flag} --watch\n  \
         {bin} pacer{api_flag}\n  \
         curl -s http://{addr}/v1/runs\n  \
         curl -s http://{addr}/v1/queue\n  \
         curl -s -X POST http://{addr}/v1/runs -H 'content-type: application/json' -d '{{\"model\":\"gpt-4.1-mini\",\"input\":\"Say hello\"}}'\n"
    );
    Ok(())
}

/// How the user ran this binary, for copy-paste: relative to the current
/// directory when it lies under it (`./target/release/paceline`).
#[cfg(feature = "mock")]
fn invocation() -> String {
    let Ok(exe) = std::env::current_exe() else { return "paceline".into() };
    if let Ok(cwd) = std::env::current_dir() {
        if let Ok(rel) = exe.strip_prefix(&cwd) {
            return format!("./{}", rel.display());
        }
    }
    exe.display().to_string()
}

mod redis;

use redis::find_redis;

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory as _, Parser as _};

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        up: Args,
    }

    #[test]
    fn the_flags_of_api_worker_and_demo_fit_in_one_command() {
        Cli::command().debug_assert();
        #[cfg(feature = "mock")]
        {
            let cli = Cli::try_parse_from(["up", "--concurrency", "4", "--demo", "--demo-tpm", "5000", "--tpm", "900"])
                .unwrap();
            assert_eq!(cli.up.slots.concurrency, 4);
            assert!(cli.up.demo);
            assert_eq!(cli.up.demo_args.demo_tpm, 5000);
            assert_eq!(cli.up.pacer.tpm, Some(900));
            assert_eq!(cli.up.serve.listen.to_string(), "127.0.0.1:8080");
        }
        let cli = Cli::try_parse_from(["up", "--workers", "2", "--retention", "90", "--floor-pct", "1"]).unwrap();
        assert_eq!((cli.up.slots.concurrency, cli.up.pacer.companion_floor_pct), (2, 1.0), "the old names still parse");
    }
}
