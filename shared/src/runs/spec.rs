//! The run spec a client submits (`POST /v1/runs`; README, "Submitting a run"), and the rules it
//! must keep. Validation happens here, before anything reaches Redis: a body
//! that breaks a rule is a 422 naming the field, never a half-written run.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use super::endpoints::endpoint_allowed;
use super::endpoints::ToolEndpoints;
use super::generation::{self, Generation};
use crate::pacer::Mode;

/// Default and bounds of `max_turns`.
pub const DEFAULT_MAX_TURNS: u32 = 40;
/// The largest `max_turns` accepted.
pub const MAX_MAX_TURNS: u32 = 1_000;
/// The longest `max_run_seconds` accepted: 30 days.
pub const MAX_MAX_RUN_SECONDS: u32 = 30 * 24 * 3_600;
/// Default `max_output_tokens`.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 2_048;
/// The largest `max_output_tokens` accepted.
pub const MAX_MAX_OUTPUT_TOKENS: u32 = 1_000_000;
/// The largest `max_cost_usd` accepted.
pub const MAX_COST_USD: f64 = 1_000_000.0;
/// The bounds of `context_window_tokens`.
pub const CONTEXT_WINDOW_TOKENS: std::ops::RangeInclusive<u64> = 1_024..=100_000_000;

/// `context_overflow` (SPEC §4a): what a turn whose input would not fit the
/// model's context window does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextOverflow {
    /// The oldest tool outputs are elided, then the oldest turns, until it fits.
    #[default]
    Trim,
    /// The provider's own compaction where it has one (Responses
    /// `truncation: "auto"`), `trim` elsewhere.
    Compact,
    /// The run fails with `error.kind = "context_overflow"`, nothing sent.
    Fail,
}

impl ContextOverflow {
    /// The default.
    pub fn is_trim(&self) -> bool {
        *self == Self::Trim
    }
}

/// A validated run spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// The model name, as the provider knows it.
    pub model: String,
    /// System instructions, resent on every turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// The run's input as Responses-API input items (a string input becomes
    /// one user message).
    pub input: Vec<Value>,
    /// Function tools, Responses shape (`{"type":"function","name",...}`).
    #[serde(default)]
    pub tools: Vec<Value>,
    /// Where tool calls are POSTed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_endpoint: Option<String>,
    /// MCP servers whose tools the run offers the model as `<name>__<tool>`
    /// (README, "MCP tools").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServer>,
    /// Where the run's completion webhook is POSTed (`runs::webhooks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook_url: Option<String>,
    /// `work` (background) or `companion` (a live listener).
    pub mode: Mode,
    /// Turns at most; reaching it fails the run with `max_turns`.
    pub max_turns: u32,
    /// The output limit of each call.
    pub max_output_tokens: u32,
    /// A wall-clock deadline from the run's creation, s: a turn that would
    /// start after it fails the run with `deadline` instead. `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_run_seconds: Option<u32>,
    /// The client's own data, returned as given.
    #[serde(default)]
    pub metadata: Value,
    /// The named provider the run's turns go to (`PACELINE_PROVIDERS`);
    /// `None`: the fleet's first (its default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// What a turn that would overflow the model's context window does.
    #[serde(default, skip_serializing_if = "ContextOverflow::is_trim")]
    pub context_overflow: ContextOverflow,
    /// The model's context window, tokens, over the built-in table's
    /// (`shared::models`); `None`: the table's, if it knows the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window_tokens: Option<u64>,
    /// The most the run may cost, USD at the model's price: a call whose
    /// estimated cost would cross it is not sent, and the run fails with
    /// `budget_exceeded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    /// Sampling, reasoning, structured output, tool choice and the
    /// provider's knobs (`generation.rs`), at the top level of the body.
    #[serde(flatten)]
    pub generation: Generation,
}

/// One of a run's MCP servers (`mcp_servers[i]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct McpServer {
    /// The prefix of its tools' names (`<name>__<tool>`): 1–[`MAX_MCP_NAME`]
    /// characters of a-z, A-Z, 0-9 and `-`, `_` but not `__`.
    pub name: String,
    /// Its streamable-HTTP endpoint, as the URL standard spells it.
    pub url: String,
    /// The only tools of it the model is offered (by the server's name for
    /// them); `None`: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_tools: Option<Vec<String>>,
    /// HTTP headers sent to it, each a header name and the name of the
    /// worker's environment variable holding its value: values never pass
    /// through the spec, Redis or the API.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headers_from_env: std::collections::BTreeMap<String, String>,
}

impl McpServer {
    /// The name the model knows `tool` of this server by.
    pub fn tool_name(&self, tool: &str) -> String {
        format!("{}{MCP_SEPARATOR}{tool}", self.name)
    }
}

/// Between a server's name and its tool's in the name the model sees.
pub const MCP_SEPARATOR: &str = "__";
/// The most MCP servers a run may name.
pub const MAX_MCP_SERVERS: usize = 8;
/// The longest MCP server name (the model's tool names are at most 64 characters in all).
pub const MAX_MCP_NAME: usize = 24;
/// The most names in one server's `allowed_tools`.
pub const MAX_MCP_ALLOWED_TOOLS: usize = MAX_TOOLS;
/// The most headers one server's `headers_from_env` may set.
pub const MAX_MCP_HEADERS: usize = 16;

/// The headers a run may not set on its MCP requests: the transport's own.
const MCP_RESERVED_HEADERS: [&str; 16] = [
    "accept",
    "content-type",
    "content-length",
    "host",
    "mcp-session-id",
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
    "last-event-id",
    "connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "cookie",
    "keep-alive",
];

/// The environment variables a run's `headers_from_env` may name
/// (`PACELINE_MCP_HEADER_VARS`): `NAME` for every tenant, `TENANT=NAME` for
/// one, comma-separated. A worker's environment holds its provider keys and
/// secrets too; only a variable listed here is ever read for a header, and
/// only for the tenant it is listed for. Empty allows none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpHeaderVars(pub Vec<(Option<String>, String)>);

impl McpHeaderVars {
    /// Whether `tenant`'s runs may send the value of variable `name`.
    pub fn allows(&self, tenant: &str, name: &str) -> bool {
        self.0.iter().any(|(t, n)| n == name && t.as_deref().is_none_or(|t| t == tenant))
    }

    /// Whether none is allowed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::str::FromStr for McpHeaderVars {
    type Err = String;

