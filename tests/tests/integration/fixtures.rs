//! The fixtures the test modules share, so that none reaches into another:
//! [`App`] (a private Redis, the mock provider, a tool endpoint, a run store
//! and in-process or process workers on them) and its helpers, and the
//! provider-call helpers of the provider-client tests.

use std::net::SocketAddr;
use std::time::Duration;

use mock_provider::{MockConfig, MockServer};
use paceline_tests::{poll_until, unique_prefix, within, ChildGuard, RedisServer};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::keys::Keys;
use shared::runs::{ApiStyle, Run, RunSpec, RunStore, SubmitPolicy, ToolEndpoints};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use worker::provider::{CallFailure, CallSuccess, Provider, StreamEvent};

/// The tenant [`App::submit`] submits as.
pub(crate) const TENANT: &str = "default";

/// A tool endpoint: `browser__snapshot` answers 30 000 characters (over its
/// cap), `big` 20 000, anything else a short echo.
async fn tool_server() -> SocketAddr {
    async fn tool(axum::Json(call): axum::Json<Value>) -> axum::Json<Value> {
        let name = call["name"].as_str().unwrap_or_default();
        let output = match name {
            "browser__snapshot" => format!("<html>{}</html>", "b".repeat(30_000)),
            "big" => "x".repeat(20_000),
            _ => format!("ok {}", call["arguments"].as_str().unwrap_or_default()),
        };
        axum::Json(json!({ "output": output }))
    }
    serve(axum::Router::new().route("/tools", axum::routing::post(tool))).await
}

/// Serves `tool` as a tool endpoint (`POST /tools`) on a free port of
/// 127.0.0.1, and returns its URL.
pub(crate) async fn tool_endpoint<H, T>(tool: H) -> String
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    let addr = serve(axum::Router::new().route("/tools", axum::routing::post(tool))).await;
    format!("http://{addr}/tools")
}

/// Serves `app` on a free port of 127.0.0.1 (the tests' tool endpoints).
pub(crate) async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.ok() });
    addr
}

/// One test's world: a private Redis and key prefix, the mock provider, a
/// tool endpoint, a run store, and the workers started on them.
pub(crate) struct App {
    pub(crate) redis: RedisServer,
    pub(crate) prefix: String,
    pub(crate) mock: MockServer,
    pub(crate) store: RunStore,
    pub(crate) tools: String,
    /// The provider names runs may give (empty: the one `default`).
    pub(crate) providers: Vec<String>,
    workers: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl App {
    /// An API on this app's Redis and prefix with these tenants (name, token)
    /// and operator token, allowing the app's tool endpoint: its URL, and the
    /// sender that stops it (dropped, it stops too).
    pub(crate) async fn tenant_api(&self, tenants: &[(&str, &str)], operator: &str) -> (String, oneshot::Sender<()>) {
        let mut config =
            api::ApiConfig::new("127.0.0.1:0".parse().unwrap(), RedisArgs::new(self.redis.url(), self.prefix.clone()));
        config.serve.tokens =
            tenants.iter().fold(api::config::ApiTokens::default(), |tokens, (name, token)| tokens.with(*name, *token));
        config.access.operator_token = Some(shared::config::Secret::new(operator));
        config.runs.tool_endpoints = ToolEndpoints::every_tenant([self.tools.clone()]);
        let built = api::Application::build(config).await.expect("build the API");
        let url = format!("http://{}", built.local_addr());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(built.run_until_stopped(async {
            let _ = stopped.await;
        }));
        (url, stop)
    }

    pub(crate) async fn start(mock: MockConfig) -> Self {
        Self::start_on(RedisServer::start(), mock).await
    }

    /// [`App::start`] on a given Redis (e.g. one with AOF, to restart it).
    pub(crate) async fn start_on(redis: RedisServer, mock: MockConfig) -> Self {
        shared::telemetry::init("error");
        let prefix = unique_prefix();
        let mock = MockServer::start(MockConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            keep_bodies: mock.keep_bodies.max(200),
            ..mock
        })
        .await
        .unwrap();
        let conn = shared::redis_util::manager(&redis.url()).await.unwrap();
        let store = RunStore::new(conn, Keys::new(&prefix), Duration::from_secs(600));
        let tools = format!("http://{}/tools", tool_server().await);
        Self { redis, prefix, mock, store, tools, providers: vec![], workers: vec![] }
    }

    pub(crate) fn config(&self) -> worker::WorkerConfig {
        let mut c = worker::WorkerConfig::new(RedisArgs::new(self.redis.url(), &self.prefix), self.mock.base_url());
        c.runs.tool_endpoints = shared::runs::ToolEndpoints::every_tenant([self.tools.clone()]);
        c.queue.lease_ms = 2_000;
        c
    }

