//! The mock provider, driven like a client would drive OpenAI: a plain reqwest
//! client, a tiny SSE parser, and the stats log as the witness that the
//! buckets never let more through than they are configured to.

use futures::StreamExt;
use mock_provider::{BucketMode, ChargeMode, Fault, HeaderStyle, LimitsMode, MockConfig, MockServer, Stats};
use paceline_tests::{eventually, paceline_bin, within, ChildGuard};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

// ------------------------------------------------------------------ helpers

async fn start(config: MockConfig) -> MockServer {
    MockServer::start(config).await.expect("start the mock provider")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

async fn post(server: &MockServer, path: &str, body: &Value) -> reqwest::Response {
    within(
        "a mock provider answer",
        Duration::from_secs(10),
        client().post(format!("{}{path}", server.base_url())).json(body).send(),
    )
    .await
    .expect("send")
}

/// The answer's status, `x-ratelimit-*`/`retry-after*` headers, and JSON body.
async fn post_json(server: &MockServer, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let resp = post(server, path, body).await;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = within("a JSON body", Duration::from_secs(10), resp.json::<Value>()).await.expect("json");
    (status, headers, body)
}

fn header<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    headers.get(name).unwrap_or_else(|| panic!("no {name} header")).to_str().unwrap()
}

fn header_u64(headers: &reqwest::header::HeaderMap, name: &str) -> u64 {
    header(headers, name).parse().unwrap_or_else(|_| panic!("{name} is not a number"))
}

/// Parses a Go-style duration (`1h2m3.5s`, `13ms`, `0s`) into milliseconds.
fn go_ms(s: &str) -> f64 {
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().unwrap();
    }
    let (mut total, mut num) = (0.0, String::new());
    for c in s.chars() {
        let unit = match c {
            'h' => 3_600_000.0,
            'm' => 60_000.0,
            's' => 1000.0,
            _ => {
                num.push(c);
                continue;
            }
        };
        total += num.parse::<f64>().unwrap_or_else(|_| panic!("bad duration {s}")) * unit;
        num.clear();
    }
    total
}

/// One server-sent event, with the time it arrived.
#[derive(Debug, Clone)]
struct Sse {
    event: Option<String>,
    data: String,
    at: Instant,
}

impl Sse {
    fn json(&self) -> Value {
        serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("frame is not JSON ({e}): {}", self.data))
    }
}

/// A tiny SSE parser: frames end with a blank line; `event:` and `data:` lines
/// (several `data:` lines join with newlines); comments and other fields are skipped.
async fn read_sse(resp: reqwest::Response) -> Vec<Sse> {
    assert!(header(resp.headers(), "content-type").starts_with("text/event-stream"), "not an event stream");
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut events = Vec::new();
    within("the end of the stream", Duration::from_secs(10), async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("stream chunk");
            let at = Instant::now();
            buf.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let (mut event, mut data) = (None, Vec::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = Some(v.trim_start().to_string());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                    }
                }
                if event.is_some() || !data.is_empty() {
                    events.push(Sse { event, data: data.join("\n"), at });
                }
            }
        }
    })
    .await;
    assert!(buf.trim().is_empty(), "stream ended inside a frame: {buf:?}");
    events
}

fn tool(name: &str) -> Value {
    json!({"type": "function", "name": name, "description": "look something up",
           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                          "required": ["query"]}})
}

fn chat_tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "description": "look something up",
           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}})
}

/// One of the mock's buckets, as the stats log describes what it took.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// The one token bucket (input + output limit, refunds given back).
    Tokens,
    /// The Anthropic shape's input bucket (input tokens, never given back).
    Input,
    /// The Anthropic shape's output bucket (output limit, refunds given back).
    Output,
    /// The request bucket (one per admitted request).
    Requests,
}

/// What `part` took (+) and got back (-) over time, from the log.
fn ledger(stats: &Stats, part: Part) -> Vec<(u64, i128)> {
    let mut ledger = Vec::new();
    for e in stats.log.iter().filter(|e| e.status == 200) {
        let (taken, refunded) = match part {
            Part::Tokens => (e.charged, e.refunded),
            Part::Input => (e.charged_input, 0),
            Part::Output => (e.charged - e.charged_input, e.refunded),
            Part::Requests => (1, 0),
        };
        ledger.push((e.at_us, taken as i128));
        if let (Some(at), true) = (e.refunded_at_us, refunded > 0) {
            ledger.push((at, -(refunded as i128)));
        }
    }
    ledger.sort_by_key(|(t, _)| *t);
    ledger
}

/// Walks every bucket's log like a ledger (+charged at admission, -refunded
/// at the refund) and checks every span [t1, t2]: what the bucket let through
/// is at most its capacity plus what it refilled in the span.
fn assert_no_span_overdraws(stats: &Stats) {
    let b = &stats.buckets;
    let mut parts = vec![(Part::Requests, &b.requests)];
    match (&b.input, &b.output) {
        (Some(input), Some(output)) => parts.extend([(Part::Input, input), (Part::Output, output)]),
        _ => parts.push((Part::Tokens, &b.tokens)),
    }
    for (part, view) in parts {
        let ledger = ledger(stats, part);
        assert!(!ledger.is_empty());
        assert_bucket_held(view, &ledger, part);
    }
}

fn assert_bucket_held(view: &mock_provider::stats::BucketView, ledger: &[(u64, i128)], part: Part) {
    let (cap, win) = (view.limit as i128, view.window_us as i128);
    for i in 0..ledger.len() {
        // A span starts with all the events at its first instant.
        if i > 0 && ledger[i - 1].0 == ledger[i].0 {
            continue;
        }
        let mut sum = 0i128;
        for j in i..ledger.len() {
            sum += ledger[j].1;
            if j + 1 < ledger.len() && ledger[j + 1].0 == ledger[j].0 {
                continue;
            }
            let (t1, t2) = (ledger[i].0 as i128, ledger[j].0 as i128);
            let allowed = match view.mode {
                BucketMode::Continuous => cap * win + cap * (t2 - t1),
                BucketMode::Window => cap * (1 + t2 / win - t1 / win) * win,
            };
            assert!(
                sum * win <= allowed,
                "{part:?}: span {t1}..{t2} µs let {sum} through; the bucket allows {}",
                allowed / win
            );
        }
    }
}

/// The names of the rate-limit and retry headers of an answer.
fn rate_header_names(headers: &reqwest::header::HeaderMap) -> BTreeSet<String> {
    headers
        .keys()
        .map(|k| k.as_str().to_string())
        .filter(|k| ["x-ratelimit-", "anthropic-", "retry-after", "x-ms-"].iter().any(|p| k.starts_with(p)))
        .collect()
}

/// The rate-limit and retry headers `style` sends: on every answer, plus the
/// retry headers on a 429 that asks for a wait.
fn expected_headers(style: HeaderStyle, limits: LimitsMode, wait: bool) -> BTreeSet<String> {
    let mut names: Vec<String> = Vec::new();
    if limits == LimitsMode::Enforced {
        match style {
            HeaderStyle::OpenAi => {
                for kind in ["limit", "remaining", "reset"] {
                    for unit in ["requests", "tokens"] {
                        names.push(format!("x-ratelimit-{kind}-{unit}"));
                    }
                }
            }
            HeaderStyle::Anthropic => {
                for family in ["requests", "input-tokens", "output-tokens", "tokens"] {
                    for kind in ["limit", "remaining", "reset"] {
                        names.push(format!("anthropic-ratelimit-{family}-{kind}"));
                    }
                }
            }
            HeaderStyle::Azure => {
                names.extend(["x-ratelimit-remaining-requests".into(), "x-ratelimit-remaining-tokens".into()]);
            }
            HeaderStyle::None => {}
        }
    }
    if wait {
        match style {
            HeaderStyle::OpenAi | HeaderStyle::Azure => names.extend(["retry-after".into(), "retry-after-ms".into()]),
            HeaderStyle::Anthropic => names.push("retry-after".into()),
            HeaderStyle::None => {}
        }
    }
    names.into_iter().collect()
}