    /// `NAME,TENANT=NAME,…`; blanks are skipped.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (tenant, name) = match entry.split_once('=') {
                Some((t, n)) if super::endpoints::valid_tenant(t.trim()) => (Some(t.trim().to_owned()), n.trim()),
                Some(_) => return Err(format!("{entry:?}: not TENANT=NAME (a tenant is 1–64 of a-z A-Z 0-9 _ - .)")),
                None => (None, entry),
            };
            if !valid_env_name(name) {
                return Err(format!("{entry:?}: {name:?} is not an environment variable's name (A-Z, 0-9, _)"));
            }
            out.push((tenant, name.to_owned()));
        }
        Ok(Self(out))
    }
}

impl std::fmt::Display for McpHeaderVars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: Vec<String> = self
            .0
            .iter()
            .map(|(t, n)| match t {
                Some(t) => format!("{t}={n}"),
                None => n.clone(),
            })
            .collect();
        f.write_str(&entries.join(","))
    }
}

/// Checks `mcp_servers` (a list of [`McpServer`]s); `tool_names`, the run's
/// function tools, may not fall under a server's prefix.
fn mcp_servers_from_json(v: Option<&Value>, tool_names: &[&str]) -> Result<Vec<McpServer>, SpecError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(vec![]),
        Some(Value::Array(list)) if list.len() <= MAX_MCP_SERVERS => list,
        Some(Value::Array(_)) => {
            return Err(err("mcp_servers", format!("must hold at most {MAX_MCP_SERVERS} servers")));
        }
        Some(_) => return Err(err("mcp_servers", "must be a list of {\"name\", \"url\"} objects")),
    };
    let mut servers: Vec<McpServer> = Vec::with_capacity(list.len());
    for (i, entry) in list.iter().enumerate() {
        let field = |f: &str| format!("mcp_servers[{i}].{f}");
        let Some(o) = entry.as_object() else { return Err(err(format!("mcp_servers[{i}]"), "must be an object")) };
        if let Some(k) = o.keys().find(|k| !["name", "url", "allowed_tools", "headers_from_env"].contains(&k.as_str()))
        {
            return Err(err(field(k), "unknown field"));
        }
        let name = match o.get("name") {
            Some(Value::String(n))
                if (1..=MAX_MCP_NAME).contains(&n.len())
                    && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    && !n.contains(MCP_SEPARATOR)
                    && !n.ends_with('_') =>
            {
                n.clone()
            }
            Some(Value::String(_)) => {
                return Err(err(
                    field("name"),
                    format!(
                        "must be 1–{MAX_MCP_NAME} characters of a-z, A-Z, 0-9, _ or -, without \"__\" and not ending \
                         in _ (its tools are offered as <name>__<tool>)"
                    ),
                ))
            }
            _ => return Err(err(field("name"), "is required: a short name the server's tools are prefixed with")),
        };
        if servers.iter().any(|s| s.name == name) {
            return Err(err(field("name"), "is used by another server"));
        }
        let prefix = format!("{name}{MCP_SEPARATOR}");
        if let Some(t) = tool_names.iter().find(|t| t.starts_with(&prefix)) {
            return Err(err(field("name"), format!("would own the run's function tool {t:?}: rename one")));
        }
        let url = match o.get("url") {
            Some(Value::String(url)) => match url::Url::parse(url.trim()) {
                Ok(u) if !u.username().is_empty() || u.password().is_some() => {
                    return Err(err(
                        field("url"),
                        "must not hold a user or password: send credentials as a header from the workers' \
                         environment (headers_from_env)",
                    ))
                }
                // Whether this tenant may name it is `SubmitPolicy::admit`'s to say.
                Ok(u)
                    if u.as_str().len() <= 2048 && matches!(u.scheme(), "http" | "https") && !u.cannot_be_a_base() =>
                {
                    u.as_str().to_owned()
                }
                _ => return Err(err(field("url"), "must be an http(s) URL of at most 2 048 characters")),
            },
            _ => return Err(err(field("url"), "is required: the server's streamable-HTTP endpoint")),
        };
        let allowed_tools = match o.get("allowed_tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(names)) if names.len() <= MAX_MCP_ALLOWED_TOOLS => {
                let mut out = Vec::with_capacity(names.len());
                for n in names {
                    match n.as_str() {
                        Some(n) if (1..=128).contains(&n.len()) => out.push(n.to_owned()),
                        _ => {
                            return Err(err(field("allowed_tools"), "must be a list of tool names (1–128 characters)"))
                        }
                    }
                }
                Some(out)
            }
            Some(_) => {
                return Err(err(
                    field("allowed_tools"),
                    format!("must be a list of at most {MAX_MCP_ALLOWED_TOOLS} tool names"),
                ))
            }
        };
        let headers_from_env = match o.get("headers_from_env") {
            None | Some(Value::Null) => Default::default(),
            Some(Value::Object(h)) if h.len() <= MAX_MCP_HEADERS => {
                let mut out = std::collections::BTreeMap::new();
                for (header, var) in h {
                    let token = |s: &str| {
                        !s.is_empty()
                            && s.len() <= 64
                            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
                    };
                    if !token(header) || MCP_RESERVED_HEADERS.contains(&header.to_ascii_lowercase().as_str()) {
                        return Err(err(
                            field("headers_from_env"),
                            format!(
                                "{header:?} is not a header a run may set (a name of letters, digits and -, not one \
                                 of the transport's own: {})",
                                MCP_RESERVED_HEADERS.join(", ")
                            ),
                        ));
                    }
                    let var = match var.as_str() {
                        Some(v) if valid_env_name(v) => v.to_owned(),
                        _ => {
                            return Err(err(
                                field("headers_from_env"),
                                format!(
                                    "the value for {header:?} must name an environment variable of the workers \
                                     (A-Z, 0-9, _; not a digit first), not hold the header's value"
                                ),
                            ))
                        }
                    };
                    if out.keys().any(|k: &String| k.eq_ignore_ascii_case(header)) {
                        return Err(err(field("headers_from_env"), format!("names {header:?} twice")));
                    }
                    out.insert(header.clone(), var);
                }
                out
            }
            Some(_) => {
                return Err(err(
                    field("headers_from_env"),
                    format!(
                        "must be an object of at most {MAX_MCP_HEADERS} header names to environment variable names"
                    ),
                ))
            }
        };
        servers.push(McpServer { name, url, allowed_tools, headers_from_env });
    }
    Ok(servers)
}

