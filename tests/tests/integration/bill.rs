//! A long run's bill (SPEC §4a) against the mock provider: a run that
//! outgrows the model's context window, each `context_overflow` policy, the
//! provider's context-length 400; prompt caching on both styles.

use serde_json::{json, Value};
use shared::runs::{ApiStyle, RunStatus};
use worker::config::ProviderArgs;
use worker::context::TRIMMED_PLACEHOLDER;

use crate::fixtures::{secs, tool_endpoint, App};
use mock_provider::MockConfig;
use paceline_tests::ChildGuard;

/// A tool output of about 2 400 characters of English (~600 of the mock's tokens).
async fn wordy_tools() -> String {
    tool_endpoint(|| async {
        let note = "The reference note says the scheduler keeps due times on the server clock, \
                    one lease per delivery, and a shared budget per model. ";
        axum::Json(json!({"output": note.repeat(18)}))
    })
    .await
}

/// A run of up to 20 turns calling `lookup`, with `extra` fields.
fn long_run(app: &App, extra: Value) -> Value {
    let mut body = json!({
        "model": "gpt-test",
        "instructions": "You are a test.",
        "input": "do the task",
        "tools": [{"type": "function", "name": "lookup", "description": "a tool",
                   "parameters": {"type": "object", "properties": {}}}],
        "tool_endpoint": app.tools,
        "max_turns": 20,
        "max_output_tokens": 64,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

/// The mock, scripted for 12 tool rounds (~7 000 of its tokens by the last),
/// its context window `window`.
async fn app_with_window(window: u64) -> App {
    let mut app =
        App::start(MockConfig { tool_rounds: 12, context_window: Some(window), ..MockConfig::default() }).await;
    app.tools = wordy_tools().await;
    app.spawn_worker(app.config());
    app
}

/// SPEC §4a, `trim`: a run whose history outgrows the window it is given
/// completes, its oldest tool outputs elided, and no call the provider would
/// refuse is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_outgrows_its_context_window_is_trimmed_and_completes() {
    let mut app = app_with_window(6_000).await;
    let run = app.submit(long_run(&app, json!({"context_window_tokens": 4_500}))).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let stats = app.mock.stats();
    assert!(stats.log.iter().all(|e| e.status == 200), "a call over the window was sent");
    assert_eq!(stats.requests, 13, "12 tool rounds and the answer");
    let trimmed = stats.bodies.iter().filter(|b| b.body.to_string().contains(TRIMMED_PLACEHOLDER)).count();
    assert!(trimmed >= 3, "only {trimmed} calls were trimmed");
    let largest = stats.log.iter().map(|e| e.input_tokens).max().unwrap();
    assert!(largest <= 6_000, "{largest} tokens sent");
    app.stop_workers().await;
}

/// SPEC §4a, `fail`: the run fails with `context_overflow` instead of sending
/// a call that would not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_says_fail_fails_before_it_sends_a_call_over_its_window() {
    let mut app = app_with_window(6_000).await;
    let body = long_run(&app, json!({"context_window_tokens": 4_500, "context_overflow": "fail"}));
    let run = app.submit(body).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "context_overflow");
    assert!(error.message.contains("does not fit"), "{}", error.message);
    let stats = app.mock.stats();
    assert!(stats.log.iter().all(|e| e.status == 200), "a call over the window was sent");
    assert!(stats.requests < 13 && stats.requests > 3, "{} requests", stats.requests);
    app.stop_workers().await;
}