/// The delay a rate-limit 429 asks for, where `style` puts it: `retry-after-ms`,
/// `retry-after` (whole seconds), or the body's `RetryInfo` detail.
fn advertised_delay(style: HeaderStyle, headers: &reqwest::header::HeaderMap, body: &Value) -> Duration {
    match style {
        HeaderStyle::OpenAi | HeaderStyle::Azure => Duration::from_millis(header_u64(headers, "retry-after-ms")),
        HeaderStyle::Anthropic => Duration::from_secs(header_u64(headers, "retry-after")),
        HeaderStyle::None => {
            let delay = body["error"]["details"][0]["retryDelay"].as_str().expect("a RetryInfo detail");
            Duration::from_secs_f64(delay.strip_suffix('s').expect("an s suffix").parse().expect("seconds"))
        }
    }
}

// ------------------------------------------------------------------ buckets

/// 200 clients that retry on 429 after the server's retry-after, for 1.5 s
/// against a 3000-tokens-per-second bucket.
async fn hammer(bucket: BucketMode) {
    let server = start(MockConfig {
        tpm: 3000,
        rpm: 1_000_000,
        window: Duration::from_secs(1),
        bucket,
        output_tokens: 20,
        ..MockConfig::default()
    })
    .await;
    let url = format!("{}/responses", server.base_url());
    let client = client();
    let deadline = Instant::now() + Duration::from_millis(1500);
    let tasks = (0..200u64).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            // 40 chars of input = 10 tokens; charged 10 + 100 at admission.
            let body = json!({"model": "gpt-test", "input": "x".repeat(40), "max_output_tokens": 100});
            loop {
                let resp = client.post(&url).json(&body).send().await.expect("send");
                let status = resp.status().as_u16();
                let wait = resp.headers().get("retry-after-ms").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                let _ = resp.bytes().await;
                match status {
                    200 => return true,
                    429 if Instant::now() < deadline => {
                        let wait = wait.expect("a 429 carries retry-after-ms").min(300) + i % 20;
                        tokio::time::sleep(Duration::from_millis(wait)).await;
                    }
                    429 => return false,
                    other => panic!("unexpected status {other}"),
                }
            }
        })
    });
    let results = within("200 clients", Duration::from_secs(15), futures::future::join_all(tasks)).await;
    let admitted = results.into_iter().filter(|r| *r.as_ref().unwrap()).count() as u64;
    let stats = server.stats();
    assert_eq!(stats.largest_overdraft, 0);
    assert_eq!(stats.ok, admitted);
    assert!(admitted >= 3000 / 110, "only {admitted} admitted: the bucket let too little through");
    assert!(stats.rate_limited > 0, "200 clients never hit the limit");
    assert_eq!(stats.requests, stats.ok + stats.rate_limited);
    assert_eq!(stats.tokens_admitted, admitted * (10 + 20), "usage is input + output");
    assert_no_span_overdraws(&stats);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_clients_never_get_more_than_a_continuous_bucket_allows() {
    hammer(BucketMode::Continuous).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_clients_never_get_more_than_a_window_bucket_allows() {
    hammer(BucketMode::Window).await;
}

#[tokio::test]
async fn headers_agree_with_the_bucket() {
    // A 10-minute fixed window: nothing refills during the test, so every number is exact.
    let server = start(MockConfig {
        tpm: 10_000,
        rpm: 50,
        window: Duration::from_secs(600),
        bucket: BucketMode::Window,
        output_tokens: 20,
        ..MockConfig::default()
    })
    .await;
    let body = json!({"model": "gpt-test", "input": "y".repeat(400), "max_output_tokens": 100});
    let (status, h, first) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 200);
    let input = first["usage"]["input_tokens"].as_u64().unwrap();
    assert_eq!(input, 100);
    assert_eq!(first["usage"]["output_tokens"], 20);
    assert_eq!(first["usage"]["total_tokens"], 120);
    assert_eq!(header_u64(&h, "x-ratelimit-limit-tokens"), 10_000);
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-tokens"), 10_000 - 200, "charged input + max_output_tokens");
    assert_eq!(header_u64(&h, "x-ratelimit-limit-requests"), 50);
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-requests"), 49);
    let reset = go_ms(header(&h, "x-ratelimit-reset-tokens"));
    assert!((590_000.0..=600_000.0).contains(&reset), "reset {reset} ms is not the window's end");
    let shape = header(&h, "x-ratelimit-reset-tokens");
    assert!(shape.starts_with("9m5") || shape == "10m0s", "Go shape: {shape}");
    assert_eq!(header(&h, "x-ratelimit-reset-requests"), header(&h, "x-ratelimit-reset-tokens"));

    // The unused 80 output tokens came back after the first answer.
    let (_, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-tokens"), 10_000 - 120 - 200);
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-requests"), 48);
    let stats = server.stats();
    assert_eq!(stats.buckets.tokens.remaining, 10_000 - 240);
    assert_eq!(stats.tokens_admitted, 240);
    assert_eq!(stats.tokens_charged, 400);
    assert_eq!(stats.tokens_refunded, 160);
}

#[tokio::test]
async fn a_keep_charge_provider_never_gives_the_output_reservation_back() {
    let server = start(MockConfig {
        tpm: 10_000,
        window: Duration::from_secs(600),
        bucket: BucketMode::Window,
        output_tokens: 20,
        charge: mock_provider::ChargeMode::Keep,
        ..MockConfig::default()
    })
    .await;
    let body = json!({"model": "gpt-test", "input": "y".repeat(400), "max_output_tokens": 100});
    for _ in 0..2 {
        let (status, _, answer) = post_json(&server, "/responses", &body).await;
        assert_eq!(status, 200);
        assert_eq!(answer["usage"]["total_tokens"], 120, "usage is what was used, whatever was charged");
    }
    let (_, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-tokens"), 10_000 - 3 * 200, "input + max_output, kept");
    let stats = server.stats();
    assert_eq!((stats.tokens_charged, stats.tokens_refunded, stats.tokens_admitted), (600, 0, 600));
    assert_eq!(stats.largest_overdraft, 0);
}

#[tokio::test]
async fn a_continuous_bucket_reports_the_time_until_full() {
    // 100 tokens per second.
    let server = start(MockConfig { tpm: 6000, window: Duration::from_secs(60), ..MockConfig::default() }).await;
    let body = json!({"model": "gpt-test", "input": "z".repeat(400), "max_output_tokens": 400});
    let (status, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 200);
    let remaining = header_u64(&h, "x-ratelimit-remaining-tokens");
    assert!((5500..5510).contains(&remaining), "remaining {remaining}");
    let reset = go_ms(header(&h, "x-ratelimit-reset-tokens"));
    let missing = (6000 - remaining) as f64;
    assert!(
        reset > (missing - 1.0) * 10.0 && reset <= missing * 10.0 + 1.0,
        "reset {reset} ms for {missing} missing tokens at 100/s"
    );
}

#[tokio::test]
async fn over_the_limit_answers_429_like_openai() {
    // A fixed minute and answers longer than any limit asked for: no refill
    // and no refund during the test, so every number is exact.
    let server = start(MockConfig {
        tpm: 500,
        rpm: 3,
        window: Duration::from_secs(60),
        bucket: BucketMode::Window,
        output_tokens: 1000,
        ..MockConfig::default()
    })
    .await;

    // Too large: more than the whole limit, no wait helps, no retry-after.
    let too_large = json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 1000});
    let (status, h, body) = post_json(&server, "/responses", &too_large).await;
    assert_eq!(status, 429);
    assert!(h.get("retry-after").is_none());
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["type"], "tokens");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Request too large for gpt-test in organization org-mock on tokens per min (TPM): Limit 500, Requested 1001."),
        "{msg}"
    );

    // Tokens: 451 taken, then 51 + 10 more do not fit in the 49 left.
    let big = json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 450});
    assert_eq!(post_json(&server, "/responses", &big).await.0, 200);
    let chat =
        json!({"model": "gpt-test", "messages": [{"role": "user", "content": "a".repeat(200)}], "max_tokens": 10});
    let (status, h, body) = post_json(&server, "/chat/completions", &chat).await;
    assert_eq!(status, 429);
    assert_eq!(body["error"]["type"], "tokens");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert!(body["error"]["param"].is_null());
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Rate limit reached for gpt-test in organization org-mock on tokens per min (TPM): Limit 500, Used 451, Requested 61. Please try again in "),
        "{msg}"
    );
    let retry_ms = header_u64(&h, "retry-after-ms");
    assert!(retry_ms > 50_000 && retry_ms <= 60_000, "the window ends within a minute: {retry_ms}");
    assert_eq!(header_u64(&h, "retry-after"), retry_ms.div_ceil(1000));
    let hint = msg.split("try again in ").nth(1).unwrap().split(". ").next().unwrap();
    assert!((go_ms(hint) - retry_ms as f64).abs() <= 1.0, "hint {hint} vs {retry_ms} ms");
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-tokens"), 49, "a 429 carries the headers too");
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-requests"), 2, "a refused request takes no request slot");

    // Requests: one admitted so far; two more fit, the next does not.
    let small = json!({"model": "gpt-test", "input": "hi", "max_output_tokens": 10});
    assert_eq!(post_json(&server, "/responses", &small).await.0, 200);
    assert_eq!(post_json(&server, "/responses", &small).await.0, 200);
    let (status, h, body) = post_json(&server, "/responses", &small).await;
    assert_eq!(status, 429);
    assert_eq!(body["error"]["type"], "requests");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in "), "{msg}");
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-requests"), 0);
    assert!(header_u64(&h, "retry-after") > 0);

    let stats = server.stats();
    assert_eq!(stats.rate_limited_by_code["rate_limit_exceeded"], 3);
    assert_eq!(stats.largest_overdraft, 0);
}

