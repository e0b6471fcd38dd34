//! The generation parameters a run may set (README, "Generation parameters"): sampling, reasoning
//! effort, structured output, tool choice, stop sequences and the provider's
//! own knobs. They are validated here, in the run spec's names (the Responses
//! API's), and each wire format passes them in its own names
//! (`worker/src/request.rs`); a parameter a format has no form for is left
//! out there, never sent half-right.
//!
//! Validation is strict where a provider would refuse the call anyway: a
//! value out of range here is a 422 naming the field at submit, where the
//! same value sent on turn 12 of a run would be a 400 that fails the run.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::spec::SpecError;

/// The largest `temperature` accepted (OpenAI's range is 0–2).
pub const MAX_TEMPERATURE: f64 = 2.0;
/// The most stop sequences a run may set (OpenAI's and a common bound).
pub const MAX_STOP_SEQUENCES: usize = 4;
/// The longest `prompt_cache_key` accepted, in characters.
pub const MAX_PROMPT_CACHE_KEY: usize = 1024;

/// Every generation parameter a run may set, as submitted (all optional).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Sampling temperature, 0 to 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// How hard a reasoning model thinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    /// The answer's format (`text.format`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<Text>,
    /// Whether (and which) tool the model must call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Whether the model may ask for several calls in one turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Up to four sequences that end the answer (stored as a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    /// Best-effort determinism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// The provider's processing tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<ServiceTier>,
    /// Groups requests for the provider's prompt cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    /// Whether the provider keeps the response (Responses; default false:
    /// turns are stateless and resend their whole context).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// What the provider does with a context larger than the model's window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation: Option<Truncation>,
    /// Whether the run's calls use the provider's prompt cache (SPEC §4a);
    /// a run stored before the field existed reads as `auto`.
    #[serde(default, skip_serializing_if = "PromptCache::is_auto")]
    pub prompt_cache: PromptCache,
}

/// `prompt_cache` (SPEC §4a): what paceline does for the provider's prompt
/// cache (`worker/src/request.rs`, "Prompt caching").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptCache {
    /// Anthropic: `cache_control` breakpoints on the stable prefix and the
    /// history; OpenAI: a `prompt_cache_key` stable for the run, unless the
    /// run gives one.
    #[default]
    Auto,
    /// Nothing: no breakpoints, no key but the run's own.
    Off,
}

impl PromptCache {
    /// The default.
    pub fn is_auto(&self) -> bool {
        *self == Self::Auto
    }
}

/// `reasoning`: `{"effort": ...}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reasoning {
    /// The effort.
    pub effort: Effort,
}

/// A reasoning effort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effort {
    /// The least reasoning (GPT-5).
    Minimal,
    /// Little.
    Low,
    /// The models' default.
    Medium,
    /// The most.
    High,
}

impl Effort {
    /// The name as sent (`minimal`, `low`, `medium`, `high`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Minimal => "minimal",
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }
}

/// `text`: `{"format": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Text {
    /// The answer's format.
    pub format: Format,
}

/// `text.format`, in the Responses API's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Format {
    /// Plain text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON that follows `schema`.
    JsonSchema(JsonSchema),
}

/// A structured-output schema (`text.format` with `type: "json_schema"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchema {
    /// The schema's name: 1–64 characters of a-z, A-Z, 0-9, `_` or `-`.
    pub name: String,
    /// The JSON schema (an object).
    pub schema: Value,
    /// Whether the provider must follow the schema exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    /// What the answer is for (helps the model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// `tool_choice`: `auto`, `required`, `none`, or one named function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "Value", try_from = "Value")]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// The model must call some tool.
    Required,
    /// The model must not call a tool.
    None,
    /// The model must call this function (one of the run's tools).
    Function(String),
}

impl From<ToolChoice> for Value {
    fn from(c: ToolChoice) -> Self {
        match c {
            ToolChoice::Auto => json!("auto"),
            ToolChoice::Required => json!("required"),
            ToolChoice::None => json!("none"),
            ToolChoice::Function(name) => json!({"type": "function", "name": name}),
        }
    }
}

