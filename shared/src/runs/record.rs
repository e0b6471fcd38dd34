//! The run object as the API shows it (`GET /v1/runs/{id}`), and its Redis hash fields.
//!
//! The record is a Redis hash so the commit scripts can change single fields
//! atomically; this module is the one place that names those fields and turns
//! them into the run object.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;

use super::state::{RunStatus, WaitReason};
use crate::clock::Millis;
use crate::pacer::Mode;

/// Tokens a run has used, as the provider reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    /// Input tokens over all calls.
    pub input_tokens: u64,
    /// Output tokens over all calls.
    pub output_tokens: u64,
    /// Their sum.
    pub total_tokens: u64,
    /// The part of `output_tokens` the model spent reasoning (Responses
    /// `output_tokens_details.reasoning_tokens`, Chat
    /// `completion_tokens_details.reasoning_tokens`; Anthropic does not
    /// report thinking apart, so 0 there).
    #[serde(default)]
    pub reasoning_tokens: u64,
    /// The part of `input_tokens` read from the provider's prompt cache
    /// (Responses `input_tokens_details.cached_tokens`, Chat
    /// `prompt_tokens_details.cached_tokens`, Anthropic
    /// `cache_read_input_tokens`).
    #[serde(default)]
    pub cached_input_tokens: u64,
    /// The part of `input_tokens` written to the provider's prompt cache
    /// (Anthropic `cache_creation_input_tokens`; OpenAI reports none).
    #[serde(default)]
    pub cache_write_tokens: u64,
}

/// What pacing did to a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PacingCounters {
    /// Times a turn was owed budget and requeued.
    pub budget_waits: u64,
    /// Milliseconds requeued for budget, rate limits and retries.
    pub waited_ms: u64,
    /// 429s received.
    pub rate_limited: u64,
    /// Transient errors retried.
    pub retries: u64,
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunError {
    /// `max_turns`, `rate_limited`, `quota`, `request_too_large`,
    /// `spend_limit`, `partial_output`, `provider_error`, `provider_unavailable`,
    /// `dead_lettered` (its turn used up its deliveries: the queue buried it),
    /// `deadline`, `context_overflow`, `budget_exceeded`.
    pub kind: String,
    /// The provider's or paceline's message.
    pub message: String,
}

/// What a failed run's `error.kind` says: every kind this version writes
/// (the Lua scripts write `dead_lettered` and `deadline` themselves; a test
/// holds them to these names). [`RunError::kind`] stays a string: a record
/// may come from another version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The model wanted another turn and there was none left.
    MaxTurns,
    /// 429s outlasted the retry ladder.
    RateLimited,
    /// The account's quota is spent.
    Quota,
    /// The request is larger than the model or the budget allows.
    RequestTooLarge,
    /// The account's spend limit is reached.
    SpendLimit,
    /// Transient provider errors outlasted the retry ladder.
    ProviderUnavailable,
    /// The provider refused the call for good.
    ProviderError,
    /// A companion turn delivered again after it had streamed text.
    PartialOutput,
    /// The turn's deliveries were spent: the queue buried it.
    DeadLettered,
    /// The run passed its `max_run_seconds`.
    Deadline,
    /// Its input does not fit the model's context window, and the run says
    /// `context_overflow: "fail"` (or trimming could not make it fit).
    ContextOverflow,
    /// Its next call would have crossed its `max_cost_usd`.
    BudgetExceeded,
    /// Its spec and transcript passed the bound of what one run may store
    /// (`RUN_MAX_BYTES`, runs/lib.lua).
    RunTooLarge,
    /// Its MCP servers' tools could not be listed, through the retry ladder
    /// (an unreachable server, a malformed answer).
    ToolsUnavailable,
}