/// An environment variable's name as a worker's environment may hold it:
/// upper-case letters, digits and `_`, not a digit first, at most 128.
fn valid_env_name(v: &str) -> bool {
    (1..=128).contains(&v.len())
        && !v.starts_with(|c: char| c.is_ascii_digit())
        && v.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// The most input items a run may start with.
pub const MAX_INPUT_ITEMS: usize = 1_000;
/// The most tools a run may offer (OpenAI's own bound).
pub const MAX_TOOLS: usize = 128;
/// The most keys of a run's metadata.
pub const MAX_METADATA_KEYS: usize = 64;
/// The most bytes of a run's metadata, as JSON (every page of a search reads it).
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// The roles a message in a run's input may have.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// Checks input item `i`: a message (`role` one of [`ROLES`], `content` a
/// string or a list of content parts) or a typed item (`type` a short
/// snake_case name); a function call carries `call_id`, `name` and string
/// `arguments`, a function call's output `call_id` and `output`, as the
/// providers will require of them at the first call.
fn check_input_item(i: usize, item: &Value) -> Result<(), SpecError> {
    let field = |f: &str| if f.is_empty() { format!("input[{i}]") } else { format!("input[{i}].{f}") };
    let Some(o) = item.as_object() else {
        return Err(err(field(""), "must be an object (a Responses-API input item)"));
    };
    let text = |k: &str| o.get(k).is_some_and(Value::is_string);
    match o.get("type") {
        Some(Value::String(t))
            if t.is_empty() || t.len() > 64 || !t.chars().all(|c| c.is_ascii_lowercase() || c == '_') =>
        {
            return Err(err(field("type"), "must be an item type (snake_case, at most 64 characters)"))
        }
        Some(Value::String(t)) if t == "function_call" => {
            if let Some(k) = ["call_id", "name", "arguments"].into_iter().find(|k| !text(k)) {
                return Err(err(field(k), "must be a string (a function_call carries call_id, name and arguments)"));
            }
            return Ok(());
        }
        Some(Value::String(t)) if t == "function_call_output" => {
            if !text("call_id") {
                return Err(err(field("call_id"), "must be a string"));
            }
            if !o.get("output").is_some_and(|v| v.is_string() || v.is_array()) {
                return Err(err(field("output"), "must be a string or a list of content parts"));
            }
            return Ok(());
        }
        Some(Value::String(t)) if t != "message" => return Ok(()),
        Some(Value::String(_)) | None => {}
        Some(_) => return Err(err(field("type"), "must be a string")),
    }
    match o.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => {}
        Some(_) => return Err(err(field("role"), "must be user, assistant, system or developer")),
        None => return Err(err(field(""), "must be a message ({role, content}) or a typed item")),
    }
    match o.get("content") {
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(parts)) if parts.iter().all(Value::is_object) => Ok(()),
        Some(_) => Err(err(field("content"), "must be a string or a list of content parts (objects)")),
        None => Err(err(field(""), "must be a message ({role, content}) or a typed item")),
    }
}

/// The longest model name a run may give.
pub const MAX_MODEL_LEN: usize = 128;

/// Whether `m` may be a model name: 1 to [`MAX_MODEL_LEN`] characters of
/// letters, digits and `._:/@+-`, a letter or digit first — every provider's
/// names (`gpt-4.1-mini`, `claude-sonnet-4-5-20250929`,
/// `meta-llama/Llama-3.1-8B-Instruct`, `ft:gpt-4o-mini:org::id`,
/// `us.anthropic.claude-3-5-sonnet-20241022-v2:0`), and nothing that could
/// be a key, a label or a log line of its own (the name keys the pacer's
/// state and labels metrics).
pub fn valid_model(m: &str) -> bool {
    let mut chars = m.chars();
    m.len() <= MAX_MODEL_LEN
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "._:/@+-".contains(c))
}

/// `PACELINE_MODELS`: the models runs may name, comma-separated; a name
/// ending in `*` allows every name it starts (`gpt-4.1*,claude-*`). Empty:
/// any valid name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelAllowList(Vec<String>);

impl ModelAllowList {
    /// Whether a run may name `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.0.is_empty()
            || self.0.iter().any(|m| match m.strip_suffix('*') {
                Some(prefix) => model.starts_with(prefix),
                None => m == model,
            })
    }
}

impl std::str::FromStr for ModelAllowList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let names: Vec<String> = s.split(',').map(str::trim).filter(|m| !m.is_empty()).map(str::to_owned).collect();
        if let Some(bad) = names.iter().find(|m| !valid_model(m.strip_suffix('*').unwrap_or(m))) {
            return Err(format!(
                "`{bad}` is not a model name (letters, digits and ._:/@+-, a trailing * for a prefix)"
            ));
        }
        Ok(Self(names))
    }
}

/// What a submitted body got wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    /// The JSON field at fault (`tools[2].name`).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { field: field.into(), message: message.into() }
}

/// What runs may name and who may submit what: tool endpoints
/// (`PACELINE_TOOL_ENDPOINTS`, per tenant or for all), providers
/// (`PACELINE_PROVIDERS`) and companion mode (`PACELINE_COMPANION_TENANTS`).
/// [`RunSpec::from_json`] checks the body; [`SubmitPolicy::admit`] checks it
/// against the tenant who sent it.
#[derive(Debug, Clone, Default)]
pub struct SubmitPolicy {
    /// Allowed tool endpoints; empty allows none.
    pub tool_endpoints: ToolEndpoints,
    /// The fleet's provider names; empty means the one unnamed provider of a
    /// single-provider fleet, which a run may call
    /// [`crate::providers::DEFAULT_PROVIDER`].
    pub providers: Vec<String>,
    /// The tenants that may submit `mode: companion`; empty: every tenant.
    pub companion_tenants: Vec<String>,
    /// The models runs may name (`PACELINE_MODELS`); empty: any valid name.
    pub models: ModelAllowList,
    /// Allowed completion webhook URLs (`PACELINE_WEBHOOK_ENDPOINTS`); empty allows none.
    pub webhook_endpoints: ToolEndpoints,
    /// Allowed MCP servers (`PACELINE_MCP_ENDPOINTS`); empty allows none.
    pub mcp_endpoints: ToolEndpoints,
    /// The variables `headers_from_env` may name (`PACELINE_MCP_HEADER_VARS`); empty allows none.
    pub mcp_header_vars: McpHeaderVars,
}

/// Why a tenant may not submit a spec that is valid in itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A rule of the body for this tenant (422): a `tool_endpoint` not
    /// allowed to it.
    #[error(transparent)]
    Invalid(SpecError),
    /// A privilege this tenant lacks (403): companion mode. The same body
    /// from a tenant that holds it is accepted, so it is not a bad body.
    #[error("{0}")]
    Forbidden(String),
}

