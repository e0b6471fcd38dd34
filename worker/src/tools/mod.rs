//! Calling the run's tool endpoint (README, "Tool endpoints").
//!
//! Each function call of a turn is POSTed as `{"run_id","call_id","name",
//! "arguments","tenant"}` and answered with `{"output": "..."}`; the calls of
//! one turn run in parallel. A tool that fails — refused connection, non-2xx,
//! a redirect, bad JSON, timeout — does not fail the run: its error becomes
//! the text the model reads as that tool's output, so the model can react to it.
//!
//! Who may call what is checked here again before the calls (the API checked
//! at submit): `shared::runs::ToolEndpoints::allows`, the run's tenant
//! against `PACELINE_TOOL_ENDPOINTS`, compared on the parsed URL (scheme,
//! host, port, then whole path segments), never as raw text. No redirect is
//! followed: a 3xx would send the call (and its signature) to a URL the
//! allow-list never saw, so it is the tool's error instead.
//!
//! Where a call may connect is checked on the address its host resolves to
//! (`resolve.rs`): a name that resolves to loopback, a private or
//! link-local address is refused, and the connection goes to the addresses
//! checked. Only tools the run declared are called; a turn runs at most
//! [`MAX_TOOL_CALLS_PER_TURN`] calls and reads at most
//! [`MAX_TOOL_ANSWERS_PER_TURN`] bytes of answers, however many there are.
//!
//! Each call names its tenant (`X-Paceline-Tenant`, and `tenant` in the
//! body) and, with `PACELINE_TOOL_SECRET`, is signed with the key of its tool
//! server (`signing.rs`), so a tool server can authorise the call and refuse
//! a replay older than its tolerance.

pub mod mcp;
pub(crate) mod resolve;
mod signing;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use shared::config::Secret;
use shared::runs::{McpHeaderVars, McpServer, ToolEndpoints};

pub use crate::provider::ToolCall;
pub use signing::{endpoint_key, sign, verify, SIGNATURE_HEADER};

/// The default time a tool has to answer.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// The most of one tool's answer that is read. Far above what the model is
/// shown (16 000 / 24 000 characters, clipped later with a note), so the
/// clipping note can say how long the output was; it only bounds memory.
pub const MAX_TOOL_ANSWER: usize = 8 * 1024 * 1024;

/// The most of all of one turn's tool answers that is read, together: what a
/// turn holds at once, whatever its calls answer. Each call made gets an
/// equal share (at most [`MAX_TOOL_ANSWER`]): its calls run at once, and a
/// share no other call can eat keeps one call's answer from depending on
/// how fast the others' arrive. An answer past its share is answered "too
/// large" instead.
pub const MAX_TOOL_ANSWERS_PER_TURN: usize = 16 * 1024 * 1024;

/// Tool calls run in one turn at most; a model asking for more gets the rest
/// answered "not run" (every call still gets an output, or the provider
/// rejects the next turn).
pub const MAX_TOOL_CALLS_PER_TURN: usize = 32;

/// The most of an error body quoted in the output text.
const MAX_ERROR_EXCERPT: usize = 500;

/// One tool call's result, as the model will read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The call it answers.
    pub call_id: String,
    /// The tool's name (the output cap depends on it: `browser__*`).
    pub name: String,
    /// The tool's output, or `tool error: …` when it failed. Not clipped yet.
    pub output: String,
    /// The tool failed and `output` describes how.
    pub error: bool,
}

/// The header naming the run's tenant.
pub const TENANT_HEADER: &str = "x-paceline-tenant";

/// Calls a worker's tool endpoints: the allow-list, the signing secret, the
/// timeout and an HTTP client that follows no redirect, uses no proxy and
/// connects to public addresses only, unless the allow-list names the address.
#[derive(Debug, Clone)]
pub struct ToolClient {
    http: reqwest::Client,
    allowed: ToolEndpoints,
    secret: Option<Secret>,
    timeout: Duration,
    mcp: Arc<mcp::McpClient>,
}