/// SPEC §4a: a window paceline does not know is the provider's to say. Its
/// context-length 400 is the one 400 sent again — trimmed to the window it
/// learned, at once, once: every 400 is followed by the same turn's success,
/// and the turns after it fit before they are sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_context_length_error_costs_one_request_and_one_retry() {
    let mut app = app_with_window(4_500).await;
    let run = app.submit(long_run(&app, json!({}))).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    let log = app.mock.stats().log;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let statuses: Vec<u16> = log.iter().map(|e| e.status).collect();
    let refused = statuses.iter().filter(|&&s| s == 400).count();
    assert!(refused >= 1, "the window never bound: {statuses:?}");
    // The Responses API's error names no numbers: the window is learned a
    // tenth under what it refused, and the first 400 teaches enough for most
    // of what follows.
    assert!(refused <= 2, "the window was not learned: {statuses:?}");
    for (i, s) in statuses.iter().enumerate() {
        if *s == 400 {
            assert_eq!(statuses.get(i + 1), Some(&200), "a 400 not followed by its one retry: {statuses:?}");
            assert_eq!(log[i].code.as_deref(), Some("context_length_exceeded"));
        }
    }
    assert_eq!(statuses.len(), 13 + refused, "one retry per 400, never more: {statuses:?}");
    app.stop_workers().await;
}

/// SPEC §4a, prompt caching on Anthropic: breakpoints on the prefix and the
/// history, so each turn reads what the one before wrote; the run's usage
/// reports the reads and the writes as the provider counted them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_run_reads_its_earlier_turns_from_the_cache() {
    let mock = MockConfig { tool_rounds: 6, cache: true, ..MockConfig::default() };
    let mut app = App::start(crate::styles::mock_config(ApiStyle::Anthropic, mock)).await;
    app.tools = wordy_tools().await;
    let mut config = app.config();
    config.provider = ProviderArgs::single(crate::styles::base(&app.mock, ApiStyle::Anthropic), ApiStyle::Anthropic);
    app.spawn_worker(config);
    let instructions = "Follow the house rules for research notes carefully. ".repeat(100);
    let body = long_run(&app, json!({"model": "claude-sonnet-4-5", "instructions": instructions}));
    let run = app.submit(body).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let stats = app.mock.stats();
    assert_eq!(stats.requests, 7);
    // What the run says is what the provider counted.
    assert_eq!(run.usage.cached_input_tokens, stats.cache_read_tokens);
    assert_eq!(run.usage.cache_write_tokens, stats.cache_write_tokens);
    let input: u64 = stats.log.iter().map(|e| e.input_tokens).sum();
    assert_eq!(run.usage.input_tokens, input);
    // From the second turn on, every call reads all the previous call sent.
    for pair in stats.log.windows(2) {
        assert!(pair[1].cache_read_tokens + 3 >= pair[0].input_tokens, "{pair:?}");
    }
    let share = stats.cache_read_tokens as f64 / input as f64;
    assert!(share > 0.6, "{share:.2} of the input read from the cache");
    // Its cost: each kind at its own list price (Sonnet: 3 uncached, 0.3 read,
    // 3.75 written, 15 out, USD per million), from the provider's counts.
    let uncached = input - stats.cache_read_tokens - stats.cache_write_tokens;
    let want = (uncached as f64 * 3.0
        + stats.cache_read_tokens as f64 * 0.3
        + stats.cache_write_tokens as f64 * 3.75
        + run.usage.output_tokens as f64 * 15.0)
        / 1e6;
    let cost = run.cost_usd.expect("a known model's cost");
    assert!((cost - want).abs() < 2e-6, "{cost} against {want}");
    // Off: nothing marked, nothing read.
    let before = stats.cache_read_tokens;
    let body = long_run(&app, json!({"model": "claude-test", "prompt_cache": "off", "input": "another task"}));
    let run = app.submit(body).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!((run.status, run.usage.cached_input_tokens, run.usage.cache_write_tokens), (RunStatus::Completed, 0, 0));
    assert_eq!(run.cost_usd, None, "a model without a price has no cost, not 0");
    assert_eq!(app.mock.stats().cache_read_tokens, before);
    app.stop_workers().await;
}