impl SubmitPolicy {
    /// The provider names a run may give.
    pub fn provider_names(&self) -> Vec<&str> {
        if self.providers.is_empty() {
            vec![crate::providers::DEFAULT_PROVIDER]
        } else {
            self.providers.iter().map(String::as_str).collect()
        }
    }

    /// Whether `tenant` may submit companion runs.
    pub fn may_use_companion(&self, tenant: &str) -> bool {
        self.companion_tenants.is_empty() || self.companion_tenants.iter().any(|t| t == tenant)
    }

    /// Whether `tenant` may submit `spec` (already valid by [`RunSpec::from_json`]).
    pub fn admit(&self, tenant: &str, spec: &RunSpec) -> Result<(), Refusal> {
        if spec.mode == Mode::Companion && !self.may_use_companion(tenant) {
            return Err(Refusal::Forbidden(format!(
                "tenant {tenant} may not submit companion runs (PACELINE_COMPANION_TENANTS); submit it as mode \"work\""
            )));
        }
        if !self.models.allows(&spec.model) {
            return Err(Refusal::Invalid(err("model", "is not an allowed model (PACELINE_MODELS)")));
        }
        if let Some(url) = &spec.tool_endpoint {
            if !self.tool_endpoints.allows(tenant, url) {
                return Err(Refusal::Invalid(err(
                    "tool_endpoint",
                    "is not an allowed tool endpoint (PACELINE_TOOL_ENDPOINTS)",
                )));
            }
        }
        if let Some(url) = &spec.webhook_url {
            if !self.webhook_endpoints.allows(tenant, url) {
                return Err(Refusal::Invalid(err(
                    "webhook_url",
                    "is not an allowed webhook endpoint (PACELINE_WEBHOOK_ENDPOINTS)",
                )));
            }
        }
        for (i, server) in spec.mcp_servers.iter().enumerate() {
            if !self.mcp_endpoints.allows(tenant, &server.url) {
                return Err(Refusal::Invalid(err(
                    format!("mcp_servers[{i}].url"),
                    "is not an allowed MCP server (PACELINE_MCP_ENDPOINTS)",
                )));
            }
            if let Some(var) = server.headers_from_env.values().find(|v| !self.mcp_header_vars.allows(tenant, v)) {
                return Err(Refusal::Invalid(err(
                    format!("mcp_servers[{i}].headers_from_env"),
                    format!("names {var}, which PACELINE_MCP_HEADER_VARS does not allow this tenant's runs to send"),
                )));
            }
        }
        Ok(())
    }
}

const KNOWN_FIELDS: [&str; 16] = [
    "model",
    "instructions",
    "input",
    "tools",
    "tool_endpoint",
    "mode",
    "max_turns",
    "max_output_tokens",
    "max_run_seconds",
    "metadata",
    "provider",
    "context_overflow",
    "context_window_tokens",
    "max_cost_usd",
    "webhook_url",
    "mcp_servers",
];

