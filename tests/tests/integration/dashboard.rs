//! The dashboard (README, "The dashboard") in headless Chromium, driven over WebDriver
//! (`chromedriver`, plain JSON over HTTP): runs submitted through the API against
//! the mock with a small budget appear and reach `completed` without a reload,
//! a run shows its transcript and live text, the budget chart draws points, the
//! operator's token lists the workers, a queued run is cancelled from its page,
//! every page fits a phone's width, and another tenant's token shows none of them. It also measures what one open page
//! costs Redis (`INFO commandstats`), and saves screenshots (to
//! `PACELINE_SCREENSHOTS_DIR` when set — README's come from
//! `PACELINE_SCREENSHOTS_DIR=docs/dashboard` —, else under the target dir).
//!
//! Skipped, with a line saying so, where `chromium` or `chromedriver` is not
//! installed (`.ci/run` installs both), so a plain `cargo test` passes anywhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mock_provider::MockConfig;
use paceline_tests::{eventually, ChildGuard};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::fixtures::{secs, App};

const ACME: &str = "tok-acme-dashboard-0123456789";
const BETA: &str = "tok-beta-dashboard-9876543210";
const OPERATOR: &str = "tok-operator-dashboard-55555";

/// The first of `names` on the `PATH`.
fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|n| std::env::split_paths(&path).map(|d| d.join(n)).find(|p| p.is_file()))
}

/// A headless Chromium session behind its own chromedriver (a process group of
/// its own: dropping it kills the driver and every browser process it started).
struct Browser {
    http: reqwest::Client,
    driver: String,
    session: String,
    _process: ChildGuard,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let group = format!("-{}", self._process.0.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
    }
}

impl Browser {
    /// Starts chromedriver on a free port and a headless session of `width`×`height`.
    async fn start(chromium: &Path, chromedriver: &Path, width: u32, height: u32) -> Self {
        let port = paceline_tests::free_tcp_port();
        let mut cmd = Command::new(chromedriver);
        cmd.arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let process = ChildGuard(cmd.spawn().expect("start chromedriver"));
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let driver = format!("http://127.0.0.1:{port}");
        eventually("chromedriver to answer", secs(20), || async {
            let r = http.get(format!("{driver}/status")).send().await.ok()?;
            let v: Value = r.json().await.ok()?;
            (v["value"]["ready"] == true).then_some(())
        })
        .await;
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--no-first-run", "--disable-extensions", format!("--window-size={width},{height}"),
                         "--force-device-scale-factor=1", "--lang=en-US"],
            },
        }}});
        let v: Value = http.post(format!("{driver}/session")).json(&caps).send().await.unwrap().json().await.unwrap();
        let session = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {v}")).to_owned();
        let browser = Self { http, driver, session, _process: process };
        browser.viewport(width, height).await;
        browser
    }

    /// Sizes the window so that the page's viewport is `width`×`height` (the
    /// window's size includes its frame).
    async fn viewport(&self, width: u32, height: u32) {
        let frame = self
            .js("return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]", json!([]))
            .await;
        let (dw, dh) = (frame[0].as_u64().unwrap_or(0), frame[1].as_u64().unwrap_or(0));
        let rect = json!({"width": width as u64 + dw, "height": height as u64 + dh});
        self.call(reqwest::Method::POST, "/window/rect", Some(rect)).await;
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.driver, self.session);
        let mut r = self.http.request(method, url);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let v: Value = r.send().await.unwrap().json().await.unwrap();
        assert!(v["value"].get("error").is_none(), "webdriver {path}: {v}");
        v["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page.
    async fn js(&self, script: &str, args: Value) -> Value {
        self.call(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": args}))).await
    }

    /// Waits until `script` returns something truthy (bounded), and returns it.
    async fn until(&self, what: &str, timeout: Duration, script: &str) -> Value {
        eventually(what, timeout, || async {
            let v = self.js(script, json!([])).await;
            let truthy = !(v.is_null() || v == false || v == 0 || v == "");
            truthy.then_some(v)
        })
        .await
    }

    async fn element(&self, css: &str) -> String {
        let v =
            self.call(reqwest::Method::POST, "/element", Some(json!({"using": "css selector", "value": css}))).await;
        v.as_object().and_then(|o| o.values().next()).and_then(Value::as_str).unwrap().to_owned()
    }

    /// Types `text` into the element `css` as a user would, then clicks `submit`.
    async fn type_and_click(&self, css: &str, text: &str, submit: &str) {
        let input = self.element(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{input}/clear"), Some(json!({}))).await;
        self.call(reqwest::Method::POST, &format!("/element/{input}/value"), Some(json!({"text": text}))).await;
        let button = self.element(submit).await;
        self.call(reqwest::Method::POST, &format!("/element/{button}/click"), Some(json!({}))).await;
    }

    async fn screenshot(&self, dir: &Path, name: &str) {
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(v.as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), png).unwrap();
    }
}

/// Standard base64 (WebDriver's screenshots), so no crate is needed for one call.
fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, c)| n | (value(*c) as u32) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// The API on `app`'s Redis and prefix: tenants `acme` and `beta`, the operator.
async fn start_api(app: &App) -> (String, oneshot::Sender<()>) {
    app.tenant_api(&[("acme", ACME), ("beta", BETA)], OPERATOR).await
}