/// The run's `error.kind` when a failed call ends it:
///
/// | kind | `error.kind` | when the run fails |
/// | --- | --- | --- |
/// | `RateLimited` | `rate_limited` | the ladder is exhausted (6 attempts) |
/// | `Quota` | `quota` | at once |
/// | `RequestTooLarge` | `request_too_large` | at once |
/// | `SpendLimit` | `spend_limit` | at once |
/// | `Transient` | `provider_unavailable` | the ladder is exhausted |
/// | `Terminal` | `provider_error` | at once, with the provider's message |
/// | `ContextOverflow` | `context_overflow` | after the one trimmed retry |
impl From<crate::pacer::FailureKind> for ErrorKind {
    fn from(kind: crate::pacer::FailureKind) -> Self {
        use crate::pacer::FailureKind;
        match kind {
            FailureKind::RateLimited => Self::RateLimited,
            FailureKind::Quota => Self::Quota,
            FailureKind::RequestTooLarge => Self::RequestTooLarge,
            FailureKind::SpendLimit => Self::SpendLimit,
            FailureKind::Transient => Self::ProviderUnavailable,
            FailureKind::Terminal => Self::ProviderError,
            FailureKind::ContextOverflow => Self::ContextOverflow,
        }
    }
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [Self; 14] = [
        Self::MaxTurns,
        Self::RateLimited,
        Self::Quota,
        Self::RequestTooLarge,
        Self::SpendLimit,
        Self::ProviderUnavailable,
        Self::ProviderError,
        Self::PartialOutput,
        Self::DeadLettered,
        Self::Deadline,
        Self::ContextOverflow,
        Self::BudgetExceeded,
        Self::RunTooLarge,
        Self::ToolsUnavailable,
    ];

    /// The name in `error.kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MaxTurns => "max_turns",
            Self::RateLimited => "rate_limited",
            Self::Quota => "quota",
            Self::RequestTooLarge => "request_too_large",
            Self::SpendLimit => "spend_limit",
            Self::ProviderUnavailable => "provider_unavailable",
            Self::ProviderError => "provider_error",
            Self::PartialOutput => "partial_output",
            Self::DeadLettered => "dead_lettered",
            Self::Deadline => "deadline",
            Self::ContextOverflow => "context_overflow",
            Self::BudgetExceeded => "budget_exceeded",
            Self::RunTooLarge => "run_too_large",
            Self::ToolsUnavailable => "tools_unavailable",
        }
    }
}

/// The run object (`GET /v1/runs/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Run {
    /// `run_` + ULID.
    pub id: String,
    /// Where it is.
    pub status: RunStatus,
    /// `work` or `companion`.
    pub mode: Mode,
    /// The model.
    pub model: String,
    /// Turns committed.
    pub turns_completed: u32,
    /// The turn limit.
    pub max_turns: u32,
    /// Tokens used.
    pub usage: Usage,
    /// What they cost, USD, at the model's list price (`crate::models`):
    /// each kind of token at its own rate. `None` for a model whose price is
    /// not known — never 0.
    #[serde(default)]
    pub cost_usd: Option<f64>,
    /// What pacing did.
    pub pacing: PacingCounters,
    /// Why it waits, while `waiting`.
    pub wait_reason: Option<WaitReason>,
    /// When its next turn is due, while `waiting` (RFC 3339, ms).
    pub next_attempt_at: Option<String>,
    /// The model's final answer, once completed.
    pub output_text: Option<String>,
    /// Why it failed.
    pub error: Option<RunError>,
    /// RFC 3339, ms.
    pub created_at: String,
    /// RFC 3339, ms.
    pub updated_at: String,
    /// RFC 3339, ms, once finished.
    pub finished_at: Option<String>,
    /// The client's own data.
    pub metadata: Value,
    /// The id of the run's trace (32 hex digits): every turn's spans, on any
    /// worker, join it when traces are exported (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Its completion webhook, when the spec named a `webhook_url`: where it
    /// goes and how its delivery stands (`runs::webhooks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<super::webhooks::WebhookState>,
}

