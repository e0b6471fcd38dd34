//! The binary's command line: `--help` lists the main subcommands.
//! (Having an integration test here also makes `cargo test --workspace` build
//! the `paceline` binary that the integration tests start as real processes.)

use std::process::Command;

#[test]
fn help_lists_every_subcommand_of_the_spec() {
    let out = Command::new(env!("CARGO_BIN_EXE_paceline")).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["up", "api", "worker", "submit", "watch", "runs", "status", "pacer", "usage"] {
        assert!(help.contains(&format!("  {cmd} ")), "help lacks `{cmd}`:\n{help}");
    }
    // The simulator's subcommands come with the `mock` feature (the default),
    // and a production build (`--no-default-features`) has none of them.
    for cmd in ["mock-provider", "bench"] {
        let listed = help.contains(&format!("  {cmd} "));
        assert_eq!(listed, cfg!(feature = "mock"), "`{cmd}` in the help:\n{help}");
    }
}