impl TryFrom<Value> for ToolChoice {
    type Error = String;
    fn try_from(v: Value) -> Result<Self, String> {
        parse_tool_choice(&v).map_err(|e| e.message)
    }
}

/// `service_tier` (OpenAI's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceTier {
    /// The project's default tier, or priority capacity when it has some.
    Auto,
    /// Standard capacity.
    Default,
    /// Cheaper, slower (OpenAI's flex processing).
    Flex,
    /// Scale tier capacity.
    Scale,
    /// Priority processing.
    Priority,
}

impl ServiceTier {
    /// The name as sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Default => "default",
            Self::Flex => "flex",
            Self::Scale => "scale",
            Self::Priority => "priority",
        }
    }
}

/// `truncation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// The provider drops the oldest items to fit.
    Auto,
    /// A context over the window fails the call (the default).
    Disabled,
}

impl Truncation {
    /// The name as sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Disabled => "disabled",
        }
    }
}

/// The run spec's fields this module validates.
pub const FIELDS: [&str; 13] = [
    "temperature",
    "top_p",
    "reasoning",
    "text",
    "tool_choice",
    "parallel_tool_calls",
    "stop",
    "seed",
    "service_tier",
    "prompt_cache_key",
    "store",
    "truncation",
    "prompt_cache",
];

fn err(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { field: field.into(), message: message.into() }
}

/// A present, non-null field of the body.
fn given<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Refuses keys of `obj` (the object at `field`) that are not in `known`.
fn only(obj: &Map<String, Value>, field: &str, known: &[&str]) -> Result<(), SpecError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(err(format!("{field}.{k}"), "unknown field")),
        None => Ok(()),
    }
}