/// The record's hash fields (the commit scripts use the same names).
pub mod field {
    /// Owner tenant.
    pub const TENANT: &str = "tenant";
    /// `RunStatus` name.
    pub const STATUS: &str = "status";
    /// `work` / `companion`.
    pub const MODE: &str = "mode";
    /// Model.
    pub const MODEL: &str = "model";
    /// The validated spec as JSON (instructions, tools, endpoint, limits).
    pub const SPEC: &str = "spec";
    /// Turns committed.
    pub const TURNS: &str = "turns";
    /// Max turns.
    pub const MAX_TURNS: &str = "max_turns";
    /// The run's wall-clock deadline after its creation, ms (absent: none).
    pub const MAX_RUN_MS: &str = "max_run_ms";
    /// Usage counters.
    pub const INPUT_TOKENS: &str = "input_tokens";
    /// See above.
    pub const OUTPUT_TOKENS: &str = "output_tokens";
    /// See above (part of the output).
    pub const REASONING_TOKENS: &str = "reasoning_tokens";
    /// See above (part of the input).
    pub const CACHED_INPUT_TOKENS: &str = "cached_input_tokens";
    /// See above (part of the input).
    pub const CACHE_WRITE_TOKENS: &str = "cache_write_tokens";
    /// Pacing counters.
    pub const BUDGET_WAITS: &str = "budget_waits";
    /// See above.
    pub const WAITED_MS: &str = "waited_ms";
    /// See above.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// See above.
    pub const RETRIES: &str = "retries";
    /// `WaitReason` name or empty.
    pub const WAIT_REASON: &str = "wait_reason";
    /// Due time of the next attempt, ms (Redis clock) or empty.
    pub const NEXT_ATTEMPT_MS: &str = "next_attempt_ms";
    /// Final text.
    pub const OUTPUT_TEXT: &str = "output_text";
    /// Error kind / message.
    pub const ERROR_KIND: &str = "error_kind";
    /// See above.
    pub const ERROR_MESSAGE: &str = "error_message";
    /// Timestamps, ms (Redis clock).
    pub const CREATED_MS: &str = "created_ms";
    /// See above.
    pub const UPDATED_MS: &str = "updated_ms";
    /// See above.
    pub const FINISHED_MS: &str = "finished_ms";
    /// Client metadata JSON.
    pub const METADATA: &str = "metadata";
    /// `tools` while a turn's tool calls are being run (its model output is
    /// committed, its tool outputs not yet); empty otherwise.
    pub const PHASE: &str = "phase";
    /// How long the run's keys live once it is finished, ms (the store's
    /// retention when it was created): a turn the queue buries ends its run
    /// in the queue's own script, which knows no configuration.
    pub const RETENTION_MS: &str = "retention_ms";
    /// The record's format version (`runs::turn::RECORD_FORMAT`; absent: 1).
    pub const FORMAT: &str = "format";
    /// The run's trace context, a W3C `traceparent` (`00-<trace id>-<span id>-01`)
    /// written at its creation: each turn's span is a child of that span.
    pub const TRACE: &str = "trace";
    /// The tools of the run's MCP servers as its first turn listed them
    /// (JSON; `worker::tools::mcp`), kept for every later turn; absent
    /// until then.
    pub const MCP_TOOLS: &str = "mcp_tools";
    /// The run's completion webhook URL (from its spec; absent: none).
    pub const WEBHOOK_URL: &str = "webhook_url";
    /// Its current webhook event's id (written when the run ends: `hooks.lua`).
    pub const WEBHOOK_EVENT: &str = "webhook_event";
    /// That event's state (`pending`, `retrying`, `delivered`, `stopped`, `failed`).
    pub const WEBHOOK_STATE: &str = "webhook_state";
    /// Attempts made to deliver it.
    pub const WEBHOOK_ATTEMPTS: &str = "webhook_attempts";
    /// The last attempt's HTTP status, or empty.
    pub const WEBHOOK_LAST_STATUS: &str = "webhook_last_status";
    /// When its next attempt is due, ms (Redis clock), or empty.
    pub const WEBHOOK_NEXT_MS: &str = "webhook_next_ms";
    /// What went wrong at the last attempt, or empty.
    pub const WEBHOOK_ERROR: &str = "webhook_error";
}

/// A new trace context for a run: a W3C `traceparent` with a random trace
/// id and span id (the run's root, which its turns' spans are children of).
pub fn new_traceparent() -> String {
    use rand::Rng as _;
    let mut rng = rand::rng();
    // Neither may be all zeros (W3C trace context: invalid).
    let trace: u128 = rng.random_range(1..=u128::MAX);
    let span: u64 = rng.random_range(1..=u64::MAX);
    format!("00-{trace:032x}-{span:016x}-01")
}

/// The trace id of a `traceparent`; `None` for anything else ([`traceparent_parts`]).
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    traceparent_parts(traceparent).map(|(trace, _, _)| trace)
}

/// A `traceparent`'s trace id, parent span id and flags
/// (`<version>-<32 hex>-<16 hex>-<2 hex>`, lowercase; W3C: neither id all
/// zeros, version not `ff`); `None` for anything else.
pub fn traceparent_parts(traceparent: &str) -> Option<(&str, &str, u8)> {
    let parts: Vec<&str> = traceparent.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    let zeros = |s: &str| s.bytes().all(|b| b == b'0');
    match parts.as_slice() {
        [version, trace, span, flags]
            if hex(version, 2)
                && *version != "ff"
                && hex(trace, 32)
                && hex(span, 16)
                && hex(flags, 2)
                && !zeros(trace)
                && !zeros(span) =>
        {
            Some((trace, span, u8::from_str_radix(flags, 16).ok()?))
        }
        _ => None,
    }
}

