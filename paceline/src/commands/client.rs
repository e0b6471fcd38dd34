//! The client subcommands that talk to the API: `submit`, `watch`, `runs`,
//! `status`, `pacer`, `dead`, `retry`. Output meant for scripts (a run id, the final text, JSON)
//! goes to stdout; progress and messages go to stderr. An error from the API
//! is one line: `paceline: API 422 invalid_request (max_turns): must be …`.

use std::io::{IsTerminal, Read};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use shared::config::Secret;
use worker::provider::sse::SseParser;

/// Exit code of `watch` when the run failed.
const EXIT_FAILED: u8 = 1;
/// Exit code of `watch` when the run was cancelled.
const EXIT_CANCELLED: u8 = 3;

/// Where the API is and who we are (every client subcommand).
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// Base URL of the paceline API.
    #[arg(long = "api", env = "PACELINE_API", default_value = "http://127.0.0.1:8080")]
    pub api: String,
    /// Bearer token (a tenant's token from the server's PACELINE_API_TOKENS).
    #[arg(long = "token", env = "PACELINE_TOKEN", hide_env_values = true)]
    pub token: Option<Secret>,
    /// The operator's token (the server's PACELINE_OPERATOR_TOKEN): used by
    /// `dead`, and by the other commands when no tenant token is given.
    #[arg(long = "operator-token", env = "PACELINE_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<Secret>,
}

impl ApiArgs {
    fn given(t: &Option<Secret>) -> Option<Secret> {
        t.clone().filter(|t| !t.is_empty())
    }

    /// The tenant's token, else the operator's.
    fn tenant_first(&self) -> Option<Secret> {
        Self::given(&self.token).or_else(|| Self::given(&self.operator_token))
    }

    /// The operator's token, else the tenant's (which the API will refuse with 403).
    fn operator_first(&self) -> Option<Secret> {
        Self::given(&self.operator_token).or_else(|| Self::given(&self.token))
    }
}

/// `paceline submit FILE|-`.
#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    /// The run spec (JSON), or `-` for stdin.
    pub file: String,
    /// Follow the run after submitting it (as `paceline watch`).
    #[arg(long)]
    pub watch: bool,
    /// An Idempotency-Key: submitting again with it returns the first run.
    #[arg(long = "idempotency-key")]
    pub idempotency_key: Option<String>,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline watch RUN_ID`: exits 0 when the run completes, 1 when it fails,
/// 3 when it is cancelled.
#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    /// The run.
    pub run_id: String,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline runs`.
#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    /// Only runs in this status.
    #[arg(long)]
    pub status: Option<String>,
    /// How many (newest first).
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline status RUN_ID`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The run.
    pub run_id: String,
    /// Print the API's JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline pacer`.
#[derive(Debug, clap::Args)]
pub struct PacerArgs {
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline dead` (operator).
#[derive(Debug, clap::Args)]
pub struct DeadArgs {
    /// How many (newest first), 1 to 200.
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline retry RUN_ID`.
#[derive(Debug, clap::Args)]
pub struct RetryArgs {
    /// The failed run.
    pub run_id: String,
    /// Follow the run after re-driving it (as `paceline watch`).
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// A small client of the API.
struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<Secret>,
}

impl Client {
    /// With the tenant's token (else the operator's).
    fn new(args: &ApiArgs) -> anyhow::Result<Self> {
        Self::with_token(args, args.tenant_first())
    }

    /// With the operator's token (else the tenant's).
    fn operator(args: &ApiArgs) -> anyhow::Result<Self> {
        Self::with_token(args, args.operator_first())
    }

    fn with_token(args: &ApiArgs, token: Option<Secret>) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).build()?;
        Ok(Self { http, base: args.api.trim_end_matches('/').to_owned(), token })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) if !t.is_empty() => r.bearer_auth(t.expose()),
            _ => r,
        }
    }

    /// Sends, and turns a non-2xx answer into one clear line.
    async fn send(&self, r: reqwest::RequestBuilder) -> anyhow::Result<reqwest::Response> {
        let resp =
            r.send().await.map_err(|e| anyhow::anyhow!("cannot reach the API at {}: {}", self.base, root(&e)))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        Err(ApiFailure { status, line: api_error_line(status, &text) }.into())
    }

    async fn json(&self, r: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let resp = self.send(r.timeout(Duration::from_secs(30))).await?;
        resp.json().await.context("the API answered something that is not JSON")
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, path)).await
    }
}