impl ToolClient {
    /// A client allowing the tool endpoints `allowed` (and no MCP server:
    /// [`with_mcp`](Self::with_mcp)), signing endpoint calls with `secret`
    /// (none or empty: unsigned), giving each call `timeout` from connect to
    /// the last byte.
    pub fn new(allowed: ToolEndpoints, secret: Option<Secret>, timeout: Duration) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            // A proxy would resolve the host itself, past the address check.
            .no_proxy()
            .dns_resolver(Arc::new(resolve::PublicOnly::TOOLS))
            .build()?;
        let mcp = Arc::new(mcp::McpClient::new(http.clone(), ToolEndpoints::default(), Default::default()));
        Ok(Self { http, allowed, secret: secret.filter(|s| !s.is_empty()), timeout, mcp })
    }

    /// This client, allowing the MCP servers of `allowed` (`PACELINE_MCP_ENDPOINTS`)
    /// and their headers from the variables of `header_vars` (`PACELINE_MCP_HEADER_VARS`).
    pub fn with_mcp(self, allowed: ToolEndpoints, header_vars: McpHeaderVars) -> Self {
        Self { mcp: Arc::new(mcp::McpClient::new(self.http.clone(), allowed, header_vars)), ..self }
    }

    /// The MCP servers' client (discovery at a run's first turn).
    pub fn mcp(&self) -> &mcp::McpClient {
        &self.mcp
    }

    /// Whether calls are signed.
    pub fn signs(&self) -> bool {
        self.secret.is_some()
    }

    /// Calls every tool of one turn of `tenant`'s run in parallel and returns
    /// their results in the order of `calls`: a tool named `<server>__<tool>`
    /// for one of the run's MCP `servers` goes to that server, any other to
    /// `endpoint`. Never fails: a tool's failure is its output text — also a
    /// call to a tool the run did not `declare`, or to an endpoint or server
    /// this worker does not allow to `tenant`, which is not made.
    // Each argument is one thing a call needs; a struct would be built at its one call site.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        endpoint: &str,
        servers: &[McpServer],
        tenant: &str,
        run_id: &str,
        declared: &[&str],
        calls: &[ToolCall],
    ) -> Vec<ToolResult> {
        let permitted = self.allowed.allows(tenant, endpoint);
        let asked = calls.len();
        let made = calls.iter().take(MAX_TOOL_CALLS_PER_TURN).filter(|c| declared.contains(&c.name.as_str())).count();
        let share = answer_share(made);
        let futures = calls.iter().enumerate().map(|(i, call)| {
            let span = crate::traces::tool_span(&call.name, &call.call_id);
            let traced = span.clone();
            tracing::Instrument::instrument(async move {
            let started = std::time::Instant::now();
            let result = if i >= MAX_TOOL_CALLS_PER_TURN {
                Err(format!(
                    "not run: this turn asked for {asked} tool calls and at most {MAX_TOOL_CALLS_PER_TURN} run in one turn"
                ))
            } else if !declared.contains(&call.name.as_str()) {
                Err(format!("not run: the run declared no tool named {:?}", excerpt(&call.name)))
            } else if let Some((server, tool)) = mcp::route(servers, &call.name) {
                if self.mcp.allows(tenant, server) {
                    let call = self.mcp.call(tenant, server, tool, &call.arguments, share);
                    match tokio::time::timeout(self.timeout, call).await {
                        Ok(result) => result,
                        Err(_) => Err(format!("timed out after {}", describe(self.timeout))),
                    }
                } else {
                    Err(format!("the MCP server {:?} is not allowed on this worker", server.url))
                }
            } else if !permitted {
                Err(format!("the endpoint {endpoint:?} is not allowed on this worker"))
            } else {
                let call = self.call(endpoint, tenant, run_id, call, share);
                match tokio::time::timeout(self.timeout, call).await {
                    Ok(result) => result,
                    Err(_) => Err(format!("timed out after {}", describe(self.timeout))),
                }
            };
            let (output, error) = match result {
                Ok(output) => (output, false),
                Err(why) => {
                    tracing::info!(message = "tool call failed", run.id = %run_id, tool.name = %call.name, tool.call_id = %call.call_id, error = %why);
                    (format!("tool error: {why}"), true)
                }
            };
            tracing::debug!(message = "tool call done", run.id = %run_id, tool.name = %call.name, error, elapsed_ms = started.elapsed().as_millis() as u64);
            if error {
                traced.record("error.type", "tool_error");
            }
            ToolResult { call_id: call.call_id.clone(), name: call.name.clone(), output, error }
        }, span)
        });
        futures::future::join_all(futures).await
    }

    /// One POST, its answer read up to `share` bytes; `Err` is the failure's
    /// description.
    async fn call(
        &self,
        endpoint: &str,
        tenant: &str,
        run_id: &str,
        call: &ToolCall,
        share: usize,
    ) -> Result<String, String> {
        let body = json!({"run_id": run_id, "call_id": call.call_id, "name": call.name, "arguments": call.arguments,
                          "tenant": tenant});
        // The bytes signed are the bytes sent.
        let body = serde_json::to_vec(&body).map_err(|e| format!("cannot encode the call: {e}"))?;
        let mut request = self
            .http
            .post(endpoint)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(TENANT_HEADER, tenant);
        if let Some(key) = self.secret.as_ref().and_then(|secret| endpoint_key(secret, endpoint)) {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            request = request.header(SIGNATURE_HEADER, sign(&key, now, &body));
        }
        let response = request.body(body).send().await.map_err(|e| describe_error(&e))?;
        let status = response.status();
        if status.is_redirection() {
            let to = response
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .map(|l| format!(" to {}", excerpt(l)))
                .unwrap_or_default();
            return Err(format!(
                "the endpoint redirected (HTTP {}{to}); tool calls do not follow redirects",
                status.as_u16()
            ));
        }
        let bytes = read_limited(response, share).await?;
        let text = String::from_utf8_lossy(&bytes);
        if !status.is_success() {
            let excerpt = excerpt(text.trim());
            return Err(if excerpt.is_empty() {
                format!("HTTP {}", status.as_u16())
            } else {
                format!("HTTP {}: {excerpt}", status.as_u16())
            });
        }
        let answer: Value = serde_json::from_str(&text)
            .map_err(|e| format!("the answer is not JSON ({e}): {}", excerpt(text.trim())))?;
        match answer.get("output") {
            Some(Value::String(s)) => Ok(s.clone()),
            // A tool that answers structured data: the model reads it as JSON text.
            Some(Value::Null) | None => Err(format!("the answer has no \"output\": {}", excerpt(&answer.to_string()))),
            Some(other) => Ok(other.to_string()),
        }
    }
}

