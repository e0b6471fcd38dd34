//! Tools from MCP servers (README, "MCP tools"): a run's `mcp_servers` are
//! Model Context Protocol servers over the streamable HTTP transport, spoken
//! with the official Rust SDK (`rmcp`) on our reqwest client.
//!
//! - **Revisions.** Each connection probes the stateless 2026-07-28 revision
//!   (`server/discover`, every request carrying its version and capabilities)
//!   and falls back to `initialize` and a session (2025-03-26 … 2025-11-25)
//!   when the server does not know it (`ClientLifecycleMode::Auto`). The
//!   version agreed is logged. A session the server forgot (404) is opened
//!   again by the SDK, and the call sent once more.
//! - **One connection a worker and server** (its URL and the headers it is
//!   sent): made at the first use, shared by every turn and call of the
//!   process (the SDK multiplexes requests on it), made again when its
//!   transport closed; at most [`MAX_CONNECTIONS`], the least recently used
//!   closed first.
//! - **Discovery** (`tools/list`, every page, bounded) happens at a run's first
//!   turn; its result is kept in the run's record (`RunStore::keep_mcp_tools`),
//!   so every later turn, on any worker, offers the model the same tools. A
//!   tool is offered as `<server>__<tool>` with the server's schema, filtered
//!   by `allowed_tools`; one whose name or schema a provider would refuse is
//!   left out, with a warning.
//! - **Calls** go to `tools/call`; the answer's content becomes the tool's
//!   output text: text as it is, images, audio and binary resources
//!   described (type and size), embedded text resources with their URI, and
//!   the structured content when there is nothing else. A result flagged
//!   `isError`, and every failure below it, is the tool's error text — never
//!   the run's failure (`ToolClient::run`).
//! - **Where it may connect**: `PACELINE_MCP_ENDPOINTS` (checked at submit
//!   and again here), the same public-address rule and no-redirect client as
//!   endpoint tools (`resolve.rs`). Header values come from this worker's
//!   environment, by the names the spec gives, and are marked sensitive:
//!   they are never logged, stored or shown.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ContentBlock, Implementation,
    PaginatedRequestParams, ProtocolVersion, ResourceContents, Tool,
};
use rmcp::service::{ClientCacheConfig, ClientInitializeError, ClientLifecycleMode, ClientServiceExt, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceError};
use serde_json::{json, Value};
use shared::runs::{McpHeaderVars, McpServer, ToolEndpoints, MCP_SEPARATOR};
use tokio::sync::{OnceCell, Semaphore};

use super::{excerpt, too_large};

/// Connections a worker keeps open at most (one a tenant, server and header set).
pub const MAX_CONNECTIONS: usize = 64;

/// How long connecting (and agreeing on a revision) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long listing a run's servers' tools may take, every page of every
/// server (listed at once) together.
const LIST_TIMEOUT: Duration = Duration::from_secs(60);

/// Pages of `tools/list` read at most: a server whose cursor never ends is
/// read this far.
const MAX_LIST_PAGES: usize = 100;

/// Tools of one server read at most, before filtering.
const MAX_LISTED_TOOLS: usize = 10_000;

/// The largest schema (as JSON) a tool may have to be offered.
const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// The most a run's kept tool list may hold, as JSON (its record carries it
/// to every turn).
const MAX_OFFERED_BYTES: usize = 1024 * 1024;

/// The longest description offered; a longer one is cut.
const MAX_DESCRIPTION_CHARS: usize = 4_096;

/// The most bytes of one answer read, on the wire (a JSON body, or one SSE
/// event): a larger answer is the tool's error. The model reads at most
/// 24 000 characters of it; what is read past that only says how long it was.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// MCP calls a worker waits on at once; with [`MAX_ANSWER_BYTES`] they bound
/// what MCP answers hold in a worker (128 MiB), however many turns run.
const MAX_CALLS_AT_ONCE: usize = 32;

