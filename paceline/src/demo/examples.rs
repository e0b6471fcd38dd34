//! The demo's sample runs: `examples/*.json` (or the copies compiled in),
//! their tool endpoint and MCP server pointed at the demo's, spread over the
//! three providers.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

use super::{DEMO_STYLES, EXAMPLES_MCP_SERVER, EXAMPLES_TOOL_ENDPOINT};

/// The examples compiled in, used when `--examples` is not a directory (the
/// binary run outside the repository).
const EMBEDDED_EXAMPLES: [(&str, &str); 5] = [
    ("browse-work", include_str!("../../../examples/browse-work.json")),
    ("companion", include_str!("../../../examples/companion.json")),
    ("docs-mcp", include_str!("../../../examples/docs-mcp.json")),
    ("plain", include_str!("../../../examples/plain.json")),
    ("research-work", include_str!("../../../examples/research-work.json")),
];

/// One sample run: its name (the file's stem) and its spec.
#[derive(Debug, Clone)]
pub struct Example {
    /// The file's stem, shown on its progress line.
    pub name: String,
    /// The run spec, as submitted (the tool endpoint and MCP server rewritten).
    pub body: Value,
}

/// The example runs: `dir/*.json` when `dir` exists, else the built-in ones,
/// the demo's tool endpoint and MCP server at `tool_endpoint` and
/// `mcp_server`. Also says where they came from. A file that is not a JSON
/// object is an error naming it.
pub fn load_examples(dir: &Path, tool_endpoint: &str, mcp_server: &str) -> anyhow::Result<(Vec<Example>, String)> {
    let mut raw: Vec<(String, String)> = Vec::new();
    let source;
    if dir.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        anyhow::ensure!(!files.is_empty(), "{} holds no *.json run specs (or pass --examples DIR)", dir.display());
        for f in files {
            let name = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            let text = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
            raw.push((name, text));
        }
        source = format!("{}/*.json", dir.display());
    } else {
        raw = EMBEDDED_EXAMPLES.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
        source = "the examples built into this binary".to_string();
    }
    let mut examples = Vec::new();
    for (name, text) in raw {
        let mut body: Value = serde_json::from_str(&text).with_context(|| format!("example {name}: not JSON"))?;
        anyhow::ensure!(body.is_object(), "example {name}: a run spec is a JSON object");
        if body["tool_endpoint"].as_str() == Some(EXAMPLES_TOOL_ENDPOINT) {
            body["tool_endpoint"] = json!(tool_endpoint);
        }
        if let Some(servers) = body.get_mut("mcp_servers").and_then(Value::as_array_mut) {
            for server in servers.iter_mut().filter(|s| s["url"].as_str() == Some(EXAMPLES_MCP_SERVER)) {
                server["url"] = json!(mcp_server);
            }
        }
        examples.push(Example { name, body });
    }
    Ok((examples, source))
}

/// Spreads the demo runs over the three providers, so each wire style shows:
/// the research run on Responses, the browsing run on Chat Completions, the
/// companion (live) run on Anthropic's Messages API (as a Claude model), and
/// any other in turn. A run that names its provider keeps it.
pub fn assign_providers(examples: &mut [Example]) {
    let mut next = 0;
    for ex in examples.iter_mut().filter(|e| e.body.get("provider").is_none()) {
        let style = match ex.name.as_str() {
            "research-work" | "plain" => shared::runs::ApiStyle::Responses,
            "browse-work" => shared::runs::ApiStyle::Chat,
            "companion" | "docs-mcp" => shared::runs::ApiStyle::Anthropic,
            _ => {
                next += 1;
                DEMO_STYLES[(next - 1) % DEMO_STYLES.len()]
            }
        };
        ex.body["provider"] = json!(style.as_str());
        if style == shared::runs::ApiStyle::Anthropic
            && ex.body["model"].as_str().is_some_and(|m| m.starts_with("gpt-"))
        {
            ex.body["model"] = json!("claude-sonnet-4-5");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_examples_are_run_specs_for_the_demo_tools() {
        let (examples, source) =
            load_examples(Path::new("/nonexistent-examples-dir"), "http://127.0.0.1:1/tools", "http://127.0.0.1:1/mcp")
                .unwrap();
        assert_eq!(examples.len(), 5, "{source}");
        let policy = shared::runs::SubmitPolicy {
            tool_endpoints: shared::runs::ToolEndpoints::every_tenant(["http://127.0.0.1:1/tools"]),
            mcp_endpoints: shared::runs::ToolEndpoints::every_tenant(["http://127.0.0.1:1/mcp"]),
            ..Default::default()
        };
        for ex in &examples {
            let spec = shared::runs::RunSpec::from_json(&ex.body, &policy);
            assert!(spec.as_ref().is_ok_and(|s| policy.admit("default", s).is_ok()), "{}: {spec:?}", ex.name);
            if let Some(t) = ex.body["tool_endpoint"].as_str() {
                assert_eq!(t, "http://127.0.0.1:1/tools", "{} is rewritten", ex.name);
            }
        }
        let docs = examples.iter().find(|e| e.name == "docs-mcp").expect("the MCP example");
        assert_eq!(docs.body["mcp_servers"][0]["url"], "http://127.0.0.1:1/mcp", "its server is rewritten");
    }

    #[test]
    fn the_demo_runs_cover_every_style() {
        let (mut examples, _) =
            load_examples(Path::new("/nonexistent-examples-dir"), "http://127.0.0.1:1/tools", "http://127.0.0.1:1/mcp")
                .unwrap();
        assign_providers(&mut examples);
        let mut styles: Vec<&str> = examples.iter().filter_map(|e| e.body["provider"].as_str()).collect();
        styles.sort();
        styles.dedup();
        assert_eq!(styles, vec!["anthropic", "chat", "responses"]);
        let companion = examples.iter().find(|e| e.name == "companion").unwrap();
        assert!(companion.body["model"].as_str().unwrap().starts_with("claude"));
    }
}