/// Formats Redis-clock milliseconds as RFC 3339 with milliseconds (UTC).
pub fn rfc3339_ms(ms: Millis) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let f = time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    t.format(&f).unwrap_or_default()
}

impl Run {
    /// The record fields [`Run::from_fields`] reads, and the tenant: what a
    /// listing fetches, rather than the whole record (whose spec alone can be
    /// a MiB, for each of up to thousands of runs).
    pub const FIELDS: [&'static str; 31] = [
        field::TENANT,
        field::STATUS,
        field::MODE,
        field::MODEL,
        field::TURNS,
        field::MAX_TURNS,
        field::INPUT_TOKENS,
        field::OUTPUT_TOKENS,
        field::REASONING_TOKENS,
        field::CACHED_INPUT_TOKENS,
        field::BUDGET_WAITS,
        field::WAITED_MS,
        field::RATE_LIMITED,
        field::RETRIES,
        field::WAIT_REASON,
        field::NEXT_ATTEMPT_MS,
        field::OUTPUT_TEXT,
        field::ERROR_KIND,
        field::ERROR_MESSAGE,
        field::CREATED_MS,
        field::UPDATED_MS,
        field::FINISHED_MS,
        field::METADATA,
        field::WEBHOOK_URL,
        field::WEBHOOK_EVENT,
        field::WEBHOOK_STATE,
        field::WEBHOOK_ATTEMPTS,
        field::WEBHOOK_LAST_STATUS,
        field::WEBHOOK_NEXT_MS,
        field::WEBHOOK_ERROR,
        field::TRACE,
    ];