/// The API answered with an error status.
#[derive(Debug, thiserror::Error)]
#[error("{line}")]
struct ApiFailure {
    status: u16,
    line: String,
}

/// The innermost cause of a reqwest error (`connection refused`), not the
/// whole nested chain.
fn root(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// `API 422 invalid_request (max_turns): must be an integer from 1 to 1000`.
fn api_error_line(status: u16, body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let err = parsed.as_ref().map(|v| &v["error"]);
    match err {
        Some(e) if e.is_object() => {
            let kind = e["type"].as_str().unwrap_or("error");
            let message = e["message"].as_str().unwrap_or("");
            match e["field"].as_str() {
                Some(f) if !f.is_empty() => format!("API {status} {kind} ({f}): {message}"),
                _ => format!("API {status} {kind}: {message}"),
            }
        }
        _ => {
            let text: String = body.chars().take(200).collect::<String>().replace('\n', " ");
            format!("API {status}: {}", if text.trim().is_empty() { "(no body)" } else { text.trim() })
        }
    }
}

/// Submits a run spec; prints the run id (and follows it with `--watch`).
pub async fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let body = if args.file == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the spec from stdin")?;
        s
    } else {
        std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file))?
    };
    let client = Client::new(&args.api)?;
    let mut r = client
        .request(reqwest::Method::POST, "/v1/runs")
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(k) = &args.idempotency_key {
        r = r.header("Idempotency-Key", k);
    }
    let run = client.json(r).await?;
    let id = run["id"].as_str().context("the API's answer has no run id")?.to_owned();
    println!("{id}");
    if args.watch {
        return follow(&client, &id).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// Follows a run.
pub async fn watch(args: WatchArgs) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.api)?;
    follow(&client, &args.run_id).await
}

/// What the progress line shows.
struct Progress {
    bar: ProgressBar,
    turns: u64,
    tokens: u64,
    state: String,
    /// A wait with its deadline (budget, rate limit, retry).
    until: Option<(String, Instant)>,
}