#[tokio::test]
async fn a_retry_after_the_given_delay_is_admitted() {
    // 1000 tokens per second, continuous.
    // An answer longer than the limit asked for: nothing is refunded.
    let server =
        start(MockConfig { tpm: 1000, window: Duration::from_secs(1), output_tokens: 1000, ..MockConfig::default() })
            .await;
    let body = json!({"model": "gpt-test", "input": "x", "max_output_tokens": 700});
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
    let (status, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 429);
    let wait = header_u64(&h, "retry-after-ms");
    assert!(wait > 0 && wait <= 1000, "{wait}");
    tokio::time::sleep(Duration::from_millis(wait)).await;
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200, "the retry-after was honest");
}

// ------------------------------------------------------------------ provider shapes

/// 40 clients for 1.3 s (across a window boundary) against a 3000-tokens-per-second bucket of `config`'s
/// shape: both endpoints, streamed and not, inputs of 1 to 120 tokens, output
/// limits of 10 to 150 (or none), each retrying a 429 soon after the delay
/// its shape advertised. Every answer must carry exactly its shape's headers.
async fn crowd(config: MockConfig) -> Stats {
    let (style, limits) = (config.headers, config.limits);
    // Anthropic's input bucket is cut to about the output bucket's default
    // (a fifth of --tpm), so that both buckets bind in turn.
    let server = start(MockConfig {
        tpm: 3000,
        itpm: Some(700),
        rpm: 400,
        window: Duration::from_secs(1),
        output_tokens: 30,
        ..config
    })
    .await;
    let base = server.base_url();
    let client = client();
    let deadline = Instant::now() + Duration::from_millis(1300);
    let tasks = (0..40u64).map(|i| {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let mut dice = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            while Instant::now() < deadline {
                dice ^= dice << 13;
                dice ^= dice >> 7;
                dice ^= dice << 17;
                let text = "w".repeat(4 * (1 + dice as usize % 120));
                let max_out = (dice % 5 != 0).then_some(10 + (dice >> 8) % 141);
                let stream = dice >> 16 & 1 == 1;
                let (path, body) = if dice >> 17 & 1 == 1 {
                    let mut b = json!({"model": "m", "input": text, "stream": stream});
                    if let Some(n) = max_out {
                        b["max_output_tokens"] = json!(n);
                    }
                    ("responses", b)
                } else {
                    let mut b =
                        json!({"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream});
                    if let Some(n) = max_out {
                        b["max_tokens"] = json!(n);
                    }
                    ("chat/completions", b)
                };
                let resp = client.post(format!("{base}/{path}")).json(&body).send().await.expect("send");
                let status = resp.status().as_u16();
                let headers = resp.headers().clone();
                let bytes = resp.bytes().await.expect("the whole answer");
                assert_eq!(rate_header_names(&headers), expected_headers(style, limits, status == 429), "{status}");
                match status {
                    200 => {}
                    429 => {
                        let body: Value = serde_json::from_slice(&bytes).expect("a JSON error");
                        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
                        let wait = advertised_delay(style, &headers, &body);
                        assert!(wait > Duration::ZERO);
                        tokio::time::sleep(wait.min(Duration::from_millis(50)) + Duration::from_millis(i % 7)).await;
                    }
                    other => panic!("unexpected status {other}"),
                }
            }
        })
    });
    for task in within("40 clients", Duration::from_secs(20), futures::future::join_all(tasks)).await {
        task.expect("a client panicked");
    }
    // A stream's refund comes just after its last frame: wait for them all.
    let stats = eventually("the last refunds", Duration::from_secs(5), || async {
        let stats = server.stats();
        stats.log.iter().all(|e| e.status != 200 || e.refunded_at_us.is_some()).then_some(stats)
    })
    .await;
    server.shutdown().await;
    stats
}

/// What every crowd must show, whatever the shape.
fn assert_the_crowd_was_served_honestly(stats: &Stats, label: &str) {
    assert_eq!(stats.largest_overdraft, 0, "{label}");
    assert!(stats.ok >= 5, "{label}: only {} admitted", stats.ok);
    assert_eq!(stats.requests, stats.ok + stats.rate_limited, "{label}");
    // The counters agree with the log they summarise.
    let admitted: Vec<_> = stats.log.iter().filter(|e| e.status == 200).collect();
    let input: u64 = admitted.iter().map(|e| e.charged_input).sum();
    let output: u64 = admitted.iter().map(|e| e.charged - e.charged_input - e.refunded).sum();
    assert_eq!((stats.input_tokens_admitted, stats.output_tokens_admitted), (input, output), "{label}");
    assert_eq!(stats.tokens_admitted, input + output, "{label}");
}

