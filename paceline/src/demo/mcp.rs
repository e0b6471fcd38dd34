//! The demo's MCP server (README, "MCP tools"): `docs`, served with the
//! official Rust SDK (`rmcp`) over streamable HTTP at `/mcp` beside the demo
//! tool endpoint. It speaks the stateless 2026-07-28 revision and the session
//! ones before it (without keeping sessions: any request stands alone), and
//! offers `lookup` (a short note on a topic) and `word_count`.

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{json, Value};

/// The demo's MCP server.
#[derive(Debug, Clone, Copy, Default)]
pub struct DocsServer;

/// Its tools, as `tools/list` answers them.
fn tools() -> Vec<Tool> {
    let schema = |v: Value| Arc::new(v.as_object().cloned().unwrap_or_default());
    vec![
        Tool::new(
            "lookup",
            "Looks up a short note on a topic in the team's docs.",
            schema(json!({"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]})),
        ),
        Tool::new(
            "word_count",
            "Counts the words of a text.",
            schema(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
        ),
    ]
}

impl ServerHandler for DocsServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let text = |key: &str| args.get(key).and_then(Value::as_str).unwrap_or_default().to_owned();
        let result = match request.name.as_ref() {
            "lookup" => CallToolResult::success(vec![ContentBlock::text(note(&text("topic")))]),
            "word_count" => {
                CallToolResult::success(vec![ContentBlock::text(text("text").split_whitespace().count().to_string())])
            }
            other => CallToolResult::error(vec![ContentBlock::text(format!(
                "the docs server has no tool named {other:?} (it has lookup, word_count)"
            ))]),
        };
        Ok(result.into())
    }
}

/// What `lookup` answers on `topic`.
fn note(topic: &str) -> String {
    format!(
        "Docs on {topic:?}: paceline queues every turn of a run in Redis and asks one shared pacer before each \
         model call, so that every worker together stays inside the provider's tokens-per-minute budget. A turn \
         that must wait is requeued with the delay it owes, not parked in a sleeping task."
    )
}

/// The server as an axum service, to be mounted at `/mcp`.
pub fn service() -> StreamableHttpService<DocsServer, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default().with_legacy_session_mode(false).with_sse_keep_alive(None);
    StreamableHttpService::new(|| Ok(DocsServer), Default::default(), config)
}
