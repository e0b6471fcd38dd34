//! What the API and the workers both read about runs (`RunArgs`, flattened
//! into `paceline api`, `worker` and `up`).

/// What the API and the workers both read about runs: which tool endpoints a
/// run may name, and how long a finished run is kept. Declared once,
/// flattened into `paceline api`, `paceline worker` and `paceline up`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// URL prefixes a run's `tool_endpoint` may start with, comma-separated:
    /// `PREFIX` for every tenant, `TENANT=PREFIX` for one (the API checks a
    /// run against it; a worker checks again before each call).
    #[arg(long = "tool-endpoints", env = "PACELINE_TOOL_ENDPOINTS", default_value = "", value_name = "LIST")]
    pub tool_endpoints: super::ToolEndpoints,
    /// URL prefixes a run's `webhook_url` may start with, comma-separated,
    /// in the same `PREFIX` / `TENANT=PREFIX` form (the API checks a run
    /// against it; a worker checks again before each delivery).
    #[arg(long = "webhook-endpoints", env = "PACELINE_WEBHOOK_ENDPOINTS", default_value = "", value_name = "LIST")]
    pub webhook_endpoints: super::ToolEndpoints,
    /// URL prefixes of the MCP servers a run's `mcp_servers` may name,
    /// comma-separated, in the same `PREFIX` / `TENANT=PREFIX` form (the API
    /// checks a run against it; a worker checks again before it connects).
    #[arg(long = "mcp-endpoints", env = "PACELINE_MCP_ENDPOINTS", default_value = "", value_name = "LIST")]
    pub mcp_endpoints: super::ToolEndpoints,
    /// The environment variables a run's `headers_from_env` may name,
    /// comma-separated: `NAME` for every tenant, `TENANT=NAME` for one (the
    /// API checks a run against it; a worker reads no other for a header).
    #[arg(long = "mcp-header-vars", env = "PACELINE_MCP_HEADER_VARS", default_value = "", value_name = "LIST")]
    pub mcp_header_vars: super::McpHeaderVars,
    /// How long a finished run's record, transcript and events are kept
    /// (`90s`, `30m`, `12h`, `7d`, or seconds).
    #[arg(long = "retention", env = "PACELINE_RETENTION", default_value = DEFAULT_RETENTION, value_parser = crate::config::parse_duration)]
    pub retention: std::time::Duration,
    /// A JSON file of prices, USD per million tokens, over the built-in table
    /// (`{"MODEL": {"input": 2.0, "cached_input": 0.5, "cache_write": 2.5,
    /// "output": 8.0}}`): what a run's `cost_usd` is reckoned at.
    #[arg(long = "prices", env = "PACELINE_PRICES", value_name = "FILE", value_parser = crate::models::read_prices)]
    pub prices: Option<crate::models::PriceTable>,
    /// The models runs may name, comma-separated, a trailing `*` for a
    /// prefix (`gpt-4.1*,claude-*`); unset: any valid model name.
    #[arg(long = "models", env = "PACELINE_MODELS", default_value = "", value_name = "LIST")]
    pub models: super::spec::ModelAllowList,
}

impl RunArgs {
    /// Puts the given prices over the built-in ones for this process.
    pub fn use_prices(&self) {
        if let Some(table) = &self.prices {
            crate::models::use_prices(table.clone());
        }
    }
}

/// Default of `--retention`.
pub const DEFAULT_RETENTION: &str = "7d";

impl Default for RunArgs {
    /// No tool endpoint; the default retention.
    fn default() -> Self {
        Self {
            tool_endpoints: super::ToolEndpoints::default(),
            webhook_endpoints: super::ToolEndpoints::default(),
            mcp_endpoints: super::ToolEndpoints::default(),
            mcp_header_vars: super::McpHeaderVars::default(),
            retention: crate::config::parse_duration(DEFAULT_RETENTION).expect("the default retention parses"),
            prices: None,
            models: Default::default(),
        }
    }
}
