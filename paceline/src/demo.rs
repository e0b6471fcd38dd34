//! What `paceline up --demo` adds: three mock providers, one per wire style
//! (`responses`, `chat`, and `anthropic` with Anthropic's split input/output
//! buckets and headers), each with a visibly scarce budget of its own; a small
//! tool endpoint (`search`, and `browser__snapshot` whose big pages get
//! clipped and elided); the sample runs of `examples/`, spread over the three
//! providers; and one progress line per run until they all finish.
//!
//! The examples name the demo tool endpoint as `http://127.0.0.1:8090/tools`
//! (its default address), so `paceline submit examples/…` works against a
//! running demo; when the endpoint listens elsewhere (`--demo-tools-listen`,
//! or 8090 is taken) the demo rewrites that URL in what it submits.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use shared::runs::{Run, RunStatus};
use tokio::sync::watch;

use crate::api_client::ApiClient;

/// The tool endpoint the example files name; the demo's default address.
pub const EXAMPLES_TOOL_ENDPOINT: &str = "http://127.0.0.1:8090/tools";
const DEFAULT_TOOLS_LISTEN: &str = "127.0.0.1:8090";

/// The examples compiled in, used when `--examples` is not a directory (the
/// binary run outside the repository).
const EMBEDDED_EXAMPLES: [(&str, &str); 4] = [
    ("browse-work", include_str!("../../examples/browse-work.json")),
    ("companion", include_str!("../../examples/companion.json")),
    ("plain", include_str!("../../examples/plain.json")),
    ("research-work", include_str!("../../examples/research-work.json")),
];

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
        let router = axum::Router::new().route("/tools", axum::routing::post(tool));
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

    /// The mocks' budgets, for the banner.
    pub fn describe(&self) -> String {
        let c = self.mocks[0].config();
        let at: Vec<String> =
            DEMO_STYLES.iter().zip(&self.mocks).map(|(s, m)| format!("{} at {}", s.as_str(), m.url())).collect();
        format!(
            "mock providers {} ({} tokens per {:.0} s window each, {} ms latency), demo tools at {}",
            at.join(", "),
            c.tpm,
            c.window.as_secs_f64(),
            c.latency.as_millis(),
            self.tool_endpoint()
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

/// One sample run: its name (the file's stem) and its spec.
#[derive(Debug, Clone)]
pub struct Example {
    /// The file's stem, shown on its progress line.
    pub name: String,
    /// The run spec, as submitted (the tool endpoint rewritten).
    pub body: Value,
}

/// The example runs: `dir/*.json` when `dir` exists, else the built-in ones.
/// Also says where they came from. A file that is not a JSON object is an
/// error naming it.
pub fn load_examples(dir: &Path, tool_endpoint: &str) -> anyhow::Result<(Vec<Example>, String)> {
    let mut raw: Vec<(String, String)> = Vec::new();
    let source;
    if dir.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        anyhow::ensure!(!files.is_empty(), "{} holds no *.json run specs (or pass --examples DIR)", dir.display());
        for f in files {
            let name = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let text = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
            raw.push((name, text));
        }
        source = format!("{}/*.json", dir.display());
    } else {
        raw = EMBEDDED_EXAMPLES.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
        source = "the examples built into this binary".to_string();
    }
    let mut examples = Vec::new();
    for (name, text) in raw {
        let mut body: Value = serde_json::from_str(&text).with_context(|| format!("example {name}: not JSON"))?;
        anyhow::ensure!(body.is_object(), "example {name}: a run spec is a JSON object");
        if body["tool_endpoint"].as_str() == Some(EXAMPLES_TOOL_ENDPOINT) {
            body["tool_endpoint"] = json!(tool_endpoint);
        }
        examples.push(Example { name, body });
    }
    Ok((examples, source))
}

/// Spreads the demo runs over the three providers, so each wire style shows:
/// the research run on Responses, the browsing run on Chat Completions, the
/// companion (live) run on Anthropic's Messages API (as a Claude model), and
/// any other in turn. A run that names its provider keeps it.
pub fn assign_providers(examples: &mut [Example]) {
    let mut next = 0;
    for ex in examples.iter_mut().filter(|e| e.body.get("provider").is_none()) {
        let style = match ex.name.as_str() {
            "research-work" | "plain" => shared::runs::ApiStyle::Responses,
            "browse-work" => shared::runs::ApiStyle::Chat,
            "companion" => shared::runs::ApiStyle::Anthropic,
            _ => {
                next += 1;
                DEMO_STYLES[(next - 1) % DEMO_STYLES.len()]
            }
        };
        ex.body["provider"] = json!(style.as_str());
        if style == shared::runs::ApiStyle::Anthropic
            && ex.body["model"].as_str().is_some_and(|m| m.starts_with("gpt-"))
        {
            ex.body["model"] = json!("claude-sonnet-4-5");
        }
    }
}

/// `12 345`.
fn thousands(n: u64) -> String {
    let digits: Vec<char> = n.to_string().chars().rev().collect();
    let groups: Vec<String> = digits.chunks(3).map(|g| g.iter().rev().collect()).collect();
    groups.into_iter().rev().collect::<Vec<_>>().join(" ")
}

/// Seconds until an RFC 3339 time, if it is in the future.
fn seconds_until(at: &str) -> Option<f64> {
    let at = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()?;
    let left = (at - time::OffsetDateTime::now_utc()).as_seconds_f64();
    Some(left.max(0.0))
}

/// One run's line: `waiting  turn 1/12 · 1 234 tokens · budget 2.3s`.
fn describe_run(run: &Run) -> String {
    let status = run.status.as_str();
    let mut line = format!(
        "{status:<9} turn {}/{} · {} tokens",
        run.turns_completed,
        run.max_turns,
        thousands(run.usage.total_tokens)
    );
    let p = &run.pacing;
    if run.status == RunStatus::Waiting {
        let why = run.wait_reason.map_or("budget", |w| w.as_str());
        match run.next_attempt_at.as_deref().and_then(seconds_until) {
            Some(s) => line.push_str(&format!(" · {why} wait {s:.1}s")),
            None => line.push_str(&format!(" · {why} wait")),
        }
    } else if run.status.is_finished() {
        if p.budget_waits > 0 {
            let waited = p.waited_ms as f64 / 1000.0;
            line.push_str(&format!(" · waited {waited:.1}s for budget ({}×)", p.budget_waits));
        }
        if let Some(e) = &run.error {
            line.push_str(&format!(" · {}: {}", e.kind, e.message));
        }
    }
    if p.rate_limited > 0 {
        line.push_str(&format!(" · {} rate limited", p.rate_limited));
    }
    line
}

/// The budget line: `budget gpt-4.1-mini: 3 210 / 12 000 tokens left, 1 100 reserved`.
fn describe_pacer(pacer: &Value) -> Option<String> {
    let budgets = pacer["budgets"].as_array()?;
    let parts: Vec<String> = budgets
        .iter()
        .filter(|b| !b["limit_tokens"].is_null())
        .map(|b| {
            let n = |k: &str| b[k].as_u64().map(thousands).unwrap_or_else(|| "-".into());
            format!(
                "budget {} ({}): {} / {} tokens left, {} reserved",
                b["budget"].as_str().unwrap_or("?"),
                b["model"].as_str().unwrap_or("?"),
                n("remaining_tokens"),
                n("limit_tokens"),
                n("reserved_tokens"),
            )
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Submits the examples through the API and shows one line per run until all
/// of them finish (or `stop` turns true). Answers the runs' final statuses.
pub async fn drive(
    api: &ApiClient,
    examples: &[Example],
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<BTreeMap<String, RunStatus>> {
    let multi = MultiProgress::new();
    let fancy = std::io::stderr().is_terminal();
    let width = examples.iter().map(|e| e.name.len() + 12).max().unwrap_or(8);
    let style = ProgressStyle::with_template(&format!("{{spinner}} {{prefix:<{width}}}  {{wide_msg}}"))
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let budget_bar = multi.add(ProgressBar::new_spinner());
    budget_bar
        .set_style(ProgressStyle::with_template("  {wide_msg}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
    let mut runs = Vec::new();
    for ex in examples {
        let id =
            api.submit(ex.body.to_string(), None).await.with_context(|| format!("submitting example {}", ex.name))?.id;
        let bar = multi.add(ProgressBar::new_spinner());
        bar.set_style(style.clone());
        let label = match ex.body["provider"].as_str() {
            Some(p) => format!("{} ({p})", ex.name),
            None => ex.name.clone(),
        };
        bar.set_prefix(label.clone());
        bar.set_message("queued");
        if fancy {
            bar.enable_steady_tick(Duration::from_millis(120));
        } else {
            eprintln!("submitted {} as {id}", ex.name);
        }
        runs.push((ex.name.clone(), label, id, bar, String::new()));
    }
    let mut finals = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    while finals.len() < runs.len() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        if let Ok(p) = api.pacer().await {
            if let Some(line) = describe_pacer(&p) {
                budget_bar.set_message(line);
            }
        }
        for (_, label, id, bar, last) in runs.iter_mut() {
            if finals.contains_key(id.as_str()) {
                continue;
            }
            // A failed poll (the API busy for a moment) is just tried again.
            let Ok(run) = api.run(id).await else { continue };
            let line = describe_run(&run);
            if !fancy {
                // Without a terminal: one plain line whenever the state changes.
                let key = format!("{}/{}/{:?}", run.status.as_str(), run.turns_completed, run.wait_reason);
                if key != *last {
                    eprintln!("{label:<width$}  {line}");
                    *last = key;
                }
            }
            if run.status.is_finished() {
                let mark = if run.status == RunStatus::Completed { "✓" } else { "✗" };
                bar.finish_with_message(format!("{mark} {line}"));
                finals.insert(id.clone(), run.status);
            } else {
                bar.set_message(line);
            }
        }
    }
    budget_bar.finish();
    for (_, _, _, bar, _) in &runs {
        if !bar.is_finished() {
            bar.abandon();
        }
    }
    Ok(runs.iter().filter_map(|(name, _, id, ..)| finals.get(id).map(|s| (name.clone(), *s))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_examples_are_run_specs_for_the_demo_tools() {
        let (examples, source) =
            load_examples(Path::new("/nonexistent-examples-dir"), "http://127.0.0.1:1/tools").unwrap();
        assert_eq!(examples.len(), 4, "{source}");
        for ex in &examples {
            let spec = shared::runs::RunSpec::from_json(
                &ex.body,
                &shared::runs::SubmitPolicy {
                    tool_endpoints: shared::runs::ToolEndpoints::every_tenant(["http://127.0.0.1:1/tools"]),
                    ..Default::default()
                },
            );
            assert!(spec.is_ok(), "{}: {spec:?}", ex.name);
            if let Some(t) = ex.body["tool_endpoint"].as_str() {
                assert_eq!(t, "http://127.0.0.1:1/tools", "{} is rewritten", ex.name);
            }
        }
    }

    #[test]
    fn the_demo_runs_cover_every_style() {
        let (mut examples, _) =
            load_examples(Path::new("/nonexistent-examples-dir"), "http://127.0.0.1:1/tools").unwrap();
        assign_providers(&mut examples);
        let mut styles: Vec<&str> = examples.iter().filter_map(|e| e.body["provider"].as_str()).collect();
        styles.sort();
        styles.dedup();
        assert_eq!(styles, vec!["anthropic", "chat", "responses"]);
        let companion = examples.iter().find(|e| e.name == "companion").unwrap();
        assert!(companion.body["model"].as_str().unwrap().starts_with("claude"));
    }

    #[test]
    fn a_browser_page_is_bigger_than_the_model_may_see() {
        assert!(browser_page("https://x", 1).len() > shared::runs::context::BROWSER_TOOL_OUTPUT_CAP * 2);
    }

    #[test]
    fn lines() {
        assert_eq!(thousands(12_345), "12 345");
        assert_eq!(thousands(999), "999");
        let run: Run = serde_json::from_value(json!({"id": "run_1", "status": "completed", "mode": "work",
            "model": "gpt-test", "turns_completed": 3, "max_turns": 12,
            "usage": {"input_tokens": 8000, "output_tokens": 1000, "total_tokens": 9000,
                      "reasoning_tokens": 0, "cached_input_tokens": 0},
            "pacing": {"budget_waits": 2, "waited_ms": 4200, "rate_limited": 0, "retries": 0},
            "wait_reason": null, "next_attempt_at": null, "output_text": "done", "error": null,
            "created_at": "2026-12-02T10:00:00.000Z", "updated_at": "2026-12-02T10:01:00.000Z",
            "finished_at": "2026-12-02T10:01:00.000Z", "metadata": {}}))
        .unwrap();
        assert_eq!(describe_run(&run), "completed turn 3/12 · 9 000 tokens · waited 4.2s for budget (2×)");
    }
}