fn boolean(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, SpecError> {
    match given(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(err(key, "must be true or false")),
    }
}

/// The name of a run's tool, or of a JSON schema: OpenAI's rule.
pub fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Generation {
    /// Validates the generation parameters of a submitted body; `tools` are
    /// the run's tool names (a `tool_choice` function must be one of them).
    pub fn from_json(obj: &Map<String, Value>, tools: &[&str]) -> Result<Self, SpecError> {
        let temperature = match given(obj, "temperature") {
            None => None,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(t) if (0.0..=MAX_TEMPERATURE).contains(&t) => Some(t),
                _ => return Err(err("temperature", "must be a number from 0 to 2")),
            },
            Some(_) => return Err(err("temperature", "must be a number from 0 to 2")),
        };
        let top_p = match given(obj, "top_p") {
            None => None,
            Some(Value::Number(n)) => match n.as_f64() {
                Some(p) if p > 0.0 && p <= 1.0 => Some(p),
                _ => return Err(err("top_p", "must be a number greater than 0 and at most 1")),
            },
            Some(_) => return Err(err("top_p", "must be a number greater than 0 and at most 1")),
        };
        let reasoning = match given(obj, "reasoning") {
            None => None,
            Some(Value::Object(r)) => {
                only(r, "reasoning", &["effort"])?;
                let effort = match r.get("effort") {
                    Some(Value::String(e)) => serde_json::from_value::<Effort>(json!(e)).ok(),
                    _ => None,
                }
                .ok_or_else(|| err("reasoning.effort", "must be \"minimal\", \"low\", \"medium\" or \"high\""))?;
                Some(Reasoning { effort })
            }
            Some(_) => return Err(err("reasoning", "must be an object: {\"effort\": \"low\" | ...}")),
        };
        let text = match given(obj, "text") {
            None => None,
            Some(Value::Object(t)) => {
                only(t, "text", &["format"])?;
                match t.get("format").filter(|f| !f.is_null()) {
                    None => None,
                    Some(f) => Some(Text { format: parse_format(f, tools)? }),
                }
            }
            Some(_) => return Err(err("text", "must be an object: {\"format\": {...}}")),
        };
        let tool_choice = match given(obj, "tool_choice") {
            None => None,
            Some(c) => Some(check_choice(parse_tool_choice(c)?, tools)?),
        };
        let parallel_tool_calls = boolean(obj, "parallel_tool_calls")?;
        let stop = match given(obj, "stop") {
            None => None,
            Some(Value::String(s)) => Some(vec![stop_sequence(s, "stop")?]),
            Some(Value::Array(list)) if (1..=MAX_STOP_SEQUENCES).contains(&list.len()) => {
                let mut out = Vec::with_capacity(list.len());
                for (i, s) in list.iter().enumerate() {
                    let field = format!("stop[{i}]");
                    let Some(s) = s.as_str() else { return Err(err(field, "must be a string")) };
                    out.push(stop_sequence(s, &field)?);
                }
                Some(out)
            }
            Some(_) => return Err(err("stop", "must be a string or a list of 1 to 4 strings")),
        };
        let seed = match given(obj, "seed") {
            None => None,
            Some(Value::Number(n)) => Some(n.as_i64().ok_or_else(|| err("seed", "must be an integer"))?),
            Some(_) => return Err(err("seed", "must be an integer")),
        };
        let service_tier = match given(obj, "service_tier") {
            None => None,
            Some(v) => Some(v.as_str().and_then(|s| serde_json::from_value::<ServiceTier>(json!(s)).ok()).ok_or_else(
                || err("service_tier", "must be \"auto\", \"default\", \"flex\", \"scale\" or \"priority\""),
            )?),
        };
        let prompt_cache_key = match given(obj, "prompt_cache_key") {
            None => None,
            Some(Value::String(k)) if (1..=MAX_PROMPT_CACHE_KEY).contains(&k.chars().count()) => Some(k.clone()),
            Some(_) => return Err(err("prompt_cache_key", "must be a string of 1 to 1024 characters")),
        };
        let store = boolean(obj, "store")?;
        let truncation = match given(obj, "truncation") {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .and_then(|s| serde_json::from_value::<Truncation>(json!(s)).ok())
                    .ok_or_else(|| err("truncation", "must be \"auto\" or \"disabled\""))?,
            ),
        };
        let prompt_cache = match given(obj, "prompt_cache") {
            None => PromptCache::Auto,
            Some(v) => v
                .as_str()
                .and_then(|s| serde_json::from_value::<PromptCache>(json!(s)).ok())
                .ok_or_else(|| err("prompt_cache", "must be \"auto\" or \"off\""))?,
        };
        Ok(Self {
            temperature,
            top_p,
            reasoning,
            text,
            tool_choice,
            parallel_tool_calls,
            stop,
            seed,
            service_tier,
            prompt_cache_key,
            store,
            truncation,
            prompt_cache,
        })
    }

    /// The JSON schema of a structured answer, when the run asks for one.
    pub fn json_schema(&self) -> Option<&JsonSchema> {
        match self.text.as_ref().map(|t| &t.format) {
            Some(Format::JsonSchema(s)) => Some(s),
            _ => None,
        }
    }
}

fn stop_sequence(s: &str, field: &str) -> Result<String, SpecError> {
    if s.is_empty() {
        return Err(err(field, "must not be empty"));
    }
    Ok(s.to_owned())
}

fn parse_format(f: &Value, tools: &[&str]) -> Result<Format, SpecError> {
    let Some(obj) = f.as_object() else {
        return Err(err("text.format", "must be an object with a \"type\""));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => {
            only(obj, "text.format", &["type"])?;
            Ok(Format::Text)
        }
        Some("json_object") => {
            only(obj, "text.format", &["type"])?;
            Ok(Format::JsonObject)
        }
        Some("json_schema") => {
            only(obj, "text.format", &["type", "name", "schema", "strict", "description"])?;
            let name = match obj.get("name") {
                Some(Value::String(n)) if valid_name(n) => n.clone(),
                Some(Value::String(_)) => {
                    return Err(err("text.format.name", "must be 1–64 characters of a-z, A-Z, 0-9, _ or -"))
                }
                Some(_) => return Err(err("text.format.name", "must be a string")),
                None => return Err(err("text.format.name", "is required for a json_schema format")),
            };
            if tools.contains(&name.as_str()) {
                // Where a provider has no native structured output the answer
                // is a tool of this name (Anthropic): it must not be taken
                // for the run's own tool.
                return Err(err("text.format.name", "is the name of one of the run's tools"));
            }
            let schema = match obj.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => return Err(err("text.format.schema", "must be a JSON schema object")),
                None => return Err(err("text.format.schema", "is required for a json_schema format")),
            };
            let strict = match obj.get("strict").filter(|v| !v.is_null()) {
                None => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(_) => return Err(err("text.format.strict", "must be true or false")),
            };
            let description = match obj.get("description").filter(|v| !v.is_null()) {
                None => None,
                Some(Value::String(d)) => Some(d.clone()),
                Some(_) => return Err(err("text.format.description", "must be a string")),
            };
            Ok(Format::JsonSchema(JsonSchema { name, schema, strict, description }))
        }
        _ => Err(err("text.format.type", "must be \"text\", \"json_object\" or \"json_schema\"")),
    }
}