impl Progress {
    fn new(max_turns: u64) -> Self {
        let bar = ProgressBar::new(max_turns.max(1));
        bar.set_style(
            ProgressStyle::with_template("{spinner} turn {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        if std::io::stderr().is_terminal() {
            bar.enable_steady_tick(Duration::from_millis(120));
        }
        Self { bar, turns: 0, tokens: 0, state: "queued".into(), until: None }
    }

    fn render(&self) {
        let wait = match &self.until {
            Some((why, at)) => {
                let left = at.saturating_duration_since(Instant::now());
                format!(" · {why} {:.1}s", left.as_secs_f64())
            }
            None => String::new(),
        };
        self.bar.set_position(self.turns);
        self.bar.set_message(format!("· {} · {} tokens{wait}", self.state, self.tokens));
    }

    /// A line above the bar (or on stderr when there is no terminal).
    fn say(&self, line: String) {
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    fn wait(&mut self, why: &str, ms: u64) {
        self.state = "waiting".into();
        self.until = Some((why.to_owned(), Instant::now() + Duration::from_millis(ms)));
        self.say(format!("  {why}: {:.1}s", ms as f64 / 1000.0));
    }

    /// Applies one event; true when it ends the run.
    fn apply(&mut self, kind: &str, data: &Value) -> bool {
        let num = |k: &str| data[k].as_u64().unwrap_or(0);
        match kind {
            "run.queued" => self.state = "queued".into(),
            "turn.started" => {
                self.state = "running".into();
                self.until = None;
            }
            "turn.paced" => self.wait("waiting for budget", num("owed_ms")),
            "turn.rate_limited" => {
                self.wait(&format!("rate limited (attempt {})", num("attempt")), num("retry_after_ms"))
            }
            "turn.retry" => {
                let reason = data["reason"].as_str().unwrap_or("transient error").to_owned();
                self.wait(&format!("retrying after {reason} (attempt {})", num("attempt")), num("delay_ms"))
            }
            "turn.tool_call" => self.say(format!("  tool call: {}", data["name"].as_str().unwrap_or("?"))),
            "turn.completed" => {
                self.turns += 1;
                self.tokens += data["usage"]["total_tokens"].as_u64().unwrap_or(0);
                self.state = "running".into();
                self.until = None;
            }
            "run.completed" | "run.failed" | "run.cancelled" => return true,
            _ => {}
        }
        false
    }
}

/// Follows `id` from its event stream until it finishes, reconnecting with
/// `Last-Event-ID` when the stream breaks; then prints the final text (stdout)
/// or the error (stderr) and answers the exit code.
async fn follow(client: &Client, id: &str) -> anyhow::Result<ExitCode> {
    let run = client.get(&format!("/v1/runs/{id}")).await?;
    let mut progress = Progress::new(run["max_turns"].as_u64().unwrap_or(1));
    let mut last_id: Option<String> = None;
    let mut failures = 0u32;
    let mut finished = false;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while !finished {
        let mut r = client
            .request(reqwest::Method::GET, &format!("/v1/runs/{id}/events"))
            .header("accept", "text/event-stream");
        if let Some(l) = &last_id {
            r = r.header("Last-Event-ID", l);
        }
        let resp = match client.send(r).await {
            Ok(resp) => resp,
            // The API itself refused (404, 401): reconnecting will not help.
            Err(e) if e.downcast_ref::<ApiFailure>().is_some_and(|f| f.status < 500) => return Err(e),
            Err(e) => {
                failures += 1;
                if failures > 10 {
                    return Err(e);
                }
                progress.say(format!("  reconnecting: {e}"));
                tokio::time::sleep(Duration::from_millis(500 * failures.min(6) as u64)).await;
                continue;
            }
        };
        let mut bytes = resp.bytes_stream();
        let mut parser = SseParser::new();
        loop {
            tokio::select! {
                _ = tick.tick() => progress.render(),
                chunk = bytes.next() => {
                    let chunk = match chunk {
                        Some(Ok(c)) => c,
                        Some(Err(_)) | None => break,
                    };
                    failures = 0;
                    for ev in parser.push(&chunk).map_err(|e| anyhow::anyhow!("the event stream: {e}"))? {
                        if let Some(i) = ev.id {
                            last_id = Some(i);
                        }
                        let kind = ev.event.unwrap_or_default();
                        let data: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
                        if progress.apply(&kind, &data) {
                            finished = true;
                        }
                    }
                    progress.render();
                    if finished {
                        break;
                    }
                }
            }
        }
        if !finished {
            // The stream ended without the run ending: was it already over?
            let run = client.get(&format!("/v1/runs/{id}")).await?;
            let status = run["status"].as_str().unwrap_or("");
            if matches!(status, "completed" | "failed" | "cancelled") {
                finished = true;
            } else {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    progress.bar.finish_and_clear();
    let run = client.get(&format!("/v1/runs/{id}")).await?;
    let usage = run["usage"]["total_tokens"].as_u64().unwrap_or(progress.tokens);
    let turns = run["turns_completed"].as_u64().unwrap_or(progress.turns);
    match run["status"].as_str().unwrap_or("") {
        "completed" => {
            eprintln!("{id} completed: {turns} turns, {usage} tokens");
            println!("{}", run["output_text"].as_str().unwrap_or(""));
            Ok(ExitCode::SUCCESS)
        }
        "cancelled" => {
            eprintln!("{id} cancelled after {turns} turns");
            Ok(ExitCode::from(EXIT_CANCELLED))
        }
        other => {
            let kind = run["error"]["kind"].as_str().unwrap_or(other);
            let message = run["error"]["message"].as_str().unwrap_or("");
            eprintln!("{id} failed ({kind}) after {turns} turns: {message}");
            Ok(ExitCode::from(EXIT_FAILED))
        }
    }
}

/// Lists runs.
pub async fn runs(args: RunsArgs) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.api)?;
    let mut r = client.request(reqwest::Method::GET, "/v1/runs").query(&[("limit", args.limit.to_string())]);
    if let Some(s) = &args.status {
        r = r.query(&[("status", s)]);
    }
    let page = client.json(r).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<30}  {:<9}  {:<20}  {:>7}  {:>9}  {:<24}", "ID", "STATUS", "MODEL", "TURNS", "TOKENS", "CREATED");
    for run in page["data"].as_array().into_iter().flatten() {
        println!(
            "{:<30}  {:<9}  {:<20}  {:>7}  {:>9}  {:<24}",
            run["id"].as_str().unwrap_or(""),
            run["status"].as_str().unwrap_or(""),
            truncate(run["model"].as_str().unwrap_or(""), 20),
            format!("{}/{}", run["turns_completed"], run["max_turns"]),
            run["usage"]["total_tokens"],
            run["created_at"].as_str().unwrap_or(""),
        );
    }
    if page["has_more"].as_bool() == Some(true) {
        eprintln!("(more: --limit to see more)");
    }
    Ok(ExitCode::SUCCESS)
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(n - 1).collect::<String>())
    }
}