/// Every bucket mode and charge mode of one header style under a crowd.
async fn a_crowd_never_overdraws(style: HeaderStyle) {
    let mut shapes = Vec::new();
    for bucket in [BucketMode::Continuous, BucketMode::Window] {
        for charge in [ChargeMode::Refund, ChargeMode::Keep] {
            shapes.push(MockConfig { headers: style, bucket, charge, ..MockConfig::default() });
        }
    }
    let labels: Vec<String> = shapes.iter().map(|c| format!("{style} {} {}", c.bucket, c.charge)).collect();
    let crowds = futures::future::join_all(shapes.into_iter().map(crowd)).await;
    for (stats, label) in crowds.iter().zip(&labels) {
        assert_the_crowd_was_served_honestly(stats, label);
        assert!(stats.rate_limited > 0, "{label}: 40 clients never hit the limit");
        assert_no_span_overdraws(stats);
        assert_eq!(stats.buckets.headers, style);
        assert_eq!(stats.buckets.input.is_some(), style == HeaderStyle::Anthropic, "{label}");
        if label.ends_with("keep") {
            assert_eq!(stats.tokens_refunded, 0, "{label}");
        } else {
            assert!(stats.tokens_refunded > 0, "{label}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_never_overdraws_the_openai_shape() {
    a_crowd_never_overdraws(HeaderStyle::OpenAi).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_never_overdraws_the_anthropic_shape() {
    a_crowd_never_overdraws(HeaderStyle::Anthropic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_never_overdraws_the_azure_shape() {
    a_crowd_never_overdraws(HeaderStyle::Azure).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_never_overdraws_the_headerless_shape() {
    a_crowd_never_overdraws(HeaderStyle::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_is_all_admitted_without_limits() {
    for style in [HeaderStyle::OpenAi, HeaderStyle::Anthropic] {
        let stats = crowd(MockConfig { headers: style, limits: LimitsMode::None, ..MockConfig::default() }).await;
        let label = format!("{style} without limits");
        assert_the_crowd_was_served_honestly(&stats, &label);
        assert_eq!(stats.rate_limited, 0, "{label}");
        assert_eq!(stats.buckets.limits, LimitsMode::None);
        assert_eq!(stats.buckets.tokens.limit, 0, "{label}: no bucket");
    }
}

/// A 60 s fixed window with one request per window: the second request is
/// refused on the request bucket, whatever the token buckets say.
fn one_request_per_minute(headers: HeaderStyle) -> MockConfig {
    MockConfig {
        headers,
        rpm: 1,
        tpm: 1000,
        window: Duration::from_secs(60),
        bucket: BucketMode::Window,
        output_tokens: 20,
        ..MockConfig::default()
    }
}

#[tokio::test]
async fn each_header_style_sends_exactly_its_headers() {
    for style in [HeaderStyle::OpenAi, HeaderStyle::Anthropic, HeaderStyle::Azure, HeaderStyle::None] {
        let server = start(one_request_per_minute(style)).await;
        let body = json!({"model": "m", "input": "x", "max_output_tokens": 100});
        let (status, h, _) = post_json(&server, "/responses", &body).await;
        assert_eq!(status, 200);
        assert_eq!(rate_header_names(&h), expected_headers(style, LimitsMode::Enforced, false), "{style} 200");
        let (status, h, body) = post_json(&server, "/responses", &body).await;
        assert_eq!((status, body["error"]["type"].as_str()), (429, Some("requests")));
        assert_eq!(rate_header_names(&h), expected_headers(style, LimitsMode::Enforced, true), "{style} 429");
        assert_eq!(server.stats().buckets.headers, style);
    }
}

/// Parses an Anthropic reset: RFC 3339, UTC, exactly millisecond precision.
fn rfc3339(value: &str) -> SystemTime {
    let fraction = value.strip_suffix('Z').expect("UTC").rsplit('.').next().unwrap();
    assert_eq!(fraction.len(), 3, "millisecond precision: {value}");
    let t = time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc3339).expect(value);
    SystemTime::UNIX_EPOCH + Duration::from_nanos(t.unix_timestamp_nanos() as u64)
}

#[tokio::test]
async fn anthropic_headers_describe_each_bucket_with_reset_instants() {
    // 60 s continuous: input refills 100 tokens/s, output 10/s, requests one per 1.2 s.
    let server = start(MockConfig {
        headers: HeaderStyle::Anthropic,
        itpm: Some(6000),
        otpm: Some(600),
        rpm: 50,
        window: Duration::from_secs(60),
        output_tokens: 20,
        ..MockConfig::default()
    })
    .await;
    let before = SystemTime::now();
    let body = json!({"model": "m", "input": "a".repeat(400), "max_output_tokens": 100});
    let (status, h, answer) = post_json(&server, "/responses", &body).await;
    let after = SystemTime::now();
    assert_eq!(status, 200);
    assert_eq!(answer["usage"]["input_tokens"], 100);
    assert_eq!(header_u64(&h, "anthropic-ratelimit-input-tokens-limit"), 6000);
    assert_eq!(header_u64(&h, "anthropic-ratelimit-input-tokens-remaining"), 5900, "charged its input");
    assert_eq!(header_u64(&h, "anthropic-ratelimit-output-tokens-limit"), 600);
    assert_eq!(header_u64(&h, "anthropic-ratelimit-output-tokens-remaining"), 500, "charged max_output_tokens");
    assert_eq!(header_u64(&h, "anthropic-ratelimit-requests-remaining"), 49);
    // 500/600 left is scarcer than 5900/6000: the tokens headers describe output.
    for kind in ["limit", "remaining", "reset"] {
        assert_eq!(
            header(&h, &format!("anthropic-ratelimit-tokens-{kind}")),
            header(&h, &format!("anthropic-ratelimit-output-tokens-{kind}"))
        );
    }
    for (family, full_in) in [("input-tokens", 1.0), ("output-tokens", 10.0), ("requests", 1.2)] {
        let reset = rfc3339(header(&h, &format!("anthropic-ratelimit-{family}-reset")));
        let earliest = before + Duration::from_secs_f64(full_in) - Duration::from_millis(2);
        let latest = after + Duration::from_secs_f64(full_in) + Duration::from_millis(2);
        assert!(reset >= earliest && reset <= latest, "{family}: full again at {reset:?}, not in {full_in} s");
    }
}

#[tokio::test]
async fn anthropic_gives_back_unused_output_but_never_input() {
    for charge in [ChargeMode::Refund, ChargeMode::Keep] {
        let server = start(MockConfig { charge, ..one_request_per_minute(HeaderStyle::Anthropic) }).await;
        let body = json!({"model": "m", "input": "a".repeat(400), "max_output_tokens": 100});
        let (status, _, answer) = post_json(&server, "/responses", &body).await;
        assert_eq!((status, answer["usage"]["output_tokens"].as_u64()), (200, Some(20)));
        let stats = server.stats();
        let (input, output) = (stats.buckets.input.unwrap(), stats.buckets.output.unwrap());
        assert_eq!((input.limit, output.limit), (1000, 200), "--itpm is --tpm, --otpm a fifth");
        assert_eq!(input.remaining, 900, "{charge}: input is never given back");
        let kept = if charge == ChargeMode::Keep { 100 } else { 20 };
        assert_eq!(output.remaining, 200 - kept, "{charge}");
        assert_eq!((stats.input_tokens_admitted, stats.output_tokens_admitted), (100, kept));
        assert_eq!(stats.tokens_admitted, 100 + kept);
    }
}

#[tokio::test]
async fn a_tight_output_bucket_refuses_on_output_while_input_has_room() {
    let server = start(MockConfig {
        headers: HeaderStyle::Anthropic,
        itpm: Some(10_000),
        otpm: Some(100),
        window: Duration::from_secs(60),
        bucket: BucketMode::Window,
        output_tokens: 1000,
        ..MockConfig::default()
    })
    .await;
    let body = |max: u64| json!({"model": "m", "input": "a".repeat(40), "max_output_tokens": max});
    assert_eq!(post_json(&server, "/responses", &body(80)).await.0, 200);
    let (status, h, err) = post_json(&server, "/responses", &body(50)).await;
    assert_eq!(status, 429);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("on output tokens per minute (OTPM): Limit 100, Used 80, Requested 50. Please try again in "),
        "{msg}"
    );
    assert_eq!(header_u64(&h, "anthropic-ratelimit-input-tokens-remaining"), 9990, "input had room");
    assert_eq!(header_u64(&h, "anthropic-ratelimit-output-tokens-remaining"), 20);
    assert!(header_u64(&h, "retry-after") >= 1);
    assert!(h.get("retry-after-ms").is_none(), "Anthropic sends whole seconds only");
    // More than the whole output bucket: too large, no wait helps.
    let (status, h, err) = post_json(&server, "/responses", &body(101)).await;
    assert_eq!(status, 429);
    assert!(err["error"]["message"].as_str().unwrap().starts_with(
        "Request too large for m in organization org-mock on output tokens per minute (OTPM): Limit 100, Requested 101."
    ));
    assert!(h.get("retry-after").is_none());
}

#[tokio::test]
async fn a_tight_input_bucket_refuses_on_input_while_output_has_room() {
    let server = start(MockConfig {
        headers: HeaderStyle::Anthropic,
        itpm: Some(100),
        otpm: Some(10_000),
        window: Duration::from_secs(60),
        bucket: BucketMode::Window,
        output_tokens: 5,
        ..MockConfig::default()
    })
    .await;
    // 320 characters are 80 input tokens.
    let body = json!({"model": "m", "input": "a".repeat(320), "max_output_tokens": 10});
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
    let (status, h, err) = post_json(
        &server,
        "/chat/completions",
        &json!({"model": "m", "max_tokens": 10,
        "messages": [{"role": "user", "content": "a".repeat(316)}]}),
    )
    .await;
    assert_eq!(status, 429);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("on input tokens per minute (ITPM): Limit 100, Used 80, Requested 80."), "{msg}");
    assert_eq!(err["error"]["type"], "tokens");
    assert_eq!(header_u64(&h, "anthropic-ratelimit-output-tokens-remaining"), 10_000 - 5, "output had room");
    assert_eq!(header_u64(&h, "anthropic-ratelimit-input-tokens-remaining"), 20);
    assert_eq!(header_u64(&h, "anthropic-ratelimit-tokens-remaining"), 20, "the scarcer bucket is input");
}

#[tokio::test]
async fn azure_sends_what_remains_and_a_429_with_both_retry_headers() {
    let server = start(one_request_per_minute(HeaderStyle::Azure)).await;
    let body = json!({"model": "m", "input": "x", "max_output_tokens": 100});
    let (_, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-requests"), 0);
    assert_eq!(header_u64(&h, "x-ratelimit-remaining-tokens"), 1000 - 101);
    let (status, h, err) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 429);
    assert_eq!(err["error"]["code"], "rate_limit_exceeded");
    let ms = header_u64(&h, "retry-after-ms");
    assert!(ms > 50_000 && ms <= 60_000, "the window ends within a minute: {ms}");
    assert_eq!(header_u64(&h, "retry-after"), ms.div_ceil(1000), "whole seconds, rounded up");
}

#[tokio::test]
async fn a_headerless_429_carries_its_delay_in_the_body() {
    let server = start(one_request_per_minute(HeaderStyle::None)).await;
    let body = json!({"model": "m", "input": "x"});
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
    let (status, h, err) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 429);
    assert!(rate_header_names(&h).is_empty(), "{h:?}");
    let msg = err["error"]["message"].as_str().unwrap();
    let hint = msg.split("Please try again in ").nth(1).unwrap().split(". ").next().unwrap();
    let detail = &err["error"]["details"][0];
    assert_eq!(detail["@type"], "type.googleapis.com/google.rpc.RetryInfo");
    let delay = advertised_delay(HeaderStyle::None, &h, &err);
    assert!(delay > Duration::from_secs(50) && delay <= Duration::from_secs(60), "{detail}");
    assert!((go_ms(hint) - delay.as_millis() as f64).abs() <= 1.0, "hint {hint} vs {detail}");

    server.inject(Fault::RateLimited { retry_after_ms: 1500 });
    let (status, h, err) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 429);
    assert!(rate_header_names(&h).is_empty());
    assert!(err["error"]["message"].as_str().unwrap().contains("Please try again in 1.5s."));
    assert_eq!(err["error"]["details"][0]["retryDelay"], "1.500s");
}

#[tokio::test]
async fn without_limits_a_burst_far_over_the_tpm_is_admitted() {
    let server =
        start(MockConfig { tpm: 100, rpm: 1, limits: LimitsMode::None, output_tokens: 20, ..MockConfig::default() })
            .await;
    let body = json!({"model": "m", "input": "a".repeat(400), "max_output_tokens": 50});
    let burst = (0..30).map(|_| post_json(&server, "/responses", &body));
    for (status, h, answer) in futures::future::join_all(burst).await {
        assert_eq!(status, 200);
        assert!(rate_header_names(&h).is_empty(), "no limits, no rate-limit headers: {h:?}");
        assert_eq!(answer["usage"]["input_tokens"], 100, "usage is still reported");
        assert_eq!(answer["usage"]["output_tokens"], 20);
    }
    let stats = server.stats();
    assert_eq!((stats.ok, stats.rate_limited, stats.largest_overdraft), (30, 0, 0));
    assert_eq!(stats.tokens_admitted, 30 * 120, "36 times the --tpm, in one burst");
    assert_eq!(stats.buckets.limits, LimitsMode::None);
}

// ------------------------------------------------------------------ wire formats

#[tokio::test]
async fn a_responses_stream_is_the_real_event_sequence() {
    let server = start(MockConfig { output_tokens: 30, ..MockConfig::default() }).await;
    let resp = post(
        &server,
        "/responses",
        &json!({"model": "gpt-test", "instructions": "be brief",
        "input": [{"role": "user", "content": "hello"}], "stream": true, "max_output_tokens": 64}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-ratelimit-remaining-tokens").is_some(), "streams carry the headers");
    let events = read_sse(resp).await;
    let kinds: Vec<String> = events.iter().map(|e| e.event.clone().expect("every frame names its event")).collect();
    for (i, e) in events.iter().enumerate() {
        let data = e.json();
        assert_eq!(data["type"], kinds[i].as_str(), "event: and data.type agree");
        assert_eq!(data["sequence_number"], json!(i));
    }
    assert_eq!(
        kinds[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    let n = kinds.len();
    assert_eq!(
        kinds[n - 4..],
        ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    );
    let deltas: Vec<&Sse> =
        events.iter().filter(|e| e.event.as_deref() == Some("response.output_text.delta")).collect();
    assert!(deltas.len() >= 3, "the answer comes as several deltas");
    assert_eq!(deltas.len(), n - 8);
    let text: String = deltas.iter().map(|e| e.json()["delta"].as_str().unwrap().to_string()).collect();
    let done = events[n - 1].json();
    let response = &done["response"];
    assert_eq!(response["status"], "completed");
    assert!(response["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(response["output"][0]["type"], "message");
    assert_eq!(response["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(text.split(' ').count(), 30);
    let usage = &response["usage"];
    // "be brief" + "user" + "hello" = 17 chars -> 5 tokens.
    assert_eq!(usage["input_tokens"], 5);
    assert_eq!(usage["output_tokens"], 30);
    assert_eq!(usage["total_tokens"], 35);
    assert_eq!(events[0].json()["response"]["status"], "in_progress");
}

#[tokio::test]
async fn an_output_limit_below_the_answer_makes_it_incomplete() {
    let server = start(MockConfig { output_tokens: 30, ..MockConfig::default() }).await;
    let resp =
        post(&server, "/responses", &json!({"model": "m", "input": "x", "stream": true, "max_output_tokens": 9})).await;
    let events = read_sse(resp).await;
    let last = events.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("response.incomplete"));
    let response = &last.json()["response"];
    assert_eq!(response["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(response["usage"]["output_tokens"], 9);
}

/// Sends the conversation, appends what the model asked for and a tool
/// output for each call, until it answers in text; returns the rounds it took.
async fn drive_tool_rounds(server: &MockServer, stream: bool) -> (usize, Value) {
    let mut input = vec![json!({"role": "user", "content": "find things"})];
    for round in 0..10 {
        let body = json!({"model": "gpt-test", "input": input, "tools": [tool("search"), tool("other")],
                          "stream": stream, "max_output_tokens": 256});
        let response = if stream {
            let events = read_sse(post(server, "/responses", &body).await).await;
            let done = events.last().unwrap().json();
            assert_eq!(done["type"], "response.completed");
            // The arguments deltas join to the arguments of the finished item.
            for item in done["response"]["output"].as_array().unwrap() {
                if item["type"] == "function_call" {
                    let joined: String = events
                        .iter()
                        .map(Sse::json)
                        .filter(|d| d["type"] == "response.function_call_arguments.delta" && d["item_id"] == item["id"])
                        .map(|d| d["delta"].as_str().unwrap().to_string())
                        .collect();
                    assert_eq!(joined, item["arguments"].as_str().unwrap());
                }
            }
            done["response"].clone()
        } else {
            let (status, _, body) = post_json(server, "/responses", &body).await;
            assert_eq!(status, 200);
            body
        };
        let output = response["output"].as_array().unwrap().clone();
        if output[0]["type"] == "message" {
            return (round, response);
        }
        for item in output {
            assert_eq!(item["type"], "function_call");
            assert_eq!(item["name"], "search", "the first offered tool");
            assert!(item["id"].as_str().unwrap().starts_with("fc_"));
            assert!(item["call_id"].as_str().unwrap().starts_with("call_"));
            let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
            assert!(args["query"].is_string(), "arguments fit the schema: {args}");
            input.push(item.clone());
            input.push(json!({"type": "function_call_output", "call_id": item["call_id"], "output": "found it"}));
        }
    }
    panic!("the model never stopped calling tools");
}

#[tokio::test]
async fn tools_get_function_calls_until_enough_outputs_then_a_final_answer() {
    let server = start(MockConfig { tool_rounds: 2, output_tokens: 12, ..MockConfig::default() }).await;
    for stream in [false, true] {
        let (rounds, response) = drive_tool_rounds(&server, stream).await;
        assert_eq!(rounds, 2, "stream: {stream}");
        assert_eq!(response["usage"]["output_tokens"], 12);
        assert_eq!(response["output"][0]["content"][0]["text"].as_str().unwrap().split(' ').count(), 12);
    }
    // The bodies the mock kept show what it was sent: the last had both outputs.
    let stats = server.stats();
    let last = &stats.bodies.last().unwrap().body;
    let outputs = last["input"].as_array().unwrap().iter().filter(|i| i["type"] == "function_call_output").count();
    assert_eq!(outputs, 2);
    assert_eq!(stats.log.last().unwrap().tool_outputs, 2);
}

#[tokio::test]
async fn a_retried_turn_gets_the_same_call_ids() {
    let server = start(MockConfig::default()).await;
    let body = json!({"model": "gpt-test", "input": "do it", "tools": [tool("search")]});
    let (_, _, a) = post_json(&server, "/responses", &body).await;
    let (_, _, b) = post_json(&server, "/responses", &body).await;
    assert_eq!(a["output"], b["output"]);
    assert_ne!(a["id"], b["id"], "response ids stay unique");
    let other = json!({"model": "gpt-test", "input": "do something else", "tools": [tool("search")]});
    let (_, _, c) = post_json(&server, "/responses", &other).await;
    assert_ne!(a["output"][0]["call_id"], c["output"][0]["call_id"]);
}

#[tokio::test]
async fn chat_completions_stream_tool_call_deltas_usage_and_done() {
    let server =
        start(MockConfig { tool_rounds: 1, calls_per_round: 2, output_tokens: 10, ..MockConfig::default() }).await;
    let mut messages = vec![json!({"role": "user", "content": "find things"})];
    let body = json!({"model": "gpt-test", "messages": messages, "tools": [chat_tool("search")],
                      "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 100});
    let events = read_sse(post(&server, "/chat/completions", &body).await).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(Sse::json).collect();
    // Join the tool-call fragments by index.
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        let Some(choice) = c["choices"].get(0) else { continue };
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        for tc in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.resize(i + 1, Default::default());
            }
            if let Some(id) = tc["id"].as_str() {
                calls[i].0 = id.to_string();
            }
            if let Some(name) = tc["function"]["name"].as_str() {
                calls[i].1 = name.to_string();
            }
            calls[i].2.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 2, "two parallel calls");
    for (id, name, args) in &calls {
        assert!(id.starts_with("call_"));
        assert_eq!(name, "search");
        let args: Value = serde_json::from_str(args).expect("joined arguments are JSON");
        assert!(args["query"].is_string());
    }
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // Feed both outputs back: now the answer is text.
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": calls.iter().map(|(id, name, args)|
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})).collect::<Vec<_>>()}));
    for (id, _, _) in &calls {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "found it"}));
    }
    let body = json!({"model": "gpt-test", "messages": messages, "tools": [chat_tool("search")],
                      "stream": true, "stream_options": {"include_usage": true}});
    let events = read_sse(post(&server, "/chat/completions", &body).await).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(Sse::json).collect();
    let text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str().map(str::to_string)).collect();
    assert_eq!(text.split(' ').count(), 10);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 10);
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), usage["prompt_tokens"].as_u64().unwrap() + 10);
    assert!(chunks.iter().any(|c| c["choices"].get(0).is_some_and(|ch| ch["finish_reason"] == "stop")));
}

