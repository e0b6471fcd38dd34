//! The run spec a client submits (`POST /v1/runs`, SPEC §3), and the rules it
//! must keep. Validation happens here, before anything reaches Redis: a body
//! that breaks a rule is a 422 naming the field, never a half-written run.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::pacer::Mode;

/// Default and bounds of `max_turns`.
pub const DEFAULT_MAX_TURNS: u32 = 40;
/// The largest `max_turns` accepted.
pub const MAX_MAX_TURNS: u32 = 1_000;
/// Default `max_output_tokens`.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 2_048;
/// The largest `max_output_tokens` accepted.
pub const MAX_MAX_OUTPUT_TOKENS: u32 = 1_000_000;

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
    /// `work` (background) or `companion` (a live listener).
    pub mode: Mode,
    /// Turns at most; reaching it fails the run with `max_turns`.
    pub max_turns: u32,
    /// The output limit of each call.
    pub max_output_tokens: u32,
    /// The client's own data, returned as given.
    #[serde(default)]
    pub metadata: Value,
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

/// Which tool endpoints runs may name (`PACELINE_TOOL_ENDPOINTS`: URL prefixes).
#[derive(Debug, Clone, Default)]
pub struct SubmitPolicy {
    /// Allowed URL prefixes; empty allows none.
    pub tool_endpoint_prefixes: Vec<String>,
}

const KNOWN_FIELDS: [&str; 9] = [
    "model",
    "instructions",
    "input",
    "tools",
    "tool_endpoint",
    "mode",
    "max_turns",
    "max_output_tokens",
    "metadata",
];

impl RunSpec {
    /// Validates a submitted JSON body.
    pub fn from_json(body: &Value, policy: &SubmitPolicy) -> Result<Self, SpecError> {
        let obj = body.as_object().ok_or_else(|| err("", "the body must be a JSON object"))?;
        if let Some(unknown) = obj.keys().find(|k| !KNOWN_FIELDS.contains(&k.as_str())) {
            return Err(err(unknown.clone(), "unknown field"));
        }
        let model = match obj.get("model") {
            Some(Value::String(m)) if !m.trim().is_empty() && m.len() <= 200 => m.clone(),
            Some(Value::String(_)) => return Err(err("model", "must be a non-empty name of at most 200 characters")),
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
            Some(Value::Array(items)) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    let Some(o) = item.as_object() else {
                        return Err(err(format!("input[{i}]"), "must be an object (a Responses-API input item)"));
                    };
                    let is_message = o.contains_key("role") && o.contains_key("content");
                    let is_typed = o.get("type").is_some_and(Value::is_string);
                    if !is_message && !is_typed {
                        return Err(err(format!("input[{i}]"), "must be a message ({role, content}) or a typed item"));
                    }
                }
                items.clone()
            }
            Some(Value::Array(_)) => return Err(err("input", "must not be empty")),
            Some(_) => return Err(err("input", "must be a string or a list of input items")),
            None => return Err(err("input", "is required")),
        };
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => vec![],
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
                            return Err(err(format!("{field}.name"), "must be 1–64 characters of a-z, A-Z, 0-9, _ or -"))
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
                if !endpoint_allowed(url, &policy.tool_endpoint_prefixes) {
                    return Err(err("tool_endpoint", "is not an allowed tool endpoint (PACELINE_TOOL_ENDPOINTS)"));
                }
                Some(url.clone())
            }
            Some(_) => return Err(err("tool_endpoint", "must be a URL string")),
        };
        if !tools.is_empty() && tool_endpoint.is_none() {
            return Err(err("tool_endpoint", "is required when tools are given"));
        }
        let mode = match obj.get("mode") {
            None | Some(Value::Null) => Mode::Work,
            Some(Value::String(m)) if m == "work" => Mode::Work,
            Some(Value::String(m)) if m == "companion" => Mode::Companion,
            Some(_) => return Err(err("mode", "must be \"work\" or \"companion\"")),
        };
        let max_turns = bounded(obj.get("max_turns"), "max_turns", DEFAULT_MAX_TURNS, MAX_MAX_TURNS)?;
        let max_output_tokens =
            bounded(obj.get("max_output_tokens"), "max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS, MAX_MAX_OUTPUT_TOKENS)?;
        let metadata = match obj.get("metadata") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(m @ Value::Object(_)) => m.clone(),
            Some(_) => return Err(err("metadata", "must be an object")),
        };
        Ok(Self { model, instructions, input, tools, tool_endpoint, mode, max_turns, max_output_tokens, metadata })
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

fn valid_tool_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Whether `url` starts with one of the allowed prefixes, at a boundary: the
/// prefix `http://h:9000/tools` allows `http://h:9000/tools` and
/// `http://h:9000/tools/x`, not `http://h:90001/…`, `http://h:9000.evil/…` or
/// `http://h:9000/toolsmith`.
pub fn endpoint_allowed(url: &str, prefixes: &[String]) -> bool {
    if !(url.starts_with("http://") || url.starts_with("https://")) || url.chars().any(char::is_whitespace) {
        return false;
    }
    prefixes.iter().any(|p| {
        let p = p.trim();
        if p.is_empty() || !url.starts_with(p) {
            return false;
        }
        let rest = &url[p.len()..];
        // The prefix ends at a boundary of its own, or the URL continues with one.
        p.ends_with('/') || rest.is_empty() || rest.starts_with(['/', '?', '#'])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> SubmitPolicy {
        SubmitPolicy { tool_endpoint_prefixes: vec!["http://127.0.0.1:9000/tools".into()] }
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
            (json!({"model": "m", "input": "x", "tool_endpoint": "http://evil.example/tools"}), "tool_endpoint"),
        ];
        for (body, field) in cases {
            assert_eq!(field_of(body.clone()), field, "{body}");
        }
    }

    #[test]
    fn endpoints_match_at_boundaries_only() {
        let allowed = ["http://h:9000/tools".to_string()];
        for (url, ok) in [
            ("http://h:9000/tools", true),
            ("http://h:9000/tools/search", true),
            ("http://h:9000/tools?x=1", true),
            ("http://h:90001/tools", false),
            ("http://h:9000/toolsmith", false),
            ("http://h:9000.evil.com/tools", false),
            ("ftp://h:9000/tools", false),
        ] {
            assert_eq!(endpoint_allowed(url, &allowed), ok, "{url}");
        }
        assert!(!endpoint_allowed("http://h:9000/tools", &[]), "no prefixes allow nothing");
    }
}