/// Requests one connection carries at once (the SDK queues the rest).
const MAX_REQUESTS_PER_CONNECTION: usize = 64;

/// A run's MCP tools as the model is offered them: function tools in the
/// Responses shape, their names `<server>__<tool>`.
pub type OfferedTools = Vec<Value>;

/// One open connection to a server.
struct Connection {
    service: RunningService<RoleClient, ClientConfig>,
    /// The protocol revision agreed.
    version: String,
    last_used: Mutex<Instant>,
}

/// A connection being made, or made: callers that need it at once wait for
/// the one handshake.
type Slot = Arc<OnceCell<Arc<Connection>>>;

/// Connects to MCP servers, lists their tools and calls them.
pub struct McpClient {
    http: reqwest::Client,
    allowed: ToolEndpoints,
    header_vars: McpHeaderVars,
    connections: Mutex<HashMap<String, Slot>>,
    calls: Semaphore,
}

impl std::fmt::Debug for McpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self.connections.lock().map_or(0, |c| c.len());
        f.debug_struct("McpClient").field("allowed", &self.allowed).field("connections", &open).finish()
    }
}

impl McpClient {
    /// A client allowed the servers of `allowed` and the header variables of
    /// `header_vars`, over `http` (the tools' client: no redirects, no proxy,
    /// public addresses only).
    pub fn new(http: reqwest::Client, allowed: ToolEndpoints, header_vars: McpHeaderVars) -> Self {
        Self {
            http,
            allowed,
            header_vars,
            connections: Mutex::new(HashMap::new()),
            calls: Semaphore::new(MAX_CALLS_AT_ONCE),
        }
    }

    /// Whether `tenant`'s runs may use `server`.
    pub fn allows(&self, tenant: &str, server: &McpServer) -> bool {
        self.allowed.allows(tenant, &server.url)
    }

    /// The tools `servers` offer run `run_id` of `tenant`, at most `room` of
    /// them, in the servers' order and each server's; the servers are listed
    /// at once. `Err`: a server could not be listed (why, naming it).
    pub async fn discover(
        &self,
        run_id: &str,
        tenant: &str,
        servers: &[McpServer],
        room: usize,
    ) -> Result<OfferedTools, String> {
        let lists = servers.iter().map(|server| async move {
            self.list(run_id, tenant, server)
                .await
                .map_err(|why| format!("MCP server {:?} ({}): {why}", server.name, server.url))
        });
        let lists = tokio::time::timeout(LIST_TIMEOUT, futures::future::join_all(lists))
            .await
            .map_err(|_| format!("listing the MCP servers' tools took longer than {} s", LIST_TIMEOUT.as_secs()))?;
        let mut offered = Vec::new();
        let mut names = HashSet::new();
        let mut bytes = 0;
        let mut left_out = 0;
        for list in lists {
            for tool in list? {
                let size = tool.to_string().len();
                let name = tool["name"].as_str().unwrap_or_default().to_owned();
                if offered.len() < room && bytes + size <= MAX_OFFERED_BYTES && names.insert(name) {
                    bytes += size;
                    offered.push(tool);
                } else {
                    left_out += 1;
                }
            }
        }
        if left_out > 0 {
            tracing::warn!(message = "MCP tools left out: a run offers at most 128 tools in all, of 1 MiB, each name once",
                run.id = %run_id, left_out, offered = offered.len());
        }
        Ok(offered)
    }

