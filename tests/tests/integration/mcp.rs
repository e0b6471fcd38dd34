//! Tools from MCP servers (README, "MCP tools"), against servers of the
//! official Python SDK (`tests/mcp/server.py`): `mcp` 2.x from PyPI speaks
//! the stateless 2026-07-28 revision, `mcp` 1.30 only the session revisions
//! before it. The worker is a `paceline worker` process; the model is the
//! mock provider's scripted one (it calls the first tool it is offered).

use std::path::{Path, PathBuf};

use mock_provider::MockConfig;
use paceline_tests::{free_tcp_port, poll_until, ChildGuard};
use serde_json::{json, Value};
use shared::runs::{RunStatus, SubmitPolicy, ToolEndpoints};

use crate::fixtures::{secs, serve, tool_outputs, App};

/// The bearer token the servers are sent, from the worker's environment.
const TOKEN: &str = "mcp-bearer-7f3a9c1e5b2d";
/// The variable holding it.
const TOKEN_VAR: &str = "KIT_MCP_TOKEN";

/// Which SDK serves.
#[derive(Debug, Clone, Copy)]
enum Sdk {
    /// `mcp` 2.x (the 2026-07-28 revision and the session ones).
    Modern,
    /// `mcp` 1.30 (2025-11-25 and before: `initialize` and a session).
    Legacy,
}

/// Where `.ci/run` installs `mcp` 1.30 (beside the 2.x in site-packages).
fn legacy_sdk_dir() -> PathBuf {
    std::env::var_os("PACELINE_MCP1_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/paceline/mcp-1.30"))
}

/// The `PYTHONPATH` under which `python3` imports `sdk`, when it does.
fn python_path(sdk: Sdk) -> Option<Option<PathBuf>> {
    let (path, probe) = match sdk {
        Sdk::Modern => (None, "import mcp.server.mcpserver"),
        Sdk::Legacy => (Some(legacy_sdk_dir()), "import mcp.server.fastmcp"),
    };
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-c", probe]);
    if let Some(p) = &path {
        cmd.env("PYTHONPATH", p);
    }
    if cmd.output().is_ok_and(|o| o.status.success()) {
        return Some(path);
    }
    let install = match sdk {
        Sdk::Modern => "pip install 'mcp>=2.3,<3'".to_owned(),
        Sdk::Legacy => format!("pip install --target {} mcp==1.30.0", legacy_sdk_dir().display()),
    };
    assert!(std::env::var("PACELINE_CI").is_err(), "the Python MCP SDK is not installed ({install})");
    eprintln!("SKIPPED: the Python MCP SDK is not installed ({install})");
    None
}

/// A running `tests/mcp/server.py`.
struct McpPeer {
    url: String,
    port: u16,
    args: Vec<String>,
    python_path: Option<PathBuf>,
    dir: tempfile::TempDir,
    child: Option<ChildGuard>,
}

impl McpPeer {
    /// Starts the server of `sdk` with `args`; `None`: skipped (no SDK).
    async fn start(sdk: Sdk, args: &[&str]) -> Option<Self> {
        let python_path = python_path(sdk)?;
        let port = free_tcp_port();
        let mut peer = Self {
            url: format!("http://127.0.0.1:{port}/mcp"),
            port,
            args: args.iter().map(|a| a.to_string()).collect(),
            python_path,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        peer.spawn().await;
        Some(peer)
    }

    /// (Re)starts the process on the same port, and waits until it listens.
    async fn spawn(&mut self) {
        self.child = None;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("mcp/server.py");
        let mut cmd = std::process::Command::new("python3");
        cmd.arg(script)
            .args(["--port", &self.port.to_string(), "--log"])
            .arg(self.log())
            .args(&self.args)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.dir.path().join("server.err")).unwrap());
        if let Some(p) = &self.python_path {
            cmd.env("PYTHONPATH", p);
        }
        self.child = Some(ChildGuard(cmd.spawn().expect("start the MCP server")));
        let port = self.port;
        let up = poll_until(secs(30), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(|_| ())
        })
        .await;
        if up.is_none() {
            let err = std::fs::read_to_string(self.dir.path().join("server.err")).unwrap_or_default();
            panic!("the MCP server did not listen within 30 s: {err}");
        }
    }

    fn stop(&mut self) {
        self.child = None;
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("calls.jsonl")
    }

    /// The tool calls it served, in order.
    fn calls(&self) -> Vec<Value> {
        std::fs::read_to_string(self.log())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }
}