    /// Starts an in-process worker (apalis runtime over the queue).
    pub(crate) fn spawn_worker(&mut self, config: worker::WorkerConfig) {
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            worker::run(config, async move {
                let _ = rx.await;
            })
            .await
            .expect("worker");
        });
        self.workers.push((tx, handle));
    }

    /// A `paceline worker` process on this app's Redis, mock and tools, with
    /// `args` after the common ones (killed when dropped).
    pub(crate) fn worker_process(&self, args: &[&str], rust_log: &str) -> ChildGuard {
        self.worker_process_with(args, &[], rust_log)
    }

    /// [`App::worker_process`] with `env` set too (secrets, `OTEL_*`).
    pub(crate) fn worker_process_with(&self, args: &[&str], env: &[(&str, &str)], rust_log: &str) -> ChildGuard {
        ChildGuard(self.worker_command(args, env, rust_log).spawn().expect("start paceline worker"))
    }

    /// The command [`App::worker_process_with`] runs (its logs, on stderr, to
    /// be sent elsewhere).
    pub(crate) fn worker_command(&self, args: &[&str], env: &[(&str, &str)], rust_log: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new(paceline_tests::paceline_bin());
        cmd.arg("worker")
            .args(["--prefix", &self.prefix])
            .env("REDIS_URL", self.redis.url())
            .args(["--provider-url", &self.mock.base_url(), "--tool-endpoints", &self.tools])
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", rust_log)
            .stdout(std::process::Stdio::null());
        cmd
    }

    pub(crate) async fn submit(&self, body: Value) -> Run {
        let policy = SubmitPolicy {
            tool_endpoints: ToolEndpoints::every_tenant([self.tools.clone()]),
            providers: self.providers.clone(),
            ..SubmitPolicy::default()
        };
        let spec = RunSpec::from_json(&body, &policy).expect("valid spec");
        // Its first turn carries its ask, as the API's submit gives it (`paceline api`, `up`).
        let first_ask = Some(worker::turn::first_ask(&Default::default()).ask(&spec, TENANT));
        self.store.create(TENANT, &spec, None, first_ask).await.unwrap().run
    }

    pub(crate) async fn wait_finished(&self, id: &str, timeout: Duration) -> Run {
        wait_finished_for(self, TENANT, id, timeout).await
    }

    /// Stops the in-process workers: each must drain and return within 15 s;
    /// one that panicked or hangs fails the test.
    pub(crate) async fn stop_workers(&mut self) {
        for (tx, handle) in self.workers.drain(..) {
            let _ = tx.send(());
            match tokio::time::timeout(Duration::from_secs(15), handle).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => panic!("a worker panicked: {error}"),
                Err(_) => panic!("a worker did not stop within 15 s of its shutdown"),
            }
        }
    }
}

/// The `function_call_output` texts of a run's transcript (tenant `default`).
pub(crate) async fn tool_outputs(app: &App, run_id: &str) -> Vec<String> {
    let tx = app.store.transcript("default", run_id).await.unwrap().unwrap();
    tx.iter()
        .filter(|e| e.item["type"] == "function_call_output")
        .map(|e| e.item["output"].as_str().unwrap().to_owned())
        .collect()
}

pub(crate) fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

pub(crate) fn tool_run(app: &App, tool: &str) -> Value {
    json!({
        "model": "gpt-test",
        "instructions": "You are a test.",
        "input": "do the task",
        "tools": [{"type": "function", "name": tool, "description": "a tool",
                   "parameters": {"type": "object", "properties": {}}}],
        "tool_endpoint": app.tools,
        "max_turns": 10,
        "max_output_tokens": 64,
    })
}

/// Submits `n` runs calling tool `lookup`, run `i`'s input `input(i)`, each
/// answer at most `max_output_tokens`: their ids, in order.
pub(crate) async fn submit_tool_runs(
    app: &App,
    n: usize,
    input: impl Fn(usize) -> String,
    max_output_tokens: u64,
) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let mut body = tool_run(app, "lookup");
        body["input"] = json!(input(i));
        body["max_output_tokens"] = json!(max_output_tokens);
        ids.push(app.submit(body).await.id);
    }
    ids
}

/// Waits (bounded) for a run of `tenant` to finish.
/// A run that does not finish in time fails the test with the run and every
/// key of the test's prefix printed (the queue's and the pacer's state), so
/// a stall in CI leaves what it held behind it.
pub(crate) async fn wait_finished_for(app: &App, tenant: &str, id: &str, timeout: Duration) -> Run {
    let finished = poll_until(timeout, || async {
        let run = app.store.get(tenant, id).await.ok()??;
        run.status.is_finished().then_some(run)
    })
    .await;
    match finished {
        Some(run) => run,
        None => {
            let run = app.store.get(tenant, id).await;
            let dump = paceline_tests::dump_redis(&app.redis.url(), &format!("*{}*", app.prefix)).await;
            panic!("timed out after {timeout:?} waiting for run {id} to finish; it is {run:?}\n{dump}")
        }
    }
}

// ------------------------------------------------------------------ provider calls

