//! `paceline worker` and `paceline api` as the processes an operator runs:
//! what `--help` shows of their environment, and that no key is a flag.

use std::process::{Command, Stdio};

use paceline_tests::paceline_bin;

/// Secrets an operator's environment holds, each with a canary to look for.
const SECRET_ENV: [(&str, &str); 6] = [
    ("REDIS_URL", "redis://:hunter2@cache.internal:6379"),
    ("OPENAI_API_KEY", "sk-canary-hunter3"),
    ("ANTHROPIC_API_KEY", "sk-ant-canary-hunter4"),
    ("PACELINE_TOOL_SECRET", "canary-hunter5"),
    ("PACELINE_API_TOKENS", "acme:canary-hunter6"),
    ("PACELINE_OPERATOR_TOKEN", "canary-hunter7"),
];

#[test]
fn help_never_shows_a_redis_password_or_a_key() {
    for args in [&["worker", "--help"][..], &["api", "--help"], &["up", "--help"], &["--help"]] {
        let out = Command::new(paceline_bin()).args(args).envs(SECRET_ENV).output().expect("run paceline --help");
        assert!(out.status.success(), "{args:?}: {out:?}");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!text.contains("hunter"), "{args:?} shows a secret:\n{text}");
        if args[0] != "--help" {
            assert!(text.contains("REDIS_URL"), "{args:?} still names the variable:\n{text}");
        }
    }
}

#[test]
fn no_key_is_accepted_as_a_flag() {
    for flag in ["--api-key", "--anthropic-api-key", "--tool-secret"] {
        let out = Command::new(paceline_bin())
            .args(["worker", flag, "sk-canary"])
            .env("REDIS_URL", "redis://127.0.0.1:1")
            .stdin(Stdio::null())
            .output()
            .expect("run paceline worker");
        assert!(!out.status.success(), "{flag} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("unexpected argument"), "{flag}: {stderr}");
    }
}