/// A run offered `allowed` of the server at `url` (named `kit`), sent the bearer token.
fn kit_run(url: &str, allowed: &[&str]) -> Value {
    json!({
        "model": "gpt-test", "input": "use the kit", "max_turns": 5, "max_output_tokens": 64,
        "mcp_servers": [{"name": "kit", "url": url, "allowed_tools": allowed,
                         "headers_from_env": {"Authorization": TOKEN_VAR}}],
    })
}

/// A `paceline worker` process allowed `url`, holding the token (and
/// allowed to send it), calling the provider in `style`; its log in `log`.
fn mcp_worker_in(app: &App, url: &str, log: &Path, style: &str) -> ChildGuard {
    let token = format!("Bearer {TOKEN}");
    let args = ["--mcp-endpoints", url, "--mcp-header-vars", TOKEN_VAR, "--api-style", style];
    let mut cmd = app.worker_command(&args, &[(TOKEN_VAR, &token), ("OTHER_SECRET", "not-for-tenants")], "debug");
    cmd.stderr(std::fs::File::create(log).unwrap());
    ChildGuard(cmd.spawn().expect("start paceline worker"))
}

/// [`mcp_worker_in`] on the Responses API.
fn mcp_worker(app: &App, url: &str, log: &Path) -> ChildGuard {
    mcp_worker_in(app, url, log, "responses")
}

/// A function tool of a provider request, in either OpenAI shape (Chat nests it in `function`).
fn function_of(tool: &Value) -> &Value {
    tool.get("function").unwrap_or(tool)
}

/// Every key of the app's Redis whose value holds `needle`.
async fn redis_keys_holding(app: &App, needle: &str) -> Vec<String> {
    let mut conn = app.redis.client().get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    let mut holding = vec![];
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(&mut conn).await.unwrap();
        let read: &[&str] = match kind.as_str() {
            "string" => &["GET"],
            "hash" => &["HGETALL"],
            "list" => &["LRANGE", "0", "-1"],
            "zset" => &["ZRANGE", "0", "-1"],
            "set" => &["SMEMBERS"],
            "stream" => &["XRANGE", "-", "+"],
            _ => &[],
        };
        let Some((command, args)) = read.split_first() else { continue };
        let value: redis::Value = redis::cmd(command).arg(&key).arg(args).query_async(&mut conn).await.unwrap();
        let text = flatten(&value);
        if text.contains(needle) {
            holding.push(key);
        }
    }
    holding
}

/// Every string of a reply, as text (binary values lossily).
fn flatten(value: &redis::Value) -> String {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().map(flatten).collect::<Vec<_>>().join("\n")
        }
        redis::Value::Map(pairs) => pairs.iter().map(|(k, v)| format!("{}\n{}", flatten(k), flatten(v))).collect(),
        _ => String::new(),
    }
}