/// SPEC §4a, prompt caching on OpenAI: automatic, keyed by the run's
/// `prompt_cache_key`; the pacer is asked for the cached tokens too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_run_sends_a_key_of_its_own_and_reads_its_prefix() {
    let mut app = App::start(MockConfig { tool_rounds: 6, cache: true, ..MockConfig::default() }).await;
    app.tools = wordy_tools().await;
    app.spawn_worker(app.config());
    let run = app.submit(long_run(&app, json!({}))).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!(run.status, RunStatus::Completed, "{run:?}");
    let stats = app.mock.stats();
    let keys: Vec<&str> = stats.bodies.iter().filter_map(|b| b.body["prompt_cache_key"].as_str()).collect();
    assert_eq!(keys.len(), 7, "every call carries the run's key");
    assert!(keys.iter().all(|k| *k == keys[0] && k.starts_with("paceline-")), "{keys:?}");
    assert_eq!(run.usage.cached_input_tokens, stats.cache_read_tokens);
    assert!(run.usage.cached_input_tokens > 0);
    app.stop_workers().await;
}

/// `PACELINE_PRICES`: a table that does not parse, or a negative price, stops
/// `paceline api` and `paceline worker` at start with the file and the field
/// named, before anything reaches Redis.
#[test]
fn a_bad_price_table_stops_the_processes_at_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for (text, says) in
        [("{\"gpt-x\": {\"input\": -2, \"output\": 8}}", "gpt-x.input: must be a number"), ("{not json", "not JSON")]
    {
        let file = dir.path().join("prices.json");
        std::fs::write(&file, text).unwrap();
        for command in ["api", "worker"] {
            let out = std::process::Command::new(paceline_tests::paceline_bin())
                .arg(command)
                .env("PACELINE_PRICES", &file)
                .env("REDIS_URL", "redis://127.0.0.1:1")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
            assert!(stderr.contains(says) && stderr.contains("prices.json"), "{command}: {stderr}");
        }
    }
}

/// A table given with `PACELINE_PRICES` prices a model the built-in one does
/// not know, and goes over one it does. (The table is the process's: this
/// test names models no other test of this binary prices.)
#[test]
fn given_prices_go_over_the_built_in_table() {
    let table = shared::models::PriceTable::from_json(
        r#"{"house-model": {"input": 1, "output": 2}, "claude-3-5-haiku": {"input": 9, "output": 9}}"#,
    )
    .unwrap();
    assert_eq!(shared::models::price("house-model"), None);
    shared::models::use_prices(table);
    assert_eq!(shared::models::price("house-model-v2").map(|p| p.output), Some(2.0));
    assert_eq!(shared::models::price("claude-3-5-haiku-20241022").map(|p| p.input), Some(9.0));
    assert_eq!(shared::models::price("gpt-4.1").map(|p| p.input), Some(2.0), "the rest stays built in");
    shared::models::use_prices(Default::default());
}

/// SPEC §4a, `max_cost_usd`: a run never sends the call that would cross its
/// cap; it fails with `budget_exceeded` instead, its cost within the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_a_cost_cap_never_sends_the_call_that_would_cross_it() {
    let mut app = App::start(MockConfig { tool_rounds: 12, ..MockConfig::default() }).await;
    app.tools = wordy_tools().await;
    app.spawn_worker(app.config());
    // gpt-4.1: $2 a million input, $8 output; a turn here costs ~$0.001-0.014
    // (~600 more tokens of input a turn, 64 of output reserved).
    let cap = 0.03;
    let run = app.submit(long_run(&app, json!({"model": "gpt-4.1", "max_cost_usd": cap}))).await;
    let run = app.wait_finished(&run.id, secs(60)).await;
    assert_eq!(run.status, RunStatus::Failed, "{run:?}");
    let error = run.error.expect("an error");
    assert_eq!(error.kind, "budget_exceeded");
    assert!(error.message.contains("max_cost_usd"), "{}", error.message);
    let cost = run.cost_usd.expect("a priced model");
    assert!(cost <= cap, "spent {cost} of {cap}");
    let calls = app.mock.stats().requests;
    assert!((3..13).contains(&calls), "{calls} calls");
    // What the provider counted, at the list price, is what the run says it cost.
    let input: u64 = app.mock.stats().log.iter().map(|e| e.input_tokens).sum();
    assert_eq!(run.usage.input_tokens, input);
    app.stop_workers().await;
}

