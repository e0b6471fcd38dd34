//! The HTTP API against a private redis-server: every route and every error
//! status of README's "Submitting a run", tenant isolation, idempotency (sequential and
//! concurrent), SSE with Last-Event-ID, the OpenAPI document, /metrics, and
//! Redis going away; the CLI as a process against a spawned app, and
//! `paceline submit --watch` following a real worker and the mock provider to
//! completion. Each test spawns its own app on port 0 with its own Redis and
//! key prefix.

use std::time::{Duration, Instant};

use api::config::ApiTokens;
use api::{ApiConfig, Application};
use paceline_tests::{eventually, unique_prefix, within, RedisServer};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::keys::Keys;
use shared::runs::{RunStore, ToolEndpoints};
use tokio::sync::oneshot;

const ACME: &str = "tok-acme-0123456789";
const BETA: &str = "tok-beta-9876543210";
const OPERATOR: &str = "tok-operator-5555555555";
const TOOLS: &str = "http://127.0.0.1:9000/tools";

struct TestApp {
    url: String,
    redis: RedisServer,
    prefix: String,
    http: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// An app with tenants `acme` and `beta`, the operator, tool endpoints under [`TOOLS`].
async fn spawn_app_with(tweak: impl FnOnce(&mut ApiConfig)) -> TestApp {
    let redis = RedisServer::start();
    let prefix = unique_prefix();
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap(), RedisArgs::new(redis.url(), prefix.clone()));
    config.serve.tokens = ApiTokens::default().with("acme", ACME).with("beta", BETA);
    config.access.operator_token = Some(shared::config::Secret::new(OPERATOR));
    config.runs.tool_endpoints = ToolEndpoints::every_tenant([TOOLS]);
    tweak(&mut config);
    let app = Application::build(config).await.expect("build the app");
    let url = format!("http://{}", app.local_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    TestApp { url, redis, prefix, http, stop: Some(stop) }
}

fn spec() -> Value {
    json!({"model": "gpt-4.1-mini", "instructions": "Be brief.", "input": "the task", "max_turns": 5,
           "metadata": {"ticket": 42}})
}

impl TestApp {
    fn req(&self, method: reqwest::Method, path: &str, token: Option<&str>) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.url));
        match token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        read(self.req(reqwest::Method::GET, path, Some(token)).send().await.unwrap()).await
    }

    async fn post(&self, path: &str, token: &str, body: &Value) -> (u16, Value) {
        read(self.req(reqwest::Method::POST, path, Some(token)).json(body).send().await.unwrap()).await
    }

    async fn submit(&self, token: &str, body: &Value) -> Value {
        let (status, run) = self.post("/v1/runs", token, body).await;
        assert_eq!(status, 202, "{run}");
        run
    }

    /// A store on the app's Redis and prefix, to play the worker's part.
    async fn store(&self) -> RunStore {
        let conn = shared::redis_util::manager(&self.redis.url()).await.unwrap();
        RunStore::new(conn, Keys::new(self.prefix.clone()), Duration::from_secs(3600))
    }

    async fn key_count(&self) -> usize {
        let mut conn = self.redis.conn().await;
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("{}*", self.prefix)).query_async(&mut conn).await.unwrap();
        keys.len()
    }

    /// The whole SSE body of a stream that closes by itself.
    async fn events(&self, id: &str, token: &str, last_event_id: Option<&str>) -> Vec<(String, String, Value)> {
        let mut r = self.req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(token));
        if let Some(l) = last_event_id {
            r = r.header("Last-Event-ID", l);
        }
        let resp = within("the event request", Duration::from_secs(10), r.send()).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let text = within("the event stream to close", Duration::from_secs(10), resp.text()).await.unwrap();
        parse_sse(&text)
    }
}