/// The most of each answer read when a turn makes `calls` calls: an equal
/// share of [`MAX_TOOL_ANSWERS_PER_TURN`], at most [`MAX_TOOL_ANSWER`].
fn answer_share(calls: usize) -> usize {
    (MAX_TOOL_ANSWERS_PER_TURN / calls.max(1)).min(MAX_TOOL_ANSWER)
}

/// The answer's body, refusing one larger than `limit`. Read a piece at a
/// time: an answer too large is dropped at the piece that passed the limit,
/// never held whole.
async fn read_limited(response: reqwest::Response, limit: usize) -> Result<Vec<u8>, String> {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| describe_error(&e))?;
        if body.len() + chunk.len() > limit {
            return Err(too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Why an answer over `limit` bytes was not read.
fn too_large(limit: usize) -> String {
    if limit == MAX_TOOL_ANSWER {
        format!("the answer is larger than {} MiB", MAX_TOOL_ANSWER >> 20)
    } else {
        format!(
            "the answer is larger than {} KiB, its share of the {} MiB a turn's tool answers may take together",
            limit >> 10,
            MAX_TOOL_ANSWERS_PER_TURN >> 20
        )
    }
}

/// `60 s`, `1.5 s`, `250 ms`.
fn describe(d: Duration) -> String {
    if d.as_millis() < 1000 {
        format!("{} ms", d.as_millis())
    } else if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// A reqwest error with its causes ("error sending request" alone says little).
fn describe_error(error: &reqwest::Error) -> String {
    crate::provider::error_chain(error)
}

/// At most [`MAX_ERROR_EXCERPT`] characters.
fn excerpt(s: &str) -> String {
    match s.char_indices().nth(MAX_ERROR_EXCERPT) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_turn_runs_at_most_its_share_of_tool_calls_and_answers_every_one() {
        // No endpoint allowed: the calls that would run fail without a request,
        // the ones past the cap are not run at all; each has its output.
        let client = ToolClient::new(ToolEndpoints::default(), None, Duration::from_secs(1)).unwrap();
        let calls: Vec<ToolCall> = (0..40)
            .map(|i| ToolCall { call_id: format!("c{i}"), name: "search".into(), arguments: "{}".into() })
            .collect();
        let results = client.run("http://127.0.0.1:9/tools", &[], "acme", "run_1", &["search"], &calls).await;
        assert_eq!(results.len(), 40);
        assert!(results.iter().all(|r| r.error));
        let not_run = results.iter().filter(|r| r.output.contains("not run")).count();
        assert_eq!(not_run, 40 - MAX_TOOL_CALLS_PER_TURN);
        assert!(results[..MAX_TOOL_CALLS_PER_TURN].iter().all(|r| r.output.contains("not allowed")));
        assert_eq!(results[39].call_id, "c39", "in the order of the calls");
    }

    #[test]
    fn each_call_gets_an_equal_share_of_the_turns_bytes_up_to_the_answer_cap() {
        assert_eq!(answer_share(0), MAX_TOOL_ANSWER);
        assert_eq!(answer_share(1), MAX_TOOL_ANSWER);
        assert_eq!(answer_share(2), MAX_TOOL_ANSWER);
        assert_eq!(answer_share(4), 4 << 20);
        assert_eq!(answer_share(MAX_TOOL_CALLS_PER_TURN), 512 << 10);
        assert!(answer_share(3) * 3 <= MAX_TOOL_ANSWERS_PER_TURN);
        assert_eq!(
            too_large(4 << 20),
            "the answer is larger than 4096 KiB, its share of the 16 MiB a turn's tool answers may take together"
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(describe(Duration::from_secs(60)), "60 s");
        assert_eq!(describe(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(describe(Duration::from_millis(250)), "250 ms");
    }
}