    /// One server's tools to offer.
    async fn list(&self, run_id: &str, tenant: &str, server: &McpServer) -> Result<OfferedTools, String> {
        if !self.allows(tenant, server) {
            return Err("not an allowed MCP server on this worker (PACELINE_MCP_ENDPOINTS)".into());
        }
        let connection = self.connect(tenant, server).await?;
        let peer = connection.service.peer();
        let mut offered = Vec::new();
        let mut refused: Vec<String> = Vec::new();
        let mut cursor = None;
        let mut listed = 0;
        let mut pages = 0;
        while pages < MAX_LIST_PAGES && listed < MAX_LISTED_TOOLS {
            let page = peer
                .list_tools(Some(PaginatedRequestParams::default().with_cursor(cursor.take())))
                .await
                .map_err(|e| self.failed(tenant, server, &connection, &e))?;
            pages += 1;
            for tool in page.tools.iter().take(MAX_LISTED_TOOLS - listed) {
                listed += 1;
                if !server.allowed_tools.as_ref().is_none_or(|allowed| allowed.iter().any(|a| *a == tool.name)) {
                    continue;
                }
                match offer(server, tool) {
                    Ok(t) => offered.push(t),
                    Err(why) if refused.len() < 5 => refused.push(format!("{}: {why}", excerpt(&tool.name))),
                    Err(_) => refused.push(String::new()),
                }
            }
            cursor = page.next_cursor;
            if cursor.is_none() {
                break;
            }
        }
        if !refused.is_empty() {
            let shown: Vec<&String> = refused.iter().filter(|r| !r.is_empty()).collect();
            tracing::warn!(message = "MCP tools left out: a provider would refuse them", run.id = %run_id,
                mcp.server = %server.name, count = refused.len(), first = ?shown);
        }
        if cursor.is_some() {
            tracing::warn!(message = "an MCP server's tool list read in part", run.id = %run_id,
                mcp.server = %server.name, listed, pages,
                bound = if listed >= MAX_LISTED_TOOLS { "tools" } else { "pages" });
        }
        tracing::info!(message = "MCP tools listed", run.id = %run_id, mcp.server = %server.name,
            mcp.protocol = %connection.version, listed, offered = offered.len());
        Ok(offered)
    }

    /// Calls `tool` of `server` for `tenant` with `arguments` (JSON text),
    /// reading at most `share` bytes of its output. `Err`: the tool's error text.
    pub async fn call(
        &self,
        tenant: &str,
        server: &McpServer,
        tool: &str,
        arguments: &str,
        share: usize,
    ) -> Result<String, String> {
        let arguments = match serde_json::from_str::<Value>(if arguments.trim().is_empty() { "{}" } else { arguments })
        {
            Ok(Value::Object(map)) => map,
            Ok(_) | Err(_) => return Err(format!("the arguments are not a JSON object: {}", excerpt(arguments))),
        };
        let connection = self.connect(tenant, server).await?;
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        // What a worker's MCP answers hold at once is bounded: see MAX_CALLS_AT_ONCE.
        let _permit = self.calls.acquire().await.map_err(|_| "the worker is stopping".to_owned())?;
        let result = connection
            .service
            .peer()
            .call_tool(params)
            .await
            .map_err(|e| self.failed(tenant, server, &connection, &e))?;
        let text = output_text(&result);
        if text.len() > share {
            return Err(too_large(share));
        }
        if result.is_error == Some(true) {
            return Err(if text.is_empty() { "the tool reported an error".into() } else { text });
        }
        Ok(text)
    }

