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
use shared::runs::state::event;
use shared::runs::{Run, RunStatus};
use worker::provider::sse::SseParser;

use crate::api_client::{ApiClient, ApiFailure};

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
    /// Bearer token (a tenant's token from the server's PACELINE_API_TOKENS):
    /// `PACELINE_TOKEN` or `PACELINE_TOKEN_FILE` in the environment only, never
    /// a flag (a command line shows in `ps`).
    #[arg(skip = shared::config::env_only::<Secret>("PACELINE_TOKEN"))]
    pub token: Option<Secret>,
    /// The operator's token (the server's PACELINE_OPERATOR_TOKEN): used by
    /// `dead`, and by the other commands when no tenant token is given;
    /// `PACELINE_OPERATOR_TOKEN` or its `_FILE` in the environment only.
    #[arg(skip = shared::config::env_only::<Secret>("PACELINE_OPERATOR_TOKEN"))]
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
    /// Where the run's completion webhook goes (sets the spec's
    /// `webhook_url`; the API checks it against PACELINE_WEBHOOK_ENDPOINTS).
    #[arg(long = "webhook", value_name = "URL")]
    pub webhook: Option<String>,
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
pub struct PacerViewArgs {
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `paceline usage`.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// First UTC day, YYYY-MM-DD (default: 29 days before --to).
    #[arg(long)]
    pub from: Option<String>,
    /// Last UTC day, YYYY-MM-DD (default: today).
    #[arg(long)]
    pub to: Option<String>,
    /// Rows per `tenant`, `model` or `day`.
    #[arg(long, default_value = "day", value_parser = ["tenant", "model", "day"])]
    pub group_by: String,
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

/// With the tenant's token (else the operator's).
fn client(args: &ApiArgs) -> anyhow::Result<ApiClient> {
    ApiClient::new(&args.api, args.tenant_first())
}

/// With the operator's token (else the tenant's).
fn operator_client(args: &ApiArgs) -> anyhow::Result<ApiClient> {
    ApiClient::new(&args.api, args.operator_first())
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
    let body = match &args.webhook {
        None => body,
        Some(url) => with_webhook(&body, url)?,
    };
    let client = client(&args.api)?;
    let run = client.submit(body, args.idempotency_key.as_deref()).await?;
    println!("{}", run.id);
    if args.watch {
        return follow(&client, &run.id).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// The spec `body` with its `webhook_url` set to `url` (`--webhook`).
fn with_webhook(body: &str, url: &str) -> anyhow::Result<String> {
    let mut spec: serde_json::Value =
        serde_json::from_str(body).context("--webhook needs the spec to be a JSON object; it is not JSON")?;
    let Some(object) = spec.as_object_mut() else {
        anyhow::bail!("--webhook needs the spec to be a JSON object");
    };
    object.insert("webhook_url".into(), url.into());
    Ok(spec.to_string())
}

/// Follows a run.
pub async fn watch(args: WatchArgs) -> anyhow::Result<ExitCode> {
    let client = client(&args.api)?;
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
            event::RUN_QUEUED => self.state = "queued".into(),
            event::TURN_STARTED => {
                self.state = "running".into();
                self.until = None;
            }
            event::TURN_PACED => self.wait("waiting for budget", num("owed_ms")),
            event::TURN_RATE_LIMITED => {
                self.wait(&format!("rate limited (attempt {})", num("attempt")), num("retry_after_ms"))
            }
            event::TURN_RETRY => {
                let reason = data["reason"].as_str().unwrap_or("transient error").to_owned();
                self.wait(&format!("retrying after {reason} (attempt {})", num("attempt")), num("delay_ms"))
            }
            event::TURN_TOOL_CALL => self.say(format!("  tool call: {}", data["name"].as_str().unwrap_or("?"))),
            event::TURN_COMPLETED => {
                self.turns += 1;
                self.tokens += data["usage"]["total_tokens"].as_u64().unwrap_or(0);
                self.state = "running".into();
                self.until = None;
            }
            event::RUN_COMPLETED | event::RUN_FAILED | event::RUN_CANCELLED => return true,
            _ => {}
        }
        false
    }
}

/// Follows `id` from its event stream until it finishes, reconnecting with
/// `Last-Event-ID` when the stream breaks; then prints the final text (stdout)
/// or the error (stderr) and answers the exit code.
async fn follow(client: &ApiClient, id: &str) -> anyhow::Result<ExitCode> {
    let run = client.run(id).await?;
    let mut progress = Progress::new(u64::from(run.max_turns));
    let mut last_id: Option<String> = None;
    let mut failures = 0u32;
    let mut finished = run.status.is_finished();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while !finished {
        let resp = match client.events(id, last_id.as_deref()).await {
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
            if client.run(id).await?.status.is_finished() {
                finished = true;
            } else {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    progress.bar.finish_and_clear();
    let run = client.run(id).await?;
    let (turns, usage) = (run.turns_completed, run.usage.total_tokens);
    match run.status {
        RunStatus::Completed => {
            eprintln!("{id} completed: {turns} turns, {usage} tokens");
            println!("{}", run.output_text.as_deref().unwrap_or(""));
            Ok(ExitCode::SUCCESS)
        }
        RunStatus::Cancelled => {
            eprintln!("{id} cancelled after {turns} turns");
            Ok(ExitCode::from(EXIT_CANCELLED))
        }
        other => {
            let (kind, message) = match &run.error {
                Some(e) => (e.kind.as_str(), e.message.as_str()),
                None => (other.as_str(), ""),
            };
            eprintln!("{id} failed ({kind}) after {turns} turns: {message}");
            Ok(ExitCode::from(EXIT_FAILED))
        }
    }
}

/// Lists runs.
pub async fn runs(args: RunsArgs) -> anyhow::Result<ExitCode> {
    let page = client(&args.api)?.runs(args.status.as_deref(), args.limit).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<30}  {:<9}  {:<20}  {:>7}  {:>9}  {:<24}", "ID", "STATUS", "MODEL", "TURNS", "TOKENS", "CREATED");
    for run in &page.data {
        println!(
            "{:<30}  {:<9}  {:<20}  {:>7}  {:>9}  {:<24}",
            run.id,
            run.status.as_str(),
            truncate(&run.model, 20),
            format!("{}/{}", run.turns_completed, run.max_turns),
            run.usage.total_tokens,
            run.created_at,
        );
    }
    if page.has_more {
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
    let run = client(&args.api)?.run(&args.run_id).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&run)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", describe(&run));
    Ok(ExitCode::SUCCESS)
}

/// `paceline status`'s summary of a run.
fn describe(run: &Run) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "id:          {}", run.id);
    let _ = writeln!(out, "status:      {}", run.status.as_str());
    let _ = writeln!(out, "mode/model:  {} / {}", run.mode.as_str(), run.model);
    let _ = writeln!(out, "turns:       {}/{}", run.turns_completed, run.max_turns);
    let u = &run.usage;
    let _ = writeln!(out, "usage:       {} in + {} out = {} tokens", u.input_tokens, u.output_tokens, u.total_tokens);
    if u.cached_input_tokens > 0 || u.cache_write_tokens > 0 || u.reasoning_tokens > 0 {
        let _ = writeln!(
            out,
            "             {} of the input read from the cache, {} written to it, {} of the output reasoning",
            u.cached_input_tokens, u.cache_write_tokens, u.reasoning_tokens
        );
    }
    match run.cost_usd {
        Some(cost) => {
            let _ = writeln!(out, "cost:        ${cost:.4} at the model's list price");
        }
        None => {
            let _ = writeln!(out, "cost:        unknown (no price for {})", run.model);
        }
    }
    let p = &run.pacing;
    let _ = writeln!(
        out,
        "pacing:      {} budget waits ({} ms waited), {} rate limited, {} retries",
        p.budget_waits, p.waited_ms, p.rate_limited, p.retries
    );
    if let Some(trace) = &run.trace_id {
        let _ = writeln!(out, "trace:       {trace}");
    }
    if let Some(w) = &run.webhook {
        let _ = writeln!(
            out,
            "webhook:     {} to {} ({} attempts{}{})",
            w.state.as_deref().unwrap_or("not yet (the run has not ended)"),
            w.url,
            w.attempts,
            w.last_status.map(|s| format!(", last HTTP {s}")).unwrap_or_default(),
            w.next_attempt_at.as_deref().map(|t| format!(", next at {t}")).unwrap_or_default()
        );
    }
    if run.status == RunStatus::Waiting {
        let _ = writeln!(
            out,
            "waiting:     {} until {}",
            run.wait_reason.map_or("-", |w| w.as_str()),
            run.next_attempt_at.as_deref().unwrap_or("-")
        );
    }
    let _ = writeln!(out, "created:     {}", run.created_at);
    if let Some(f) = &run.finished_at {
        let _ = writeln!(out, "finished:    {f}");
    }
    if let Some(e) = &run.error {
        let _ = writeln!(out, "error:       {}: {}", e.kind, e.message);
    }
    if let Some(t) = &run.output_text {
        let _ = writeln!(out, "output:\n{t}");
    }
    out
}

/// Shows the pacer state.
pub async fn pacer(args: PacerViewArgs) -> anyhow::Result<ExitCode> {
    let v = client(&args.api)?.pacer().await?;
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

/// Prints what the calls used and cost (`GET /v1/usage`): the caller's own,
/// or every tenant's with the operator's token.
pub async fn usage(args: UsageArgs) -> anyhow::Result<ExitCode> {
    let mut query = vec![("group_by", args.group_by.clone())];
    query.extend(args.from.clone().map(|f| ("from", f)));
    query.extend(args.to.clone().map(|t| ("to", t)));
    let v = client(&args.api)?.usage(&query).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{} to {}, by {}", v["from"].as_str().unwrap_or("?"), v["to"].as_str().unwrap_or("?"), args.group_by);
    println!(
        "{:<24}  {:>8}  {:>14}  {:>14}  {:>13}  {:>12}  {:>12}",
        args.group_by.to_uppercase(),
        "CALLS",
        "INPUT",
        "CACHE READ",
        "CACHE WRITE",
        "OUTPUT",
        "USD"
    );
    let row = |key: &str, t: &Value| {
        let usd = t["cost_usd"].as_f64().map_or("unknown".to_owned(), |c| format!("{c:.4}"));
        println!(
            "{:<24}  {:>8}  {:>14}  {:>14}  {:>13}  {:>12}  {:>12}",
            truncate(key, 24),
            t["calls"],
            t["input_tokens"],
            t["cached_input_tokens"],
            t["cache_write_tokens"],
            t["output_tokens"],
            usd
        );
    };
    for r in v["data"].as_array().into_iter().flatten() {
        row(r["key"].as_str().unwrap_or(""), r);
    }
    row("total", &v["total"]);
    Ok(ExitCode::SUCCESS)
}

/// Lists the dead-lettered turns (operator).
pub async fn dead(args: DeadArgs) -> anyhow::Result<ExitCode> {
    let page = operator_client(&args.api)?.dead(args.limit).await?;
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
    let client = client(&args.api)?;
    let run = client.retry(&args.run_id).await?;
    eprintln!("{} queued again from turn {}", run.id, run.turns_completed);
    println!("{}", run.id);
    if args.watch {
        return follow(&client, &run.id).await;
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
    fn events_drive_the_progress() {
        let mut p = Progress::new(5);
        assert!(!p.apply(event::TURN_STARTED, &serde_json::json!({"turn": 0})));
        p.apply(event::TURN_PACED, &serde_json::json!({"owed_ms": 1500}));
        assert!(p.until.is_some());
        p.apply(event::TURN_COMPLETED, &serde_json::json!({"usage": {"total_tokens": 120}}));
        assert_eq!((p.turns, p.tokens), (1, 120));
        assert!(p.until.is_none());
        assert!(p.apply(event::RUN_COMPLETED, &serde_json::json!({})));
    }
}