/// SPEC §4a, `PACELINE_TENANT_BUDGETS`: a tenant's calls never take a day's
/// spend past its cap, however many of its turns are in flight at once (each
/// books its estimated cost first) across four worker processes of 16 slots;
/// its runs wait for the next day (`spend_cap`), then finish. The day is 3 s
/// here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_day_cap_holds_and_its_runs_resume_the_next_day() {
    // A budget nothing reaches: the day's cap is what holds the runs back.
    let mock = MockConfig { tool_rounds: 4, tpm: 10_000_000, rpm: 100_000, ..MockConfig::default() };
    let mut app = App::start(mock).await;
    app.tools = wordy_tools().await;
    let cap = 0.1;
    let budgets = format!("default={cap}");
    let flags = ["--concurrency", "16", "--tenant-budgets", &budgets, "--spend-day-s", "3"];
    let workers: Vec<ChildGuard> = (0..4).map(|_| app.worker_process(&flags, "error")).collect();
    let start_day = now_ms() / 3_000;
    let mut ids = vec![];
    for i in 0..32 {
        let body = long_run(&app, json!({"model": "gpt-4.1", "input": format!("task {i}")}));
        ids.push(app.submit(body).await.id);
    }
    let mut total = 0.0;
    let mut waited = 0;
    for id in &ids {
        let run = app.wait_finished(id, secs(90)).await;
        assert_eq!(run.status, RunStatus::Completed, "{run:?}");
        total += run.cost_usd.unwrap();
        waited += run.pacing.budget_waits;
    }
    assert!(total > 2.0 * cap, "the work ({total}) must need more than two days' caps");
    assert!(waited > 0, "no run waited for the next day");
    // Each day's ledger: within the cap, and together what the runs cost.
    let mut conn = redis::Client::open(app.redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let keys = shared::keys::Keys::new(&app.prefix);
    let (mut days, mut fullest) = (0.0, 0.0f64);
    for day in start_day..=now_ms() / 3_000 {
        let spent: Option<u64> = redis::cmd("HGET")
            .arg(keys.tenant_spend("default", day))
            .arg("spent")
            .query_async(&mut conn)
            .await
            .unwrap();
        let spent = spent.unwrap_or(0) as f64 / 1e6;
        assert!(spent <= cap, "day {day}: {spent} spent of {cap}");
        days += spent;
        fullest = fullest.max(spent);
    }
    eprintln!(
        "day cap {cap} over 4 processes x 16: 32 runs cost {total:.4} over {} days, the fullest {fullest:.4}; {waited} budget waits",
        now_ms() / 3_000 - start_day + 1
    );
    assert!((days - total).abs() < 1e-4, "the days' ledgers ({days}) against the runs' costs ({total})");
    drop(workers);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// SPEC §3, `GET /v1/usage`: tokens by kind and cost per tenant, model or day,
/// the workers' counts; a tenant sees its own, the operator every tenant's;
/// a bad day or grouping is a 422 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_adds_up_per_tenant_model_and_day() {
    let mut app = App::start(MockConfig { tool_rounds: 1, ..MockConfig::default() }).await;
    app.tools = wordy_tools().await;
    app.spawn_worker(app.config());
    let (api, _stop) = app.tenant_api(&[("alpha", "tok-a"), ("beta", "tok-b")], "tok-op").await;
    let http = reqwest::Client::new();
    let send = |token: &'static str, body: Value| {
        let (http, api) = (http.clone(), api.clone());
        async move {
            let r = http.post(format!("{api}/v1/runs")).bearer_auth(token).json(&body).send().await.unwrap();
            r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
        }
    };
    let a = send("tok-a", long_run(&app, json!({"model": "gpt-4.1"}))).await;
    let b = send("tok-b", long_run(&app, json!({"model": "gpt-test"}))).await;
    let a = crate::fixtures::wait_finished_for(&app, "alpha", &a, secs(30)).await;
    let b = crate::fixtures::wait_finished_for(&app, "beta", &b, secs(30)).await;
    assert_eq!((a.status, b.status), (RunStatus::Completed, RunStatus::Completed));
    let get = |token: &'static str, query: &'static str| {
        let (http, api) = (http.clone(), api.clone());
        async move {
            let r = http.get(format!("{api}/v1/usage{query}")).bearer_auth(token).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    // The worker writes its counts every 10 s.
    let by_tenant = paceline_tests::eventually("both tenants' usage written", secs(25), || async {
        let (status, v) = get("tok-op", "?group_by=tenant").await;
        (status == 200 && v["data"].as_array().is_some_and(|d| d.len() == 2)).then_some(v)
    })
    .await;
    // A day's counts expire KEEP_DAYS after the day ends: one instant, the same from every
    // worker and write (set once a day by each process, not with every write).
    let day = now_ms() / 86_400_000;
    let key = shared::keys::Keys::new(&app.prefix).usage_day(day);
    let expires: i64 = redis::cmd("PEXPIRETIME").arg(&key).query_async(&mut app.redis.conn().await).await.unwrap();
    assert_eq!(expires, ((day + 1 + shared::runs::usage::KEEP_DAYS) * 86_400_000) as i64, "{key}");
    let rows = by_tenant["data"].as_array().unwrap();
    assert_eq!((rows[0]["key"].as_str(), rows[1]["key"].as_str()), (Some("alpha"), Some("beta")));
    assert_eq!(rows[0]["calls"], 2);
    assert_eq!(rows[0]["input_tokens"], a.usage.input_tokens);
    assert_eq!(rows[0]["output_tokens"], a.usage.output_tokens);
    assert!((rows[0]["cost_usd"].as_f64().unwrap() - a.cost_usd.unwrap()).abs() < 2e-6, "{by_tenant}");
    assert_eq!(rows[1]["cost_usd"], Value::Null, "a model without a price: unknown, not 0");
    assert_eq!(by_tenant["total"]["calls"], 4);
    // A tenant sees its own.
    let (status, own) = get("tok-a", "?group_by=model").await;
    assert_eq!(status, 200, "{own}");
    let rows = own["data"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["key"], "gpt-4.1");
    // By day: today.
    let (_, days) = get("tok-op", "").await;
    assert_eq!(days["group_by"], "day");
    assert_eq!(days["data"][0]["key"], days["to"]);
    // Prometheus: tokens by kind and cost by model (what this process's worker counted).
    let metrics = http.get(format!("{api}/metrics")).bearer_auth("tok-op").send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"paceline_tokens_total{model="gpt-4.1",kind="input"}"#), "{metrics}");
    assert!(metrics.contains(r#"paceline_cost_micro_usd_total{model="gpt-4.1"}"#), "{metrics}");
    assert!(!metrics.contains(r#"paceline_cost_micro_usd_total{model="gpt-test"}"#), "no price, no cost: {metrics}");
    // The CLI prints the same rows.
    let out = tokio::process::Command::new(paceline_tests::paceline_bin())
        .args(["usage", "--group-by", "tenant", "--api", &api])
        .env("PACELINE_TOKEN", "tok-op")
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table} {}", String::from_utf8_lossy(&out.stderr));
    assert!(table.contains("alpha") && table.contains("beta") && table.contains("unknown"), "{table}");
    // Bad input names its field.
    for (query, field) in [
        ("?from=2026-13-01", "from"),
        ("?to=soon", "to"),
        ("?group_by=hour", "group_by"),
        ("?from=2026-12-05&to=2026-12-01", "from"),
        ("?from=2020-01-01&to=2026-12-01", "from"),
    ] {
        let (status, err) = get("tok-op", query).await;
        assert_eq!(status, 422, "{query}: {err}");
        assert_eq!(err["error"]["field"], field, "{query}: {err}");
    }
    app.stop_workers().await;
}
