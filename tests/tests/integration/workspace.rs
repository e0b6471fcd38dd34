//! The crate graph's invariants (ARCHITECTURE.md), read from `cargo metadata`:
//! `shared` depends on neither `api` nor `worker`, and the simulator stays out
//! of a production build.

use serde_json::Value;

/// `cargo metadata` of this workspace (its own packages only).
fn metadata() -> Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root)
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Each dependency of `package`: (name, kind — "normal", "dev" or "build" —,
/// optional).
fn dependencies(meta: &Value, package: &str) -> Vec<(String, String, bool)> {
    let p = meta["packages"].as_array().unwrap().iter().find(|p| p["name"] == package).expect(package);
    p["dependencies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
            (d["name"].as_str().unwrap().to_owned(), kind, d["optional"].as_bool().unwrap_or(false))
        })
        .collect()
}

#[test]
fn shared_depends_on_neither_api_nor_worker() {
    let meta = metadata();
    for (name, kind, _) in dependencies(&meta, "shared") {
        assert!(name != "api" && name != "worker", "shared depends on {name} ({kind})");
    }
}

/// `api` and `worker` never reach `mock-provider` (tests do, through
/// `paceline-tests`); the `paceline` binary reaches it only through its `mock`
/// feature, so `cargo build -p paceline --no-default-features` has none of it.
#[test]
fn no_production_crate_depends_on_the_mock_provider() {
    let meta = metadata();
    for package in ["shared", "worker", "api"] {
        for (name, kind, _) in dependencies(&meta, package) {
            assert!(name != "mock-provider" || kind == "dev", "{package} depends on mock-provider ({kind})");
        }
    }
    let mock: Vec<_> = dependencies(&meta, "paceline").into_iter().filter(|(n, _, _)| n == "mock-provider").collect();
    assert!(mock.iter().all(|(_, kind, optional)| *optional || kind == "dev"), "paceline: {mock:?}");
    let p = meta["packages"].as_array().unwrap().iter().find(|p| p["name"] == "paceline").unwrap();
    // The demo's MCP server (rmcp's server half) comes with the simulator, and nothing else.
    assert_eq!(p["features"]["mock"], serde_json::json!(["dep:mock-provider", "dep:rmcp"]));
    let enabling: Vec<&String> = p["features"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, deps)| deps.as_array().unwrap().iter().any(|d| d == "dep:mock-provider"))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(enabling, ["mock"], "only the `mock` feature brings the simulator in");
}

/// The policy is a crate of its own that can do no I/O: `pacer` depends on
/// no Redis client, async runtime or HTTP client (so "the policy does no I/O"
/// is a fact of its `Cargo.toml`); and its simulator is a feature no
/// production crate turns on (only the tests, through `shared/sim`).
#[test]
fn the_pure_pacer_does_no_io_and_production_has_no_simulator() {
    let meta = metadata();
    for (name, kind, _) in dependencies(&meta, "pacer") {
        let io = ["redis", "tokio", "reqwest", "hyper", "axum", "shared", "futures", "apalis-core"];
        assert!(!io.contains(&name.as_str()) || kind == "dev", "pacer depends on {name} ({kind})");
    }
    let features = |package: &str| -> Vec<String> {
        let p = meta["packages"].as_array().unwrap().iter().find(|p| p["name"] == package).expect(package);
        let deps = p["dependencies"].as_array().unwrap();
        deps.iter()
            .filter(|d| d["kind"].is_null() || d["kind"] == "normal")
            .flat_map(|d| {
                d["features"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| format!("{}/{}", d["name"].as_str().unwrap(), f.as_str().unwrap()))
            })
            .chain(
                p["features"]
                    .as_object()
                    .unwrap()
                    .values()
                    .flat_map(|v| v.as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_owned())),
            )
            .collect()
    };
    for package in ["shared", "worker", "api", "paceline"] {
        let on: Vec<String> =
            features(package).into_iter().filter(|f| f.ends_with("sim") && f != "pacer/sim").collect();
        assert!(on.is_empty(), "{package} turns the simulator on: {on:?}");
    }
    assert!(features("shared").contains(&"pacer/sim".to_owned()), "shared offers `sim` as a feature of its own");
}