/// Shows one run.
pub async fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.api)?;
    let run = client.get(&format!("/v1/runs/{}", args.run_id)).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
        return Ok(ExitCode::SUCCESS);
    }
    let s = |k: &str| run[k].as_str().unwrap_or("-").to_owned();
    println!("id:          {}", s("id"));
    println!("status:      {}", s("status"));
    println!("mode/model:  {} / {}", s("mode"), s("model"));
    println!("turns:       {}/{}", run["turns_completed"], run["max_turns"]);
    let u = &run["usage"];
    println!("usage:       {} in + {} out = {} tokens", u["input_tokens"], u["output_tokens"], u["total_tokens"]);
    let (cached, reasoning) =
        (u["cached_input_tokens"].as_u64().unwrap_or(0), u["reasoning_tokens"].as_u64().unwrap_or(0));
    if cached > 0 || reasoning > 0 {
        println!("             {cached} of the input cached, {reasoning} of the output reasoning");
    }
    let p = &run["pacing"];
    println!(
        "pacing:      {} budget waits ({} ms waited), {} rate limited, {} retries",
        p["budget_waits"], p["waited_ms"], p["rate_limited"], p["retries"]
    );
    if run["status"] == "waiting" {
        println!("waiting:     {} until {}", s("wait_reason"), s("next_attempt_at"));
    }
    println!("created:     {}", s("created_at"));
    if let Some(f) = run["finished_at"].as_str() {
        println!("finished:    {f}");
    }
    if let Some(e) = run["error"].as_object() {
        println!(
            "error:       {}: {}",
            e.get("kind").and_then(Value::as_str).unwrap_or(""),
            e.get("message").and_then(Value::as_str).unwrap_or("")
        );
    }
    if let Some(t) = run["output_text"].as_str() {
        println!("output:\n{t}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Shows the pacer state.
pub async fn pacer(args: PacerArgs) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.api)?;
    let v = client.get("/v1/pacer").await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    let budgets = v["budgets"].as_array().cloned().unwrap_or_default();
    if budgets.is_empty() {
        println!("no budget state yet (no call has been paced)");
        return Ok(ExitCode::SUCCESS);
    }
    let n = |x: &Value| if x.is_null() { "-".to_owned() } else { x.to_string() };
    println!(
        "{:<12}  {:<20}  {:>18}  {:>10}  {:>9}  {:>14}  {:>9}  {:>6}  OBSERVED",
        "BUDGET", "MODEL", "TOKENS LEFT/LIMIT", "RESERVED", "RESET MS", "REQS LEFT/LIM", "BLOCKED", "REFUND"
    );
    for b in budgets {
        let refund = b["refund_share"].as_f64().map_or("-".to_owned(), |x| format!("{x:.2}"));
        println!(
            "{:<12}  {:<20}  {:>18}  {:>10}  {:>9}  {:>14}  {:>9}  {:>6}  {}",
            truncate(b["budget"].as_str().unwrap_or(""), 12),
            truncate(b["model"].as_str().unwrap_or(""), 20),
            format!("{}/{}", n(&b["remaining_tokens"]), n(&b["limit_tokens"])),
            n(&b["reserved_tokens"]),
            n(&b["reset_in_ms"]),
            format!("{}/{}", n(&b["remaining_requests"]), n(&b["limit_requests"])),
            n(&b["blocked_for_ms"]),
            refund,
            b["observed_at"].as_str().unwrap_or("-"),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Lists the dead-lettered turns (operator).
pub async fn dead(args: DeadArgs) -> anyhow::Result<ExitCode> {
    let client = Client::operator(&args.api)?;
    let r = client.request(reqwest::Method::GET, "/v1/dead").query(&[("limit", args.limit.to_string())]);
    let page = client.json(r).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(ExitCode::SUCCESS);
    }
    let turns = page["data"].as_array().cloned().unwrap_or_default();
    if turns.is_empty() {
        println!("no dead turns");
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<30}  {:<16}  {:>5}  {:<24}  REASON", "RUN", "TENANT", "TURN", "DIED AT");
    for t in turns {
        println!(
            "{:<30}  {:<16}  {:>5}  {:<24}  {}",
            t["run_id"].as_str().unwrap_or(""),
            truncate(t["tenant"].as_str().unwrap_or("-"), 16),
            t["turn"].as_u64().map_or("-".to_owned(), |n| n.to_string()),
            t["died_at"].as_str().unwrap_or(""),
            t["reason"].as_str().unwrap_or("").replace('\n', " "),
        );
    }
    if page["has_more"].as_bool() == Some(true) {
        eprintln!("(more: --limit to see more)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Re-drives a failed run from its last committed turn; prints its id (and
/// follows it with `--watch`).
pub async fn retry(args: RetryArgs) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.api)?;
    let run = client.json(client.request(reqwest::Method::POST, &format!("/v1/runs/{}/retry", args.run_id))).await?;
    let id = run["id"].as_str().context("the API's answer has no run id")?.to_owned();
    eprintln!("{id} queued again from turn {}", run["turns_completed"]);
    println!("{id}");
    if args.watch {
        return follow(&client, &id).await;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_or_the_operator_token_is_chosen_per_command() {
        let args = |token: Option<&str>, operator: Option<&str>| ApiArgs {
            api: String::new(),
            token: token.map(Secret::new),
            operator_token: operator.map(Secret::new),
        };
        let both = args(Some("t"), Some("o"));
        assert_eq!(both.tenant_first().unwrap().expose(), "t");
        assert_eq!(both.operator_first().unwrap().expose(), "o");
        let tenant = args(Some("t"), Some(""));
        assert_eq!(tenant.operator_first().unwrap().expose(), "t");
        let operator = args(None, Some("o"));
        assert_eq!(operator.tenant_first().unwrap().expose(), "o");
        assert!(args(None, None).tenant_first().is_none());
    }

    #[test]
    fn api_errors_are_one_line() {
        let body =
            r#"{"error":{"type":"invalid_request","message":"must be an integer from 1 to 1000","field":"max_turns"}}"#;
        assert_eq!(api_error_line(422, body), "API 422 invalid_request (max_turns): must be an integer from 1 to 1000");
        assert_eq!(
            api_error_line(401, r#"{"error":{"type":"unauthorized","message":"missing or invalid bearer token"}}"#),
            "API 401 unauthorized: missing or invalid bearer token"
        );
        assert_eq!(api_error_line(502, "<html>\nbad gateway\n</html>"), "API 502: <html> bad gateway </html>");
        assert_eq!(api_error_line(500, ""), "API 500: (no body)");
    }

    #[test]
    fn events_drive_the_progress() {
        let mut p = Progress::new(5);
        assert!(!p.apply("turn.started", &serde_json::json!({"turn": 0})));
        p.apply("turn.paced", &serde_json::json!({"owed_ms": 1500}));
        assert!(p.until.is_some());
        p.apply("turn.completed", &serde_json::json!({"usage": {"total_tokens": 120}}));
        assert_eq!((p.turns, p.tokens), (1, 120));
        assert!(p.until.is_none());
        assert!(p.apply("run.completed", &serde_json::json!({})));
    }
}
