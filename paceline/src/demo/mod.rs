//! What `paceline up --demo` adds: three mock providers, one per wire style
//! (`responses`, `chat`, and `anthropic` with Anthropic's split input/output
//! buckets and headers), each with a visibly scarce budget of its own; a small
//! tool endpoint (`search`, and `browser__snapshot` whose big pages get
//! clipped and elided) and beside it an MCP server (`docs`, `mcp.rs`); the
//! sample runs of `examples/`, spread over the three providers; and one
//! progress line per run until they all finish.
//!
//! The examples name the demo tool endpoint as `http://127.0.0.1:8090/tools`
//! and its MCP server as `http://127.0.0.1:8090/mcp` (their default address),
//! so `paceline submit examples/…` works against a running demo; when they
//! listen elsewhere (`--demo-tools-listen`, or 8090 is taken) the demo
//! rewrites those URLs in what it submits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{json, Value};

mod examples;
mod mcp;
mod progress;

pub use examples::{assign_providers, load_examples, Example};
pub use progress::drive;

/// The tool endpoint the example files name; the demo's default address.
pub const EXAMPLES_TOOL_ENDPOINT: &str = "http://127.0.0.1:8090/tools";
/// The MCP server the example files name; the demo's default address.
pub const EXAMPLES_MCP_SERVER: &str = "http://127.0.0.1:8090/mcp";
const DEFAULT_TOOLS_LISTEN: &str = "127.0.0.1:8090";

/// The demo's knobs (all optional; the defaults make pacing visible).
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Where the demo tool endpoint listens (the examples name 127.0.0.1:8090; another port is rewritten).
    #[arg(long = "demo-tools-listen", default_value = DEFAULT_TOOLS_LISTEN)]
    pub demo_tools_listen: SocketAddr,
    /// Where the demo's mock provider listens (port 0 picks a free one).
    #[arg(long = "demo-mock-listen", default_value = "127.0.0.1:0")]
    pub demo_mock_listen: SocketAddr,
    /// The mock provider's token budget per window: scarce, so pacing shows.
    #[arg(long = "demo-tpm", default_value_t = 12_000)]
    pub demo_tpm: u64,
    /// The mock provider's rate-limit window in seconds (a "minute" scaled down).
    #[arg(long = "demo-window-s", default_value_t = 10.0)]
    pub demo_window_s: f64,
    /// The mock provider's latency before the first byte of an answer, ms.
    #[arg(long = "demo-latency-ms", default_value_t = 300)]
    pub demo_latency_ms: u64,
    /// Directory of run specs (*.json) the demo submits; when it does not
    /// exist, the examples built into the binary are used.
    #[arg(long = "examples", default_value = "examples")]
    pub examples: PathBuf,
}

/// The demo's providers: one per wire style, named after it.
const DEMO_STYLES: [shared::runs::ApiStyle; 3] =
    [shared::runs::ApiStyle::Responses, shared::runs::ApiStyle::Chat, shared::runs::ApiStyle::Anthropic];

/// The demo's in-process servers.
pub struct Demo {
    /// One mock per style of [`DEMO_STYLES`], in that order.
    mocks: Vec<mock_provider::MockServer>,
    tools_addr: SocketAddr,
    tools_stop: Option<tokio::sync::oneshot::Sender<()>>,
    tools_task: tokio::task::JoinHandle<()>,
}