impl RunSpec {
    /// Validates a submitted JSON body.
    pub fn from_json(body: &Value, policy: &SubmitPolicy) -> Result<Self, SpecError> {
        let obj = body.as_object().ok_or_else(|| err("", "the body must be a JSON object"))?;
        let known = |k: &str| KNOWN_FIELDS.contains(&k) || generation::FIELDS.contains(&k);
        if let Some(unknown) = obj.keys().find(|k| !known(k.as_str())) {
            return Err(err(unknown.clone(), "unknown field"));
        }
        let model = match obj.get("model") {
            Some(Value::String(m)) if valid_model(m) => m.clone(),
            Some(Value::String(_)) => {
                return Err(err(
                    "model",
                    format!(
                        "must be a model name of 1 to {MAX_MODEL_LEN} characters: letters, digits and . _ : / @ + - \
                         (not first)"
                    ),
                ))
            }
            Some(_) => return Err(err("model", "must be a string")),
            None => return Err(err("model", "is required")),
        };
        let instructions = match obj.get("instructions") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(err("instructions", "must be a string")),
        };
        let input = match obj.get("input") {
            Some(Value::String(s)) if !s.is_empty() => vec![serde_json::json!({"role": "user", "content": s})],
            Some(Value::String(_)) => return Err(err("input", "must not be empty")),
            Some(Value::Array(items)) if items.len() > MAX_INPUT_ITEMS => {
                return Err(err("input", format!("must hold at most {MAX_INPUT_ITEMS} items")))
            }
            Some(Value::Array(items)) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    check_input_item(i, item)?;
                }
                items.clone()
            }
            Some(Value::Array(_)) => return Err(err("input", "must not be empty")),
            Some(_) => return Err(err("input", "must be a string or a list of input items")),
            None => return Err(err("input", "is required")),
        };
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(tools)) if tools.len() > MAX_TOOLS => {
                return Err(err("tools", format!("must hold at most {MAX_TOOLS} tools")))
            }
            Some(Value::Array(tools)) => {
                let mut names = std::collections::HashSet::new();
                for (i, tool) in tools.iter().enumerate() {
                    let field = format!("tools[{i}]");
                    let Some(t) = tool.as_object() else { return Err(err(field, "must be an object")) };
                    if t.get("type").and_then(Value::as_str) != Some("function") {
                        return Err(err(format!("{field}.type"), "must be \"function\""));
                    }
                    let name = match t.get("name") {
                        Some(Value::String(n)) if valid_tool_name(n) => n,
                        Some(Value::String(_)) => {
                            return Err(err(
                                format!("{field}.name"),
                                "must be 1–64 characters of a-z, A-Z, 0-9, _ or -",
                            ))
                        }
                        _ => return Err(err(format!("{field}.name"), "is required")),
                    };
                    if !names.insert(name.clone()) {
                        return Err(err(format!("{field}.name"), "is used by another tool"));
                    }
                    if let Some(p) = t.get("parameters") {
                        if !p.is_object() {
                            return Err(err(format!("{field}.parameters"), "must be a JSON schema object"));
                        }
                    }
                }
                tools.clone()
            }
            Some(_) => return Err(err("tools", "must be a list")),
        };
        let tool_endpoint = match obj.get("tool_endpoint") {
            None | Some(Value::Null) => None,
            Some(Value::String(url)) => {
                // Whether this tenant may call it is `SubmitPolicy::admit`'s to say.
                let parsed = url::Url::parse(url.trim()).ok();
                if !parsed.is_some_and(|u| matches!(u.scheme(), "http" | "https") && !u.cannot_be_a_base()) {
                    return Err(err("tool_endpoint", "must be an http(s) URL"));
                }
                Some(url.clone())
            }
            Some(_) => return Err(err("tool_endpoint", "must be a URL string")),
        };
        let webhook_url = match obj.get("webhook_url") {
            None | Some(Value::Null) => None,
            Some(Value::String(url)) => {
                // Whether this tenant may name it is `SubmitPolicy::admit`'s to say.
                let parsed = url::Url::parse(url.trim()).ok();
                match parsed {
                    // Kept as the URL standard spells it (`HTTPS://Hooks.x:443/a` is
                    // `https://hooks.x/a`): one receiver, one origin, whatever the spelling.
                    Some(u) if url.len() <= 2048 && matches!(u.scheme(), "http" | "https") && !u.cannot_be_a_base() => {
                        Some(u.as_str().to_owned())
                    }
                    _ => return Err(err("webhook_url", "must be an http(s) URL of at most 2 048 characters")),
                }
            }
            Some(_) => return Err(err("webhook_url", "must be a URL string")),
        };
        if !tools.is_empty() && tool_endpoint.is_none() {
            return Err(err("tool_endpoint", "is required when tools are given"));
        }
        let mode = match obj.get("mode") {
            None | Some(Value::Null) => Mode::Work,
            Some(m) => {
                m.as_str().and_then(Mode::parse).ok_or_else(|| err("mode", "must be \"work\" or \"companion\""))?
            }
        };
        let max_turns = bounded(obj.get("max_turns"), "max_turns", DEFAULT_MAX_TURNS, MAX_MAX_TURNS)?;
        let max_output_tokens = bounded(
            obj.get("max_output_tokens"),
            "max_output_tokens",
            DEFAULT_MAX_OUTPUT_TOKENS,
            MAX_MAX_OUTPUT_TOKENS,
        )?;
        let max_run_seconds = match obj.get("max_run_seconds") {
            None | Some(Value::Null) => None,
            v => Some(bounded(v, "max_run_seconds", 0, MAX_MAX_RUN_SECONDS)?),
        };
        let metadata = match obj.get("metadata") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(m @ Value::Object(o)) if o.len() <= MAX_METADATA_KEYS && m.to_string().len() <= MAX_METADATA_BYTES => {
                m.clone()
            }
            Some(Value::Object(_)) => {
                return Err(err(
                    "metadata",
                    format!("must hold at most {MAX_METADATA_KEYS} keys and {MAX_METADATA_BYTES} bytes of JSON"),
                ))
            }
            Some(_) => return Err(err("metadata", "must be an object")),
        };
        let provider = match obj.get("provider") {
            None | Some(Value::Null) => None,
            Some(Value::String(name)) => {
                let known = policy.provider_names();
                if !known.contains(&name.as_str()) {
                    return Err(err(
                        "provider",
                        format!("is not a provider of this fleet (PACELINE_PROVIDERS has: {})", known.join(", ")),
                    ));
                }
                Some(name.clone())
            }
            Some(_) => return Err(err("provider", "must be the name of a provider")),
        };
        let context_overflow = match obj.get("context_overflow") {
            None | Some(Value::Null) => ContextOverflow::Trim,
            Some(v) => v
                .as_str()
                .and_then(|s| serde_json::from_value::<ContextOverflow>(Value::String(s.to_owned())).ok())
                .ok_or_else(|| err("context_overflow", "must be \"trim\", \"compact\" or \"fail\""))?,
        };
        let context_window_tokens = match obj.get("context_window_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|n| CONTEXT_WINDOW_TOKENS.contains(n)).ok_or_else(|| {
                err(
                    "context_window_tokens",
                    format!(
                        "must be an integer from {} to {}",
                        CONTEXT_WINDOW_TOKENS.start(),
                        CONTEXT_WINDOW_TOKENS.end()
                    ),
                )
            })?),
        };
        let max_cost_usd = match obj.get("max_cost_usd") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let cap = v.as_f64().filter(|c| c.is_finite() && *c > 0.0 && *c <= MAX_COST_USD).ok_or_else(|| {
                    err("max_cost_usd", format!("must be a number of USD above 0, at most {MAX_COST_USD}"))
                })?;
                if crate::models::price(&model).is_none() {
                    return Err(err(
                        "max_cost_usd",
                        format!("no price is known for model {model:?}: give one in PACELINE_PRICES to cap its cost"),
                    ));
                }
                Some(cap)
            }
        };
        let tool_names: Vec<&str> = tools.iter().filter_map(|t| t.get("name").and_then(Value::as_str)).collect();
        let generation = Generation::from_json(obj, &tool_names)?;
        let mcp_servers = mcp_servers_from_json(obj.get("mcp_servers"), &tool_names)?;
        Ok(Self {
            model,
            instructions,
            input,
            tools,
            tool_endpoint,
            mcp_servers,
            webhook_url,
            mode,
            max_turns,
            max_output_tokens,
            max_run_seconds,
            metadata,
            provider,
            context_overflow,
            context_window_tokens,
            max_cost_usd,
            generation,
        })
    }
}

fn bounded(v: Option<&Value>, field: &str, default: u32, max: u32) -> Result<u32, SpecError> {
    match v {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) if (1..=max as u64).contains(&n) => Ok(n as u32),
            _ => Err(err(field, format!("must be an integer from 1 to {max}"))),
        },
        Some(_) => Err(err(field, "must be an integer")),
    }
}