/// `tool_choice` as written (submitted, or read back from a stored spec).
fn parse_tool_choice(c: &Value) -> Result<ToolChoice, SpecError> {
    const MODES: &str = "must be \"auto\", \"required\", \"none\" or {\"type\": \"function\", \"name\": ...}";
    match c {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            "none" => Ok(ToolChoice::None),
            _ => Err(err("tool_choice", MODES)),
        },
        Value::Object(o) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(err("tool_choice.type", "must be \"function\""));
            }
            only(o, "tool_choice", &["type", "name"])?;
            match o.get("name").and_then(Value::as_str) {
                Some(name) => Ok(ToolChoice::Function(name.to_owned())),
                None => Err(err("tool_choice.name", "is required")),
            }
        }
        _ => Err(err("tool_choice", MODES)),
    }
}

/// A submitted `tool_choice` against the run's `tools`: a function must be
/// one of them, and `required` needs at least one.
fn check_choice(choice: ToolChoice, tools: &[&str]) -> Result<ToolChoice, SpecError> {
    match &choice {
        ToolChoice::Function(name) if !tools.contains(&name.as_str()) => Err(err(
            "tool_choice.name",
            if tools.is_empty() {
                "names a function, but the run has no tools".to_string()
            } else {
                format!("names no tool of this run (it has: {})", tools.join(", "))
            },
        )),
        ToolChoice::Required if tools.is_empty() => Err(err("tool_choice", "is \"required\" but the run has no tools")),
        _ => Ok(choice),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value, tools: &[&str]) -> Result<Generation, SpecError> {
        Generation::from_json(body.as_object().unwrap(), tools)
    }

    #[test]
    fn every_parameter_is_read() {
        let g = parse(
            json!({"temperature": 0.2, "top_p": 1, "reasoning": {"effort": "high"},
                   "text": {"format": {"type": "json_schema", "name": "verdict", "strict": true,
                                       "schema": {"type": "object"}}},
                   "tool_choice": {"type": "function", "name": "search"}, "parallel_tool_calls": false,
                   "stop": "END", "seed": -7, "service_tier": "flex", "prompt_cache_key": "k1",
                   "store": true, "truncation": "auto", "prompt_cache": "off"}),
            &["search"],
        )
        .unwrap();
        assert_eq!(g.temperature, Some(0.2));
        assert_eq!(g.top_p, Some(1.0));
        assert_eq!(g.reasoning, Some(Reasoning { effort: Effort::High }));
        assert_eq!(g.json_schema().unwrap().name, "verdict");
        assert_eq!(g.tool_choice, Some(ToolChoice::Function("search".into())));
        assert_eq!(g.stop, Some(vec!["END".to_string()]));
        assert_eq!(g.seed, Some(-7));
        assert_eq!(g.service_tier, Some(ServiceTier::Flex));
        assert_eq!(g.truncation, Some(Truncation::Auto));
        assert_eq!(g.prompt_cache, PromptCache::Off);
        // Stored and read back (the worker reads the spec from Redis): the same.
        let back: Generation = serde_json::from_value(serde_json::to_value(&g).unwrap()).unwrap();
        assert_eq!(back, g);
        assert_eq!(serde_json::to_value(&g).unwrap()["tool_choice"], json!({"type": "function", "name": "search"}));
        assert_eq!(parse(json!({}), &[]).unwrap(), Generation::default());
        assert_eq!(parse(json!({"temperature": null}), &[]).unwrap(), Generation::default());
        // Caching is on unless a run turns it off; a spec stored without the field reads as on.
        assert_eq!(Generation::default().prompt_cache, PromptCache::Auto);
        assert!(serde_json::to_value(Generation::default()).unwrap().get("prompt_cache").is_none());
        assert_eq!(serde_json::from_value::<Generation>(json!({})).unwrap().prompt_cache, PromptCache::Auto);
    }

    #[test]
    fn each_value_out_of_range_names_its_field() {
        let cases = [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.01}), "top_p"),
            (json!({"reasoning": "high"}), "reasoning"),
            (json!({"reasoning": {"effort": "extreme"}}), "reasoning.effort"),
            (json!({"reasoning": {}}), "reasoning.effort"),
            (json!({"reasoning": {"effort": "low", "budget": 3}}), "reasoning.budget"),
            (json!({"text": "json"}), "text"),
            (json!({"text": {"verbosity": "low"}}), "text.verbosity"),
            (json!({"text": {"format": {"type": "yaml"}}}), "text.format.type"),
            (json!({"text": {"format": {"type": "json_schema", "schema": {}}}}), "text.format.name"),
            (json!({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}), "text.format.name"),
            (json!({"text": {"format": {"type": "json_schema", "name": "search", "schema": {}}}}), "text.format.name"),
            (json!({"text": {"format": {"type": "json_schema", "name": "a"}}}), "text.format.schema"),
            (json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": []}}}), "text.format.schema"),
            (
                json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "strict": "yes"}}}),
                "text.format.strict",
            ),
            (json!({"text": {"format": {"type": "text", "name": "a"}}}), "text.format.name"),
            (json!({"tool_choice": "any"}), "tool_choice"),
            (json!({"tool_choice": 1}), "tool_choice"),
            (json!({"tool_choice": {"type": "tool", "name": "search"}}), "tool_choice.type"),
            (json!({"tool_choice": {"type": "function"}}), "tool_choice.name"),
            (json!({"tool_choice": {"type": "function", "name": "fetch"}}), "tool_choice.name"),
            (json!({"parallel_tool_calls": "no"}), "parallel_tool_calls"),
            (json!({"stop": []}), "stop"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": ["a", 3]}), "stop[1]"),
            (json!({"stop": ["a", ""]}), "stop[1]"),
            (json!({"stop": ""}), "stop"),
            (json!({"seed": 1.5}), "seed"),
            (json!({"seed": "1"}), "seed"),
            (json!({"service_tier": "fast"}), "service_tier"),
            (json!({"prompt_cache_key": ""}), "prompt_cache_key"),
            (json!({"prompt_cache_key": "k".repeat(1025)}), "prompt_cache_key"),
            (json!({"store": 0}), "store"),
            (json!({"truncation": "yes"}), "truncation"),
            (json!({"prompt_cache": "on"}), "prompt_cache"),
            (json!({"prompt_cache": true}), "prompt_cache"),
        ];
        for (body, field) in cases {
            let got = parse(body.clone(), &["search"]).unwrap_err();
            assert_eq!(got.field, field, "{body}: {got}");
        }
        assert_eq!(parse(json!({"tool_choice": "required"}), &[]).unwrap_err().field, "tool_choice");
        let f = json!({"tool_choice": {"type": "function", "name": "search"}});
        assert_eq!(parse(f, &[]).unwrap_err().field, "tool_choice.name");
    }

    #[test]
    fn tool_choice_forms() {
        for (v, want) in [
            (json!("auto"), ToolChoice::Auto),
            (json!("required"), ToolChoice::Required),
            (json!("none"), ToolChoice::None),
            (json!({"type": "function", "name": "search"}), ToolChoice::Function("search".into())),
        ] {
            assert_eq!(parse(json!({"tool_choice": v}), &["search"]).unwrap().tool_choice, Some(want));
        }
    }
}