/// Three runs against `peer` through a worker process calling the provider in
/// `style`: one offered echo, big and fail (it calls echo), one big, one fail.
/// Checks what the provider was offered, what reached the server (`revision`
/// in its header, a session or none), what the model read, and that the
/// bearer value is nowhere. Returns the server's calls.
async fn offered_called_and_kept_secret(peer: &McpPeer, style: &str, revision: &str, session: bool) -> Vec<Value> {
    let app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let log = peer.dir.path().join("worker.log");
    let _worker = mcp_worker_in(&app, &peer.url, &log, style);

    let echo = app.submit(kit_run(&peer.url, &["echo", "big", "fail"])).await;
    let big = app.submit(kit_run(&peer.url, &["big"])).await;
    let fail = app.submit(kit_run(&peer.url, &["fail"])).await;
    for run in [&echo, &big, &fail] {
        let done = app.wait_finished(&run.id, secs(60)).await;
        assert_eq!(done.status, RunStatus::Completed, "a tool's error is its output, not the run's: {done:?}");
    }

    // The provider was offered exactly the allowed tools, with the server's schemas.
    let stats = app.mock.stats();
    let offered: Vec<Vec<Value>> = stats
        .bodies
        .iter()
        .filter_map(|b| b.body.get("tools").and_then(Value::as_array).cloned())
        .filter(|tools| !tools.is_empty())
        .collect();
    let names = |tools: &[Value]| -> Vec<String> {
        tools.iter().map(|t| function_of(t)["name"].as_str().unwrap_or_default().to_owned()).collect()
    };
    let all = offered.iter().find(|t| t.len() == 3).expect("a request offered the three tools");
    assert_eq!(names(all), ["kit__echo", "kit__big", "kit__fail"]);
    assert_eq!(all[0]["type"], "function");
    assert_eq!(all[0].get("function").is_some(), style == "chat", "the {style} wire's shape: {}", all[0]);
    let echo_tool = function_of(&all[0]);
    assert_eq!(echo_tool["description"], "Echoes the message back.");
    assert_eq!(echo_tool["parameters"]["properties"]["message"]["type"], "string", "{echo_tool}");
    assert_eq!(echo_tool["parameters"]["required"], json!(["message"]), "{echo_tool}");
    assert!(offered.iter().all(|t| !names(t).iter().any(|n| n.contains("hidden"))), "a tool not allowed was offered");

    // Every call reached tools/call with its arguments and the bearer header, statelessly.
    let calls = peer.calls();
    assert_eq!(calls.len(), 3, "one call a run: {calls:?}");
    let echoed = calls.iter().find(|c| c["tool"] == "echo").expect("echo was called");
    let message = echoed["arguments"]["message"].as_str().unwrap().to_owned();
    assert!(message.starts_with("mock message"), "the model's arguments: {echoed}");
    for call in &calls {
        assert_eq!(call["authorization"], format!("Bearer {TOKEN}"), "{call}");
        assert_eq!(call["mcp_protocol_version"], revision, "the revision agreed: {call}");
        assert_eq!(call["mcp_session_id"].is_string(), session, "a session or none: {call}");
    }

    // What the model read.
    assert_eq!(tool_outputs(&app, &echo.id).await, [format!("echo: {message}")]);
    let clipped = &tool_outputs(&app, &big.id).await[0];
    assert!(clipped.starts_with("bbbb"), "{}", &clipped[..40]);
    assert!(clipped.chars().count() <= 16_000, "clipped to the cap: {}", clipped.len());
    let note = &clipped[clipped.rfind('\n').unwrap() + 1..];
    assert!(note.starts_with("[output clipped: kept the first ") && note.ends_with(" of 40000 characters]"), "{note}");
    let failed = &tool_outputs(&app, &fail.id).await[0];
    assert!(failed.starts_with("tool error: ") && failed.contains("the disk is on fire"), "{failed}");

    // Written in record format 2: a worker that knows no MCP servers does not run it.
    let record = shared::keys::Keys::new(app.prefix.clone()).run_record(&echo.id);
    let mut conn = app.redis.conn().await;
    let format: String = redis::cmd("HGET").arg(&record).arg("format").query_async(&mut conn).await.unwrap();
    assert_eq!(format, "2");

    // The bearer value is nowhere but in the worker's environment.
    assert_eq!(redis_keys_holding(&app, TOKEN).await, Vec::<String>::new(), "in Redis");
    for run in [&echo, &big, &fail] {
        let shown = serde_json::to_string(&app.store.get("default", &run.id).await.unwrap().unwrap()).unwrap();
        assert!(!shown.contains(TOKEN), "in the run object: {shown}");
    }
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("MCP server connected"), "the worker logs its connection: {logged}");
    assert!(logged.contains(revision), "and the revision agreed: {logged}");
    assert!(!logged.contains(TOKEN), "in the worker's log (at debug)");
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_offered_the_allowed_tools_of_a_stateless_mcp_server_and_calls_them_with_its_bearer_header() {
    let Some(peer) = McpPeer::start(Sdk::Modern, &["--stateless"]).await else { return };
    offered_called_and_kept_secret(&peer, "responses", "2026-07-28", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_server_is_offered_and_called_alike_on_one_session_a_worker_opened_again_when_it_forgets_it() {
    let Some(mut peer) = McpPeer::start(Sdk::Legacy, &[]).await else { return };
    // The same runs as against the stateless server (on Chat Completions' wire); each
    // tenant's calls on one session.
    let calls = offered_called_and_kept_secret(&peer, "chat", "2025-11-25", true).await;
    let session = calls[0]["mcp_session_id"].as_str().unwrap().to_owned();
    assert!(calls.iter().all(|c| c["mcp_session_id"] == session.as_str()), "one session a worker: {calls:?}");

    // A worker that knew the session, then the server restarts: it knows no
    // session; the worker opens a new one and the call goes through.
    let app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let log = peer.dir.path().join("worker2.log");
    let _worker = mcp_worker(&app, &peer.url, &log);
    let run = app.submit(kit_run(&peer.url, &["echo"])).await;
    assert_eq!(app.wait_finished(&run.id, secs(60)).await.status, RunStatus::Completed);
    let before = peer.calls().last().unwrap()["mcp_session_id"].as_str().unwrap().to_owned();
    peer.stop();
    peer.spawn().await;
    let run = app.submit(kit_run(&peer.url, &["echo"])).await;
    let done = app.wait_finished(&run.id, secs(90)).await;
    assert_eq!(done.status, RunStatus::Completed, "{done:?}");
    assert!(tool_outputs(&app, &run.id).await[0].starts_with("echo: mock message"), "the call went through");
    let fresh = peer.calls().last().unwrap()["mcp_session_id"].as_str().expect("a session").to_owned();
    assert_ne!(fresh, before, "a new session after the server forgot the old one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_server_answers_badly_is_a_clear_error_bounded_in_size_and_the_worker_goes_on() {
    let Some(peer) = McpPeer::start(Sdk::Modern, &["--many", "10000"]).await else { return };
    let app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    // A "server" that answers every request with text that is not JSON-RPC.
    let garbage = serve(
        axum::Router::new()
            .fallback(|| async { ([("content-type", "application/json")], "{\"this is\": \"not JSON-RPC\"") }),
    )
    .await;
    let garbage = format!("http://{garbage}/mcp");
    let log = peer.dir.path().join("worker.log");
    let allowed = format!("{},{garbage}", peer.url);
    let _worker = mcp_worker(&app, &allowed, &log);

    // 50 MiB answered: the tool's error, the run completes.
    let huge = app.submit(kit_run(&peer.url, &["huge"])).await;
    // 10 000 tools and no allow-list: the run offers as many as a request may hold.
    let mut many = kit_run(&peer.url, &[]);
    many["mcp_servers"][0].as_object_mut().unwrap().remove("allowed_tools");
    let many = app.submit(many).await;
    // Malformed JSON-RPC: the turn waits to try again, saying why.
    let mut bad = kit_run(&garbage, &["echo"]);
    bad["mcp_servers"][0]["name"] = json!("junk");
    let bad = app.submit(bad).await;
    // What the worker itself refuses, whatever the API let through: a server
    // outside its PACELINE_MCP_ENDPOINTS, a variable outside its PACELINE_MCP_HEADER_VARS.
    let elsewhere = app.submit(kit_run("http://127.0.0.1:9/mcp", &["echo"])).await;
    let mut other_var = kit_run(&peer.url, &["echo"]);
    other_var["mcp_servers"][0]["headers_from_env"] = json!({"Authorization": "OTHER_SECRET"});
    let other_var = app.submit(other_var).await;

    let done = app.wait_finished(&huge.id, secs(90)).await;
    assert_eq!(done.status, RunStatus::Completed, "{done:?}");
    let output = &tool_outputs(&app, &huge.id).await[0];
    assert!(output.starts_with("tool error: the answer is larger than 4 MiB"), "{}", &output[..output.len().min(300)]);
    assert!(output.len() < 1_000, "an error, not the answer: {} characters", output.len());

    let done = app.wait_finished(&many.id, secs(90)).await;
    assert_eq!(done.status, RunStatus::Completed, "{done:?}");
    let stats = app.mock.stats();
    let most = stats.bodies.iter().filter_map(|b| b.body.get("tools").and_then(Value::as_array)).map(Vec::len).max();
    assert_eq!(most, Some(shared::runs::spec::MAX_TOOLS), "at most 128 tools in a request");

    for (run, says) in [
        (&bad, "could not parse JSON response"),
        (&elsewhere, "not an allowed MCP server on this worker"),
        (&other_var, "OTHER_SECRET is not a variable this worker sends"),
    ] {
        let waiting = poll_until(secs(30), || async {
            let events = app.store.events("default", &run.id, None, None, 1_000).await.ok()??;
            events.into_iter().find(|e| e.kind == "turn.retry")
        })
        .await
        .expect("the turn waits to try again");
        let reason = waiting.data["reason"].as_str().unwrap_or_default().to_owned();
        assert!(reason.starts_with("MCP server ") && reason.contains(says), "{reason}");
        let run = app.store.get("default", &run.id).await.unwrap().unwrap();
        assert!(matches!(run.status, RunStatus::Waiting | RunStatus::Running | RunStatus::Queued), "{run:?}");
    }
    assert!(peer.calls().iter().all(|c| c["authorization"] != "not-for-tenants"), "the variable was never sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_not_allowed_is_a_422_naming_it_and_writes_nothing() {
    let app = App::start(MockConfig::default()).await;
    // The test API allows no MCP server (PACELINE_MCP_ENDPOINTS unset).
    let (api, _stop) = app.tenant_api(&[("default", "t0")], "op").await;
    let http = reqwest::Client::new();
    let answer = http
        .post(format!("{api}/v1/runs"))
        .bearer_auth("t0")
        .json(&kit_run("http://127.0.0.1:9/mcp", &[]))
        .send()
        .await;
    let answer = answer.unwrap();
    assert_eq!(answer.status(), 422);
    let body: Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["field"], "mcp_servers[0].url", "{body}");
    // A header value in place of a variable's name is refused too: values never pass through the spec.
    let mut inline = kit_run("http://127.0.0.1:9/mcp", &[]);
    inline["mcp_servers"][0]["headers_from_env"] = json!({"Authorization": "Bearer abc"});
    let answer = http.post(format!("{api}/v1/runs")).bearer_auth("t0").json(&inline).send().await.unwrap();
    assert_eq!(answer.status(), 422);
    let body: Value = answer.json().await.unwrap();
    assert_eq!(body["error"]["field"], "mcp_servers[0].headers_from_env", "{body}");
    let runs: Value = http.get(format!("{api}/v1/runs")).bearer_auth("t0").send().await.unwrap().json().await.unwrap();
    assert_eq!(runs["data"], json!([]), "nothing written");
    // The policy allows it once PACELINE_MCP_ENDPOINTS names it, and PACELINE_MCP_HEADER_VARS its variable.
    let policy =
        SubmitPolicy { mcp_endpoints: ToolEndpoints::every_tenant(["http://127.0.0.1:9/"]), ..SubmitPolicy::default() };
    let spec = shared::runs::RunSpec::from_json(&kit_run("http://127.0.0.1:9/mcp", &[]), &policy).unwrap();
    assert!(policy.admit("default", &spec).is_err(), "a variable not listed");
    let policy = SubmitPolicy { mcp_header_vars: TOKEN_VAR.parse().unwrap(), ..policy };
    assert!(policy.admit("default", &spec).is_ok());
}