/// Whether `n` is a function tool's name every provider takes: 1–64 of
/// `a-z A-Z 0-9 _ -` (a run's own tools, and its MCP servers' as offered).
pub fn valid_tool_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> SubmitPolicy {
        SubmitPolicy {
            tool_endpoints: ToolEndpoints::every_tenant(["http://127.0.0.1:9000/tools"])
                .with(Some("acme"), "http://tools.acme.internal/"),
            providers: vec!["openai".into(), "claude".into()],
            companion_tenants: vec![],
            models: ModelAllowList::default(),
            webhook_endpoints: ToolEndpoints::every_tenant(["https://hooks.example.com/paceline"]),
            mcp_endpoints: ToolEndpoints::every_tenant(["https://mcp.example.com/"])
                .with(Some("acme"), "https://mcp.acme.internal/"),
            mcp_header_vars: "FILES_MCP_TOKEN,acme=ACME_MCP_TOKEN".parse().unwrap(),
        }
    }

    #[test]
    fn mcp_servers_are_named_allowed_and_send_headers_only_from_the_workers_environment() {
        let p = policy();
        let spec =
            |servers: Value| RunSpec::from_json(&json!({"model": "m", "input": "x", "mcp_servers": servers}), &p);
        let ok = spec(json!([{"name": "files", "url": "HTTPS://MCP.example.com:443/files/mcp",
                              "allowed_tools": ["read", "search"],
                              "headers_from_env": {"Authorization": "FILES_MCP_TOKEN"}}]))
        .expect("a valid body");
        let server = &ok.mcp_servers[0];
        assert_eq!(server.url, "https://mcp.example.com/files/mcp", "kept as the URL standard spells it");
        assert_eq!(server.allowed_tools.as_deref(), Some(&["read".to_owned(), "search".to_owned()][..]));
        assert_eq!(server.headers_from_env["Authorization"], "FILES_MCP_TOKEN");
        assert_eq!(server.tool_name("read"), "files__read");
        assert_eq!(p.admit("alpha", &ok), Ok(()));
        // Its spec reads back (the record keeps it as JSON).
        let back: RunSpec = serde_json::from_str(&serde_json::to_string(&ok).unwrap()).unwrap();
        assert_eq!(back, ok);

        let url = "https://mcp.example.com/mcp";
        for (servers, field) in [
            (json!({"name": "a"}), "mcp_servers"),
            (json!([7]), "mcp_servers[0]"),
            (json!([{"url": url}]), "mcp_servers[0].name"),
            (json!([{"name": "a__b", "url": url}]), "mcp_servers[0].name"),
            (json!([{"name": "a_", "url": url}]), "mcp_servers[0].name"),
            (json!([{"name": "a.b", "url": url}]), "mcp_servers[0].name"),
            (json!([{"name": "a", "url": url}, {"name": "a", "url": url}]), "mcp_servers[1].name"),
            (json!([{"name": "a"}]), "mcp_servers[0].url"),
            (json!([{"name": "a", "url": "ftp://mcp.example.com/"}]), "mcp_servers[0].url"),
            (json!([{"name": "a", "url": url, "allowed_tools": "read"}]), "mcp_servers[0].allowed_tools"),
            (json!([{"name": "a", "url": url, "allowed_tools": [""]}]), "mcp_servers[0].allowed_tools"),
            (
                json!([{"name": "a", "url": url, "headers_from_env": {"Authorization": "Bearer abc"}}]),
                "mcp_servers[0].headers_from_env",
            ),
            (
                json!([{"name": "a", "url": url, "headers_from_env": {"Mcp-Session-Id": "SID"}}]),
                "mcp_servers[0].headers_from_env",
            ),
            (
                json!([{"name": "a", "url": url, "headers_from_env": {"Bad Header": "X"}}]),
                "mcp_servers[0].headers_from_env",
            ),
            (json!([{"name": "a", "url": url, "token": "abc"}]), "mcp_servers[0].token"),
            (json!([{"name": "a", "url": "https://user:pw@mcp.example.com/mcp"}]), "mcp_servers[0].url"),
            (
                json!([{"name": "a", "url": url, "headers_from_env": {"Cookie": "C"}}]),
                "mcp_servers[0].headers_from_env",
            ),
            (json!((0..9).map(|i| json!({"name": format!("s{i}"), "url": url})).collect::<Vec<_>>()), "mcp_servers"),
        ] {
            assert_eq!(spec(servers.clone()).unwrap_err().field, field, "{servers}");
        }
        // A function tool may not fall under a server's prefix.
        let body = json!({"model": "m", "input": "x", "tool_endpoint": "http://127.0.0.1:9000/tools",
            "tools": [{"type": "function", "name": "files__read"}],
            "mcp_servers": [{"name": "files", "url": url}]});
        assert_eq!(RunSpec::from_json(&body, &p).unwrap_err().field, "mcp_servers[0].name");

        // Allowed per tenant, like tool endpoints.
        let acme = spec(json!([{"name": "a", "url": "https://mcp.acme.internal/mcp"}])).unwrap();
        assert_eq!(p.admit("acme", &acme), Ok(()));
        let Err(Refusal::Invalid(e)) = p.admit("alpha", &acme) else { panic!("another tenant's server is refused") };
        assert_eq!(e.field, "mcp_servers[0].url");
        assert!(e.message.contains("PACELINE_MCP_ENDPOINTS"), "{}", e.message);
        let none = SubmitPolicy { mcp_endpoints: ToolEndpoints::default(), ..policy() };
        assert!(none.admit("alpha", &ok).is_err(), "no list allows no server");

        // A header's variable must be one PACELINE_MCP_HEADER_VARS lets the tenant send: a
        // worker's environment holds its provider keys and secrets too.
        let naming = |var: &str, url: &str| {
            spec(json!([{"name": "a", "url": url, "headers_from_env": {"Authorization": var}}])).unwrap()
        };
        for (tenant, var, url, ok) in [
            ("alpha", "OPENAI_API_KEY", "https://mcp.example.com/mcp", false),
            ("alpha", "PACELINE_TOOL_SECRET", "https://mcp.example.com/mcp", false),
            ("alpha", "ACME_MCP_TOKEN", "https://mcp.example.com/mcp", false),
            ("acme", "ACME_MCP_TOKEN", "https://mcp.acme.internal/mcp", true),
            ("alpha", "FILES_MCP_TOKEN", "https://mcp.example.com/mcp", true),
        ] {
            let admitted = p.admit(tenant, &naming(var, url));
            assert_eq!(admitted.is_ok(), ok, "{tenant} {var}: {admitted:?}");
            if let Err(Refusal::Invalid(e)) = admitted {
                assert_eq!(e.field, "mcp_servers[0].headers_from_env");
                assert!(e.message.contains("PACELINE_MCP_HEADER_VARS"), "{}", e.message);
            }
        }
        let vars: McpHeaderVars = " A_TOKEN , acme=B_TOKEN ".parse().unwrap();
        assert_eq!(vars.to_string(), "A_TOKEN,acme=B_TOKEN");
        assert_eq!(vars.to_string().parse::<McpHeaderVars>().unwrap(), vars, "Display reads back");
        for bad in ["lower_case", "acme=1X", "a b=X", "=X"] {
            assert!(bad.parse::<McpHeaderVars>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_webhook_url_must_be_an_allowed_http_url() {
        let p = policy();
        let spec = |url: Value| RunSpec::from_json(&json!({"model": "m", "input": "x", "webhook_url": url}), &p);
        let ok = spec(json!("https://hooks.example.com/paceline/done")).expect("a valid body");
        assert_eq!(ok.webhook_url.as_deref(), Some("https://hooks.example.com/paceline/done"));
        assert_eq!(p.admit("alpha", &ok), Ok(()));
        for bad in [
            json!("ftp://hooks.example.com/x"),
            json!("not a url"),
            json!(7),
            json!(format!("https://h.x/{}", "a".repeat(3000))),
        ] {
            assert_eq!(spec(bad.clone()).unwrap_err().field, "webhook_url", "{bad}");
        }
        let elsewhere = spec(json!("https://evil.example.com/paceline")).expect("valid in itself");
        let Err(Refusal::Invalid(e)) = p.admit("alpha", &elsewhere) else {
            panic!("an endpoint not allowed is refused")
        };
        assert_eq!(e.field, "webhook_url");
        assert!(e.message.contains("PACELINE_WEBHOOK_ENDPOINTS"), "{}", e.message);
        let none_allowed = SubmitPolicy { webhook_endpoints: ToolEndpoints::default(), ..policy() };
        assert!(none_allowed.admit("alpha", &ok).is_err(), "no list allows no webhook");
    }

    fn field_of(body: Value) -> String {
        RunSpec::from_json(&body, &policy()).unwrap_err().field
    }

    #[test]
    fn a_minimal_spec_gets_the_defaults() {
        let s = RunSpec::from_json(&json!({"model": "gpt-4.1-mini", "input": "hi"}), &policy()).unwrap();
        assert_eq!(s.mode, Mode::Work);
        assert_eq!(s.max_turns, DEFAULT_MAX_TURNS);
        assert_eq!(s.input, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(s.metadata, json!({}));
        assert_eq!((s.context_overflow, s.context_window_tokens), (ContextOverflow::Trim, None));
        let s = RunSpec::from_json(
            &json!({"model": "m", "input": "hi", "context_overflow": "fail", "context_window_tokens": 8192}),
            &policy(),
        )
        .unwrap();
        assert_eq!((s.context_overflow, s.context_window_tokens), (ContextOverflow::Fail, Some(8192)));
        let stored = serde_json::to_value(&s).unwrap();
        assert_eq!(serde_json::from_value::<RunSpec>(stored).unwrap(), s);
    }

    #[test]
    fn each_rule_names_its_field() {
        let cases = [
            (json!([1]), ""),
            (json!({"input": "x"}), "model"),
            (json!({"model": 3, "input": "x"}), "model"),
            (json!({"model": "m"}), "input"),
            (json!({"model": "m", "input": ""}), "input"),
            (json!({"model": "m", "input": [3]}), "input[0]"),
            (json!({"model": "m", "input": "x", "max_turns": 0}), "max_turns"),
            (json!({"model": "m", "input": "x", "max_turns": 1001}), "max_turns"),
            (json!({"model": "m", "input": "x", "max_turns": "5"}), "max_turns"),
            (json!({"model": "m", "input": "x", "max_run_seconds": 0}), "max_run_seconds"),
            (json!({"model": "m", "input": "x", "max_run_seconds": 2_592_001}), "max_run_seconds"),
            (json!({"model": "m", "input": "x", "max_run_seconds": 1.5}), "max_run_seconds"),
            (json!({"model": "m", "input": "x", "max_output_tokens": -1}), "max_output_tokens"),
            (json!({"model": "m", "input": "x", "mode": "fast"}), "mode"),
            (json!({"model": "m", "input": "x", "metadata": []}), "metadata"),
            (json!({"model": "m", "input": "x", "colour": "red"}), "colour"),
            (
                json!({"model": "m", "input": "x", "tool_endpoint": "http://127.0.0.1:9000/tools",
                       "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (
                json!({"model": "m", "input": "x", "tool_endpoint": "http://127.0.0.1:9000/tools",
                       "tools": [{"type": "function", "name": "a"}, {"type": "function", "name": "a"}]}),
                "tools[1].name",
            ),
            (json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "a"}]}), "tool_endpoint"),
            (json!({"model": "m", "input": "x", "tool_endpoint": "file:///etc/passwd"}), "tool_endpoint"),
            (json!({"model": "m", "input": "x", "provider": "gemini"}), "provider"),
            (json!({"model": "m", "input": "x", "provider": 1}), "provider"),
            (json!({"model": "m", "input": "x", "temperature": 3}), "temperature"),
            (json!({"model": "m", "input": "x", "tool_choice": "required"}), "tool_choice"),
            (json!({"model": "m", "input": "x", "context_overflow": "drop"}), "context_overflow"),
            (json!({"model": "m", "input": "x", "context_overflow": 1}), "context_overflow"),
            (json!({"model": "m", "input": "x", "context_window_tokens": 0}), "context_window_tokens"),
            (json!({"model": "m", "input": "x", "context_window_tokens": -5}), "context_window_tokens"),
            (json!({"model": "m", "input": "x", "context_window_tokens": 1.5}), "context_window_tokens"),
            (json!({"model": "m", "input": "x", "context_window_tokens": "8k"}), "context_window_tokens"),
            (json!({"model": "m", "input": "x", "prompt_cache": "maybe"}), "prompt_cache"),
            (json!({"model": "gpt-4.1", "input": "x", "max_cost_usd": 0}), "max_cost_usd"),
            (json!({"model": "gpt-4.1", "input": "x", "max_cost_usd": -1}), "max_cost_usd"),
            (json!({"model": "gpt-4.1", "input": "x", "max_cost_usd": "5"}), "max_cost_usd"),
            (json!({"model": "gpt-4.1", "input": "x", "max_cost_usd": 2e6}), "max_cost_usd"),
            (json!({"model": "no-price", "input": "x", "max_cost_usd": 5}), "max_cost_usd"),
        ];
        for (body, field) in cases {
            assert_eq!(field_of(body.clone()), field, "{body}");
        }
    }

    #[test]
    fn a_run_names_a_provider_of_the_fleet_and_its_generation_parameters() {
        let body = json!({"model": "claude-sonnet-4-5", "input": "hi", "provider": "claude",
                          "temperature": 0.5, "reasoning": {"effort": "low"}});
        let s = RunSpec::from_json(&body, &policy()).unwrap();
        assert_eq!(s.provider.as_deref(), Some("claude"));
        assert_eq!(s.generation.temperature, Some(0.5));
        // Stored as JSON and read back by the worker: the same spec, the
        // parameters at the top level as submitted.
        let stored = serde_json::to_value(&s).unwrap();
        assert_eq!(stored["reasoning"], json!({"effort": "low"}));
        assert_eq!(serde_json::from_value::<RunSpec>(stored).unwrap(), s);
        // A single-provider fleet knows one provider, `default`.
        let single = SubmitPolicy::default();
        assert!(RunSpec::from_json(&json!({"model": "m", "input": "x", "provider": "default"}), &single).is_ok());
        let err = RunSpec::from_json(&json!({"model": "m", "input": "x", "provider": "claude"}), &single).unwrap_err();
        assert_eq!(err.field, "provider");
        assert!(err.message.contains("default"), "{err}");
    }

    #[test]
    fn a_tenant_may_name_the_shared_endpoints_and_its_own() {
        let p = policy();
        let run = |url: &str| {
            RunSpec::from_json(&json!({"model": "m", "input": "x", "tool_endpoint": url}), &p).expect("a valid body")
        };
        assert_eq!(p.admit("beta", &run("http://127.0.0.1:9000/tools/x")), Ok(()));
        assert_eq!(p.admit("acme", &run("http://tools.acme.internal/search")), Ok(()));
        let Err(Refusal::Invalid(e)) = p.admit("beta", &run("http://tools.acme.internal/search")) else {
            panic!("acme's endpoint is refused to beta")
        };
        assert_eq!(e.field, "tool_endpoint");
        assert!(matches!(p.admit("acme", &run("http://evil.example/tools")), Err(Refusal::Invalid(_))));
    }

    #[test]
    fn companion_mode_is_for_the_listed_tenants_or_for_all_when_none_are() {
        let companion =
            RunSpec::from_json(&json!({"model": "m", "input": "x", "mode": "companion"}), &policy()).unwrap();
        let work = RunSpec::from_json(&json!({"model": "m", "input": "x"}), &policy()).unwrap();
        assert_eq!(policy().admit("anyone", &companion), Ok(()), "unset: every tenant");
        let p = SubmitPolicy { companion_tenants: vec!["acme".into()], ..policy() };
        assert_eq!(p.admit("acme", &companion), Ok(()));
        let Err(Refusal::Forbidden(why)) = p.admit("beta", &companion) else { panic!("beta may not") };
        assert!(why.contains("beta") && why.contains("PACELINE_COMPANION_TENANTS"), "{why}");
        assert_eq!(p.admit("beta", &work), Ok(()), "work runs stay open to every tenant");
    }

    #[test]
    fn a_model_name_is_bounded_and_the_allow_list_checks_it() {
        for good in [
            "gpt-4.1-mini",
            "claude-sonnet-4-5-20250929",
            "meta-llama/Llama-3.1-8B-Instruct",
            "ft:gpt-4o-mini:org::id",
            "us.anthropic.claude-3-5-sonnet-20241022-v2:0",
            "m",
        ] {
            assert!(valid_model(good), "{good}");
        }
        let long = "m".repeat(MAX_MODEL_LEN + 1);
        for bad in ["", " gpt", "gpt 4", "-gpt", "gpt\n", "a{b}", "caf\u{e9}", long.as_str()] {
            assert!(!valid_model(bad), "{bad:?}");
            let e = RunSpec::from_json(&json!({"model": bad, "input": "x"}), &policy()).unwrap_err();
            assert_eq!(e.field, "model", "{bad:?}");
        }
        let p = SubmitPolicy { models: "gpt-4.1*,claude-sonnet-4-5".parse().unwrap(), ..policy() };
        let spec = |m: &str| RunSpec::from_json(&json!({"model": m, "input": "x"}), &p).unwrap();
        assert_eq!(p.admit("a", &spec("gpt-4.1-mini")), Ok(()));
        assert_eq!(p.admit("a", &spec("claude-sonnet-4-5")), Ok(()));
        let Err(Refusal::Invalid(e)) = p.admit("a", &spec("claude-sonnet-4-5-x")) else { panic!("not listed") };
        assert!(e.field == "model" && e.message.contains("PACELINE_MODELS"), "{e:?}");
        assert!("gpt 4*".parse::<ModelAllowList>().is_err());
    }

    #[test]
    fn input_items_tools_and_metadata_are_checked_and_bounded() {
        let ok = |body: Value| RunSpec::from_json(&body, &policy()).map(|_| ()).map_err(|e| e.field);
        let with_input = |input: Value| json!({"model": "m", "input": input});
        assert_eq!(
            ok(with_input(json!([
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"type": "reasoning", "summary": []},
            ]))),
            Ok(())
        );
        for (item, field) in [
            (json!({"role": "tool", "content": "x"}), "input[0].role"),
            (json!({"role": "user", "content": 3}), "input[0].content"),
            (json!({"role": "user", "content": ["x"]}), "input[0].content"),
            (json!({"type": "function_call", "call_id": "c", "name": "f"}), "input[0].arguments"),
            (json!({"type": "function_call_output", "output": "x"}), "input[0].call_id"),
            (json!({"type": "function_call_output", "call_id": "c"}), "input[0].output"),
            (json!({"type": "Bad Type"}), "input[0].type"),
            (json!({"type": 3}), "input[0].type"),
        ] {
            assert_eq!(ok(with_input(json!([item]))), Err(field.to_owned()), "{item}");
        }
        let many: Vec<Value> = (0..=MAX_INPUT_ITEMS).map(|_| json!({"role": "user", "content": "x"})).collect();
        assert_eq!(ok(with_input(json!(many))), Err("input".to_owned()));
        let tools: Vec<Value> =
            (0..=MAX_TOOLS).map(|i| json!({"type": "function", "name": format!("t{i}"), "parameters": {}})).collect();
        let body = json!({"model": "m", "input": "x", "tools": tools, "tool_endpoint": "http://127.0.0.1:9000/tools"});
        assert_eq!(ok(body), Err("tools".to_owned()));
        let keys: serde_json::Map<String, Value> =
            (0..=MAX_METADATA_KEYS).map(|i| (format!("k{i}"), json!(1))).collect();
        assert_eq!(ok(json!({"model": "m", "input": "x", "metadata": keys})), Err("metadata".to_owned()));
        let big = "x".repeat(MAX_METADATA_BYTES);
        assert_eq!(ok(json!({"model": "m", "input": "x", "metadata": {"k": big}})), Err("metadata".to_owned()));
    }
}