    /// The open connection to `server` for `tenant`, or a new one: made once
    /// however many calls need it at the same moment.
    async fn connect(&self, tenant: &str, server: &McpServer) -> Result<Arc<Connection>, String> {
        let key = connection_key(tenant, server);
        let slot = {
            let mut open = self.lock();
            if let Some(slot) = open.get(&key).filter(|s| s.get().is_some_and(|c| c.service.is_transport_closed())) {
                // Its transport closed: made again below.
                let slot = slot.clone();
                forget(&mut open, &key, &slot);
            }
            if !open.contains_key(&key) && open.len() >= MAX_CONNECTIONS {
                let oldest = open
                    .iter()
                    .min_by_key(|(_, s)| {
                        // One being made is the newest.
                        s.get().map_or_else(Instant::now, |c| *c.last_used.lock().unwrap_or_else(|p| p.into_inner()))
                    })
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    open.remove(&k);
                }
            }
            open.entry(key.clone()).or_default().clone()
        };
        let connection = slot.get_or_try_init(|| self.open(tenant, server)).await?;
        *connection.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        Ok(connection.clone())
    }

    /// A new connection to `server`, its revision agreed.
    async fn open(&self, tenant: &str, server: &McpServer) -> Result<Arc<Connection>, String> {
        let mut headers = HashMap::new();
        for (name, var) in &server.headers_from_env {
            if !self.header_vars.allows(tenant, var) {
                return Err(format!("{var} is not a variable this worker sends (PACELINE_MCP_HEADER_VARS)"));
            }
            let value = std::env::var(var)
                .map_err(|_| format!("this worker has no environment variable {var} (headers_from_env of {name})"))?;
            let name =
                http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("{name:?} is not a header name"))?;
            let mut value = http::HeaderValue::from_str(&value)
                .map_err(|_| format!("the value of {var} cannot be sent as a header (control characters)"))?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        let config = StreamableHttpClientTransportConfig::with_uri(server.url.as_str())
            .custom_headers(headers)
            .max_json_response_size(MAX_ANSWER_BYTES)
            .max_sse_event_size(MAX_ANSWER_BYTES)
            .max_concurrent_requests(MAX_REQUESTS_PER_CONNECTION)
            .reinit_on_expired_session(true);
        let transport = StreamableHttpClientTransport::with_client(self.http.clone(), config);
        let info = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("paceline", env!("CARGO_PKG_VERSION")),
        );
        let lifecycle = ClientLifecycleMode::Auto {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            legacy_version: Some(ProtocolVersion::LATEST_WITH_INITIALIZE),
        };
        let service = match tokio::time::timeout(CONNECT_TIMEOUT, info.serve_with_lifecycle(transport, lifecycle)).await
        {
            Ok(Ok(service)) => service,
            Ok(Err(e)) => return Err(format!("cannot connect: {}", describe_start(&e))),
            Err(_) => return Err(format!("cannot connect: no answer within {} s", CONNECT_TIMEOUT.as_secs())),
        };
        // Every list is read afresh (the SDK would answer a failed re-read
        // with a stale list), and a run's list is kept by the run.
        service.peer().set_response_cache_config(ClientCacheConfig::disabled()).await;
        let agreed = service.peer().peer_info().map(|i| i.protocol_version.clone());
        let version = agreed.as_ref().map_or_else(|| "unknown".to_owned(), ToString::to_string);
        tracing::info!(message = "MCP server connected", mcp.server = %server.name, mcp.protocol = %version,
            stateless = agreed.is_some_and(|v| !v.has_initialize()));
        Ok(Arc::new(Connection { service, version, last_used: Mutex::new(Instant::now()) }))
    }

    /// What a failed request says, as the tool's error; a connection whose
    /// transport closed is forgotten, to be made again by the next call.
    fn failed(&self, tenant: &str, server: &McpServer, connection: &Arc<Connection>, error: &ServiceError) -> String {
        if matches!(error, ServiceError::TransportClosed) || connection.service.is_transport_closed() {
            let key = connection_key(tenant, server);
            let mut open = self.lock();
            if let Some(slot) = open.get(&key).filter(|s| s.get().is_some_and(|c| Arc::ptr_eq(c, connection))).cloned()
            {
                forget(&mut open, &key, &slot);
            }
        }
        let text = match error {
            ServiceError::McpError(data) => {
                return format!("the server answered error {}: {}", data.code.0, excerpt(&data.message))
            }
            // The transport's own error, without the transport's type name.
            ServiceError::TransportSend(sent) => describe_chain(&*sent.error),
            other => describe_chain(other),
        };
        if text.contains("exceeded the maximum size") || text.contains("stream closed before its final response") {
            // A JSON body past the bound is refused whole; an SSE event past it ends the stream.
            return format!(
                "the answer is larger than {} MiB, the most an MCP answer may be ({text})",
                MAX_ANSWER_BYTES >> 20
            );
        }
        text
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Drops `slot` from `open` if it is still the one under `key`.
fn forget(open: &mut HashMap<String, Slot>, key: &str, slot: &Slot) {
    if open.get(key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
        open.remove(key);
    }
}

/// A connection's key: the tenant (one tenant's session is never
/// another's), the server's URL and the headers it is sent (by the variables
/// holding them, never their values).
fn connection_key(tenant: &str, server: &McpServer) -> String {
    let mut key = format!("{tenant}\n{}", server.url);
    for (name, var) in &server.headers_from_env {
        key.push('\n');
        key.push_str(&name.to_ascii_lowercase());
        key.push('=');
        key.push_str(var);
    }
    key
}

/// `tool` of `server` as the model is offered it, or why it cannot be.
fn offer(server: &McpServer, tool: &Tool) -> Result<Value, String> {
    let name = server.tool_name(&tool.name);
    if !shared::runs::spec::valid_tool_name(&name) {
        return Err(format!("{name:?} is not a tool name the providers take (1–64 of a-z, A-Z, 0-9, _ and -)"));
    }
    let mut schema = (*tool.input_schema).clone();
    match schema.get("type") {
        None => {
            schema.insert("type".into(), "object".into());
        }
        Some(Value::String(t)) if t == "object" => {}
        Some(_) => return Err("its input schema is not an object schema".into()),
    }
    let schema = Value::Object(schema);
    if schema.to_string().len() > MAX_SCHEMA_BYTES {
        return Err(format!("its input schema is larger than {} KiB", MAX_SCHEMA_BYTES >> 10));
    }
    let description = tool.description.as_deref().or(tool.title.as_deref()).unwrap_or_default();
    let description: String = description.chars().take(MAX_DESCRIPTION_CHARS).collect();
    // Not strict: an MCP schema seldom keeps the rules strict mode asks of one
    // (every property required, no additional ones), and Responses takes a
    // function tool as strict unless told.
    Ok(json!({"type": "function", "name": name, "description": description, "parameters": schema, "strict": false}))
}

/// The server and tool a call named `name` goes to, when it is an MCP tool
/// of one of `servers` (`<server>__<tool>`: a server's name holds no `__`
/// and ends in no `_`, so the first `__` ends it).
pub fn route<'a>(servers: &'a [McpServer], name: &'a str) -> Option<(&'a McpServer, &'a str)> {
    let (server, tool) = name.split_once(MCP_SEPARATOR)?;
    servers.iter().find(|s| s.name == server).map(|s| (s, tool))
}