/// A request body in `style`, offering a `search` tool when `tools`.
pub(crate) fn body(style: ApiStyle, tools: bool) -> Value {
    let params = json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]});
    match style {
        ApiStyle::Responses => {
            let mut b = json!({"model": "gpt-test", "instructions": "Be brief.", "store": false,
                               "input": [{"role": "user", "content": "What is paceline?"}],
                               "max_output_tokens": 500});
            if tools {
                b["tools"] = json!([{"type": "function", "name": "search", "parameters": params}]);
            }
            b
        }
        ApiStyle::Chat => {
            let mut b = json!({"model": "gpt-test", "max_completion_tokens": 500,
                               "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is paceline?"}]});
            if tools {
                b["tools"] = json!([{"type": "function", "function": {"name": "search", "parameters": params}}]);
            }
            b
        }
        ApiStyle::Anthropic => {
            let mut b = json!({"model": "claude-test", "max_tokens": 500, "system": "Be brief.",
                               "messages": [{"role": "user", "content": "What is paceline?"}]});
            if tools {
                b["tools"] = json!([{"name": "search", "input_schema": params}]);
            }
            b
        }
    }
}

/// One call, bounded; the events the callback saw, and the result.
pub(crate) async fn call(provider: &Provider, body: Value) -> (Vec<StreamEvent>, Result<CallSuccess, CallFailure>) {
    let mut events = Vec::new();
    let result = within("a provider call", Duration::from_secs(15), provider.call(body, &mut |e| events.push(e))).await;
    (events, result)
}

// ------------------------------------------------------------------ the fixtures' own checks

// `App::stop_workers` is what catches a worker that panicked or does not
// stop: every test that starts in-process workers ends with it.

#[tokio::test]
#[should_panic(expected = "a worker panicked")]
async fn stop_workers_fails_on_a_worker_that_panicked() {
    let mut app = App::start(MockConfig::default()).await;
    let (tx, _rx) = oneshot::channel::<()>();
    app.workers.push((tx, tokio::spawn(async { panic!("boom") })));
    app.stop_workers().await;
}

#[tokio::test]
#[should_panic(expected = "did not stop within 15 s")]
async fn stop_workers_fails_on_a_worker_that_hangs() {
    let mut app = App::start(MockConfig::default()).await;
    let (tx, _rx) = oneshot::channel::<()>();
    app.workers.push((tx, tokio::spawn(std::future::pending::<()>())));
    app.stop_workers().await;
}

/// What the queue and the pacer held, sampled every 100 ms while a workload
/// runs: printed when a test finds the fleet idle with work left, so a stall
/// seen once (on a loaded CI machine) says where the wake-up went.
pub(crate) struct QueueTrace {
    samples: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl QueueTrace {
    /// Starts sampling `app`'s queue and pacer keys.
    pub(crate) async fn start(app: &App) -> Self {
        let mut conn = app.redis.conn().await;
        let keys = shared::queue::QueueKeys::new(&Keys::new(app.prefix.clone()));
        // (Every budget and model: `{*}` matches the budget in its braces.)
        let state_pattern = Keys::new(app.prefix.clone()).pacer_state("*", "*");
        let url = app.redis.url();
        let samples = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let started = std::time::Instant::now();
            for i in 0u64.. {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let sample = async {
                    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await?;
                    let now = secs * 1000 + micros / 1000;
                    let due: u64 = redis::cmd("ZCARD").arg(&keys.due).query_async(&mut conn).await?;
                    let head: Vec<(String, f64)> = redis::cmd("ZRANGE")
                        .arg(&keys.due)
                        .arg(0)
                        .arg(2)
                        .arg("WITHSCORES")
                        .query_async(&mut conn)
                        .await?;
                    let leased: u64 = redis::cmd("ZCARD").arg(&keys.lease).query_async(&mut conn).await?;
                    let tokens: Vec<String> =
                        redis::cmd("LRANGE").arg(&keys.notify).arg(0).arg(5).query_async(&mut conn).await?;
                    let timer: Option<String> = redis::cmd("GET").arg(&keys.timer).query_async(&mut conn).await?;
                    let head: Vec<String> =
                        head.iter().map(|(id, at)| format!("{id}@{:+}", *at as i64 - now)).collect();
                    let timer = timer.map(|t| match t.split_once('|') {
                        Some((at, who)) => {
                            format!("{:+}|{}", at.parse::<i64>().unwrap_or(0) - now, &who[..who.len().min(12)])
                        }
                        None => t,
                    });
                    let mut line = format!(
                        "t={:>6} ms leased={leased} due={due} head={head:?} timer={timer:?} tokens={tokens:?}",
                        started.elapsed().as_millis()
                    );
                    if i % 10 == 0 {
                        // The pacer's state, once a second (its records are packed: `dump_redis` escapes them).
                        line.push('\n');
                        line.push_str(&paceline_tests::dump_redis(&url, &state_pattern).await);
                    }
                    Ok::<_, redis::RedisError>(line)
                };
                match sample.await {
                    Ok(line) => out.lock().unwrap().push(line),
                    Err(error) => out.lock().unwrap().push(format!("sample failed: {error}")),
                }
            }
        });
        Self { samples, task }
    }

    /// Every sample so far, one a line.
    pub(crate) fn report(&self) -> String {
        self.samples.lock().unwrap().join("\n")
    }
}

impl Drop for QueueTrace {
    fn drop(&mut self) {
        self.task.abort();
    }
}