impl Demo {
    /// Starts the mock provider and the tool endpoint.
    pub async fn start(args: &DemoArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(
            args.demo_window_s.is_finite() && args.demo_window_s > 0.0,
            "--demo-window-s must be a positive number"
        );
        anyhow::ensure!(args.demo_tpm > 0, "--demo-tpm must be at least 1");
        let mut mocks = Vec::new();
        for (i, style) in DEMO_STYLES.into_iter().enumerate() {
            // A fixed port serves the first mock; the others take free ones.
            let mut listen = args.demo_mock_listen;
            if i > 0 {
                listen.set_port(0);
            }
            let headers = match style {
                shared::runs::ApiStyle::Anthropic => mock_provider::HeaderStyle::Anthropic,
                _ => mock_provider::HeaderStyle::OpenAi,
            };
            let mock = mock_provider::MockServer::start(mock_provider::MockConfig {
                listen,
                tpm: args.demo_tpm,
                // Anthropic's output bucket holds the output limits of a few turns at once.
                otpm: Some((args.demo_tpm / 2).max(1)),
                rpm: 600,
                window: Duration::from_secs_f64(args.demo_window_s),
                latency: Duration::from_millis(args.demo_latency_ms),
                tool_rounds: 2,
                calls_per_round: 1,
                output_tokens: 120,
                headers,
                ..mock_provider::MockConfig::default()
            })
            .await
            .with_context(|| format!("the demo's mock provider cannot listen on {listen}"))?;
            mocks.push(mock);
        }
        let listener = match tokio::net::TcpListener::bind(args.demo_tools_listen).await {
            Ok(l) => l,
            // The default port is taken: any free one will do, the examples are rewritten.
            Err(_) if args.demo_tools_listen.to_string() == DEFAULT_TOOLS_LISTEN => {
                tokio::net::TcpListener::bind("127.0.0.1:0").await.context("the demo tool endpoint")?
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("the demo tool endpoint cannot listen on {}", args.demo_tools_listen))
            }
        };
        let tools_addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router =
            axum::Router::new().route("/tools", axum::routing::post(tool)).nest_service("/mcp", mcp::service());
        let tools_task = tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self { mocks, tools_addr, tools_stop: Some(stop), tools_task })
    }

    /// The workers' providers: one per style, each at its own mock (and so
    /// its own budget), named after its style. No keys: the mocks need none.
    pub fn providers(&self) -> shared::providers::ProviderTable {
        let entries = DEMO_STYLES
            .into_iter()
            .zip(&self.mocks)
            .map(|(style, mock)| shared::providers::ProviderEntry {
                name: style.as_str().to_owned(),
                style,
                url: match style {
                    shared::runs::ApiStyle::Anthropic => mock.url(),
                    _ => mock.base_url(),
                },
                key_env: None,
                tpm: None,
                rpm: None,
            })
            .collect();
        shared::providers::ProviderTable(entries)
    }

    /// The tool endpoint's URL, allowed for the demo runs.
    pub fn tool_endpoint(&self) -> String {
        format!("http://{}/tools", self.tools_addr)
    }

    /// The MCP server's URL, allowed for the demo runs.
    pub fn mcp_server(&self) -> String {
        format!("http://{}/mcp", self.tools_addr)
    }

    /// The mocks' budgets, for the banner.
    pub fn describe(&self) -> String {
        let c = self.mocks[0].config();
        let at: Vec<String> =
            DEMO_STYLES.iter().zip(&self.mocks).map(|(s, m)| format!("{} at {}", s.as_str(), m.url())).collect();
        format!(
            "mock providers {} ({} tokens per {:.0} s window each, {} ms latency), demo tools at {}, demo MCP server at {}",
            at.join(", "),
            c.tpm,
            c.window.as_secs_f64(),
            c.latency.as_millis(),
            self.tool_endpoint(),
            self.mcp_server()
        )
    }

    /// Requests the mocks served, and how many were 429s.
    pub fn provider_counts(&self) -> (u64, u64) {
        self.mocks.iter().map(|m| m.summary()).fold((0, 0), |(n, l), s| (n + s.requests, l + s.rate_limited))
    }

    /// Stops both servers.
    pub async fn stop(mut self) {
        if let Some(stop) = self.tools_stop.take() {
            let _ = stop.send(());
        }
        let _ = self.tools_task.await;
        for mock in self.mocks {
            mock.shutdown().await;
        }
    }
}

/// The demo tool endpoint (the tool protocol of README, "Tool endpoints"): `{"name", "arguments"}`
/// in, `{"output"}` out.
async fn tool(axum::Json(call): axum::Json<Value>) -> (axum::http::StatusCode, axum::Json<Value>) {
    let name = call["name"].as_str().unwrap_or("");
    let args: Value = match &call["arguments"] {
        Value::String(s) => serde_json::from_str(s).unwrap_or(Value::Null),
        other => other.clone(),
    };
    let round = args["round"].as_u64().unwrap_or(1);
    // A little latency, like a real tool.
    tokio::time::sleep(Duration::from_millis(120)).await;
    let output = match name {
        "search" => search_results(args["query"].as_str().unwrap_or("rate limiting"), round),
        "browser__snapshot" => browser_page(args["url"].as_str().unwrap_or("https://status.example.com"), round),
        _ => {
            return (
                axum::http::StatusCode::NOT_FOUND,
                axum::Json(
                    json!({"error": format!("the demo has no tool named {name:?} (it has search, browser__snapshot)")}),
                ),
            )
        }
    };
    (axum::http::StatusCode::OK, axum::Json(json!({ "output": output })))
}

fn search_results(query: &str, round: u64) -> String {
    let mut out = format!("Results for {query:?} (page {round}):\n");
    for i in 1..=6 {
        out.push_str(&format!(
            "{i}. Notes on {query}, part {i}\n   https://example.com/{round}/{i}\n   \
             A token bucket refills continuously; a fixed window resets at once. Both are reported in \
             x-ratelimit-* headers, which lag the calls still in flight.\n"
        ));
    }
    out
}

/// A big accessibility tree (~60 000 characters): more than the 24 000 a
/// browser tool may show the model, so the worker clips it, and the next
/// snapshot makes the worker elide this one from the context.
fn browser_page(url: &str, round: u64) -> String {
    let mut out = format!("Page: {url} (snapshot {round})\n- document \"Status\"\n");
    let mut i = 0;
    while out.len() < 60_000 {
        i += 1;
        out.push_str(&format!(
            "  - region \"Component {i}\"\n    - heading \"Service {i}\" [level=3]\n    - text \"Operational for 90 days, uptime 99.9{}%\"\n    - link \"History of service {i}\" [ref=e{i}]\n",
            i % 10
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_browser_page_is_bigger_than_the_model_may_see() {
        assert!(browser_page("https://x", 1).len() > worker::context::BROWSER_TOOL_OUTPUT_CAP * 2);
    }
}