#[tokio::test]
async fn chat_completions_json_answers_with_usage() {
    let server = start(MockConfig { output_tokens: 7, ..MockConfig::default() }).await;
    let (status, _, body) = post_json(
        &server,
        "/chat/completions",
        &json!({"model": "gpt-test",
        "messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efgh"}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    // "system" + "abcd" + "user" + "efgh" = 18 chars -> 5 tokens.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}})
    );
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let server = start(MockConfig::default()).await;
    let resp = client()
        .post(format!("{}/responses", server.base_url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (status, _, body) = post_json(&server, "/responses", &json!({"input": "no model"})).await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("model"));
    let (status, _, _) = post_json(&server, "/embeddings", &json!({"model": "m"})).await;
    assert_eq!(status, 404);
}

// ------------------------------------------------------------------ faults

#[tokio::test]
async fn fail_rate_gives_5xx_and_the_same_seed_the_same_failures() {
    async fn statuses(seed: u64) -> Vec<u16> {
        let server = start(MockConfig { fail_rate: 0.5, seed, ..MockConfig::default() }).await;
        let mut out = Vec::new();
        for _ in 0..40 {
            let (status, h, body) = post_json(&server, "/responses", &json!({"model": "m", "input": "x"})).await;
            if status != 200 {
                assert!([500, 503, 529].contains(&status), "{status}");
                assert!(body["error"]["message"].is_string());
                assert!(h.get("x-ratelimit-remaining-tokens").is_some());
            }
            out.push(status);
        }
        let stats = server.stats();
        assert_eq!(stats.ok, out.iter().filter(|s| **s == 200).count() as u64);
        out
    }
    let a = statuses(7).await;
    let failed = a.iter().filter(|s| **s != 200).count();
    assert!((8..=32).contains(&failed), "{failed} of 40 failed at rate 0.5");
    assert_eq!(a, statuses(7).await, "same seed, same fate");
    assert_ne!(a, statuses(8).await);
}

#[tokio::test]
async fn quota_after_n_answers_insufficient_quota() {
    let server = start(MockConfig { quota_after: Some(2), ..MockConfig::default() }).await;
    let body = json!({"model": "m", "input": "x"});
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
    for _ in 0..2 {
        let (status, h, err) = post_json(&server, "/responses", &body).await;
        assert_eq!(status, 429);
        assert_eq!(err["error"]["code"], "insufficient_quota");
        assert_eq!(err["error"]["type"], "insufficient_quota");
        assert!(err["error"]["message"].as_str().unwrap().starts_with("You exceeded your current quota"));
        assert!(h.get("retry-after").is_none(), "waiting does not fix billing");
    }
    assert_eq!(server.stats().rate_limited_by_code["insufficient_quota"], 2);
}

#[tokio::test]
async fn a_daily_cap_reports_a_reset_hours_away() {
    let server = start(MockConfig { tpm: 1000, daily_cap: true, output_tokens: 1000, ..MockConfig::default() }).await;
    let body = json!({"model": "m", "input": "x", "max_output_tokens": 600});
    let (status, h, _) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 200);
    // The day started with the server: the reset is all but 24 hours away
    // (`23h59m59.9s`, or `24h0m0s` when the request came within a millisecond).
    let reset = header(&h, "x-ratelimit-reset-tokens");
    assert!(go_ms(reset) > 23.9 * 3_600_000.0 && reset.contains('h'), "{reset}");
    let (status, h, err) = post_json(&server, "/responses", &body).await;
    assert_eq!(status, 429);
    assert!(header_u64(&h, "retry-after") > 23 * 3600);
    assert!(err["error"]["message"].as_str().unwrap().contains("tokens per day (TPD)"));
    let msg = err["error"]["message"].as_str().unwrap();
    let hint = msg.split("Please try again in ").nth(1).unwrap().split(". ").next().unwrap();
    assert!(go_ms(hint) > 23.9 * 3_600_000.0, "{msg}");
}

#[tokio::test]
async fn a_stall_pauses_a_stream_after_some_text() {
    let server =
        start(MockConfig { stall: Duration::from_millis(400), output_tokens: 40, ..MockConfig::default() }).await;
    let started = Instant::now();
    let resp = post(&server, "/responses", &json!({"model": "m", "input": "x", "stream": true})).await;
    let events = read_sse(resp).await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    let (gap_at, gap) =
        events.windows(2).enumerate().map(|(i, w)| (i, w[1].at - w[0].at)).max_by_key(|(_, gap)| *gap).unwrap();
    // The sender sleeps 400 ms between two frames; a loaded machine may read
    // the first of them late, so the gap seen here can be somewhat shorter.
    assert!(gap >= Duration::from_millis(200), "longest gap {gap:?}");
    assert!(
        events[..=gap_at].iter().any(|e| e.event.as_deref() == Some("response.output_text.delta")),
        "the stall comes after some text"
    );
    assert_eq!(events.last().unwrap().event.as_deref(), Some("response.completed"), "then it goes on");
    assert_eq!(server.stats().stalls, 1);
}

#[tokio::test]
async fn a_midstream_error_ends_a_stream_after_text() {
    let server = start(MockConfig { midstream_error_rate: 1.0, output_tokens: 40, ..MockConfig::default() }).await;
    let resp =
        post(&server, "/responses", &json!({"model": "m", "input": "x", "stream": true, "max_output_tokens": 100}))
            .await;
    assert_eq!(resp.status(), 200, "the failure comes inside a 200");
    let events = read_sse(resp).await;
    let last = events.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    let data = last.json();
    assert_eq!(data["error"]["code"], "server_error");
    assert_eq!(data["sequence_number"], json!(events.len() - 1));
    assert!(events.iter().any(|e| e.event.as_deref() == Some("response.output_text.delta")));
    assert!(!events.iter().any(|e| e.event.as_deref() == Some("response.completed")));

    let resp = post(
        &server,
        "/chat/completions",
        &json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    let events = read_sse(resp).await;
    assert!(events.last().unwrap().json()["error"]["message"].is_string());
    assert!(events.iter().all(|e| e.data != "[DONE]"));

    // A mid-stream rate limit, injected for one request: inside a 200 too.
    server.inject(Fault::MidstreamError { code: Some("rate_limit_exceeded".into()) });
    let resp = post(&server, "/responses", &json!({"model": "m", "input": "x", "stream": true})).await;
    let data = read_sse(resp).await.last().unwrap().json();
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["code"], "rate_limit_exceeded");
    assert!(data["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Rate limit reached for m in organization org-mock"));

    // A JSON answer is not a stream: unaffected.
    assert_eq!(post_json(&server, "/responses", &json!({"model": "m", "input": "x"})).await.0, 200);
    let stats = server.stats();
    assert_eq!(stats.midstream_errors, 3);
    assert_eq!(stats.log[0].code.as_deref(), Some("midstream_error"));
    assert!(stats.log[0].refunded > 60, "unread output is given back: {}", stats.log[0].refunded);
}

#[tokio::test]
async fn no_headers_behaves_like_vllm() {
    let server = start(MockConfig { headers: HeaderStyle::None, ..MockConfig::default() }).await;
    let (status, h, _) = post_json(&server, "/responses", &json!({"model": "m", "input": "x"})).await;
    assert_eq!(status, 200);
    assert!(h.keys().all(|k| !k.as_str().starts_with("x-ratelimit-")), "{h:?}");
}

#[tokio::test]
async fn latency_comes_before_the_first_byte() {
    let server = start(MockConfig { latency: Duration::from_millis(300), ..MockConfig::default() }).await;
    let started = Instant::now();
    let resp = post(&server, "/responses", &json!({"model": "m", "input": "x", "stream": true})).await;
    assert!(started.elapsed() >= Duration::from_millis(300), "headers came after {:?}", started.elapsed());
    read_sse(resp).await;
}

#[tokio::test]
async fn injected_faults_hit_the_next_requests_in_order() {
    let server = start(MockConfig::default()).await;
    let resp = client()
        .post(format!("{}/_mock/faults", server.url()))
        .json(&json!([{"fault": "rate_limited", "retry_after_ms": 1500}, {"fault": "server_error", "status": 503}]))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    server.inject(Fault::Quota);
    let body = json!({"model": "m", "input": "x"});
    let (status, h, err) = post_json(&server, "/responses", &body).await;
    assert_eq!((status, err["error"]["code"].as_str()), (429, Some("rate_limit_exceeded")));
    assert_eq!(header_u64(&h, "retry-after-ms"), 1500);
    assert_eq!(header_u64(&h, "retry-after"), 2);
    assert!(err["error"]["message"].as_str().unwrap().contains("Please try again in 1.5s."));
    assert_eq!(post_json(&server, "/responses", &body).await.0, 503);
    assert_eq!(post_json(&server, "/responses", &body).await.2["error"]["code"], "insufficient_quota");
    assert_eq!(post_json(&server, "/responses", &body).await.0, 200);
}

// ------------------------------------------------------------------ prompt cache

/// Anthropic's usage as `(input_tokens, cache_creation_input_tokens, cache_read_input_tokens)`.
fn cache_usage(usage: &Value) -> (u64, u64, u64) {
    let n = |k: &str| usage[k].as_u64().unwrap_or_else(|| panic!("no {k} in {usage}"));
    (n("input_tokens"), n("cache_creation_input_tokens"), n("cache_read_input_tokens"))
}

/// A client that caches like paceline: a breakpoint on the system prompt and
/// one on the newest block, moved forward each turn. Each turn reads what the
/// turn before wrote and writes only what it adds; reads cost the input
/// bucket nothing.
#[tokio::test]
async fn an_anthropic_conversation_reads_each_turn_what_the_last_one_wrote() {
    let itpm = 100_000;
    let server = start(MockConfig {
        cache: true,
        headers: HeaderStyle::Anthropic,
        itpm: Some(itpm),
        bucket: BucketMode::Window,
        tool_rounds: 2,
        ..MockConfig::default()
    })
    .await;
    let marker = json!({"type": "ephemeral"});
    let system = json!([{"type": "text", "text": "You answer questions. ".repeat(250), "cache_control": marker}]);
    let tools = json!([{"name": "search", "description": "look something up",
                        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}]);
    let mut messages =
        vec![json!({"role": "user", "content": [{"type": "text", "text": "What is new?", "cache_control": marker}]})];
    let body = |messages: &[Value]| {
        let mut body = json!({"model": "claude-test", "max_tokens": 100, "system": system, "tools": tools});
        body["messages"] = json!(messages);
        body
    };

    let mut turns = Vec::new();
    for turn in 1..=3 {
        let (status, _, answer) = post_json(&server, "/messages", &body(&messages)).await;
        assert_eq!(status, 200, "turn {turn}: {answer}");
        turns.push(cache_usage(&answer["usage"]));
        if turn == 3 {
            break;
        }
        // The next turn: the answer's tool call and its result, which takes the
        // newest-block marker from the block before it.
        let call = answer["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap().clone();
        let newest = messages.last_mut().unwrap()["content"].as_array_mut().unwrap().last_mut().unwrap();
        newest.as_object_mut().unwrap().remove("cache_control");
        messages.push(json!({"role": "assistant", "content": [call.clone()]}));
        messages.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
            "content": format!("result {turn}: ").repeat(40), "cache_control": marker}]}));
    }

    let stats = server.stats();
    let totals: Vec<u64> = stats.log.iter().map(|e| e.input_tokens).collect();
    for (i, &(input, write, read)) in turns.iter().enumerate() {
        // The last block is marked: nothing after it, and the three parts are the prompt.
        assert_eq!(input, 0, "turn {}", i + 1);
        assert_eq!(read + write, totals[i], "turn {}", i + 1);
    }
    assert_eq!(turns[0].2, 0, "the first turn reads nothing");
    assert!(turns[0].1 >= 1024, "and writes its whole prompt: {:?}", turns[0]);
    for i in 1..3 {
        // A turn reads the prompt the turn before wrote, up to the block that
        // lost its marker (its 9 characters of "ephemeral", up to 3 tokens).
        let (read, before) = (turns[i].2, totals[i - 1]);
        assert!(read <= before && read + 3 >= before, "turn {}: read {read} of the {before} written", i + 1);
        assert!(turns[i].1 < 200, "turn {} writes only what it adds: {:?}", i + 1, turns[i]);
    }

    // The same turn again (a retry) reads it all and writes nothing, in the stream too.
    let mut retry = body(&messages);
    retry["stream"] = json!(true);
    let frames = read_sse(post(&server, "/messages", &retry).await).await;
    assert_eq!(frames[0].event.as_deref(), Some("message_start"));
    assert_eq!(cache_usage(&frames[0].json()["message"]["usage"]), (0, 0, totals[2]));

    let stats = server.stats();
    let reads: u64 = turns.iter().map(|t| t.2).sum::<u64>() + totals[2];
    let writes: u64 = turns.iter().map(|t| t.1).sum();
    assert_eq!((stats.cache_read_tokens, stats.cache_write_tokens), (reads, writes));
    // The input bucket was charged the writes (and no uncached input): not the reads.
    assert_eq!(stats.input_tokens_admitted, writes);
    assert_eq!(stats.buckets.input.as_ref().unwrap().remaining, itpm - writes);
    server.shutdown().await;
}