/// Every command Redis has run since it started (`INFO commandstats`).
async fn redis_commands(app: &App) -> u64 {
    let mut conn = app.redis.conn().await;
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    info.lines().filter_map(|l| l.split_once("calls=")?.1.split(',').next()?.parse::<u64>().ok()).sum()
}

/// Redis commands per second over `span` (less the two INFO calls of the measure).
async fn commands_per_s(app: &App, span: Duration) -> f64 {
    let before = redis_commands(app).await;
    tokio::time::sleep(span).await;
    let after = redis_commands(app).await;
    (after - before).saturating_sub(2) as f64 / span.as_secs_f64()
}

#[tokio::test]
async fn the_dashboard_shows_a_tenants_runs_live_its_transcript_and_budget_and_nothing_to_another_tenant() {
    let (Some(chromium), Some(chromedriver)) =
        (which(&["chromium", "chromium-browser", "google-chrome"]), which(&["chromedriver"]))
    else {
        eprintln!("SKIPPED dashboard test: chromium or chromedriver is not installed (apt-get install chromium chromium-driver)");
        return;
    };
    let shots = std::env::var_os("PACELINE_SCREENSHOTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard"));

    // A small budget (600 tokens per 10 s), answers that pause mid-way (live text to see).
    let mut app = App::start(MockConfig {
        tpm: 600,
        window: secs(10),
        tool_rounds: 1,
        output_tokens: 24,
        latency: Duration::from_millis(150),
        stall: Duration::from_millis(700),
        ..MockConfig::default()
    })
    .await;
    let (api, _stop_api) = start_api(&app).await;
    let mut config = app.config();
    config.slots.concurrency = 4;
    app.spawn_worker(config);
    let http = reqwest::Client::new();

    let browser = Browser::start(&chromium, &chromedriver, 1280, 800).await;
    browser.goto(&format!("{api}/#/runs")).await;
    // The API answers 401: the page asks for a token.
    browser.until("the token form", secs(10), "return !document.querySelector('#login').hidden").await;
    browser.type_and_click("#token-input", ACME, "#token-submit").await;
    browser
        .until(
            "an empty run list",
            secs(10),
            "return document.querySelector('#runs-note').textContent.includes('No runs')",
        )
        .await;
    // A mark in the page: still there at the end means the page never reloaded.
    browser.js("window.__sameLoad = 'yes'", json!([])).await;

    let spec = json!({
        "model": "gpt-test", "input": "do the task", "max_turns": 6, "max_output_tokens": 100,
        "tools": [{"type": "function", "name": "search", "description": "a tool",
                   "parameters": {"type": "object", "properties": {}}}],
        "tool_endpoint": app.tools, "metadata": {"batch": "dashboard"},
    });
    let mut ids = vec![];
    for _ in 0..5 {
        let r = http.post(format!("{api}/v1/runs")).bearer_auth(ACME).json(&spec).send().await.unwrap();
        assert_eq!(r.status(), 202);
        ids.push(r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned());
    }

    // They appear without a reload; a waiting run shows its countdown.
    browser.until("five rows", secs(10), "return document.querySelectorAll('#runs-table tbody tr').length === 5").await;
    browser
        .until(
            "a wait countdown",
            secs(30),
            "return document.querySelector('#runs-table tr[data-status=\"waiting\"] .countdown') !== null",
        )
        .await;
    browser.screenshot(&shots, "runs.png").await;

    // A run still going: its live text arrives from the event stream, then its transcript.
    let open = browser
        .js(
            "const r = document.querySelector('#runs-table tr:not([data-status=\"completed\"])');
             return r ? r.dataset.id : null",
            json!([]),
        )
        .await;
    let id = open.as_str().map(str::to_owned).unwrap_or_else(|| ids[0].clone());
    browser.js("location.hash = '#/run/' + arguments[0]", json!([id])).await;
    browser.until("live text", secs(40), "return document.querySelector('#live-text').textContent.trim()").await;
    browser
        .until(
            "the run to complete",
            secs(60),
            "return document.querySelector('#run-facts .status').textContent.includes('completed')",
        )
        .await;
    let transcript = browser
        .until(
            "the transcript",
            secs(10),
            "const t = document.querySelector('#transcript'); return t.querySelectorAll('.item').length >= 4 && t.textContent",
        )
        .await;
    let transcript = transcript.as_str().unwrap();
    assert!(transcript.contains("tool call") && transcript.contains("search"), "{transcript}");
    assert!(transcript.contains("do the task"), "{transcript}");
    browser.screenshot(&shots, "run.png").await;

    // Back to the list: every run reaches completed, still the same page load.
    browser.js("location.hash = '#/runs'", json!([])).await;
    browser
        .until(
            "five completed runs",
            secs(90),
            "const rows = [...document.querySelectorAll('#runs-table tbody tr')];
             return rows.length === 5 && rows.every(r => r.dataset.status === 'completed')",
        )
        .await;
    let texts = browser.js("return document.querySelector('#runs-table tbody').textContent", json!([])).await;
    assert!(texts.as_str().unwrap().contains("✓ completed"), "statuses are words: {texts}");

    // The budget: levels and a chart whose points show the admitted tokens.
    browser.js("location.hash = '#/budget'", json!([])).await;
    let drawn = browser
        .until(
            "the budget chart",
            secs(20),
            "const c = window.pacelineCharts && [...window.pacelineCharts.values()][0];
             const box = document.querySelector('.chart');
             return c && box && Number(box.dataset.admitted) > 0 && [c.data[0].length, Number(box.dataset.admitted)]",
        )
        .await;
    assert_eq!(drawn[0], 900, "15 minutes, one point a second: {drawn}");
    let card = browser.js("return document.querySelector('#budgets').textContent", json!([])).await;
    let card = card.as_str().unwrap();
    assert!(card.contains("default · gpt-test") && card.contains("600"), "{card}");
    // The tenant's day: its answered calls, as the workers counted them
    // (written every 10 s); `gpt-test` has no price, so its cost is unknown, not 0.
    let spend = browser
        .until(
            "acme's spend today",
            secs(30),
            "const r = document.querySelector('#spend-table tbody tr[data-tenant=\"acme\"]');
             return r && Number(r.children[1].textContent.replace(/,/g, '')) >= 10 && r.textContent",
        )
        .await;
    assert!(spend.as_str().unwrap().contains("unknown"), "a model without a price costs unknown: {spend}");
    browser.screenshot(&shots, "budget.png").await;

    // The fleet: a tenant's own counts; workers need the operator's token.
    browser.js("location.hash = '#/fleet'", json!([])).await;
    browser
        .until(
            "the workers note",
            secs(10),
            "return document.querySelector('#workers-note').textContent.includes('Operator token needed')",
        )
        .await;
    assert_eq!(browser.js("return window.__sameLoad", json!([])).await, "yes", "the page never reloaded");
    // The operator's token reads the live workers.
    browser.js("document.querySelector('#change-token').click()", json!([])).await;
    browser.type_and_click("#token-input", OPERATOR, "#token-submit").await;
    browser
        .until(
            "the operator's worker list",
            secs(10),
            "return document.querySelectorAll('#workers-table tbody tr').length === 1
                && document.querySelector('#queue-facts').textContent.includes('the whole queue')",
        )
        .await;
    browser.screenshot(&shots, "fleet.png").await;
    browser.js("document.querySelector('#change-token').click()", json!([])).await;
    browser.type_and_click("#token-input", ACME, "#token-submit").await;

    // At a phone's width every page fits: nothing wider than the screen but the tables' own scroll boxes.
    browser.viewport(390, 844).await;
    for page in ["#/runs", "#/budget", "#/fleet", &format!("#/run/{id}")] {
        browser.js("location.hash = arguments[0]", json!([page])).await;
        let fits = browser
            .until(
                &format!("{page} at phone width"),
                secs(10),
                "return window.innerWidth <= 400 && document.querySelector('.page:not([hidden]) h1') !== null
                    && document.documentElement.scrollWidth <= window.innerWidth + 1 && 'fits'",
            )
            .await;
        assert_eq!(fits, "fits", "{page}");
    }
    browser.viewport(1280, 800).await;

    // What one open page costs Redis, with the workers stopped (nothing else runs).
    app.stop_workers().await;
    browser.js("location.hash = '#/runs'", json!([])).await;
    let runs_page = commands_per_s(&app, secs(10)).await;
    browser.js("location.hash = '#/budget'", json!([])).await;
    let budget_page = commands_per_s(&app, secs(10)).await;
    browser.goto("about:blank").await;
    let closed = commands_per_s(&app, secs(5)).await;
    // One GET /v1/runs and one GET /v1/pacer a second: the bar the dashboard must stay under.
    let before = redis_commands(&app).await;
    http.get(format!("{api}/v1/runs")).bearer_auth(ACME).send().await.unwrap();
    http.get(format!("{api}/v1/pacer")).bearer_auth(ACME).send().await.unwrap();
    let yardstick = (redis_commands(&app).await - before).saturating_sub(1) as f64;
    eprintln!(
        "dashboard cost: Runs page {runs_page:.1} Redis commands/s, Budget page {budget_page:.1}/s, \
         page closed {closed:.1}/s; one GET /v1/runs + one GET /v1/pacer = {yardstick} commands"
    );
    assert!(runs_page - closed <= yardstick && budget_page - closed <= yardstick, "over the yardstick");

    // Cancel from the run page: a run queued while no worker runs.
    let r = http.post(format!("{api}/v1/runs")).bearer_auth(ACME).json(&spec).send().await.unwrap();
    let queued = r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    browser.goto(&format!("{api}/#/run/{queued}")).await;
    browser
        .until(
            "the queued run",
            secs(10),
            "return document.querySelector('#run-facts .status')?.textContent.includes('queued')",
        )
        .await;
    let cancel = browser.element("#run-cancel").await;
    browser.call(reqwest::Method::POST, &format!("/element/{cancel}/click"), Some(json!({}))).await;
    browser
        .until(
            "the run cancelled",
            secs(10),
            "return document.querySelector('#run-facts .status').textContent.includes('cancelled')
                && document.querySelector('#run-cancel').disabled && document.querySelector('#run-retry').disabled",
        )
        .await;
    ids.push(queued);

    // A dead turn on the fleet page (operator): its run is listed with the
    // reason, and Retry re-drives it (the row goes, the run is queued again).
    let r = http.post(format!("{api}/v1/runs")).bearer_auth(ACME).json(&spec).send().await.unwrap();
    let dead = r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let queue = shared::runs::run_queue(
        &shared::config::RedisArgs::new(app.redis.url(), app.prefix.clone()),
        shared::queue::QueueConfig::default(),
    )
    .unwrap();
    let lease = queue.fetch("dashboard-test", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, dead);
    queue.dead(&lease, "buried by the dashboard test").await.unwrap();
    browser.goto(&format!("{api}/#/fleet")).await;
    browser.until("the page", secs(10), "return document.querySelector('#change-token') !== null").await;
    browser.js("document.querySelector('#change-token').click()", json!([])).await;
    browser.type_and_click("#token-input", OPERATOR, "#token-submit").await;
    browser
        .until(
            "the dead turn listed",
            secs(10),
            &format!(
                "const rows = document.querySelectorAll('#dead-table tbody tr');
                 return rows.length === 1 && rows[0].textContent.includes('{dead}')
                    && rows[0].textContent.includes('buried by the dashboard test')
                    && rows[0].textContent.includes('acme')"
            ),
        )
        .await;
    browser.screenshot(&shots, "dead.png").await;
    let retry = browser.element("#dead-table tbody button").await;
    browser.call(reqwest::Method::POST, &format!("/element/{retry}/click"), Some(json!({}))).await;
    browser
        .until(
            "the dead turn retried",
            secs(10),
            "return document.querySelector('#dead-note').textContent.includes('No dead turns')
                && document.querySelectorAll('#dead-table tbody tr').length === 0",
        )
        .await;
    let run = http.get(format!("{api}/v1/runs/{dead}")).bearer_auth(ACME).send().await.unwrap();
    assert_eq!(run.json::<Value>().await.unwrap()["status"], "queued", "retried from the dashboard");
    ids.push(dead);

    // Another tenant's token sees none of acme's runs, nor its budget line.
    browser.goto(&format!("{api}/#/runs")).await;
    browser.until("the page", secs(10), "return document.querySelector('#change-token') !== null").await;
    browser.js("document.querySelector('#change-token').click()", json!([])).await;
    browser.type_and_click("#token-input", BETA, "#token-submit").await;
    browser
        .until(
            "beta's empty list",
            secs(10),
            "return document.querySelector('#runs-note').textContent.includes('No runs')
                && document.querySelectorAll('#runs-table tbody tr').length === 0",
        )
        .await;
    browser.js("location.hash = '#/budget'", json!([])).await;
    browser
        .until(
            "beta's empty budget page",
            secs(10),
            "return document.querySelector('#budget-note').textContent.includes('No budget')
                && document.querySelector('#spend-note').textContent.includes('No calls')
                && document.querySelectorAll('#spend-table tbody tr').length === 0",
        )
        .await;
    browser.js("location.hash = '#/run/' + arguments[0]", json!([ids[0]])).await;
    browser
        .until(
            "acme's run refused to beta",
            secs(10),
            "return document.querySelector('#error').textContent.includes('No run')
                && document.querySelectorAll('#transcript .item').length === 0",
        )
        .await;
    browser.js("location.hash = '#/runs'", json!([])).await;
    browser
        .until(
            "beta's list again",
            secs(10),
            "return document.querySelector('#runs-note').textContent.includes('No runs')",
        )
        .await;
    // (The run page keeps the id beta asked for; what the API gave is in the other pages.)
    let seen = browser
        .js(
            "return ['#page-runs', '#page-budget', '#page-fleet', '#transcript', '#run-facts']
                .map(s => document.querySelector(s).textContent).join(' ')",
            json!([]),
        )
        .await;
    for id in &ids {
        assert!(!seen.as_str().unwrap().contains(id.as_str()), "beta sees {id}");
    }
    let started = Instant::now();
    browser.call(reqwest::Method::DELETE, "", None).await;
    assert!(started.elapsed() < secs(20));
    eprintln!("dashboard screenshots in {}", shots.display());
}