/// A tool result as the model reads it.
fn output_text(result: &CallToolResult) -> String {
    let mut parts: Vec<String> = Vec::with_capacity(result.content.len());
    for block in &result.content {
        parts.push(match block {
            ContentBlock::Text(t) => t.text.clone(),
            ContentBlock::Image(i) => format!("[an image, {}, {} bytes: not shown]", i.mime_type, decoded_len(&i.data)),
            ContentBlock::Audio(a) => format!("[audio, {}, {} bytes: not shown]", a.mime_type, decoded_len(&a.data)),
            ContentBlock::Resource(r) => match &r.resource {
                ResourceContents::TextResourceContents { uri, text, .. } => format!("[resource {uri}]\n{text}"),
                ResourceContents::BlobResourceContents { uri, mime_type, blob, .. } => format!(
                    "[resource {uri}, {}, {} bytes: not shown]",
                    mime_type.as_deref().unwrap_or("binary"),
                    decoded_len(blob)
                ),
                // Non-exhaustive in the SDK: a later revision's kinds.
                #[allow(unreachable_patterns)]
                _ => "[a resource of a kind this worker does not show]".to_owned(),
            },
            ContentBlock::ResourceLink(link) => format!("[resource link {}: {}]", link.uri, link.name),
            // Non-exhaustive in the SDK: a later revision's kinds.
            #[allow(unreachable_patterns)]
            _ => "[content of a kind this worker does not show]".to_owned(),
        });
    }
    if parts.is_empty() {
        if let Some(structured) = result.structured_content.as_ref().filter(|v| !v.is_null()) {
            return structured.to_string();
        }
    }
    parts.join("\n")
}