// ------------------------------------------------------------------ stats

#[tokio::test]
async fn stats_over_http_match_the_server_and_reset_zeroes_them() {
    let server = start(MockConfig { keep_bodies: 2, ..MockConfig::default() }).await;
    for i in 0..3 {
        post_json(&server, "/responses", &json!({"model": "m", "input": format!("request {i}")})).await;
    }
    let http: Stats = client().get(format!("{}/_mock/stats", server.url())).send().await.unwrap().json().await.unwrap();
    let local = server.stats();
    assert_eq!(http.requests, 3);
    assert_eq!(http.ok, local.ok);
    assert_eq!(http.tokens_admitted, local.tokens_admitted);
    assert_eq!(http.log.len(), 3);
    assert!(http.log.windows(2).all(|w| w[0].at_us <= w[1].at_us && w[0].seq < w[1].seq));
    assert_eq!(http.bodies.len(), 2, "only the latest bodies are kept");
    assert_eq!(http.bodies[1].body["input"], "request 2");
    assert_eq!(http.bodies[1].seq, http.log[2].seq);

    let raw: Value =
        client().get(format!("{}/_mock/stats?log=false", server.url())).send().await.unwrap().json().await.unwrap();
    assert_eq!(raw["2xx"], 3);
    assert_eq!(raw["largest_overdraft"], 0);
    assert_eq!(raw["log"], json!([]));
    assert_eq!(
        (raw["buckets"]["headers"].as_str(), raw["buckets"]["limits"].as_str()),
        (Some("openai"), Some("enforced"))
    );
    assert!(raw["buckets"].get("input").is_none(), "one token bucket: no input or output entries");

    let resp = client().post(format!("{}/_mock/reset", server.url())).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let after = server.stats();
    assert_eq!((after.requests, after.ok, after.log.len()), (0, 0, 0));
    assert_eq!(after.buckets.tokens.remaining, after.buckets.tokens.limit);
    server.shutdown().await;
}