    /// The run object from its record's fields; `None` when the record is
    /// missing or not a run (a half-written hash is never shown).
    pub fn from_fields(id: &str, f: &HashMap<String, String>) -> Option<Self> {
        let get = |k: &str| f.get(k).map(String::as_str).filter(|v| !v.is_empty());
        let num = |k: &str| get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let ms = |k: &str| get(k).and_then(|v| v.parse::<Millis>().ok());
        let status = RunStatus::parse(get(field::STATUS)?)?;
        let mode = get(field::MODE).and_then(Mode::parse).unwrap_or(Mode::Work);
        let input_tokens = num(field::INPUT_TOKENS);
        let output_tokens = num(field::OUTPUT_TOKENS);
        let usage = Usage {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            reasoning_tokens: num(field::REASONING_TOKENS),
            cached_input_tokens: num(field::CACHED_INPUT_TOKENS),
            cache_write_tokens: num(field::CACHE_WRITE_TOKENS),
        };
        let model = get(field::MODEL).unwrap_or_default();
        let waiting = status == RunStatus::Waiting;
        let wait_reason = if waiting {
            get(field::WAIT_REASON).and_then(|r| serde_json::from_value(Value::String(r.to_owned())).ok())
        } else {
            None
        };
        Some(Self {
            id: id.to_owned(),
            status,
            mode,
            model: model.to_owned(),
            turns_completed: num(field::TURNS) as u32,
            max_turns: num(field::MAX_TURNS) as u32,
            usage,
            cost_usd: crate::models::price(model).map(|p| (p.cost_usd(&usage) * 1e6).round() / 1e6),
            pacing: PacingCounters {
                budget_waits: num(field::BUDGET_WAITS),
                waited_ms: num(field::WAITED_MS),
                rate_limited: num(field::RATE_LIMITED),
                retries: num(field::RETRIES),
            },
            wait_reason,
            next_attempt_at: if waiting { ms(field::NEXT_ATTEMPT_MS).map(rfc3339_ms) } else { None },
            output_text: get(field::OUTPUT_TEXT).map(str::to_owned),
            error: get(field::ERROR_KIND).map(|kind| RunError {
                kind: kind.to_owned(),
                message: get(field::ERROR_MESSAGE).unwrap_or_default().to_owned(),
            }),
            created_at: rfc3339_ms(ms(field::CREATED_MS).unwrap_or(0)),
            updated_at: rfc3339_ms(ms(field::UPDATED_MS).unwrap_or(0)),
            finished_at: ms(field::FINISHED_MS).map(rfc3339_ms),
            metadata: get(field::METADATA)
                .and_then(|m| serde_json::from_str(m).ok())
                .unwrap_or(Value::Object(Default::default())),
            trace_id: get(field::TRACE).and_then(trace_id_of).map(str::to_owned),
            webhook: super::webhooks::WebhookState::from_fields(f),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_calls_kind_names_the_runs_error() {
        use crate::pacer::FailureKind::*;
        let cases = [
            (RateLimited, "rate_limited"),
            (Quota, "quota"),
            (RequestTooLarge, "request_too_large"),
            (SpendLimit, "spend_limit"),
            (Transient, "provider_unavailable"),
            (Terminal, "provider_error"),
            (ContextOverflow, "context_overflow"),
        ];
        for (kind, error_kind) in cases {
            assert_eq!(ErrorKind::from(kind).as_str(), error_kind, "{kind:?}");
        }
    }

    #[test]
    fn a_runs_trace_context_is_a_w3c_traceparent() {
        let tp = new_traceparent();
        let id = trace_id_of(&tp).expect("its own traceparent reads");
        assert_eq!(id.len(), 32);
        assert_ne!(new_traceparent(), tp, "random");
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "00-abc-def-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "x",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(trace_id_of(bad), None, "{bad}");
        }
    }

    /// A run read from [`Run::FIELDS`] alone is the run read from its whole
    /// record: a field `from_fields` reads and `FIELDS` lacks shows here.
    #[test]
    fn the_listing_fields_are_all_a_run_needs() {
        let all = [
            (field::TENANT, "alpha"),
            (field::STATUS, "waiting"),
            (field::MODE, "companion"),
            (field::MODEL, "m"),
            (field::SPEC, "{\"big\": true}"),
            (field::TURNS, "2"),
            (field::MAX_TURNS, "9"),
            (field::INPUT_TOKENS, "10"),
            (field::OUTPUT_TOKENS, "3"),
            (field::REASONING_TOKENS, "1"),
            (field::CACHED_INPUT_TOKENS, "4"),
            (field::BUDGET_WAITS, "5"),
            (field::WAITED_MS, "600"),
            (field::RATE_LIMITED, "7"),
            (field::RETRIES, "8"),
            (field::WAIT_REASON, "budget"),
            (field::NEXT_ATTEMPT_MS, "1796032805120"),
            (field::OUTPUT_TEXT, "so far"),
            (field::ERROR_KIND, "x"),
            (field::ERROR_MESSAGE, "y"),
            (field::CREATED_MS, "1796032800000"),
            (field::UPDATED_MS, "1796032801000"),
            (field::FINISHED_MS, "1796032802000"),
            (field::METADATA, "{\"k\": 1}"),
            (field::PHASE, "tools"),
            (field::RETENTION_MS, "60000"),
            (field::WEBHOOK_URL, "https://hooks.example/x"),
            (field::WEBHOOK_EVENT, "evt_1_1"),
            (field::WEBHOOK_STATE, "retrying"),
            (field::WEBHOOK_ATTEMPTS, "2"),
            (field::WEBHOOK_LAST_STATUS, "500"),
            (field::WEBHOOK_NEXT_MS, "1796032809000"),
            (field::WEBHOOK_ERROR, "HTTP 500"),
            (field::TRACE, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ];
        let whole: HashMap<String, String> = all.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let listed: HashMap<String, String> = whole
            .iter()
            .filter(|(k, _)| Run::FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(Run::from_fields("run_1", &listed), Run::from_fields("run_1", &whole));
        assert!(Run::from_fields("run_1", &listed).is_some());
    }

    #[test]
    fn times_are_rfc3339_with_milliseconds() {
        assert_eq!(rfc3339_ms(1_796_032_805_120), "2026-11-30T10:00:05.120Z");
    }

    #[test]
    fn a_waiting_run_shows_why_and_until_when() {
        let f: HashMap<String, String> = [
            ("status", "waiting"),
            ("model", "m"),
            ("wait_reason", "budget"),
            ("next_attempt_ms", "1796032805120"),
            ("input_tokens", "10"),
            ("output_tokens", "5"),
            ("created_ms", "1796032800000"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let run = Run::from_fields("run_1", &f).unwrap();
        assert_eq!(run.wait_reason, Some(WaitReason::Budget));
        assert_eq!(run.next_attempt_at.as_deref(), Some("2026-11-30T10:00:05.120Z"));
        assert_eq!(run.usage.total_tokens, 15);
        assert!(Run::from_fields("run_1", &HashMap::new()).is_none(), "no status, no run");
    }
}
