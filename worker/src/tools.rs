//! Calling the run's tool endpoint (SPEC §5).
//!
//! Each function call of a turn is POSTed as `{"run_id","call_id","name",
//! "arguments"}` and answered with `{"output": "..."}`; the calls of one turn
//! run in parallel. A tool that fails — refused connection, non-2xx, bad
//! JSON, timeout — does not fail the run: its error becomes the text the
//! model reads as that tool's output, so the model can react to it.
//!
//! `shared::runs::spec::endpoint_allowed` is the `PACELINE_TOOL_ENDPOINTS` check: a URL passes
//! when it lies under one of the configured prefixes, compared on the parsed
//! URL (scheme, host, port, then whole path segments), never as raw text.

use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use crate::provider::ToolCall;

/// The default time a tool has to answer (SPEC §5).
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// The most of a tool's answer that is read. Far above what the model is
/// shown (16 000 / 24 000 characters, clipped later with a note), so the
/// clipping note can say how long the output was; it only bounds memory.
const MAX_TOOL_ANSWER: usize = 8 * 1024 * 1024;

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

/// Calls every tool of one turn in parallel and returns their results in
/// the order of `calls`. Never fails: a tool's failure is its output text —
/// also an endpoint outside `allowed` (this worker's prefixes), which is not
/// called. `timeout` bounds each call from connect to the last byte of its answer.
pub async fn run_tools(
    client: &reqwest::Client,
    endpoint: &str,
    allowed: &[String],
    run_id: &str,
    calls: &[ToolCall],
    timeout: Duration,
) -> Vec<ToolResult> {
    let permitted = shared::runs::spec::endpoint_allowed(endpoint, allowed);
    let futures = calls.iter().map(|call| async move {
        let started = std::time::Instant::now();
        let result = if !permitted {
            Err(format!("the endpoint {endpoint:?} is not allowed on this worker"))
        } else {
            match tokio::time::timeout(timeout, call_tool(client, endpoint, run_id, call)).await {
                Ok(result) => result,
                Err(_) => Err(format!("timed out after {}", describe(timeout))),
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
        ToolResult { call_id: call.call_id.clone(), name: call.name.clone(), output, error }
    });
    futures::future::join_all(futures).await
}

/// One POST; `Err` is the failure's description.
async fn call_tool(client: &reqwest::Client, endpoint: &str, run_id: &str, call: &ToolCall) -> Result<String, String> {
    let body = json!({"run_id": run_id, "call_id": call.call_id, "name": call.name, "arguments": call.arguments});
    let response = client.post(endpoint).json(&body).send().await.map_err(|e| describe_error(&e))?;
    let status = response.status();
    let bytes = read_limited(response).await?;
    let text = String::from_utf8_lossy(&bytes);
    if !status.is_success() {
        let excerpt = excerpt(text.trim());
        return Err(if excerpt.is_empty() {
            format!("HTTP {}", status.as_u16())
        } else {
            format!("HTTP {}: {excerpt}", status.as_u16())
        });
    }
    let answer: Value =
        serde_json::from_str(&text).map_err(|e| format!("the answer is not JSON ({e}): {}", excerpt(text.trim())))?;
    match answer.get("output") {
        Some(Value::String(s)) => Ok(s.clone()),
        // A tool that answers structured data: the model reads it as JSON text.
        Some(Value::Null) | None => Err(format!("the answer has no \"output\": {}", excerpt(&answer.to_string()))),
        Some(other) => Ok(other.to_string()),
    }
}

/// The answer's body, refusing one larger than [`MAX_TOOL_ANSWER`].
async fn read_limited(response: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut stream = response.bytes_stream();
    let mut body = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| describe_error(&e))?;
        if body.len() + chunk.len() > MAX_TOOL_ANSWER {
            return Err(format!("the answer is larger than {} MiB", MAX_TOOL_ANSWER / (1024 * 1024)));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
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

    #[test]
    fn durations_read_well() {
        assert_eq!(describe(Duration::from_secs(60)), "60 s");
        assert_eq!(describe(Duration::from_millis(1500)), "1.5 s");
        assert_eq!(describe(Duration::from_millis(250)), "250 ms");
    }
}
