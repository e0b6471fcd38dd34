//! Real workers on each wire style and on several named providers (README,
//! "Providers: OpenAI, Anthropic, several in one fleet"):
//! a tool-using run completes on Responses, Chat Completions and Anthropic's
//! Messages API; the generation parameters reach each provider in its own
//! names (the mock keeps the bodies); an Anthropic 529 is retried and a 400
//! costs one request; two named providers keep their own budgets; and the
//! keys (OpenAI's and Anthropic's) appear nowhere but in the request headers.

use std::time::{Duration, Instant};

use mock_provider::{Fault, HeaderStyle, MockConfig, MockServer};
use paceline_tests::{eventually, ChildGuard};
use serde_json::{json, Value};
use shared::providers::{ProviderEntry, ProviderTable};
use shared::runs::{ApiStyle, RunStatus};
use worker::config::ProviderArgs;

use crate::fixtures::{secs, tool_run, App};

const STYLES: [ApiStyle; 3] = [ApiStyle::Responses, ApiStyle::Chat, ApiStyle::Anthropic];

/// The mock's shape for a style: Anthropic's headers and split buckets for
/// Anthropic, its output bucket roomy enough for the output limits these
/// tests reserve (the pacing against it is not what they are about).
pub(crate) fn mock_config(style: ApiStyle, config: MockConfig) -> MockConfig {
    if style == ApiStyle::Anthropic {
        MockConfig { headers: HeaderStyle::Anthropic, otpm: config.otpm.or(Some(200_000)), ..config }
    } else {
        MockConfig { headers: HeaderStyle::OpenAi, ..config }
    }
}

/// The provider's base URL on `mock` for `style`.
pub(crate) fn base(mock: &MockServer, style: ApiStyle) -> String {
    if style == ApiStyle::Anthropic {
        mock.url()
    } else {
        mock.base_url()
    }
}

/// An app whose one worker speaks `style` to the app's mock.
async fn app_on(style: ApiStyle, config: MockConfig) -> App {
    let mut app = App::start(mock_config(style, config)).await;
    let mut c = app.config();
    c.provider = ProviderArgs::single(base(&app.mock, style), style);
    app.spawn_worker(c);
    app
}

