//! The one client of paceline's HTTP API, for the CLI's subcommands and
//! `paceline up --demo`: runs come back as [`shared::runs::Run`] (the type the
//! API serialises), lists as the API's own [`api::RunList`], and an error
//! answer is one line: `API 422 invalid_request (max_turns): must be …`.

use std::time::Duration;

use anyhow::Context as _;
use serde::de::DeserializeOwned;
use serde_json::Value;
use shared::config::Secret;
use shared::runs::Run;

/// A client of the API at one base URL, with one bearer token (or none: open mode).
#[derive(Debug, Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: String,
    token: Option<Secret>,
}

/// The API answered with an error status.
#[derive(Debug, thiserror::Error)]
#[error("{line}")]
pub struct ApiFailure {
    /// The HTTP status.
    pub status: u16,
    /// What to show: [`api_error_line`].
    pub line: String,
}

/// How long one request (not an event stream) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

impl ApiClient {
    /// A client of the API at `base` (`http://127.0.0.1:8080`); an empty token is none.
    pub fn new(base: &str, token: Option<Secret>) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).build()?;
        let token = token.filter(|t| !t.is_empty());
        Ok(Self { http, base: base.trim_end_matches('/').to_owned(), token })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t.expose()),
            None => r,
        }
    }

    /// Sends, and turns a non-2xx answer into an [`ApiFailure`].
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

    async fn json<T: DeserializeOwned>(&self, r: reqwest::RequestBuilder) -> anyhow::Result<T> {
        let resp = self.send(r.timeout(REQUEST_TIMEOUT)).await?;
        let bytes = resp.bytes().await.context("reading the API's answer")?;
        serde_json::from_slice(&bytes).context("the API answered something this client cannot read")
    }

    /// `POST /v1/runs` with a spec as the user wrote it (the API validates it).
    pub async fn submit(&self, spec: impl Into<reqwest::Body>, idempotency_key: Option<&str>) -> anyhow::Result<Run> {
        let mut r = self
            .request(reqwest::Method::POST, "/v1/runs")
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(spec);
        if let Some(k) = idempotency_key {
            r = r.header("Idempotency-Key", k);
        }
        self.json(r).await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn run(&self, id: &str) -> anyhow::Result<Run> {
        self.json(self.request(reqwest::Method::GET, &format!("/v1/runs/{id}"))).await
    }

    /// `GET /v1/runs`: the newest `limit`, in `status` if given.
    pub async fn runs(&self, status: Option<&str>, limit: usize) -> anyhow::Result<api::RunList> {
        let mut r = self.request(reqwest::Method::GET, "/v1/runs").query(&[("limit", limit.to_string())]);
        if let Some(s) = status {
            r = r.query(&[("status", s)]);
        }
        self.json(r).await
    }

    /// `POST /v1/runs/{id}/retry`.
    pub async fn retry(&self, id: &str) -> anyhow::Result<Run> {
        self.json(self.request(reqwest::Method::POST, &format!("/v1/runs/{id}/retry"))).await
    }

    /// `GET /v1/pacer`, as the API wrote it.
    pub async fn pacer(&self) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, "/v1/pacer")).await
    }

    /// `GET /v1/usage` with `query` (`from`, `to`, `group_by`), as the API wrote it.
    pub async fn usage(&self, query: &[(&str, String)]) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, "/v1/usage").query(query)).await
    }

    /// `GET /v1/dead` (operator), as the API wrote it.
    pub async fn dead(&self, limit: usize) -> anyhow::Result<Value> {
        self.json(self.request(reqwest::Method::GET, "/v1/dead").query(&[("limit", limit.to_string())])).await
    }

    /// `GET /v1/runs/{id}/events`, resumed after `last_event_id`: the open
    /// stream, to read with an SSE parser.
    pub async fn events(&self, id: &str, last_event_id: Option<&str>) -> anyhow::Result<reqwest::Response> {
        let mut r =
            self.request(reqwest::Method::GET, &format!("/v1/runs/{id}/events")).header("accept", "text/event-stream");
        if let Some(l) = last_event_id {
            r = r.header("Last-Event-ID", l);
        }
        self.send(r).await
    }
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
pub fn api_error_line(status: u16, body: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