async fn read(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

/// (id, event, data) of each event; comments (keep-alives) skipped.
fn parse_sse(text: &str) -> Vec<(String, String, Value)> {
    let mut out = vec![];
    for block in text.split("\n\n") {
        let (mut id, mut ev, mut data) = (String::new(), String::new(), String::new());
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("event:") {
                ev = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if !ev.is_empty() {
            out.push((id, ev, serde_json::from_str(&data).unwrap_or(Value::Null)));
        }
    }
    out
}

/// An event stream read as it arrives, so a test waits for an event instead of
/// sleeping until it has probably come.
struct OpenStream {
    resp: reqwest::Response,
    /// Everything read so far.
    bytes: Vec<u8>,
}

impl OpenStream {
    /// Opens `GET /v1/runs/{id}/events` as `token`.
    async fn open(app: &TestApp, id: &str, token: &str) -> Self {
        let resp = within(
            "the event request",
            Duration::from_secs(10),
            app.req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(token)).send(),
        )
        .await
        .unwrap();
        Self::new(resp)
    }

    /// Reads `resp`, an event stream's answer.
    fn new(resp: reqwest::Response) -> Self {
        assert_eq!(resp.status(), 200);
        Self { resp, bytes: vec![] }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// Reads until an event `kind` has arrived, at most `timeout`; fails if
    /// the stream ends first.
    async fn until_event(&mut self, kind: &str, timeout: Duration) {
        within(&format!("event {kind} on the stream"), timeout, async {
            while !parse_sse(&self.text()).iter().any(|(_, k, _)| k == kind) {
                match self.resp.chunk().await.unwrap() {
                    Some(chunk) => self.bytes.extend_from_slice(&chunk),
                    None => panic!("the stream ended before {kind}: {}", self.text()),
                }
            }
        })
        .await;
    }

    /// Reads to the end of the stream, at most `timeout`: the whole body.
    async fn rest(mut self, what: &str, timeout: Duration) -> String {
        within(what, timeout, async {
            while let Some(chunk) = self.resp.chunk().await.unwrap() {
                self.bytes.extend_from_slice(&chunk);
            }
        })
        .await;
        self.text()
    }
}

fn error_type(body: &Value) -> &str {
    body["error"]["type"].as_str().unwrap_or_else(|| panic!("not an error body: {body}"))
}

#[tokio::test]
async fn probes_answer_without_a_token() {
    let app = spawn_app().await;
    let r = app.req(reqwest::Method::GET, "/healthz", None).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // With tokens configured, /metrics is the operator's.
    let r = app.req(reqwest::Method::GET, "/metrics", None).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let (status, body) = read(app.req(reqwest::Method::GET, "/metrics", Some(ACME)).send().await.unwrap()).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(error_type(&body), "forbidden");
    let r = app.req(reqwest::Method::GET, "/metrics", Some(OPERATOR)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // In open mode it is open, as every route is.
    let open = spawn_app_with(|c| {
        c.serve.tokens = ApiTokens::default();
        c.access.operator_token = None;
    })
    .await;
    let r = open.req(reqwest::Method::GET, "/metrics", None).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_submitted_runs_first_turn_carries_the_ask_its_tokens_were_counted_for() {
    // With the binary's `FirstAsk` (the worker's token count), the first turn
    // is queued with its pacer ask, so the fetch that leases it can ask first.
    let app = spawn_app_with(|c| c.first_ask = Some(worker::turn::first_ask(&Default::default()))).await;
    let mut body = spec();
    body["input"] = json!("word ".repeat(400));
    body["max_output_tokens"] = json!(300);
    let run = app.submit(ACME, &body).await;
    let queue =
        shared::runs::run_queue(&RedisArgs::new(app.redis.url(), app.prefix.clone()), Default::default()).unwrap();
    let turn: shared::runs::Turn = queue.payload(run["id"].as_str().unwrap()).await.unwrap().expect("queued");
    assert_eq!((turn.job.turn, turn.cleared), (0, false));
    let ask = turn.ask.expect("the first turn's ask");
    assert_eq!((ask.model.as_str(), ask.tenant.as_str(), ask.output, ask.requests), ("gpt-4.1-mini", "acme", 300, 1));
    // Its input counted: 400 words and the framing, and the output reserved.
    assert!((700..=800).contains(&ask.tokens), "{ask:?}");

    // Without one (a store used directly, an API built in code), the first turn asks when it starts.
    let plain = spawn_app().await;
    let run = plain.submit(ACME, &spec()).await;
    let queue =
        shared::runs::run_queue(&RedisArgs::new(plain.redis.url(), plain.prefix.clone()), Default::default()).unwrap();
    let turn: shared::runs::Turn = queue.payload(run["id"].as_str().unwrap()).await.unwrap().expect("queued");
    assert_eq!(turn.ask, None);
}

#[tokio::test]
async fn a_submitted_run_is_queued_and_readable() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap();
    assert!(id.starts_with("run_"), "{run}");
    assert_eq!(run["status"], "queued");
    assert_eq!(run["mode"], "work");
    assert_eq!(run["model"], "gpt-4.1-mini");
    assert_eq!(run["max_turns"], 5);
    assert_eq!(run["turns_completed"], 0);
    assert_eq!(run["metadata"], json!({"ticket": 42}));
    for k in [
        "usage",
        "pacing",
        "wait_reason",
        "next_attempt_at",
        "output_text",
        "error",
        "created_at",
        "updated_at",
        "finished_at",
    ] {
        assert!(run.get(k).is_some(), "the run object lacks {k}: {run}");
    }

    let (status, got) = app.get(&format!("/v1/runs/{id}"), ACME).await;
    assert_eq!(status, 200);
    assert_eq!(got["id"], run["id"]);

    let (status, tx) = app.get(&format!("/v1/runs/{id}/transcript"), ACME).await;
    assert_eq!(status, 200);
    assert_eq!(tx["run_id"], run["id"]);
    assert_eq!(tx["items"], json!([{"turn": 0, "item": {"role": "user", "content": "the task"}}]));

    let (status, q) = app.get("/v1/queue", ACME).await;
    assert_eq!(status, 200);
    assert_eq!(q["ready"].as_u64().unwrap() + q["delayed"].as_u64().unwrap(), 1, "{q}");
    assert_eq!(q["in_flight"], 0);
    assert_eq!(q["dead"], 0);
    assert!(q["observed_at"].is_string());
}

#[tokio::test]
async fn no_token_or_a_bad_one_is_401_on_every_v1_route() {
    let app = spawn_app().await;
    let id = "run_01JDXXXXXXXXXXXXXXXXXXXXXX";
    let routes = [
        (reqwest::Method::POST, "/v1/runs".to_string()),
        (reqwest::Method::GET, "/v1/runs".to_string()),
        (reqwest::Method::GET, format!("/v1/runs/{id}")),
        (reqwest::Method::GET, format!("/v1/runs/{id}/transcript")),
        (reqwest::Method::GET, format!("/v1/runs/{id}/events")),
        (reqwest::Method::POST, format!("/v1/runs/{id}/cancel")),
        (reqwest::Method::GET, "/v1/pacer".to_string()),
        (reqwest::Method::GET, "/v1/queue".to_string()),
        (reqwest::Method::GET, "/v1/workers".to_string()),
        (reqwest::Method::GET, "/v1/dead".to_string()),
        (reqwest::Method::POST, format!("/v1/runs/{id}/retry")),
        (reqwest::Method::GET, "/v1/openapi.json".to_string()),
    ];
    for (method, path) in routes {
        for token in [None, Some("nope"), Some("tok-acme-012345678")] {
            let (status, body) = read(app.req(method.clone(), &path, token).json(&spec()).send().await.unwrap()).await;
            assert_eq!(status, 401, "{method} {path} with {token:?}: {body}");
            assert_eq!(error_type(&body), "unauthorized");
        }
    }
    assert_eq!(app.key_count().await, 0, "a refused request reached Redis");
}

#[tokio::test]
async fn open_mode_without_tokens_is_tenant_default() {
    let app = spawn_app_with(|c| {
        c.serve.tokens = ApiTokens::default();
        c.access.operator_token = None;
    })
    .await;
    let r = app.req(reqwest::Method::POST, "/v1/runs", None).json(&spec()).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let (status, list) = read(app.req(reqwest::Method::GET, "/v1/runs", None).send().await.unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    // Open mode reads the operator's views too.
    for path in ["/v1/workers", "/v1/queue", "/v1/pacer", "/metrics"] {
        let r = app.req(reqwest::Method::GET, path, None).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
}

#[tokio::test]
async fn each_generation_parameter_out_of_range_is_a_422_naming_it_and_a_valid_set_is_kept() {
    let app = spawn_app_with(|c| {
        c.providers.providers =
            "openai=responses@https://api.openai.com/v1,claude=anthropic@https://api.anthropic.com".parse().unwrap()
    })
    .await;
    let tools = json!([{"type": "function", "name": "search", "parameters": {"type": "object", "properties": {}}}]);
    let with = |extra: Value| {
        let mut body = json!({"model": "m", "input": "x", "tool_endpoint": TOOLS, "tools": tools});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let schema = json!({"type": "object"});
    let cases = [
        (json!({"temperature": 2.1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"reasoning": {"effort": "maximal"}}), "reasoning.effort"),
        (json!({"reasoning": {"effort": "low", "summary": "auto"}}), "reasoning.summary"),
        (json!({"text": {"format": {"type": "xml"}}}), "text.format.type"),
        (json!({"text": {"format": {"type": "json_schema", "schema": schema}}}), "text.format.name"),
        (json!({"text": {"format": {"type": "json_schema", "name": "v"}}}), "text.format.schema"),
        (
            json!({"text": {"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": 1}}}),
            "text.format.strict",
        ),
        (json!({"tool_choice": "always"}), "tool_choice"),
        (json!({"tool_choice": {"type": "function", "name": "fetch"}}), "tool_choice.name"),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (json!({"stop": ["a", 1]}), "stop[1]"),
        (json!({"seed": 0.5}), "seed"),
        (json!({"service_tier": "turbo"}), "service_tier"),
        (json!({"prompt_cache_key": ""}), "prompt_cache_key"),
        (json!({"store": "no"}), "store"),
        (json!({"truncation": "middle"}), "truncation"),
        (json!({"provider": "gemini"}), "provider"),
        (json!({"top_k": 5}), "top_k"),
    ];
    for (extra, field) in cases {
        let (status, err) = app.post("/v1/runs", ACME, &with(extra.clone())).await;
        assert_eq!(status, 422, "{extra}: {err}");
        assert_eq!(err["error"]["field"], field, "{extra}: {err}");
    }
    let (status, err) =
        app.post("/v1/runs", ACME, &json!({"model": "m", "input": "x", "tool_choice": "required"})).await;
    assert_eq!((status, err["error"]["field"].as_str()), (422, Some("tool_choice")), "{err}");
    let (_, err) = app.post("/v1/runs", ACME, &with(json!({"provider": "gemini"}))).await;
    assert!(err["error"]["message"].as_str().unwrap().contains("openai, claude"), "{err}");
    assert_eq!(app.key_count().await, 0, "invalid input reached Redis");

    // Every parameter at once, in range, on a named provider: accepted and stored as given.
    let all = with(json!({"provider": "claude", "temperature": 0, "top_p": 1, "reasoning": {"effort": "minimal"},
        "text": {"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": true}},
        "tool_choice": {"type": "function", "name": "search"}, "parallel_tool_calls": false, "stop": "END",
        "seed": 7, "service_tier": "priority", "prompt_cache_key": "k", "store": false, "truncation": "disabled"}));
    let run = app.submit(ACME, &all).await;
    assert_eq!(run["usage"]["reasoning_tokens"], 0);
    assert_eq!(run["usage"]["cached_input_tokens"], 0);
    let key = Keys::new(app.prefix.clone()).run_record(run["id"].as_str().unwrap());
    let mut conn = app.redis.conn().await;
    let spec: String = redis::cmd("HGET").arg(&key).arg("spec").query_async(&mut conn).await.unwrap();
    let stored: Value = serde_json::from_str(&spec).unwrap();
    assert_eq!(stored["provider"], "claude");
    assert_eq!(stored["stop"], json!(["END"]));
    assert_eq!(stored["tool_choice"], json!({"type": "function", "name": "search"}));
}

#[tokio::test]
async fn malformed_json_is_400_and_breaking_a_rule_is_422_naming_the_field() {
    let app = spawn_app().await;
    for raw in ["{", "not json", "{\"model\": }", "", "[1,"] {
        let (status, body) = read(
            app.req(reqwest::Method::POST, "/v1/runs", Some(ACME))
                .header("content-type", "application/json")
                .body(raw)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 400, "{raw:?}: {body}");
        assert_eq!(error_type(&body), "invalid_json");
    }
    let deep = "[".repeat(100_000);
    let (status, _) = read(
        app.req(reqwest::Method::POST, "/v1/runs", Some(ACME))
            .header("content-type", "application/json")
            .body(deep)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "deep nesting is refused, not a crash");

    let cases = [
        (json!({"input": "x"}), "model"),
        (json!({"model": "m"}), "input"),
        (json!({"model": "m", "input": "x", "max_turns": 0}), "max_turns"),
        (json!({"model": "m", "input": "x", "max_turns": 100000}), "max_turns"),
        (json!({"model": "m", "input": "x", "mode": "fast"}), "mode"),
        (json!({"model": "m", "input": "x", "colour": "red"}), "colour"),
        (json!({"model": "m", "input": "x", "tool_endpoint": TOOLS, "tools": [{"type": "function"}]}), "tools[0].name"),
        (json!({"model": "m", "input": "x", "tool_endpoint": "http://evil.example/tools"}), "tool_endpoint"),
        (json!("just a string"), ""),
    ];
    for (body, field) in cases {
        let (status, err) = app.post("/v1/runs", ACME, &body).await;
        assert_eq!(status, 422, "{body}: {err}");
        assert_eq!(error_type(&err), "invalid_request");
        assert_eq!(err["error"]["field"], field, "{body}: {err}");
        assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(app.key_count().await, 0, "invalid input reached Redis");

    // An allowed endpoint with tools is accepted.
    let ok = json!({"model": "m", "input": "x", "tool_endpoint": format!("{TOOLS}/search"),
                    "tools": [{"type": "function", "name": "search", "parameters": {"type": "object", "properties": {}}}]});
    app.submit(ACME, &ok).await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_before_it_is_read() {
    let app = spawn_app().await;
    let big = json!({"model": "m", "input": "x".repeat(2 * 1024 * 1024)}).to_string();
    let (status, body) =
        read(app.req(reqwest::Method::POST, "/v1/runs", Some(ACME)).body(big.clone()).send().await.unwrap()).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(error_type(&body), "payload_too_large");

    // Chunked (no Content-Length): cut off while it is read.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        big.into_bytes().chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
    let body = reqwest::Body::wrap_stream(futures::stream::iter(chunks));
    let (status, err) = read(
        app.req(reqwest::Method::POST, "/v1/runs", Some(ACME))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(error_type(&err), "payload_too_large");
    assert_eq!(app.key_count().await, 0);

    // Just under the limit is fine.
    let fits = json!({"model": "m", "input": "x".repeat(1000 * 1000)});
    app.submit(ACME, &fits).await;
}

#[tokio::test]
async fn unknown_runs_and_other_tenants_runs_are_404() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap().to_owned();
    for path in [
        format!("/v1/runs/{id}"),
        format!("/v1/runs/{id}/transcript"),
        format!("/v1/runs/{id}/events"),
        "/v1/runs/run_01JDXXXXXXXXXXXXXXXXXXXXXX".to_string(),
        "/v1/runs/not-a-run-id".to_string(),
        "/v1/runs/run_..%2F..%2Fetc/transcript".to_string(),
    ] {
        let (status, body) = app.get(&path, BETA).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(error_type(&body), "not_found");
    }
    let (status, _) = app.post(&format!("/v1/runs/{id}/cancel"), BETA, &json!({})).await;
    assert_eq!(status, 404, "beta cancelled acme's run");
    let (_, got) = app.get(&format!("/v1/runs/{id}"), ACME).await;
    assert_eq!(got["status"], "queued", "acme's run was touched by beta");

    let (_, beta_list) = app.get("/v1/runs", BETA).await;
    assert_eq!(beta_list["data"], json!([]), "beta sees acme's runs");
    let (status, body) = app.get("/v1/no-such-route", ACME).await;
    assert_eq!(status, 404);
    assert_eq!(error_type(&body), "not_found");
}

#[tokio::test]
async fn cancel_is_200_then_409() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap();
    let (status, cancelled) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 200, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    assert!(cancelled["finished_at"].is_string());
    let (status, body) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(error_type(&body), "conflict");
    let (_, q) = app.get("/v1/queue", ACME).await;
    assert_eq!(
        q["ready"].as_u64().unwrap() + q["delayed"].as_u64().unwrap(),
        0,
        "the cancelled run's turn is still queued: {q}"
    );
}

#[tokio::test]
async fn runs_list_newest_first_in_pages_and_by_status() {
    let app = spawn_app().await;
    let mut ids = vec![];
    for i in 0..5 {
        let run = app.submit(ACME, &json!({"model": "m", "input": format!("task {i}")})).await;
        ids.push(run["id"].as_str().unwrap().to_owned());
    }
    app.submit(BETA, &spec()).await;
    let (_, cancelled) = app.post(&format!("/v1/runs/{}/cancel", ids[1]), ACME, &json!({})).await;
    assert_eq!(cancelled["status"], "cancelled");

    let mut seen = vec![];
    let mut cursor: Option<String> = None;
    for _ in 0..10 {
        let path = match &cursor {
            Some(c) => format!("/v1/runs?limit=2&cursor={c}"),
            None => "/v1/runs?limit=2".to_string(),
        };
        let (status, page) = app.get(&path, ACME).await;
        assert_eq!(status, 200, "{page}");
        let data = page["data"].as_array().unwrap();
        assert!(data.len() <= 2);
        seen.extend(data.iter().map(|r| r["id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(seen, newest_first);

    let (_, only) = app.get("/v1/runs?status=cancelled", ACME).await;
    let only: Vec<&str> = only["data"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(only, vec![ids[1].as_str()]);

    for (q, field) in [
        ("status=done", "status"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=x", "limit"),
        ("cursor=zzz", "cursor"),
    ] {
        let (status, body) = app.get(&format!("/v1/runs?{q}"), ACME).await;
        assert_eq!(status, 422, "{q}: {body}");
        assert_eq!(body["error"]["field"], field);
    }
}

#[tokio::test]
async fn runs_are_searched_by_id_and_metadata_value_across_pages() {
    let app = spawn_app().await;
    let mut tagged = vec![];
    for i in 0..30 {
        let mut body = spec();
        body["metadata"] = json!({"customer": if i % 10 == 3 { "Acme-Widgets" } else { "other" }, "n": i.to_string()});
        let run = app.submit(ACME, &body).await;
        if i % 10 == 3 {
            tagged.push(run["id"].as_str().unwrap().to_owned());
        }
    }
    // Beta's run with the same metadata is not acme's.
    let mut body = spec();
    body["metadata"] = json!({"customer": "Acme-Widgets"});
    app.submit(BETA, &body).await;
    // Three matches spread over 30 runs, found through pages of 2 (case-insensitive).
    let mut found = vec![];
    let mut cursor = String::new();
    // Bounded: a cursor that never ends fails here instead of looping.
    for pages in 1.. {
        assert!(pages <= 31, "more pages than acme has runs: {found:?}");
        let (status, page) = app.get(&format!("/v1/runs?limit=2&q=acme-widgets{cursor}"), ACME).await;
        assert_eq!(status, 200, "{page}");
        found.extend(page["data"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={c}"),
            None => break,
        }
    }
    tagged.reverse(); // newest first
    assert_eq!(found, tagged);
    // By a part of an id.
    let part = &tagged[0][tagged[0].len() - 8..];
    let (_, page) = app.get(&format!("/v1/runs?q={part}"), ACME).await;
    assert_eq!(page["data"][0]["id"], tagged[0]);
    // Too long a search is a 422 naming q.
    let (status, body) = app.get(&format!("/v1/runs?q={}", "x".repeat(201)), ACME).await;
    assert_eq!((status, body["error"]["field"].as_str()), (422, Some("q")), "{body}");
}

#[tokio::test]
async fn an_idempotency_key_returns_the_first_run() {
    let app = spawn_app().await;
    let send = |token: &'static str, key: &'static str, body: Value| {
        app.req(reqwest::Method::POST, "/v1/runs", Some(token)).header("Idempotency-Key", key).json(&body).send()
    };
    let first = send(ACME, "k-1", spec()).await.unwrap();
    assert_eq!(first.status(), 202);
    let first: Value = first.json().await.unwrap();
    // The same body in another layout is the same request.
    let reordered = json!({"metadata": {"ticket": 42}, "max_turns": 5, "input": "the task", "instructions": "Be brief.", "model": "gpt-4.1-mini"});
    let again = send(ACME, "k-1", reordered).await.unwrap();
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["id"], first["id"]);

    let (status, err) = read(send(ACME, "k-1", json!({"model": "m", "input": "another"})).await.unwrap()).await;
    assert_eq!(status, 422, "{err}");
    assert_eq!(err["error"]["field"], "Idempotency-Key");

    // Keys are per tenant.
    let other: Value = send(BETA, "k-1", spec()).await.unwrap().json().await.unwrap();
    assert_ne!(other["id"], first["id"]);

    let (status, err) = read(send(ACME, "bad key", spec()).await.unwrap()).await;
    assert_eq!(status, 422);
    assert_eq!(err["error"]["field"], "Idempotency-Key");

    let (_, list) = app.get("/v1/runs", ACME).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn concurrent_submits_with_one_key_make_one_run() {
    let app = spawn_app().await;
    let sends = (0..16).map(|_| {
        app.req(reqwest::Method::POST, "/v1/runs", Some(ACME)).header("Idempotency-Key", "same").json(&spec()).send()
    });
    let answers = futures::future::join_all(sends).await;
    let mut ids = std::collections::HashSet::new();
    for a in answers {
        let a = a.unwrap();
        assert_eq!(a.status(), 202);
        let run: Value = a.json().await.unwrap();
        ids.insert(run["id"].as_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    let (_, list) = app.get("/v1/runs", ACME).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    let (_, q) = app.get("/v1/queue", ACME).await;
    assert_eq!(q["ready"].as_u64().unwrap() + q["delayed"].as_u64().unwrap(), 1, "{q}");
}

#[tokio::test]
async fn a_finished_runs_events_replay_close_and_resume_after_last_event_id() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap();
    let store = app.store().await;
    store.emit(id, "turn.started", &json!({"turn": 0})).await.unwrap();
    store.emit(id, "turn.output_text.delta", &json!({"delta": "Hel"})).await.unwrap();
    let (status, _) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 200);

    let all = app.events(id, ACME, None).await;
    let kinds: Vec<&str> = all.iter().map(|(_, k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["run.queued", "turn.started", "turn.output_text.delta", "run.cancelled"]);
    assert_eq!(all[2].2, json!({"delta": "Hel"}));
    assert!(all.iter().all(|(id, _, _)| !id.is_empty()), "every event has an id");

    let rest = app.events(id, ACME, Some(&all[1].0)).await;
    let kinds: Vec<&str> = rest.iter().map(|(_, k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["turn.output_text.delta", "run.cancelled"]);
    let none = app.events(id, ACME, Some(&all[3].0)).await;
    assert!(none.is_empty(), "{none:?}");

    let (status, err) = read(
        app.req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(ACME))
            .header("Last-Event-ID", "yesterday")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "a header that cannot be read is a bad request, never a 500");
    assert_eq!(err["error"]["type"], "bad_request");
    assert!(err["error"]["message"].as_str().unwrap().contains("Last-Event-ID"), "{err}");
}

#[tokio::test]
async fn events_written_in_one_step_are_events_of_their_own_and_resume_inside_it() {
    // A step writes its events as one stream entry (one XADD): the stream
    // shows each with an id of its own, in order, and a client that stopped
    // inside the entry resumes after the last event it got, not after the entry.
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap();
    let store = app.store().await;
    let calls = [json!({"call_id": "a"}), json!({"call_id": "b"}), json!({"call_id": "c"})];
    store.emit_all(id, "turn.tool_call", &calls).await.unwrap();
    let (status, _) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 200);

    let all = app.events(id, ACME, None).await;
    let kinds: Vec<&str> = all.iter().map(|(_, k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["run.queued", "turn.tool_call", "turn.tool_call", "turn.tool_call", "run.cancelled"]);
    let ids: std::collections::HashSet<&str> = all.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(ids.len(), 5, "every event has an id of its own: {all:?}");
    assert_eq!(all[1].2, json!({"call_id": "a"}));
    assert_eq!(all[3].2, json!({"call_id": "c"}));
    for (after, expected) in [(1, ["b", "c"].as_slice()), (2, &["c"]), (3, &[])] {
        let rest = app.events(id, ACME, Some(&all[after].0)).await;
        let got: Vec<&str> = rest
            .iter()
            .filter(|(_, k, _)| k == "turn.tool_call")
            .map(|(_, _, d)| d["call_id"].as_str().unwrap())
            .collect();
        assert_eq!(got, expected, "after {}", all[after].0);
        assert_eq!(rest.last().map(|(_, k, _)| k.as_str()), Some("run.cancelled"));
    }
}

#[tokio::test]
async fn a_live_runs_events_are_followed_until_it_finishes() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap().to_owned();
    let started = Instant::now();
    let mut stream = OpenStream::open(&app, &id, ACME).await;
    // Its first event says it is open (it follows the run from there).
    stream.until_event("run.queued", Duration::from_secs(5)).await;
    let store = app.store().await;
    store.emit(&id, "turn.paced", &json!({"owed_ms": 1200})).await.unwrap();
    // A new event reaches it: it follows the live run (`until_event` fails
    // if the stream ends first).
    stream.until_event("turn.paced", Duration::from_secs(5)).await;
    let (status, _) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 200);
    let text = stream.rest("the stream to close after run.cancelled", Duration::from_secs(5)).await;
    let kinds: Vec<String> = parse_sse(&text).into_iter().map(|(_, k, _)| k).collect();
    assert_eq!(kinds, ["run.queued", "turn.paced", "run.cancelled"]);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn event_streams_are_bounded_per_tenant_in_all_and_in_time() {
    let app = spawn_app_with(|c| {
        c.streams.max_tenant_streams = 2;
        c.streams.max_streams = 3;
        c.streams.lifetime = Duration::from_secs(1);
    })
    .await;
    let id = app.submit(ACME, &spec()).await["id"].as_str().unwrap().to_owned();
    let beta_id = app.submit(BETA, &spec()).await["id"].as_str().unwrap().to_owned();
    let open = |token: &'static str, id: String| {
        let req = app.req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(token));
        async move { req.send().await.unwrap() }
    };
    // Two for acme; a third is 429 with the error body; beta still gets one.
    let a1 = open(ACME, id.clone()).await;
    let a2 = open(ACME, id.clone()).await;
    assert_eq!((a1.status().as_u16(), a2.status().as_u16()), (200, 200));
    let (status, body) = read(open(ACME, id.clone()).await).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(error_type(&body), "too_many_streams");
    assert!(body["error"]["message"].as_str().unwrap().contains("PACELINE_MAX_TENANT_STREAMS"), "{body}");
    let b1 = open(BETA, beta_id.clone()).await;
    assert_eq!(b1.status(), 200);
    // Three in all: a fourth, of a tenant under its own bound, is 429 too.
    let (status, body) = read(open(BETA, beta_id.clone()).await).await;
    assert_eq!(status, 429, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("PACELINE_MAX_STREAMS"), "{body}");
    // Each ends after its lifetime (1 s) though the run is live, having sent
    // what there was; the client resumes with Last-Event-ID.
    let started = Instant::now();
    let text = within("a stream to end at its lifetime", Duration::from_secs(5), a1.text()).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(4));
    let events = parse_sse(&text);
    assert_eq!(events.iter().map(|(_, k, _)| k.as_str()).collect::<Vec<_>>(), ["run.queued"]);
    for r in [a2, b1] {
        within("the others to end", Duration::from_secs(5), r.text()).await.unwrap();
    }
    // Ended streams give their places back.
    let again = eventually("a place for acme again", Duration::from_secs(5), || async {
        let r = open(ACME, id.clone()).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    let resumed = app
        .req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(ACME))
        .header("Last-Event-ID", events[0].0.as_str())
        .send()
        .await
        .unwrap();
    assert_eq!(resumed.status(), 200);
    let text = within("the resumed stream to end", Duration::from_secs(5), resumed.text()).await.unwrap();
    assert!(parse_sse(&text).is_empty(), "nothing after the last id: {text}");
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_whose_client_stopped_reading_gives_its_place_back_within_the_write_timeout() {
    let app = spawn_app_with(|c| {
        c.streams.max_tenant_streams = 1;
        c.streams.lifetime = Duration::from_secs(1);
        c.serve.write_timeout = Duration::from_secs(2);
    })
    .await;
    let id = app.submit(ACME, &spec()).await["id"].as_str().unwrap().to_owned();
    // A client that opens the stream, reads its answer's first bytes, and
    // then reads nothing more, with a small receive window.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(app.url.trim_start_matches("http://").parse().unwrap()).await.unwrap();
    let request =
        format!("GET /v1/runs/{id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ACME}\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut stalled, request.as_bytes()).await.unwrap();
    let mut head = [0u8; 12];
    tokio::io::AsyncReadExt::read_exact(&mut stalled, &mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let open = || app.req(reqwest::Method::GET, &format!("/v1/runs/{id}/events"), Some(ACME)).send();
    assert_eq!(open().await.unwrap().status(), 429, "the stalled stream holds acme's one place");
    // The run goes on: far more than the connection's buffers hold (8 MiB).
    let store = app.store().await;
    let chunk = "x".repeat(64 * 1024);
    for _ in 0..128 {
        store.emit(&id, "turn.output_text.delta", &json!({"delta": chunk})).await.unwrap();
    }
    // The stream's lifetime (1 s) cannot end it, unpolled behind full
    // buffers; the write timeout (2 s) closes its connection and frees the place.
    let started = Instant::now();
    let again = eventually("acme's place back", Duration::from_secs(15), || async {
        let r = open().await.unwrap();
        (r.status() == 200).then_some(r)
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    drop(again);
    // The stalled connection was closed by the server: what it holds ends in EOF.
    let mut rest = Vec::new();
    let read = within("the stalled connection's end", Duration::from_secs(10), async {
        tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut rest).await
    })
    .await;
    assert!(read.is_err() || rest.len() < 16 * 1024 * 1024, "it ended");
}

/// Redis's `connected_clients`.
async fn redis_clients(app: &TestApp) -> i64 {
    let mut conn = app.redis.conn().await;
    let info: String = redis::cmd("INFO").arg("clients").query_async(&mut conn).await.unwrap();
    info.lines().find_map(|l| l.strip_prefix("connected_clients:")).unwrap().trim().parse().unwrap()
}

/// 500 streams, or `PACELINE_TEST_STREAMS` of them (a measurement: README
/// has 5 000; each stream is two file descriptors in this one process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_open_event_streams_share_one_redis_reader() {
    let n: usize = std::env::var("PACELINE_TEST_STREAMS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let app = spawn_app_with(|c| {
        c.streams.max_tenant_streams = 2 * n;
        c.streams.max_streams = 2 * n;
    })
    .await;
    let mut ids: Vec<String> = vec![];
    for _ in 0..5 {
        ids.push(app.submit(ACME, &spec()).await["id"].as_str().unwrap().to_owned());
    }
    // One stream open first, until its first event: the API's connections
    // (requests, the shared reader) are up.
    let mut first =
        app.req(reqwest::Method::GET, &format!("/v1/runs/{}/events", ids[0]), Some(ACME)).send().await.unwrap();
    assert_eq!(first.status(), 200);
    within("the first stream's first event", Duration::from_secs(10), first.chunk()).await.unwrap();
    let before = redis_clients(&app).await;
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let started = std::time::Instant::now();
    let opened = futures::future::join_all((0..n).map(|i| {
        let url = format!("{}/v1/runs/{}/events", app.url, ids[i % ids.len()]);
        let http = http.clone();
        async move { http.get(url).bearer_auth(ACME).send().await.unwrap() }
    }))
    .await;
    let open_took = started.elapsed();
    assert!(opened.iter().all(|r| r.status() == 200));
    let after = redis_clients(&app).await;
    assert!(after - before <= 2, "Redis clients went from {before} to {after} for {n} streams");
    // Each still gets its run's events: one emitted now reaches every stream.
    let store = app.store().await;
    let started = std::time::Instant::now();
    for id in &ids {
        store.emit(id, "turn.paced", &json!({"owed_ms": 5})).await.unwrap();
        let (status, _) = app.post(&format!("/v1/runs/{id}/cancel"), ACME, &json!({})).await;
        assert_eq!(status, 200);
    }
    let texts = within(
        "every stream to close after run.cancelled",
        Duration::from_secs(20 + n as u64 / 100),
        futures::future::join_all(opened.into_iter().map(|r| r.text())),
    )
    .await;
    let close_took = started.elapsed();
    for text in texts {
        let kinds: Vec<String> = parse_sse(&text.unwrap()).into_iter().map(|(_, k, _)| k).collect();
        assert_eq!(kinds, ["run.queued", "turn.paced", "run.cancelled"]);
    }
    eprintln!(
        "{n} event streams: Redis clients {before} -> {after}; opened in {:.2} s, every one had its last two events \
         and closed {:.2} s after they were written",
        open_took.as_secs_f64(),
        close_took.as_secs_f64()
    );
    drop(first);
}

#[tokio::test]
async fn a_transcript_is_read_in_pages() {
    let app = spawn_app().await;
    let id = app.submit(ACME, &spec()).await["id"].as_str().unwrap().to_owned();
    // Four more entries behind the task, as turns would append them.
    let mut conn = app.redis.conn().await;
    let key = Keys::new(app.prefix.clone()).run_transcript(&id);
    for n in 1..=4 {
        let entry =
            json!({"turn": n, "item": {"type": "message", "role": "assistant", "content": format!("step {n}")}});
        let _: () = redis::cmd("RPUSH").arg(&key).arg(entry.to_string()).query_async(&mut conn).await.unwrap();
    }
    let (status, whole) = app.get(&format!("/v1/runs/{id}/transcript"), ACME).await;
    assert_eq!(status, 200);
    assert_eq!((whole["items"].as_array().unwrap().len(), &whole["has_more"]), (5, &json!(false)));
    assert!(whole["next_cursor"].is_null());
    // Pages of two: 2 + 2 + 1, in order, the last without a cursor.
    let mut seen = vec![];
    let mut cursor: Option<String> = None;
    for pages in 1.. {
        assert!(pages <= 5, "more pages than the run has items: {seen:?}");
        let q = cursor.as_ref().map(|c| format!("&cursor={c}")).unwrap_or_default();
        let (status, page) = app.get(&format!("/v1/runs/{id}/transcript?limit=2{q}"), ACME).await;
        assert_eq!(status, 200, "{page}");
        seen.extend(page["items"].as_array().unwrap().iter().map(|e| e["turn"].as_u64().unwrap()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, [0, 1, 2, 3, 4]);
    for bad in ["limit=0", "limit=1001", "limit=x", "cursor=zz"] {
        let (status, body) = app.get(&format!("/v1/runs/{id}/transcript?{bad}"), ACME).await;
        assert_eq!((status, error_type(&body)), (400, "bad_request"), "{bad}: {body}");
    }
}

#[tokio::test]
async fn a_transcript_cursor_too_large_to_be_one_is_a_400_not_a_500() {
    let app = spawn_app().await;
    let id = app.submit(ACME, &spec()).await["id"].as_str().unwrap().to_owned();
    // usize::MAX overflowed the page's end (a panic in a debug build); past
    // i64::MAX Redis refused the index (a 500).
    for huge in ["tx_18446744073709551615", "tx_9223372036854775807", "tx_9223372036854775808", "tx_4294967296"] {
        let (status, body) = app.get(&format!("/v1/runs/{id}/transcript?cursor={huge}&limit=1000"), ACME).await;
        assert_eq!((status, error_type(&body)), (400, "bad_request"), "{huge}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("cursor"), "{body}");
    }
    // The largest a cursor may name reads an empty last page.
    let (status, page) = app.get(&format!("/v1/runs/{id}/transcript?cursor=tx_4294967295&limit=1000"), ACME).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!((page["items"].as_array().map(Vec::len), &page["has_more"]), (Some(0), &json!(false)));
}

#[tokio::test]
async fn a_live_runs_stream_ends_when_the_run_is_gone() {
    let app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap().to_owned();
    let mut stream = OpenStream::open(&app, &id, ACME).await;
    stream.until_event("run.queued", Duration::from_secs(5)).await;
    app.store().await.emit(&id, "turn.paced", &json!({"owed_ms": 1200})).await.unwrap();
    stream.until_event("turn.paced", Duration::from_secs(5)).await;
    // The run's keys go (as they do when its retention ends) while the stream follows it.
    let mut conn = app.redis.conn().await;
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("{}*:{id}", app.prefix)).query_async(&mut conn).await.unwrap();
    assert_eq!(keys.len(), 3, "{keys:?}");
    let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.unwrap();
    // It ends after its blocking read (10 s) comes back empty.
    let text = stream.rest("the stream to close after the run is gone", Duration::from_secs(15)).await;
    let kinds: Vec<String> = parse_sse(&text).into_iter().map(|(_, k, _)| k).collect();
    assert_eq!(kinds, ["run.queued", "turn.paced"]);
}

#[tokio::test]
async fn the_pacer_shows_the_callers_own_line_only() {
    use shared::pacer::{CallOutcome, Estimate, Mode, Observation, PacingConfig, SharedPacer, Who};
    let app = spawn_app().await;
    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = SharedPacer::new(conn, Keys::new(app.prefix.clone()), "default", PacingConfig::default());
    let seen = Observation { limit: Some(30_000), remaining: Some(20_000), reset_ms: Some(20_000) };
    pacer.settle("gpt-x", "r0", &CallOutcome { tokens: seen, ..Default::default() }).await.unwrap();
    let acme = Who { tenant: "acme", weight: 2.0, cap: 0.0 };
    pacer.acquire("gpt-x", "r1", Estimate { tokens: 1000, requests: 1, output: 0 }, Mode::Work, &acme).await.unwrap();
    let (_, p) = app.get("/v1/pacer", ACME).await;
    assert_eq!(
        p["budgets"][0]["tenant"],
        json!({"tenant": "acme", "weight": 2.0, "admitted_tokens": 1000, "waiting_tokens": 0, "waits": 0}),
        "{p}"
    );
    assert!(p["budgets"][0].get("tenants").is_none(), "a tenant reads no other line: {p}");
    // beta's turns never used this budget and model: it is not beta's to see.
    let (_, p) = app.get("/v1/pacer", BETA).await;
    assert_eq!(p["budgets"], json!([]), "{p}");
    // The operator sees every line, and has none of its own.
    let beta = Who { tenant: "beta", weight: 1.0, cap: 0.0 };
    pacer.acquire("gpt-x", "r2", Estimate { tokens: 500, requests: 1, output: 0 }, Mode::Work, &beta).await.unwrap();
    let (_, p) = app.get("/v1/pacer", OPERATOR).await;
    let b = &p["budgets"][0];
    assert_eq!(b["tenant"], Value::Null, "{p}");
    let lines: Vec<&str> = b["tenants"].as_array().unwrap().iter().map(|t| t["tenant"].as_str().unwrap()).collect();
    assert_eq!(lines, ["acme", "beta"], "{p}");
    let (_, p) = app.get("/v1/pacer", BETA).await;
    assert_eq!(p["budgets"][0]["tenant"]["tenant"], "beta", "{p}");
    assert!(p["budgets"][0].get("tenants").is_none(), "{p}");
}

/// `GET /v1/pacer/history`: what the script counted per second (tokens
/// cleared, 429s, turns told to wait) and the refill rate, for the budgets the
/// caller may see (the same scope as `/v1/pacer`); its keys expire within 16
/// minutes.
#[tokio::test]
async fn the_pacer_history_counts_admissions_429s_and_waits_in_the_callers_scope() {
    use shared::pacer::{CallOutcome, Decision, Estimate, Mode, Observation, PacingConfig, SharedPacer, Who};
    let app = spawn_app().await;
    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = SharedPacer::new(conn, Keys::new(app.prefix.clone()), "default", PacingConfig::default());
    // A full bucket of 30 000 refilling over a minute: 500 tokens/s.
    let seen = Observation { limit: Some(30_000), remaining: Some(30_000), reset_ms: Some(0) };
    pacer.settle("gpt-h", "r0", &CallOutcome { tokens: seen, ..Default::default() }).await.unwrap();
    let acme = Who { tenant: "acme", weight: 1.0, cap: 0.0 };
    let est = Estimate { tokens: 1000, requests: 1, output: 0 };
    assert!(matches!(pacer.acquire("gpt-h", "r1", est, Mode::Work, &acme).await.unwrap(), Decision::Clear));
    let limited = CallOutcome { rate_limited_ms: Some(5_000), ..Default::default() };
    pacer.settle("gpt-h", "r1", &limited).await.unwrap();
    let owed = pacer.acquire("gpt-h", "r2", est, Mode::Work, &acme).await.unwrap();
    assert!(matches!(owed, Decision::Owed { .. }), "the 429 closed the window: {owed:?}");

    let (status, h) = app.get("/v1/pacer/history", ACME).await;
    assert_eq!(status, 200, "{h}");
    let b = &h["budgets"][0];
    assert_eq!((b["budget"].as_str(), b["model"].as_str()), (Some("default"), Some("gpt-h")), "{h}");
    let sum = |k: &str| b[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum::<u64>();
    assert_eq!(b["admitted_tokens"].as_array().unwrap().len(), 900);
    assert_eq!((sum("admitted_tokens"), sum("rate_limited"), sum("waits")), (1000, 1, 1), "{h}");
    let rate = b["refill_tokens_per_s"].as_f64().unwrap();
    assert!((rate - 500.0).abs() < 1.0, "{rate}");
    // beta's turns never used this budget: nothing to see; the operator sees it.
    let (_, h) = app.get("/v1/pacer/history", BETA).await;
    assert_eq!(h["budgets"], json!([]), "{h}");
    let (_, h) = app.get("/v1/pacer/history", OPERATOR).await;
    assert_eq!(h["budgets"].as_array().unwrap().len(), 1, "{h}");
    let (status, _) = app.get("/v1/pacer/history", "not-a-token").await;
    assert_eq!(status, 401);
    // The current second's counts live in the state; the first call of a later
    // second moves them to their minute's key, each gone within 16 minutes.
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    let owed = pacer.acquire("gpt-h", "r3", est, Mode::Work, &acme).await.unwrap();
    assert!(matches!(owed, Decision::Owed { .. }), "still closed: {owed:?}");
    let (_, h) = app.get("/v1/pacer/history", ACME).await;
    let b = &h["budgets"][0];
    let sum = |k: &str| b[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("admitted_tokens"), sum("rate_limited"), sum("waits")), (1000, 1, 2), "{h}");
    let mut conn = app.redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", Keys::new(app.prefix.clone()).pacer_history("default", "gpt-h")))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!keys.is_empty());
    for key in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(key).query_async(&mut conn).await.unwrap();
        assert!(ttl > 0 && ttl <= 960_000, "{key}: {ttl}");
    }
}

/// The operator's routes answer 403 with the error body to a tenant; the
/// queue counts a tenant reads are its own runs'.
#[tokio::test]
async fn a_tenant_reads_its_own_queue_counts_and_no_operator_route() {
    let app = spawn_app().await;
    for path in ["/v1/workers", "/v1/dead", "/metrics"] {
        let (status, body) = app.get(path, ACME).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert_eq!(error_type(&body), "forbidden");
        assert!(body["error"]["message"].as_str().unwrap().contains("operator"), "{body}");
        let (status, _) = app.get(path, OPERATOR).await;
        assert_eq!(status, 200, "{path}");
    }
    // The operator token has no runs of its own.
    let (status, body) = app.post("/v1/runs", OPERATOR, &spec()).await;
    assert_eq!(status, 403, "{body}");
    let (status, _) = app.get("/v1/runs", OPERATOR).await;
    assert_eq!(status, 403);

    let a1 = app.submit(ACME, &spec()).await;
    app.submit(ACME, &spec()).await;
    app.submit(BETA, &spec()).await;
    let (_, a) = app.get("/v1/queue", ACME).await;
    assert_eq!(
        (a["tenant"].as_str(), a["ready"].as_u64(), a["delayed"].as_u64()),
        (Some("acme"), Some(2), Some(0)),
        "{a}"
    );
    let (_, b) = app.get("/v1/queue", BETA).await;
    assert_eq!((b["tenant"].as_str(), b["ready"].as_u64()), (Some("beta"), Some(1)), "{b}");
    let (_, all) = app.get("/v1/queue", OPERATOR).await;
    assert_eq!((all["tenant"].clone(), all["ready"].as_u64()), (Value::Null, Some(3)), "{all}");
    // A finished run leaves its tenant's counts.
    let (status, _) = app.post(&format!("/v1/runs/{}/cancel", a1["id"].as_str().unwrap()), ACME, &json!({})).await;
    assert_eq!(status, 200);
    let (_, a) = app.get("/v1/queue", ACME).await;
    assert_eq!(a["ready"], 1, "{a}");
}

/// A `POST` body must be `application/json` (415 with the error body
/// otherwise, before anything reaches Redis); a `POST` with no body needs no type.
#[tokio::test]
async fn a_post_body_that_is_not_json_is_415() {
    let app = spawn_app().await;
    let body = spec().to_string();
    for ct in
        [Some("text/plain"), Some("application/x-www-form-urlencoded"), Some("multipart/form-data; boundary=x"), None]
    {
        let mut r = app.req(reqwest::Method::POST, "/v1/runs", Some(ACME)).body(body.clone());
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        let (status, err) = read(r.send().await.unwrap()).await;
        assert_eq!(status, 415, "{ct:?}: {err}");
        assert_eq!(error_type(&err), "unsupported_media_type");
    }
    assert_eq!(app.key_count().await, 0, "a refused body reached Redis");
    let r = app
        .req(reqwest::Method::POST, "/v1/runs", Some(ACME))
        .header("content-type", "application/json; charset=utf-8")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = read(r).await.1["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/runs/{id}/cancel");
    let (status, err) = read(
        app.req(reqwest::Method::POST, &path, Some(ACME))
            .header("content-type", "text/plain")
            .body("x")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, error_type(&err)), (415, "unsupported_media_type"));
    let (status, run) = read(app.req(reqwest::Method::POST, &path, Some(ACME)).send().await.unwrap()).await;
    assert_eq!((status, run["status"].as_str()), (200, Some("cancelled")), "a POST without a body needs no type");
}

/// A known route asked with a method it does not answer is a 405 with the
/// error body and an `Allow` header; an unknown route stays a 404.
#[tokio::test]
async fn a_wrong_method_on_a_known_route_is_405_with_the_error_body() {
    let app = spawn_app().await;
    let id = "run_01JDXXXXXXXXXXXXXXXXXXXXXX";
    for (method, path, allowed) in [
        (reqwest::Method::DELETE, "/v1/runs".to_string(), "POST"),
        (reqwest::Method::PUT, format!("/v1/runs/{id}"), "GET"),
        (reqwest::Method::GET, format!("/v1/runs/{id}/cancel"), "POST"),
        (reqwest::Method::GET, format!("/v1/runs/{id}/retry"), "POST"),
        (reqwest::Method::POST, "/v1/pacer".to_string(), "GET"),
        (reqwest::Method::PATCH, "/v1/dead".to_string(), "GET"),
        (reqwest::Method::POST, "/healthz".to_string(), "GET"),
    ] {
        let resp = app.req(method.clone(), &path, Some(ACME)).send().await.unwrap();
        let allow = resp.headers().get("allow").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        let (status, body) = read(resp).await;
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert_eq!(error_type(&body), "method_not_allowed", "{method} {path}");
        assert!(body["error"]["message"].as_str().unwrap().contains(method.as_str()), "{body}");
        assert!(allow.contains(allowed), "{method} {path}: Allow {allow:?}");
    }
    let (status, body) = app.get("/v1/nothing", ACME).await;
    assert_eq!((status, error_type(&body)), (404, "not_found"));

    // Every route of the OpenAPI document, asked with each method it does not
    // document, answers 405 with the error body.
    let (_, doc) = app.get("/v1/openapi.json", ACME).await;
    let mut asked = 0;
    for (path, ops) in doc["paths"].as_object().unwrap() {
        let path = path.replace("{id}", id);
        for method in ["get", "post", "put", "delete", "patch"] {
            if ops.get(method).is_some() {
                continue;
            }
            let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let (status, body) = read(app.req(m, &path, Some(ACME)).json(&spec()).send().await.unwrap()).await;
            assert_eq!(status, 405, "{method} {path}: {body}");
            assert_eq!(error_type(&body), "method_not_allowed", "{method} {path}");
            asked += 1;
        }
    }
    assert!(asked > 50, "{asked}");
}

/// Open mode answers only requests addressed to a loopback name (a page whose
/// name was rebound to 127.0.0.1 is refused); tokens, or `--insecure-open`,
/// lift the rule.
#[tokio::test]
async fn open_mode_refuses_a_host_that_is_not_loopback() {
    let open = |insecure: bool| {
        spawn_app_with(move |c| {
            c.serve.tokens = ApiTokens::default();
            c.access.operator_token = None;
            c.access.insecure_open = insecure;
        })
    };
    let app = open(false).await;
    for host in ["evil.example", "evil.example:8080", "localhost.evil.example", "192.168.1.5:8080", "[::]:8080"] {
        let (status, body) =
            read(app.req(reqwest::Method::GET, "/v1/runs", None).header("host", host).send().await.unwrap()).await;
        assert_eq!(status, 403, "{host}: {body}");
        assert_eq!(error_type(&body), "forbidden");
        let r = app.req(reqwest::Method::POST, "/v1/runs", None).header("host", host).json(&spec()).send().await;
        assert_eq!(r.unwrap().status(), 403, "{host}");
    }
    assert_eq!(app.key_count().await, 0);
    for host in ["localhost", "localhost:8080", "127.0.0.1", "127.0.0.2:9", "[::1]:8080"] {
        let r = app.req(reqwest::Method::GET, "/v1/runs", None).header("host", host).send().await.unwrap();
        assert_eq!(r.status(), 200, "{host}");
    }
    let insecure = open(true).await;
    let r = insecure.req(reqwest::Method::GET, "/v1/runs", None).header("host", "evil.example").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let tokens = spawn_app().await;
    let r = tokens.req(reqwest::Method::GET, "/v1/runs", Some(ACME)).header("host", "api.example:443").send().await;
    assert_eq!(r.unwrap().status(), 200, "with tokens, any name may front the API");
}

/// The OpenAPI document has the history and the dashboard's page, and every
/// `$ref` in it names a schema it defines.
#[tokio::test]
async fn the_openapi_document_has_the_history_and_the_dashboard_and_every_ref_resolves() {
    let app = spawn_app().await;
    let (status, doc) = app.get("/v1/openapi.json", ACME).await;
    assert_eq!(status, 200);
    assert!(doc["paths"]["/v1/pacer/history"]["get"].is_object(), "{}", doc["paths"]);
    assert!(doc["paths"]["/"]["get"].is_object(), "{}", doc["paths"]);
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r.clone());
                }
                m.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = vec![];
    refs(&doc, &mut all);
    assert!(all.iter().any(|r| r.ends_with("/PacerHistory")), "{all:?}");
    for r in all {
        let name = r.strip_prefix("#/components/schemas/").unwrap_or_else(|| panic!("{r}"));
        assert!(doc["components"]["schemas"][name].is_object(), "{r} is not defined");
    }
}

/// The dashboard page and its assets need no token (they hold no data; the
/// page asks for one when the API answers 401), are built in and load nothing
/// from another origin; in open mode the loopback-`Host` guard covers them too.
#[tokio::test]
async fn the_dashboard_is_served_without_a_token_and_behind_the_open_mode_host_guard() {
    let app = spawn_app().await;
    let page = app.req(reqwest::Method::GET, "/", None).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"), "{csp}");
    assert!(page.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let html = page.text().await.unwrap();
    assert!(html.contains("/assets/app.js") && html.contains("/assets/uPlot.iife.min.js"), "{html}");
    for asset in ["app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css"] {
        let r = app.req(reqwest::Method::GET, &format!("/assets/{asset}"), None).send().await.unwrap();
        assert_eq!(r.status(), 200, "{asset}");
    }
    let (status, _) = app.get("/assets/../Cargo.toml", ACME).await;
    assert_eq!(status, 404);
    // Its data calls still need the token.
    let r = app.req(reqwest::Method::GET, "/v1/runs", None).send().await.unwrap();
    assert_eq!(r.status(), 401);

    let open = spawn_app_with(|c| {
        c.serve.tokens = ApiTokens::default();
        c.access.operator_token = None;
    })
    .await;
    for path in ["/", "/assets/app.js"] {
        let r = open.req(reqwest::Method::GET, path, None).header("host", "evil.example").send().await.unwrap();
        assert_eq!(r.status(), 403, "{path}");
        let r = open.req(reqwest::Method::GET, path, None).header("host", "localhost:8080").send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
}

/// Open mode is for one machine: on an address that is not loopback the API
/// refuses to start, unless `--insecure-open` is given.
#[tokio::test]
async fn open_mode_refuses_to_start_on_a_non_loopback_address() {
    let redis = RedisServer::start();
    let mut config = ApiConfig::new("0.0.0.0:0".parse().unwrap(), RedisArgs::new(redis.url(), unique_prefix()));
    let err = Application::build(config.clone()).await.unwrap_err().to_string();
    assert!(err.contains("--insecure-open") && err.contains("PACELINE_API_TOKENS"), "{err}");
    config.access.insecure_open = true;
    Application::build(config.clone()).await.expect("--insecure-open starts");
    config.access.insecure_open = false;
    config.serve.tokens = ApiTokens::default().with("acme", ACME);
    Application::build(config).await.expect("with tokens it starts");
}

/// Two tenants with one token, or a tenant holding the operator's, refuse to start.
#[tokio::test]
async fn duplicate_tokens_refuse_to_start() {
    let redis = RedisServer::start();
    let mut config = ApiConfig::new("127.0.0.1:0".parse().unwrap(), RedisArgs::new(redis.url(), unique_prefix()));
    config.serve.tokens = ApiTokens::default().with("acme", ACME).with("beta", ACME);
    let err = Application::build(config.clone()).await.unwrap_err().to_string();
    assert!(err.contains("acme") && err.contains("beta") && !err.contains(ACME), "{err}");
    config.serve.tokens = ApiTokens::default().with("acme", ACME).with("beta", BETA);
    config.access.operator_token = Some(shared::config::Secret::new(BETA));
    let err = Application::build(config).await.unwrap_err().to_string();
    assert!(err.contains("PACELINE_OPERATOR_TOKEN") && !err.contains(BETA), "{err}");
}

#[tokio::test]
async fn pacer_queue_and_workers_show_the_shared_state() {
    use shared::pacer::{CallOutcome, Estimate, Mode, Observation, PacingConfig, SharedPacer};
    let app = spawn_app().await;
    let (status, p) = app.get("/v1/pacer", OPERATOR).await;
    assert_eq!(status, 200);
    assert_eq!(p["budgets"], json!([]));

    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = SharedPacer::new(conn, Keys::new(app.prefix.clone()), "default", PacingConfig::default());
    pacer
        .acquire(
            "gpt-x",
            "r1",
            Estimate { tokens: 1000, requests: 1, output: 0 },
            Mode::Work,
            &shared::pacer::Who::DEFAULT,
        )
        .await
        .unwrap();
    let seen = Observation { limit: Some(30_000), remaining: Some(20_000), reset_ms: Some(20_000) };
    pacer
        .settle("gpt-x", "r1", &CallOutcome { used_tokens: Some(900), tokens: seen, ..Default::default() })
        .await
        .unwrap();
    let (_, p) = app.get("/v1/pacer", OPERATOR).await;
    let b = &p["budgets"][0];
    assert_eq!(b["budget"], "default", "{p}");
    assert_eq!(b["model"], "gpt-x");
    assert_eq!(b["limit_tokens"], 30_000);
    for k in [
        "remaining_tokens",
        "reset_in_ms",
        "reserved_tokens",
        "remaining_requests",
        "limit_requests",
        "reserved_requests",
        "observed_at",
    ] {
        assert!(b.get(k).is_some(), "{k} missing: {b}");
    }
    // The headers lowered the estimate from a full bucket; it refills at 0.5 token/ms since.
    let remaining = b["remaining_tokens"].as_i64().unwrap();
    assert!((19_000..25_000).contains(&remaining), "{remaining}");
    assert!(b["observed_at"].is_string());

    let (_, w) = app.get("/v1/workers", OPERATOR).await;
    assert_eq!(w["workers"], json!([]));
    let queue =
        shared::runs::run_queue(&RedisArgs::new(app.redis.url(), app.prefix.clone()), Default::default()).unwrap();
    let info = shared::queue::WorkerInfo {
        identity: "host-1-x".into(),
        host: "host".into(),
        pid: 1,
        concurrency: 16,
        in_flight: 2,
        started_at_ms: 1_796_032_800_000,
        lease_ms: 3_000,
        beat_ms: 1_000,
        last_heartbeat_ms: 0,
    };
    queue.heartbeat("host-1-x", Some(&info), &[]).await.unwrap();
    let (_, w) = app.get("/v1/workers", OPERATOR).await;
    let w0 = &w["workers"][0];
    assert_eq!(w0["identity"], "host-1-x", "{w}");
    assert_eq!(w0["concurrency"], 16);
    assert_eq!(w0["started_at"], "2026-11-30T10:00:00.000Z");
    assert!(w0["last_heartbeat"].is_string());

    queue.enqueue("later", &json!({}), 60_000).await.unwrap();
    let (_, q) = app.get("/v1/queue", OPERATOR).await;
    assert_eq!(q["delayed"], 1, "{q}");
    assert!(q["next_due_at"].is_string());
    assert!(q["next_due_in_ms"].as_i64().unwrap() > 50_000);
}

#[tokio::test]
async fn the_openapi_document_lists_every_route() {
    let app = spawn_app().await;
    let (status, doc) = app.get("/v1/openapi.json", ACME).await;
    assert_eq!(status, 200);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/v1/runs", "post"),
        ("/v1/runs", "get"),
        ("/v1/runs/{id}", "get"),
        ("/v1/runs/{id}/transcript", "get"),
        ("/v1/runs/{id}/events", "get"),
        ("/v1/runs/{id}/cancel", "post"),
        ("/v1/pacer", "get"),
        ("/v1/queue", "get"),
        ("/v1/workers", "get"),
        ("/v1/dead", "get"),
        ("/v1/runs/{id}/retry", "post"),
        ("/v1/openapi.json", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    ] {
        assert!(paths.get(path).and_then(|p| p.get(method)).is_some(), "{method} {path} is missing");
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for s in [
        "Run",
        "RunStatus",
        "SubmitRun",
        "RunList",
        "Transcript",
        "PacerView",
        "QueueView",
        "WorkersView",
        "DeadList",
        "ErrorBody",
    ] {
        assert!(schemas.contains_key(s), "schema {s} is missing");
    }
    // The run spec's generation parameters and provider are documented.
    let submit = schemas["SubmitRun"]["properties"].as_object().unwrap();
    for field in [
        "temperature",
        "top_p",
        "reasoning",
        "text",
        "tool_choice",
        "parallel_tool_calls",
        "stop",
        "seed",
        "service_tier",
        "prompt_cache_key",
        "store",
        "truncation",
        "provider",
    ] {
        assert!(submit.contains_key(field), "SubmitRun.{field} is missing");
    }
    let usage = schemas["Usage"]["properties"].as_object().unwrap();
    assert!(usage.contains_key("reasoning_tokens") && usage.contains_key("cached_input_tokens"));
    assert_eq!(
        doc["paths"]["/v1/runs"]["post"]["responses"]["202"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/Run"
    );
}

#[tokio::test]
async fn metrics_expose_the_specs_families() {
    let app = spawn_app().await;
    app.submit(ACME, &spec()).await;
    let text = app.req(reqwest::Method::GET, "/metrics", Some(OPERATOR)).send().await.unwrap().text().await.unwrap();
    for family in [
        "paceline_turns_total",
        "paceline_provider_calls_total",
        "paceline_rate_limited_total",
        "paceline_budget_waits_total",
        "paceline_requeue_delay_seconds_bucket",
        "paceline_queue_depth",
        "paceline_turn_seconds_bucket",
    ] {
        assert!(text.contains(family), "{family} missing from:\n{text}");
    }
    assert!(text.contains("# TYPE paceline_turn_seconds histogram"), "{text}");
    // The pacer gauge appears once a budget is known.
    use shared::pacer::{CallOutcome, Estimate, Mode, Observation, PacingConfig, SharedPacer};
    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = SharedPacer::new(conn, Keys::new(app.prefix.clone()), "default", PacingConfig::default());
    pacer
        .acquire(
            "gpt-m",
            "r1",
            Estimate { tokens: 10, requests: 1, output: 0 },
            Mode::Work,
            &shared::pacer::Who::DEFAULT,
        )
        .await
        .unwrap();
    let seen = Observation { limit: Some(1000), remaining: Some(900), reset_ms: Some(1000) };
    pacer.settle("gpt-m", "r1", &CallOutcome { tokens: seen, ..Default::default() }).await.unwrap();
    let text = app.req(reqwest::Method::GET, "/metrics", Some(OPERATOR)).send().await.unwrap().text().await.unwrap();
    assert!(text.contains("paceline_pacer_remaining_tokens{"), "{text}");
}

#[tokio::test]
async fn redis_going_away_is_503_never_a_hang() {
    let mut app = spawn_app().await;
    let run = app.submit(ACME, &spec()).await;
    let id = run["id"].as_str().unwrap().to_owned();
    app.redis.kill();
    let started = Instant::now();
    for (method, path) in [
        (reqwest::Method::POST, "/v1/runs".to_string()),
        (reqwest::Method::GET, "/v1/runs".to_string()),
        (reqwest::Method::GET, format!("/v1/runs/{id}")),
        (reqwest::Method::GET, format!("/v1/runs/{id}/transcript")),
        (reqwest::Method::GET, format!("/v1/runs/{id}/events")),
        (reqwest::Method::POST, format!("/v1/runs/{id}/cancel")),
        (reqwest::Method::GET, "/v1/pacer".to_string()),
        (reqwest::Method::GET, "/v1/queue".to_string()),
        (reqwest::Method::GET, "/v1/workers".to_string()),
        (reqwest::Method::GET, "/readyz".to_string()),
    ] {
        let t = Instant::now();
        let token = if path == "/v1/workers" { OPERATOR } else { ACME };
        let (status, body) = within(&format!("{method} {path}"), Duration::from_secs(8), async {
            read(app.req(method.clone(), &path, Some(token)).json(&spec()).send().await.unwrap()).await
        })
        .await;
        assert_eq!(status, 503, "{method} {path}: {body}");
        assert_eq!(error_type(&body), "unavailable");
        assert!(t.elapsed() < Duration::from_secs(5), "{method} {path} took {:?}", t.elapsed());
    }
    assert!(started.elapsed() < Duration::from_secs(30));
    // Still up, and back when Redis is.
    let r = app.req(reqwest::Method::GET, "/healthz", None).send().await.unwrap();
    assert_eq!(r.status(), 200);
    app.redis.spawn();
    paceline_tests::eventually("readyz after the restart", Duration::from_secs(10), || async {
        let r = app.req(reqwest::Method::GET, "/readyz", None).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    app.submit(ACME, &spec()).await;
}

/// Runs the `paceline` binary against the app: (exit code, stdout, stderr).
async fn cli(app: &TestApp, token: &str, args: &[&str]) -> (i32, String, String) {
    let out = within(
        &format!("paceline {args:?}"),
        Duration::from_secs(30),
        tokio::process::Command::new(paceline_tests::paceline_bin())
            .args(args)
            .env("PACELINE_API", &app.url)
            .env("PACELINE_TOKEN", token)
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run paceline");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cli_submits_watches_lists_and_shows_errors_in_one_line() {
    use shared::queue::QueueConfig;
    use shared::runs::{Fence, Next, TurnJob, Usage, WaitReason};
    let app = spawn_app().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("spec.json");
    std::fs::write(&file, spec().to_string()).unwrap();
    let file = file.to_str().unwrap().to_owned();

    let (code, out, err) = cli(&app, ACME, &["submit", &file]).await;
    assert_eq!(code, 0, "{err}");
    let id = out.trim().to_owned();
    assert!(id.starts_with("run_"), "{out}");

    // `watch` follows it while this test plays the worker: a budget wait,
    // then a turn that completes the run.
    let watch = tokio::process::Command::new(paceline_tests::paceline_bin())
        .args(["watch", &id, "--api", &app.url])
        .env("PACELINE_TOKEN", ACME)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let store = app.store().await;
    let queue =
        shared::runs::run_queue(&RedisArgs::new(app.redis.url(), app.prefix.clone()), QueueConfig::default()).unwrap();
    let lease = queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    let paced = json!({"turn": 0, "owed_ms": 300, "reason": "budget"});
    assert_eq!(store.wait(&lease, job, job, 300, WaitReason::Budget, "turn.paced", &paced).await.unwrap(), Fence::Ok);
    let lease = paceline_tests::eventually("the paced turn to come back", Duration::from_secs(5), || async {
        queue.fetch("w1", 1).await.unwrap().deliveries.pop().map(|d| d.lease)
    })
    .await;
    assert_eq!(store.start(&lease, job).await.unwrap(), Fence::Ok);
    store.emit(&id, "turn.output_text.delta", &json!({"turn": 0, "delta": "the final"})).await.unwrap();
    let items = [
        json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "the final answer"}]}),
    ];
    let usage = Usage { input_tokens: 100, output_tokens: 20, total_tokens: 120, ..Usage::default() };
    let done = Next::Complete("the final answer".into());
    assert_eq!(store.commit(&lease, job, &items, usage, &done).await.unwrap(), Fence::Ok);
    let out = within("paceline watch to exit", Duration::from_secs(15), watch.wait_with_output()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "the final answer");
    assert!(stderr.contains("completed: 1 turns, 120 tokens"), "{stderr}");

    let (code, out, _) = cli(&app, ACME, &["status", &id]).await;
    assert_eq!(code, 0);
    assert!(out.contains("completed") && out.contains("120 tokens") && out.contains("1 budget waits"), "{out}");
    let (code, out, _) = cli(&app, ACME, &["runs"]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&id), "{out}");
    let (code, out, _) = cli(&app, ACME, &["pacer"]).await;
    assert_eq!(code, 0, "{out}");

    // A cancelled run: watch replays, closes, and exits non-zero.
    let (_, out, _) = cli(&app, ACME, &["submit", &file]).await;
    let other = out.trim().to_owned();
    let (status, _) = app.post(&format!("/v1/runs/{other}/cancel"), ACME, &json!({})).await;
    assert_eq!(status, 200);
    let (code, _, err) = cli(&app, ACME, &["watch", &other]).await;
    assert_eq!(code, 3, "{err}");

    // Errors are one clear line.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, json!({"model": "m", "input": "x", "max_turns": 0}).to_string()).unwrap();
    let (code, _, err) = cli(&app, ACME, &["submit", bad.to_str().unwrap()]).await;
    assert_eq!(code, 1);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("API 422 invalid_request (max_turns)"), "{err}");
    let (code, _, err) = cli(&app, "wrong", &["runs"]).await;
    assert_eq!(code, 1);
    assert!(err.trim().starts_with("paceline: API 401 unauthorized"), "{err}");
    let (code, _, err) = cli(&app, ACME, &["status", "run_01JDXXXXXXXXXXXXXXXXXXXXXX"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("API 404 not_found"), "{err}");
}

#[tokio::test]
async fn shutdown_is_not_held_up_by_an_open_event_stream() {
    let redis = RedisServer::start();
    let config = ApiConfig::new("127.0.0.1:0".parse().unwrap(), RedisArgs::new(redis.url(), unique_prefix()));
    let app = Application::build(config).await.unwrap();
    let url = format!("http://{}", app.local_addr());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    let run: Value = http.post(format!("{url}/v1/runs")).json(&spec()).send().await.unwrap().json().await.unwrap();
    let resp = http.get(format!("{url}/v1/runs/{}/events", run["id"].as_str().unwrap())).send().await.unwrap();
    let mut stream = OpenStream::new(resp);
    // Its first event: the stream is open and follows the live run.
    stream.until_event("run.queued", Duration::from_secs(5)).await;
    stop.send(()).unwrap();
    within("the server to stop", Duration::from_secs(5), server).await.unwrap().unwrap();
    // The stream ends (closed or cut) instead of holding the shutdown up.
    within("the stream to end", Duration::from_secs(5), async { while let Ok(Some(_)) = stream.resp.chunk().await {} })
        .await;
}

#[tokio::test]
async fn paceline_submit_watch_follows_a_real_worker_to_completion() {
    use mock_provider::{MockConfig, MockServer};
    let app = spawn_app().await;
    let mock = MockServer::start(MockConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tool_rounds: 0,
        output_tokens: 30,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let config = worker::WorkerConfig::new(RedisArgs::new(app.redis.url(), app.prefix.clone()), mock.base_url());
    let (stop_worker, worker_stopped) = oneshot::channel::<()>();
    let worker = tokio::spawn(worker::run(config, async {
        let _ = worker_stopped.await;
    }));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("spec.json");
    std::fs::write(&file, json!({"model": "gpt-4.1-mini", "input": "say something", "max_turns": 3}).to_string())
        .unwrap();
    let (code, out, err) = cli(&app, ACME, &["submit", "--watch", file.to_str().unwrap()]).await;
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let mut lines = out.lines();
    let id = lines.next().unwrap().trim().to_owned();
    let text: String = lines.collect::<Vec<_>>().join("\n");
    let (_, run) = app.get(&format!("/v1/runs/{id}"), ACME).await;
    assert_eq!(run["status"], "completed", "{run}");
    let expected = run["output_text"].as_str().unwrap();
    assert!(!expected.is_empty());
    assert_eq!(text.trim(), expected.trim(), "the CLI printed another final text");
    assert!(err.contains("completed: 1 turns"), "{err}");

    let _ = stop_worker.send(());
    within("the worker to stop", Duration::from_secs(10), worker).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_tenants_own_tool_endpoint_is_refused_to_another_tenant_at_submit() {
    const ACME_TOOLS: &str = "http://tools.acme.internal/v1";
    let app =
        spawn_app_with(|c| c.runs.tool_endpoints = ToolEndpoints::every_tenant([TOOLS]).with(Some("acme"), ACME_TOOLS))
            .await;
    let tools = json!([{"type": "function", "name": "search"}]);
    let acmes = json!({"model": "m", "input": "x", "tools": tools, "tool_endpoint": format!("{ACME_TOOLS}/search")});
    let before = app.key_count().await;
    let (status, err) = app.post("/v1/runs", BETA, &acmes).await;
    assert_eq!(status, 422, "{err}");
    assert_eq!((error_type(&err), err["error"]["field"].as_str()), ("invalid_request", Some("tool_endpoint")));
    assert_eq!(app.key_count().await, before, "a refused run writes nothing");
    // acme may use its own endpoint; beta the shared one.
    assert_eq!(app.submit(ACME, &acmes).await["status"], "queued");
    let shared = json!({"model": "m", "input": "x", "tools": tools, "tool_endpoint": TOOLS});
    assert_eq!(app.submit(BETA, &shared).await["status"], "queued");
}

#[tokio::test]
async fn companion_mode_from_a_tenant_not_listed_is_403_and_writes_nothing() {
    let app = spawn_app_with(|c| c.access.companion_tenants = vec!["acme".into()]).await;
    let companion = json!({"model": "m", "input": "x", "mode": "companion"});
    let before = app.key_count().await;
    let (status, err) = app.post("/v1/runs", BETA, &companion).await;
    assert_eq!(status, 403, "{err}");
    assert_eq!(error_type(&err), "forbidden");
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("PACELINE_COMPANION_TENANTS"), "{message}");
    assert_eq!(app.key_count().await, before, "a refused run never reaches Redis");
    let (_, list) = app.get("/v1/runs", BETA).await;
    assert_eq!(list["data"], json!([]), "{list}");
    // beta's work runs and acme's companion runs are taken.
    assert_eq!(app.submit(BETA, &spec()).await["mode"], "work");
    assert_eq!(app.submit(ACME, &companion).await["mode"], "companion");
    // Unset, every tenant may (as before).
    let open = spawn_app().await;
    assert_eq!(open.submit(BETA, &companion).await["mode"], "companion");
}

/// Per-tenant quotas (SPEC §1): a submit over a tenant's unfinished runs or its
/// submits a minute answers 429 with `Retry-After` and the error body, and
/// writes nothing; another tenant is not held back; a run that finishes makes
/// room; a retry that would pass the active quota is refused the same way.
#[tokio::test]
async fn a_submit_over_a_tenants_quota_is_429_with_retry_after_and_writes_nothing() {
    let app = spawn_app_with(|c| {
        c.quotas.max_active_runs = "100,acme=2".parse().unwrap();
        c.quotas.submits_per_min = "3".parse().unwrap();
    })
    .await;
    let (url, pattern) = (app.redis.url(), format!("{}*", app.prefix));
    // (Its first line names the time it was taken.)
    let dump = || async { paceline_tests::dump_redis(&url, &pattern).await.split_once('\n').unwrap().1.to_owned() };
    let first = app.submit(ACME, &spec()).await;
    app.submit(ACME, &spec()).await;
    let before = dump().await;
    let resp = app.req(reqwest::Method::POST, "/v1/runs", Some(ACME)).json(&spec()).send().await.unwrap();
    let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    let (status, err) = read(resp).await;
    assert_eq!(status, 429, "{err}");
    assert_eq!(error_type(&err), "quota_exceeded");
    assert!(err["error"]["message"].as_str().unwrap().contains("PACELINE_MAX_ACTIVE_RUNS"), "{err}");
    assert!(retry_after.as_deref().is_some_and(|s| s.parse::<u64>().is_ok_and(|n| n >= 1)), "{retry_after:?}");
    assert_eq!(dump().await, before, "a refused submit writes nothing");
    // Another tenant has its own count; its submits a minute run out at 3.
    for _ in 0..3 {
        app.submit(BETA, &spec()).await;
    }
    let resp = app.req(reqwest::Method::POST, "/v1/runs", Some(BETA)).json(&spec()).send().await.unwrap();
    let retry_after: u64 = resp.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let (status, err) = read(resp).await;
    assert_eq!(status, 429, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("PACELINE_SUBMITS_PER_MIN"), "{err}");
    // 3 a minute: the next is allowed a third of a minute after the first.
    assert!((15..=21).contains(&retry_after), "Retry-After {retry_after}");
    // A run of acme's that ends makes room for one more.
    let (status, _) = app.post(&format!("/v1/runs/{}/cancel", first["id"].as_str().unwrap()), ACME, &json!({})).await;
    assert_eq!(status, 200);
    app.submit(ACME, &spec()).await;
    let (status, _) = app.post("/v1/runs", ACME, &spec()).await;
    assert_eq!(status, 429);
}

/// `/readyz` reports Redis's memory against its `maxmemory`, with pressure
/// from 90 % (with `noeviction` a Redis at its limit refuses every write), and
/// `/metrics` carries it; a Redis without a `maxmemory` reports none.
#[tokio::test]
async fn readyz_and_metrics_report_redis_memory_pressure_before_writes_are_refused() {
    let app = spawn_app().await;
    let (status, ready) = read(app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap()).await;
    assert_eq!((status, ready.get("redis_memory")), (200, None), "{ready}");
    let mut conn = app.redis.conn().await;
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await.unwrap();
    let used: u64 = info.lines().find_map(|l| l.strip_prefix("used_memory:")).unwrap().trim().parse().unwrap();
    let set = |max: u64| redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(max).to_owned();
    let _: () = set(used * 20).query_async(&mut conn).await.unwrap();
    let (_, ready) = read(app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap()).await;
    assert_eq!(ready["redis_memory"]["pressure"], false, "{ready}");
    let _: () = set(used + used / 20).query_async(&mut conn).await.unwrap();
    let (status, ready) = read(app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap()).await;
    assert_eq!((status, &ready["redis_memory"]["pressure"]), (200, &json!(true)), "{ready}");
    let metrics = app.req(reqwest::Method::GET, "/metrics", Some(OPERATOR)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.lines().any(|l| l == "paceline_redis_memory_pressure 1"), "{metrics}");
    let _: () = set(0).query_async(&mut conn).await.unwrap();
    // A Redis set to evict keys after the API started (it refuses one at
    // start) makes it not ready, naming the policy.
    let policy = |p: &str| redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg(p).to_owned();
    let _: () = policy("allkeys-lru").query_async(&mut conn).await.unwrap();
    let (status, err) = read(app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap()).await;
    assert_eq!((status, error_type(&err)), (503, "not_ready"), "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("maxmemory-policy allkeys-lru"), "{err}");
    let _: () = policy("noeviction").query_async(&mut conn).await.unwrap();
    let (status, _) = read(app.req(reqwest::Method::GET, "/readyz", None).send().await.unwrap()).await;
    assert_eq!(status, 200);
}

/// A body sent a byte at a time (a slowloris past the headers) is answered
/// 408 once `--body-timeout` has passed since its headers, and its connection
/// closed: the header timeout alone never ended it.
#[tokio::test]
async fn a_body_that_does_not_arrive_within_the_body_timeout_is_a_408() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let app = spawn_app_with(|c| c.serve.body_timeout = Duration::from_secs(1)).await;
    let mut stream = tokio::net::TcpStream::connect(app.url.trim_start_matches("http://")).await.unwrap();
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ACME}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    // A byte every 300 ms: each frame arrives well within any idle timeout.
    let mut answer = vec![0u8; 4096];
    let n = loop {
        tokio::select! {
            read = stream.read(&mut answer) => break read.unwrap(),
            _ = tokio::time::sleep(Duration::from_millis(300)) => {
                let _ = stream.write_all(b" ").await;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(5), "no answer 5 s into a body the server waits for");
    };
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(started.elapsed() >= Duration::from_millis(900), "answered before the timeout");
    // A caller without a token is refused before its body is read: it cannot
    // make the API hold a megabyte for the body timeout.
    let mut stream = tokio::net::TcpStream::connect(app.url.trim_start_matches("http://")).await.unwrap();
    let head = "POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{";
    stream.write_all(head.as_bytes()).await.unwrap();
    let n = within("the 401", Duration::from_millis(500), stream.read(&mut answer)).await.unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
}
