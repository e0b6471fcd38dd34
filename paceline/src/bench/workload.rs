//! What a bench submits and what serves it: the run bodies (one tool offered,
//! so the mock answers `turns - 1` tool rounds and then text), a tiny tool
//! endpoint (in-process axum), and the API itself, in-process, that the runs
//! are POSTed to — the same code path a client's submit takes.

use anyhow::Context as _;
use futures::StreamExt as _;
use serde_json::{json, Value};
use shared::config::RedisArgs;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Instructions resent on every turn (~150 tokens by the mock's chars/4).
const INSTRUCTIONS: &str = "You are a careful research assistant working through a long background task. \
Read the task, decide which facts you still need, and call the lookup tool for each one before you answer. \
Keep a short running summary of what you learned, cite the notes you used, and never invent a figure. \
When you have enough, answer in a few plain sentences, naming what is still uncertain and why.";

/// What each tool call answers (~190 tokens by the mock's count).
const TOOL_OUTPUT: &str = "Reference note: the scheduler keeps due times on the server clock in milliseconds, \
a lease per delivery with a fencing epoch, and a shared token budget per model. Calls that would overdraw \
the budget wait for exactly the time the refill needs, then go in order of their bookings. Workers on other \
hosts read the same state, so a burst from one of them is seen by all before the next call goes out. \
A call refused anyway closes the window for everyone until the provider's reset, and its turn comes back \
after the server's delay plus a small jitter, never earlier, so the retries do not return as one herd.";

/// The run's task (~100 tokens); `{i}` makes each run's text its own.
fn task_text(i: usize) -> String {
    format!(
        "Task {i}: compare how three background job runners pace calls to a rate-limited API, \
         using the lookup tool for each runner's notes, then say which one wastes the least of the budget \
         when many workers share one account, and which failure each one handles worst."
    )
}

/// Padding for runs whose input is longer than their task (`--input-chars`).
const BACKGROUND: &str = " Background: the team runs many long agent sessions at once on one provider account, \
each turn resending its instructions, its history and every tool result, so the account's tokens-per-minute \
budget is what every process competes for.";

/// The shape of the runs a bench submits.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Runs to submit.
    pub runs: usize,
    /// Turns per run: `turns - 1` tool rounds, then a text answer.
    pub turns: u32,
    /// `max_output_tokens` of each call (reserved by the pacer, charged then refunded by the mock).
    pub max_output_tokens: u32,
    /// Words of the final answer (mock `output_tokens`).
    pub answer_tokens: u64,
    /// The model name.
    pub model: String,
    /// Characters of each run's input: its task padded with background text
    /// (0: the task alone, ~100 tokens).
    pub input_chars: usize,
    /// Runs call [`LONG_TOOL`], whose output is a few thousand characters,
    /// instead of `lookup`.
    pub long_outputs: bool,
    /// The runs' `prompt_cache` (`None`: not given, the default `auto`).
    pub prompt_cache: Option<&'static str>,
}

/// The tool of the long runs: its output is [`TOOL_OUTPUT`] this many times
/// (~3 400 characters).
pub const LONG_TOOL: &str = "read_notes";
const LONG_OUTPUT_REPEATS: usize = 5;

impl Workload {
    /// Turns the whole workload takes when every run completes.
    pub fn total_turns(&self) -> u64 {
        self.runs as u64 * self.turns as u64
    }

    /// The mock's script for this workload: `(tool_rounds, output_tokens)`.
    pub fn mock_script(&self) -> (usize, u64) {
        (self.turns.saturating_sub(1) as usize, self.answer_tokens)
    }

    /// Run `i`'s input: its task, padded to `input_chars`.
    fn input(&self, i: usize) -> String {
        let mut text = task_text(i);
        while text.len() < self.input_chars {
            text.push_str(BACKGROUND);
        }
        if text.len() > self.input_chars.max(task_text(i).len()) {
            text.truncate(self.input_chars); // ASCII: any length is a char boundary
        }
        text
    }