/// The bytes base64 text `data` decodes to, about.
fn decoded_len(data: &str) -> usize {
    data.len() / 4 * 3
}

/// Why a connection could not be made, without the transport's type name.
fn describe_start(error: &ClientInitializeError) -> String {
    match error {
        ClientInitializeError::TransportError { error, context } => {
            format!("{} (at: {context})", describe_chain(&*error.error))
        }
        ClientInitializeError::JsonRpcError(data) => {
            format!("the server answered error {}: {}", data.code.0, excerpt(&data.message))
        }
        other => describe_chain(other),
    }
}

/// An error with its causes, at most an excerpt of them.
fn describe_chain(error: &dyn std::error::Error) -> String {
    excerpt(&crate::provider::error_chain(error))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(name: &str) -> McpServer {
        McpServer {
            name: name.into(),
            url: "https://mcp.example.com/mcp".into(),
            allowed_tools: None,
            headers_from_env: Default::default(),
        }
    }

    #[test]
    fn a_call_routes_to_the_server_its_name_begins_with() {
        let servers = [server("files"), server("web-search")];
        assert_eq!(route(&servers, "files__read").map(|(s, t)| (s.name.as_str(), t)), Some(("files", "read")));
        assert_eq!(route(&servers, "files___x").map(|(_, t)| t), Some("_x"), "the first __ ends the server's name");
        assert_eq!(route(&servers, "web-search__q__a").map(|(_, t)| t), Some("q__a"));
        assert!(route(&servers, "other__read").is_none());
        assert!(route(&servers, "read").is_none());
    }

    #[test]
    fn a_tool_is_offered_with_its_schema_under_its_servers_prefix() {
        let tool: Tool = serde_json::from_value(json!({"name": "read", "description": "Reads a file",
            "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}}}))
        .unwrap();
        let offered = offer(&server("files"), &tool).unwrap();
        assert_eq!(offered["name"], "files__read");
        assert_eq!(offered["type"], "function");
        assert_eq!(offered["parameters"]["properties"]["path"]["type"], "string");
        // A schema without a type is an object's; any other type is refused.
        let untyped: Tool = serde_json::from_value(json!({"name": "t", "inputSchema": {}})).unwrap();
        assert_eq!(offer(&server("f"), &untyped).unwrap()["parameters"]["type"], "object");
        let array: Tool = serde_json::from_value(json!({"name": "t", "inputSchema": {"type": "array"}})).unwrap();
        assert!(offer(&server("f"), &array).unwrap_err().contains("not an object schema"));
        // A name the providers refuse is left out.
        let dotted: Tool = serde_json::from_value(json!({"name": "fs.read", "inputSchema": {}})).unwrap();
        assert!(offer(&server("f"), &dotted).is_err());
    }

    #[test]
    fn content_reads_as_text_and_what_is_not_text_is_described() {
        let result: CallToolResult = serde_json::from_value(json!({"content": [
            {"type": "text", "text": "hello"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "inside"}},
            {"type": "resource_link", "uri": "file:///b", "name": "b"}
        ]}))
        .unwrap();
        assert_eq!(
            output_text(&result),
            "hello\n[an image, image/png, 3 bytes: not shown]\n[resource file:///a.txt]\ninside\n[resource link file:///b: b]"
        );
        let structured: CallToolResult =
            serde_json::from_value(json!({"content": [], "structuredContent": {"n": 1}})).unwrap();
        assert_eq!(output_text(&structured), r#"{"n":1}"#);
    }
}