fn api_of(style: ApiStyle) -> mock_provider::wire::Api {
    match style {
        ApiStyle::Responses => mock_provider::wire::Api::Responses,
        ApiStyle::Chat => mock_provider::wire::Api::Chat,
        ApiStyle::Anthropic => mock_provider::wire::Api::Messages,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_using_run_completes_on_each_style() {
    for style in STYLES {
        let mut app = app_on(style, MockConfig { tool_rounds: 2, calls_per_round: 2, ..MockConfig::default() }).await;
        let mut body = tool_run(&app, "lookup");
        body["max_output_tokens"] = json!(256);
        let run = app.submit(body).await;
        let run = app.wait_finished(&run.id, secs(30)).await;
        assert_eq!(run.status, RunStatus::Completed, "{style:?}: {run:?}");
        assert_eq!(run.turns_completed, 2, "{style:?}: a round of two calls, then the answer");
        assert!(run.output_text.as_deref().is_some_and(|t| !t.is_empty()));
        assert!(run.usage.input_tokens > 0 && run.usage.output_tokens > 0, "{style:?}: {:?}", run.usage);
        let stats = app.mock.stats();
        assert!(stats.log.iter().all(|e| e.api == Some(api_of(style))), "{style:?}: every call on its endpoint");
        assert!(stats.log.iter().all(|e| e.status == 200), "{style:?}: {:?}", stats.log);
        // The transcript keeps the Responses shape whatever the wire.
        let tx = app.store.transcript("default", &run.id).await.unwrap().unwrap();
        let calls: Vec<&Value> = tx.iter().map(|e| &e.item).filter(|i| i["type"] == "function_call").collect();
        assert_eq!(calls.len(), 2, "{style:?}");
        assert_eq!(tx.iter().filter(|e| e.item["type"] == "function_call_output").count(), 2);
        if style == ApiStyle::Anthropic {
            assert!(calls.iter().all(|c| c["call_id"].as_str().unwrap().starts_with("toolu_")));
            // The second call carried both results in one user message, right after the calls.
            let second = &stats.bodies[1].body;
            let messages = second["messages"].as_array().unwrap();
            let results = messages.last().unwrap();
            assert_eq!(results["role"], "user");
            assert_eq!(results["content"].as_array().unwrap().len(), 2, "{second}");
            assert_eq!(stats.bodies[0].anthropic_version.as_deref(), Some("2023-06-01"));
        }
        app.stop_workers().await;
    }
}

/// The schema of the structured answer the parameter runs ask for.
fn verdict_schema() -> Value {
    json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string"}},
           "required": ["ok", "reason"], "additionalProperties": false})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_structured_output_and_a_required_tool_reach_each_style_in_its_names() {
    for style in STYLES {
        let mut app = app_on(style, MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
        let mut body = tool_run(&app, "lookup");
        body["max_output_tokens"] = json!(4096);
        body["reasoning"] = json!({"effort": "high"});
        body["text"] = json!({"format": {"type": "json_schema", "name": "verdict", "strict": true,
                                         "schema": verdict_schema()}});
        body["tool_choice"] = json!("required");
        body["temperature"] = json!(0.2);
        body["stop"] = json!(["END"]);
        let run = app.submit(body).await;
        let run = app.wait_finished(&run.id, secs(30)).await;
        assert_eq!(run.status, RunStatus::Completed, "{style:?}: {run:?}");
        // The answer is the structured one on every style (Anthropic: the answer tool's input).
        let answer: Value = serde_json::from_str(run.output_text.as_deref().unwrap()).expect("a JSON answer");
        assert_eq!(answer["ok"], json!(true), "{style:?}: {answer}");
        let stats = app.mock.stats();
        let sent = &stats.bodies[0].body;
        match style {
            ApiStyle::Responses => {
                assert_eq!(sent["reasoning"], json!({"effort": "high"}));
                assert_eq!(sent["include"], json!(["reasoning.encrypted_content"]));
                assert_eq!(sent["text"]["format"]["type"], "json_schema");
                assert_eq!(sent["text"]["format"]["name"], "verdict");
                assert_eq!(sent["text"]["format"]["strict"], json!(true));
                assert_eq!(sent["text"]["format"]["schema"], verdict_schema());
                assert_eq!(sent["tool_choice"], "required");
                assert_eq!(sent["temperature"], json!(0.2));
                assert!(sent.get("stop").is_none(), "Responses has no stop");
                // The mock reports 64 reasoning tokens per call at high effort.
                assert_eq!(run.usage.reasoning_tokens, 128, "{:?}", run.usage);
            }
            ApiStyle::Chat => {
                assert_eq!(sent["reasoning_effort"], "high");
                assert_eq!(sent["response_format"]["type"], "json_schema");
                assert_eq!(sent["response_format"]["json_schema"]["name"], "verdict");
                assert_eq!(sent["response_format"]["json_schema"]["schema"], verdict_schema());
                assert_eq!(sent["tool_choice"], "required");
                assert_eq!(sent["stop"], json!(["END"]));
                assert!(sent.get("reasoning").is_none() && sent.get("text").is_none());
                assert_eq!(run.usage.reasoning_tokens, 128, "{:?}", run.usage);
            }
            ApiStyle::Anthropic => {
                // Required is `any`; the schema is a tool the model must answer through.
                assert_eq!(sent["tool_choice"], json!({"type": "any"}));
                let tools = sent["tools"].as_array().unwrap();
                assert_eq!(tools.len(), 2);
                assert_eq!(tools[1]["name"], "verdict");
                assert_eq!(tools[1]["input_schema"], verdict_schema());
                assert_eq!(sent["max_tokens"], json!(4096));
                assert_eq!(sent["stop_sequences"], json!(["END"]));
                // Anthropic refuses thinking beside a forced tool choice, and
                // the mock would have answered 400 had it been sent.
                assert!(sent.get("thinking").is_none(), "{sent}");
                assert!(sent.get("reasoning").is_none() && sent.get("text").is_none());
                // The answer turn was a call of `verdict`, kept as the answer's text.
                let tx = app.store.transcript("default", &run.id).await.unwrap().unwrap();
                assert!(!tx.iter().any(|e| e.item["name"] == "verdict"), "the answer is not a tool call");
            }
        }
        assert!(stats.log.iter().all(|e| e.status == 200), "{style:?}: {:?}", stats.log);
        app.stop_workers().await;
    }
}

/// With reasoning and no forced choice, Anthropic gets thinking with a
/// budget, and the signed thinking goes back with the tool turn (the mock,
/// like Anthropic, refuses a tool turn without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_thinking_goes_back_with_each_tool_turn() {
    let mut app = app_on(ApiStyle::Anthropic, MockConfig { tool_rounds: 2, ..MockConfig::default() }).await;
    let mut body = tool_run(&app, "lookup");
    body["max_output_tokens"] = json!(8000);
    body["reasoning"] = json!({"effort": "low"});
    body["temperature"] = json!(0.5);
    let run = app.submit(body).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.turns_completed, 3);
    let stats = app.mock.stats();
    assert!(stats.log.iter().all(|e| e.status == 200), "{:?}", stats.log);
    let first = &stats.bodies[0].body;
    assert_eq!(first["thinking"], json!({"type": "enabled", "budget_tokens": 4096}));
    assert!(first.get("temperature").is_none(), "not with thinking");
    let last = &stats.bodies[2].body;
    let assistant = last["messages"].as_array().unwrap().iter().rev().find(|m| m["role"] == "assistant").unwrap();
    assert_eq!(assistant["content"][0]["type"], "thinking");
    assert!(assistant["content"][0]["signature"].as_str().unwrap().starts_with("sig_"));
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_529_is_retried_and_a_400_costs_exactly_one_request() {
    let mut app = app_on(ApiStyle::Anthropic, MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    app.mock.inject(Fault::ServerError { status: 529 });
    let run = app.submit(json!({"model": "claude-test", "input": "x"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    assert_eq!(run.pacing.retries, 1);
    let log = app.mock.stats().log;
    assert_eq!(log.iter().map(|e| e.status).collect::<Vec<_>>(), vec![529, 200]);
    assert!(log[1].at_ms - log[0].at_ms >= 800, "the retry waited for the backoff");

    let invalid = "messages.0.content: Input should be a valid list";
    app.mock.inject(Fault::InvalidRequest { message: Some(invalid.into()) });
    let before = app.mock.stats().requests;
    let run = app.submit(json!({"model": "claude-test", "input": "y"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "provider_error");
    assert!(error.message.contains(invalid), "{}", error.message);
    assert_eq!(app.mock.stats().requests - before, 1, "a 400 is never retried");

    // A prompt too long whose run has nothing to trim (the task alone) fails
    // as such, after that one request (`context::` has the trimmed retry).
    app.mock.inject(Fault::InvalidRequest { message: None });
    let before = app.mock.stats().requests;
    let run = app.submit(json!({"model": "claude-test", "input": "w"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "context_overflow");
    assert!(error.message.contains("prompt is too long"), "{}", error.message);
    assert_eq!(app.mock.stats().requests - before, 1, "nothing to trim: not sent again");

    // A credit balance too low is a billing stop: quota, one request.
    app.mock.inject(Fault::Quota);
    let before = app.mock.stats().requests;
    let run = app.submit(json!({"model": "claude-test", "input": "z"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.error.map(|e| e.kind), Some("quota".to_string()));
    assert_eq!(app.mock.stats().requests - before, 1);
    app.stop_workers().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_named_providers_keep_their_own_budgets() {
    // Provider `openai` is the app's mock; `claude` a second one, Anthropic-shaped.
    let mut app =
        App::start(MockConfig { tool_rounds: 0, latency: Duration::from_millis(50), ..MockConfig::default() }).await;
    let claude = MockServer::start(mock_config(
        ApiStyle::Anthropic,
        MockConfig { tool_rounds: 0, latency: Duration::from_millis(50), keep_bodies: 50, ..MockConfig::default() },
    ))
    .await
    .unwrap();
    let entry = |name: &str, style, url: String| ProviderEntry {
        name: name.into(),
        style,
        url,
        key_env: None,
        tpm: None,
        rpm: None,
    };
    let mut config = app.config();
    config.provider.named.providers = ProviderTable(vec![
        entry("openai", ApiStyle::Responses, app.mock.base_url()),
        entry("claude", ApiStyle::Anthropic, claude.url()),
    ]);
    app.providers = vec!["openai".into(), "claude".into()];
    app.spawn_worker(config.clone());
    app.spawn_worker(config);

    // A run on `openai` meets a 429 that closes its window for 6 s.
    app.mock.inject(Fault::RateLimited { retry_after_ms: 6_000 });
    let limited = app.submit(json!({"model": "gpt-test", "input": "one", "provider": "openai"})).await;
    eventually("the 429", secs(10), || async { (app.mock.stats().rate_limited == 1).then_some(()) }).await;
    let closed_at = Instant::now();
    // Meanwhile `claude` ...
    let mut ids = vec![];
    for i in 0..6 {
        ids.push(app.submit(json!({"model": "claude-test", "input": format!("q{i}"), "provider": "claude"})).await.id);
    }
    for id in &ids {
        let run = app.wait_finished(id, secs(10)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        assert_eq!(run.pacing.rate_limited, 0);
    }
    let took = closed_at.elapsed();
    // ... the other provider's runs all went through while the window was closed.
    assert!(took < Duration::from_secs(4), "claude's runs waited for openai's window: {took:?}");
    assert_eq!(claude.stats().requests, 6);
    assert_eq!(app.mock.stats().requests, 1, "nothing was sent into openai's closed window");

    // Each provider is its own budget in the pacer, per model.
    let conn = shared::redis_util::manager(&app.redis.url()).await.unwrap();
    let pacer = shared::pacer::SharedPacer::new(
        conn,
        shared::keys::Keys::new(&app.prefix),
        "default",
        shared::pacer::PacingConfig::default(),
    );
    let budgets = pacer.snapshot().await.unwrap();
    let find = |budget: &str| budgets.iter().find(|b| b.budget == budget).unwrap_or_else(|| panic!("{budgets:?}"));
    assert!(find("default:openai").blocked_for_ms > 0, "openai's window is closed");
    assert_eq!(find("default:openai").model, "gpt-test");
    assert_eq!(find("default:claude").blocked_for_ms, 0, "claude's is not");
    assert_eq!(find("default:claude").model, "claude-test");

    let limited = app.wait_finished(&limited.id, secs(20)).await;
    assert_eq!(limited.status, RunStatus::Completed);
    assert_eq!(limited.pacing.rate_limited, 1);
    let log = app.mock.stats().log;
    assert!(log[1].at_ms >= log[0].at_ms + 6_000, "openai's retry waited out its own window");
    app.stop_workers().await;
}

/// Everything a worker process writes to Redis, as text.
async fn everything_in_redis(app: &App) -> String {
    let mut conn = app.redis.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    let mut all = String::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(&mut conn).await.unwrap();
        let value: redis::Value = match kind.as_str() {
            "string" => redis::cmd("GET").arg(&key).query_async(&mut conn).await.unwrap(),
            "hash" => redis::cmd("HGETALL").arg(&key).query_async(&mut conn).await.unwrap(),
            "list" => redis::cmd("LRANGE").arg(&key).arg(0).arg(-1).query_async(&mut conn).await.unwrap(),
            "set" => redis::cmd("SMEMBERS").arg(&key).query_async(&mut conn).await.unwrap(),
            "zset" => {
                redis::cmd("ZRANGE").arg(&key).arg(0).arg(-1).arg("WITHSCORES").query_async(&mut conn).await.unwrap()
            }
            "stream" => redis::cmd("XRANGE").arg(&key).arg("-").arg("+").query_async(&mut conn).await.unwrap(),
            other => panic!("a {other} key: {key}"),
        };
        all.push_str(&format!("{key} {value:?}\n"));
    }
    all
}

const OPENAI_CANARY: &str = "sk-canary-openai-5b1e";
const ANTHROPIC_CANARY: &str = "sk-ant-canary-9d2c";

/// A `paceline worker` process with `env`, its output in `dir`.
fn worker_with_env(app: &App, dir: &std::path::Path, env: &[(&str, String)]) -> ChildGuard {
    let log = std::fs::File::create(dir.join("worker.log")).unwrap();
    let mut cmd = std::process::Command::new(paceline_tests::paceline_bin());
    cmd.arg("worker")
        .args(["--prefix", &app.prefix, "--tool-endpoints", &app.tools])
        .env("REDIS_URL", app.redis.url())
        .env_remove("PACELINE_PROVIDERS")
        .env_remove("PACELINE_API_STYLE")
        .env_remove("PACELINE_PROVIDER_URL")
        .env("RUST_LOG", "debug")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    ChildGuard(cmd.spawn().expect("start paceline worker"))
}

/// The keys reach the providers (as headers: the mocks note which header
/// came) and nothing else: not Redis (records, transcripts, events, the
/// pacer), not the worker's debug log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_and_anthropic_keys_are_never_stored_or_logged() {
    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    let claude =
        MockServer::start(mock_config(ApiStyle::Anthropic, MockConfig { tool_rounds: 1, ..MockConfig::default() }))
            .await
            .unwrap();
    app.providers = vec!["openai".into(), "claude".into()];
    let dir = tempfile::tempdir().unwrap();
    let providers = format!("openai=responses@{},claude=anthropic@{}", app.mock.base_url(), claude.url());
    let mut child = worker_with_env(
        &app,
        dir.path(),
        &[
            ("PACELINE_PROVIDERS", providers),
            ("OPENAI_API_KEY", OPENAI_CANARY.into()),
            ("ANTHROPIC_API_KEY", ANTHROPIC_CANARY.into()),
        ],
    );
    let a = app.submit(tool_run(&app, "lookup")).await;
    let mut body = tool_run(&app, "lookup");
    body["provider"] = json!("claude");
    body["model"] = json!("claude-test");
    let b = app.submit(body).await;
    for id in [&a.id, &b.id] {
        let run = app.wait_finished(id, secs(30)).await;
        assert_eq!(
            run.status,
            RunStatus::Completed,
            "{run:?}\n{}",
            std::fs::read_to_string(dir.path().join("worker.log")).unwrap()
        );
    }
    // Each key went where its provider reads it.
    assert!(app.mock.stats().bodies.iter().all(|b| b.auth.as_deref() == Some("authorization")));
    assert!(claude.stats().bodies.iter().all(|b| b.auth.as_deref() == Some("x-api-key")));
    child.signal("TERM");
    child.wait_timeout(secs(15)).expect("the worker stops on SIGTERM");

    let log = std::fs::read_to_string(dir.path().join("worker.log")).unwrap();
    assert!(log.contains("provider call"), "the debug log was written: {log}");
    let redis = everything_in_redis(&app).await;
    assert!(redis.contains(&a.id) && redis.contains("lookup"), "the scan reads the runs");
    for canary in [OPENAI_CANARY, ANTHROPIC_CANARY] {
        assert!(!log.contains(canary), "{canary} is in the worker's log");
        assert!(!redis.contains(canary), "{canary} is in Redis");
        for body in app.mock.stats().bodies.iter().chain(claude.stats().bodies.iter()) {
            assert!(!body.body.to_string().contains(canary), "{canary} is in a request body");
        }
    }
    drop(child);
}

/// `PACELINE_API_STYLE=anthropic` with `PACELINE_PROVIDER_URL` and
/// `ANTHROPIC_API_KEY` run a whole fleet on Anthropic, as before named providers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_provider_variables_run_a_fleet_on_anthropic() {
    let app =
        App::start(mock_config(ApiStyle::Anthropic, MockConfig { tool_rounds: 1, ..MockConfig::default() })).await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = worker_with_env(
        &app,
        dir.path(),
        &[
            ("PACELINE_API_STYLE", "anthropic".into()),
            ("PACELINE_PROVIDER_URL", app.mock.url()),
            ("ANTHROPIC_API_KEY", ANTHROPIC_CANARY.into()),
            // Not sent to Anthropic: it is OpenAI's.
            ("OPENAI_API_KEY", OPENAI_CANARY.into()),
        ],
    );
    let mut body = tool_run(&app, "lookup");
    body["model"] = json!("claude-test");
    let run = app.submit(body).await;
    let run = app.wait_finished(&run.id, secs(30)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let stats = app.mock.stats();
    assert!(stats.log.iter().all(|e| e.api == Some(mock_provider::wire::Api::Messages)));
    assert!(stats.bodies.iter().all(|b| b.auth.as_deref() == Some("x-api-key")));
    child.signal("TERM");
    child.wait_timeout(secs(15)).expect("the worker stops on SIGTERM");
    let log = std::fs::read_to_string(dir.path().join("worker.log")).unwrap();
    assert!(!log.contains(ANTHROPIC_CANARY) && !log.contains(OPENAI_CANARY));
    let redis = everything_in_redis(&app).await;
    assert!(!redis.contains(ANTHROPIC_CANARY));
    // Its pacer budget is the fleet's, as before named providers.
    let budgets: Vec<String> = redis::cmd("SMEMBERS")
        .arg(shared::keys::Keys::new(&app.prefix).pacer_budgets())
        .query_async(&mut app.redis.conn().await)
        .await
        .unwrap();
    assert_eq!(budgets, vec!["default"]);
}

/// A run naming a provider this worker lacks (its PACELINE_PROVIDERS differs
/// from the API's) fails at once, saying so, and calls no provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_for_a_provider_the_worker_lacks_fails_without_a_call() {
    let mut app = App::start(MockConfig { tool_rounds: 0, ..MockConfig::default() }).await;
    let mut config = app.config();
    config.provider.named.providers =
        format!("openai=responses@{}", app.mock.base_url()).parse().expect("a provider table");
    app.providers = vec!["openai".into(), "elsewhere".into()];
    app.spawn_worker(config);
    let run = app.submit(json!({"model": "m", "input": "x", "provider": "elsewhere"})).await;
    let run = app.wait_finished(&run.id, secs(20)).await;
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "provider_error");
    assert!(
        error.message.contains("no provider named \"elsewhere\"") && error.message.contains("openai"),
        "{}",
        error.message
    );
    assert_eq!(app.mock.stats().requests, 0);
    let ok = app.submit(json!({"model": "m", "input": "y"})).await;
    assert_eq!(app.wait_finished(&ok.id, secs(20)).await.status, RunStatus::Completed, "the default still works");
    app.stop_workers().await;
}