    /// The `POST /v1/runs` body of run `i`.
    pub fn body(&self, i: usize, tool_endpoint: &str, label: &str) -> Value {
        let tool = if self.long_outputs { LONG_TOOL } else { "lookup" };
        let mut body = json!({
            "model": self.model,
            "instructions": INSTRUCTIONS,
            "input": self.input(i),
            "tools": [{
                "type": "function",
                "name": tool,
                "description": "Look a topic up in the reference notes.",
                "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}
            }],
            "tool_endpoint": tool_endpoint,
            "mode": "work",
            "max_turns": self.turns.max(1),
            "max_output_tokens": self.max_output_tokens,
            "metadata": {"bench": label, "i": i.to_string()},
        });
        if let Some(cache) = self.prompt_cache {
            body["prompt_cache"] = cache.into();
        }
        body
    }
}

/// An in-process HTTP server that stops when dropped or on `stop`.
#[derive(Debug)]
pub struct Served {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Served {
    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting and waits (bounded) for the server to end.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The tool endpoint: `POST /tools` answers the same short note at once.
pub async fn tool_server() -> anyhow::Result<Served> {
    // `read_notes` (the long runs' tool) answers a few thousand characters;
    // every other tool the short note.
    let app = axum::Router::new().route(
        "/tools",
        axum::routing::post(|axum::Json(call): axum::Json<Value>| async move {
            let output =
                if call["name"] == LONG_TOOL { TOOL_OUTPUT.repeat(LONG_OUTPUT_REPEATS) } else { TOOL_OUTPUT.into() };
            axum::Json(json!({"output": output}))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("bind the tool endpoint")?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    Ok(Served { addr, stop: Some(stop), task: Some(task) })
}

/// The API (`api::Application`) in this process on a free port, over `redis`,
/// allowing tool endpoints under `tool_prefix`, with `tokens` (`tenant`,
/// `token`) or, when empty, in open mode (tenant `default`).
pub async fn api_server(redis: RedisArgs, tool_prefix: &str, tokens: &[(String, String)]) -> anyhow::Result<Served> {
    let mut config = api::ApiConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), redis);
    // The backlog trial submits up to 100 000 runs at once, as one tenant.
    config.quotas = shared::runs::Quotas::unbounded();
    config.runs.tool_endpoints = shared::runs::ToolEndpoints::every_tenant([tool_prefix]);
    for (tenant, token) in tokens {
        config.serve.tokens = config.serve.tokens.with(tenant.clone(), token.clone());
    }
    config.first_ask = Some(worker::turn::first_ask(&Default::default()));
    let app = api::Application::build(config).await?;
    let addr = app.local_addr();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(error) = app.run_until_stopped(shutdown).await {
            tracing::error!(message = "the bench's API stopped", %error);
        }
    });
    Ok(Served { addr, stop: Some(stop), task: Some(task) })
}

/// Submits `bodies` through `api`, `parallel` at a time; returns the run ids
/// in submit order. Any refusal fails the bench: a bench whose runs were
/// refused measures nothing.
pub async fn submit_all(
    api: &crate::api_client::ApiClient,
    bodies: Vec<Value>,
    parallel: usize,
) -> anyhow::Result<Vec<String>> {
    Ok(submit_all_timed(api, bodies, parallel).await?.into_iter().map(|(id, _)| id).collect())
}

/// [`submit_all`], with how long each submit took.
pub async fn submit_all_timed(
    api: &crate::api_client::ApiClient,
    bodies: Vec<Value>,
    parallel: usize,
) -> anyhow::Result<Vec<(String, std::time::Duration)>> {
    let results: Vec<anyhow::Result<(String, std::time::Duration)>> = futures::stream::iter(bodies)
        .map(|body| async move {
            let t = std::time::Instant::now();
            let id = api.submit(body.to_string(), None).await.context("POST /v1/runs")?.id;
            Ok((id, t.elapsed()))
        })
        .buffered(parallel.max(1))
        .collect()
        .await;
    results.into_iter().collect()
}