// ------------------------------------------------------------------ the subcommand

#[tokio::test]
async fn the_subcommand_lists_its_knobs_serves_and_stops_on_sigterm() {
    let help = std::process::Command::new(paceline_bin()).args(["mock-provider", "--help"]).output().unwrap();
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--listen",
        "--tpm",
        "--rpm",
        "--window-s",
        "--bucket",
        "--latency-ms",
        "--tool-rounds",
        "--output-tokens",
        "--fail-rate",
        "--quota-after",
        "--daily-cap",
        "--stall-ms",
        "--headers",
        "--limits",
        "--itpm",
        "--otpm",
        "--charge",
        "--seed",
        "--midstream-error-rate",
        "--keep-bodies",
        "--cache",
        "--cache-min-tokens",
        "--cache-ttl-s",
        "--context-window",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }

    let mut child = std::process::Command::new(paceline_bin())
        .args(["mock-provider", "--listen", "127.0.0.1:0", "--tpm", "1000", "--window-s", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start paceline mock-provider");
    let stdout = child.stdout.take().unwrap();
    let mut child = ChildGuard(child);
    // It prints its base URL, alone, on stdout.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
        let _ = tx.send(line);
    });
    let base_url = rx.recv_timeout(Duration::from_secs(10)).expect("the base URL on stdout");
    let base_url = base_url.trim();
    assert!(base_url.starts_with("http://127.0.0.1:") && base_url.ends_with("/v1"), "{base_url}");

    let resp = client()
        .post(format!("{base_url}/responses"))
        .json(&json!({"model": "m", "input": "x", "max_output_tokens": 10}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header_u64(resp.headers(), "x-ratelimit-limit-tokens"), 1000);

    child.signal("TERM");
    let status = child.wait_timeout(Duration::from_secs(5)).expect("it stops on SIGTERM");
    assert!(status.success(), "{status}");
}
