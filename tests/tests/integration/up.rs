//! `paceline up` as a user runs it: the real binary as a child process.
//! `--demo` against a harness Redis (REDIS_URL) brings its sample runs to
//! `completed` and stops cleanly on SIGTERM; without REDIS_URL it starts (and
//! stops) a private redis-server, or says how to install one. None of these
//! touch 127.0.0.1:6379: the probe is pointed at a free port.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use paceline_tests::{eventually, paceline_bin, unique_prefix, ChildGuard, RedisServer};
use serde_json::Value;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `paceline up ARGS` in `dir`, its stderr going to `dir/up.err`, with none
/// of the environment that would change what it connects to.
fn up(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> ChildGuard {
    let err = std::fs::File::create(dir.join("up.err")).unwrap();
    let mut cmd = Command::new(paceline_bin());
    cmd.arg("up").args(args).current_dir(dir);
    for var in [
        "REDIS_URL",
        "PACELINE_PREFIX",
        "PACELINE_LISTEN",
        "PACELINE_API_TOKENS",
        "PACELINE_OPERATOR_TOKEN",
        "PACELINE_INSECURE_OPEN",
        "PACELINE_DATA_DIR",
        "PACELINE_TOOL_ENDPOINTS",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied()).env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
    ChildGuard(cmd.spawn().expect("start paceline up"))
}

fn stderr_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("up.err")).unwrap_or_default()
}

async fn get(http: &reqwest::Client, url: impl reqwest::IntoUrl) -> Option<Value> {
    let resp = http.get(url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

/// The 5 demo runs at `base`, once every one has finished (within `timeout`).
async fn demo_runs_finished(http: &reqwest::Client, base: &str, timeout: Duration) -> Vec<Value> {
    eventually("the 5 demo runs to finish", timeout, || async {
        let page = get(http, &format!("{base}/v1/runs?limit=20")).await?;
        let runs = page["data"].as_array()?.clone();
        let done = runs.len() == 5
            && runs.iter().all(|r| matches!(r["status"].as_str(), Some("completed" | "failed" | "cancelled")));
        done.then_some(runs)
    })
    .await
}

/// SIGTERM, then a clean exit (0) within `timeout`.
fn stop_cleanly(child: &mut ChildGuard, dir: &Path, timeout: Duration) {
    child.signal("TERM");
    let status =
        child.wait_timeout(timeout).unwrap_or_else(|| panic!("up did not stop in {timeout:?}:\n{}", stderr_of(dir)));
    assert!(status.success(), "up exited {status}:\n{}", stderr_of(dir));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_demo_brings_the_sample_runs_to_completed_and_stops_on_sigterm() {
    let redis = RedisServer::start();
    // Outside the repository: the examples built into the binary are used,
    // and a tool endpoint on another port than the examples name is rewritten.
    let dir = tempfile::tempdir().unwrap();
    let port = paceline_tests::free_tcp_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let prefix = unique_prefix();
    let mut child = up(
        dir.path(),
        &[
            "--demo",
            "--listen",
            &listen,
            "--prefix",
            &prefix,
            "--concurrency",
            "8",
            "--demo-tools-listen",
            "127.0.0.1:0",
            "--demo-tpm",
            "400000",
            "--demo-latency-ms",
            "20",
        ],
        &[("REDIS_URL", &redis.url())],
    );
    let http = reqwest::Client::builder().timeout(secs(2)).build().unwrap();
    let base = format!("http://{listen}");
    eventually("the API answers", secs(20), || get(&http, format!("{base}/healthz"))).await;
    let runs = demo_runs_finished(&http, &base, secs(30)).await;
    for run in &runs {
        assert_eq!(run["status"], "completed", "{run}\n{}", stderr_of(dir.path()));
        let example = run["metadata"]["example"].as_str().unwrap_or("");
        // The mock asks for two tool rounds, then answers: 3 turns with tools, 1 without.
        let turns = if example == "plain" { 1 } else { 3 };
        assert_eq!(run["turns_completed"], turns, "{run}");
    }
    // The browsing run's big pages reached the model clipped.
    let browse = runs.iter().find(|r| r["metadata"]["example"] == "browse-work").expect("browse-work ran");
    let transcript =
        get(&http, &format!("{base}/v1/runs/{}/transcript", browse["id"].as_str().unwrap())).await.unwrap();
    let longest = transcript.to_string().len();
    assert!(longest < 2 * 60_000, "two 60 000-character pages were not clipped ({longest} bytes of transcript)");
    // The MCP run was offered the demo MCP server's tool (on Anthropic's wire) and read its answers.
    let docs = runs.iter().find(|r| r["metadata"]["example"] == "docs-mcp").expect("docs-mcp ran");
    let transcript = get(&http, &format!("{base}/v1/runs/{}/transcript", docs["id"].as_str().unwrap())).await.unwrap();
    let calls: Vec<&Value> =
        transcript["items"].as_array().unwrap().iter().filter(|e| e["item"]["type"] == "function_call").collect();
    assert_eq!(calls.len(), 2, "{transcript}");
    assert!(calls.iter().all(|c| c["item"]["name"] == "docs__lookup"), "{transcript}");
    let answered = transcript.to_string().matches("Docs on").count();
    assert_eq!(answered, 2, "the server's answers are the tool outputs: {transcript}");
    let err = eventually("the demo's summary", secs(5), || async {
        let err = stderr_of(dir.path());
        err.contains("all 5 demo runs finished").then_some(err)
    })
    .await;
    assert!(err.contains("using Redis at redis+unix://"), "{err}");
    assert!(err.contains("The API stays up until Ctrl-C"), "{err}");
    // The dashboard's URL is printed, and it answers there.
    assert!(err.contains(&format!("dashboard on {base}/")), "{err}");
    let page = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("/assets/app.js"));
    stop_cleanly(&mut child, dir.path(), secs(20));
    assert!(stderr_of(dir.path()).contains("paceline up: stopped"), "{}", stderr_of(dir.path()));
}

/// Kills a private redis-server a failed test left behind (it runs in its
/// own process group, so killing `up` does not take it down).
struct PidFileGuard(PathBuf);

impl Drop for PidFileGuard {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            let _ = Command::new("kill").arg("-KILL").arg(pid.trim()).stderr(Stdio::null()).status();
        }
    }
}

/// Without `REDIS_URL`, `up` starts a private Redis with a generated password
/// (a file of mode 600 beside its data; a client without it is refused) and
/// stops it on exit. An open Redis where it looks (127.0.0.1:6379 by
/// default) is named but not used: `up` writes to no Redis it cannot tell is
/// its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_url_up_starts_a_private_redis_server_and_stops_it_on_exit() {
    let dir = tempfile::tempdir().unwrap();
    let _leftover = PidFileGuard(dir.path().join(".paceline/redis/redis.pid"));
    let listen = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let open_dir = tempfile::tempdir().unwrap();
    let open_port = paceline_tests::free_tcp_port();
    let open = shared::redis_server::RedisServerOptions {
        unix_socket: false,
        tcp_port: Some(open_port),
        ..shared::redis_server::RedisServerOptions::unix(open_dir.path())
    }
    .start()
    .unwrap();
    let probe = format!("127.0.0.1:{open_port}");
    let mut child = up(
        dir.path(),
        &["--listen", &listen, "--local-redis-probe", &probe, "--concurrency", "2"],
        &[("PACELINE_PROVIDER_URL", "http://127.0.0.1:9/v1")],
    );
    let http = reqwest::Client::builder().timeout(secs(2)).build().unwrap();
    // Ready means the API reaches Redis: the private one.
    eventually("the API is ready", secs(20), || get(&http, format!("http://{listen}/readyz"))).await;
    let err = stderr_of(dir.path());
    assert!(err.contains("started a private redis-server"), "{err}");
    assert!(err.contains(&format!("an open Redis answers on {probe}")) && err.contains("REDIS_URL="), "{err}");
    let port: u16 = err
        .split("started a private redis-server")
        .nth(1)
        .and_then(|s| s.split("on 127.0.0.1:").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in: {err}"));
    let redis_dir = dir.path().join(".paceline/redis");
    assert!(redis_dir.join("appendonlydir").is_dir(), "AOF is on under ./.paceline/redis");
    // Its password: readable by its owner alone, and required.
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(redis_dir.join("paceline-password")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let password = std::fs::read_to_string(redis_dir.join("paceline-password")).unwrap();
    let anyone = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let mut conn = anyone.get_multiplexed_async_connection().await.unwrap();
    let refused = redis::cmd("PING").query_async::<String>(&mut conn).await.unwrap_err();
    assert!(refused.to_string().contains("NOAUTH"), "{refused}");
    let owner = redis::Client::open(format!("redis://:{}@127.0.0.1:{port}", password.trim())).unwrap();
    let owned = owner.get_multiplexed_async_connection().await.unwrap();
    eventually("up's keys (its worker's registration) in its private Redis", secs(10), || {
        let mut conn = owned.clone();
        async move { (redis::cmd("DBSIZE").query_async::<usize>(&mut conn).await.ok()? > 0).then_some(()) }
    })
    .await;
    let open_client = redis::Client::open(format!("redis://{probe}")).unwrap();
    let open_keys: usize = redis::cmd("DBSIZE")
        .query_async(&mut open_client.get_multiplexed_async_connection().await.unwrap())
        .await
        .unwrap();
    assert_eq!(open_keys, 0, "nothing was written to the open Redis");
    drop(open);
    stop_cleanly(&mut child, dir.path(), secs(20));
    let err = stderr_of(dir.path());
    assert!(err.contains("the private redis-server stopped"), "{err}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the private redis-server still listens on {port}"
    );
}

#[test]
fn without_redis_and_without_redis_server_up_says_how_to_install_one() {
    let dir = tempfile::tempdir().unwrap();
    let empty_path = tempfile::tempdir().unwrap();
    let probe = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let mut child = up(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--local-redis-probe", &probe],
        &[("PATH", empty_path.path().to_str().unwrap())],
    );
    let status = child.wait_timeout(secs(10)).expect("up exits at once");
    let err = stderr_of(dir.path());
    assert!(!status.success(), "{err}");
    assert!(err.contains("apt-get install redis-server") && err.contains("brew install redis"), "{err}");
}

/// A CA and a server certificate for `localhost` / 127.0.0.1, made with the
/// `openssl` command in `dir` (`ca.pem`, `server.pem`, `server.key`); `None`
/// when there is no `openssl` to make them.
fn tls_certificates(dir: &Path) -> Option<()> {
    let openssl = |args: &[&str]| {
        Command::new("openssl").args(args).current_dir(dir).stdout(Stdio::null()).stderr(Stdio::null()).status()
    };
    let ca = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2"];
    if !openssl(&[&ca[..], &["-subj", "/CN=paceline test CA"]].concat()).ok()?.success() {
        return None;
    }
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n").unwrap();
    let csr = ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr"];
    assert!(openssl(&[&csr[..], &["-subj", "/CN=localhost"]].concat()).unwrap().success());
    let sign = ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial"];
    let out = ["-out", "server.pem", "-days", "2", "-extfile", "ext.cnf"];
    assert!(openssl(&[&sign[..], &out[..]].concat()).unwrap().success());
    Some(())
}

/// Redis over TLS (`rediss://`, as managed Redis serves it): `paceline up
/// --demo` runs its sample runs to `completed` with every connection — the
/// API's, the shared event reader's, the workers' blocking fetches and the
/// cancel subscriber — over TLS, verifying the server against the CA the
/// process trusts (`SSL_CERT_FILE`, read as the platform's store). A Redis
/// whose certificate the process does not trust is refused, not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_its_demo_over_a_tls_redis_and_refuses_an_untrusted_one() {
    let certs = tempfile::tempdir().unwrap();
    if tls_certificates(certs.path()).is_none() {
        // `.ci/run` installs openssl: there the test must run, not skip.
        assert!(std::env::var("PACELINE_CI").is_err(), "no `openssl` command to make test certificates");
        eprintln!("SKIPPED: no `openssl` command to make test certificates");
        return;
    }
    let cert = |f: &str| certs.path().join(f).display().to_string();
    let tls_port = paceline_tests::free_tcp_port();
    let _redis = RedisServer::start_with(paceline_tests::RedisOptions {
        extra_args: vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            cert("server.pem"),
            "--tls-key-file".into(),
            cert("server.key"),
            "--tls-ca-cert-file".into(),
            cert("ca.pem"),
            "--tls-auth-clients".into(),
            "no".into(),
        ],
        ..paceline_tests::RedisOptions::default()
    });
    let url = format!("rediss://localhost:{tls_port}");
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let prefix = unique_prefix();
    let args = ["--demo", "--listen", &listen, "--prefix", &prefix, "--demo-tools-listen", "127.0.0.1:0"];
    let mut child = up(
        dir.path(),
        &[&args[..], &["--demo-tpm", "400000", "--demo-latency-ms", "20"]].concat(),
        &[("REDIS_URL", &url), ("SSL_CERT_FILE", &cert("ca.pem"))],
    );
    let http = reqwest::Client::builder().timeout(secs(2)).build().unwrap();
    let base = format!("http://{listen}");
    let runs = demo_runs_finished(&http, &base, secs(40)).await;
    for run in &runs {
        assert_eq!(run["status"], "completed", "{run}\n{}", stderr_of(dir.path()));
    }
    assert!(stderr_of(dir.path()).contains(&format!("using Redis at {url}")), "{}", stderr_of(dir.path()));
    stop_cleanly(&mut child, dir.path(), secs(20));

    // The same server, its CA not the one the process trusts (another CA's):
    // the API answers, and Redis is unavailable to it, never used.
    let untrusted = tempfile::tempdir().unwrap();
    tls_certificates(untrusted.path()).expect("a second CA");
    let other_ca = untrusted.path().join("ca.pem").display().to_string();
    let listen = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let args = ["--listen", &listen, "--prefix", &prefix];
    let child = up(untrusted.path(), &args, &[("REDIS_URL", &url), ("SSL_CERT_FILE", &other_ca)]);
    let base = format!("http://{listen}");
    let status = eventually("the API to answer while Redis is refused", secs(20), || async {
        Some(http.get(format!("{base}/v1/runs")).send().await.ok()?.status())
    })
    .await;
    assert_eq!(status, 503, "an untrusted Redis is unavailable, never used:\n{}", stderr_of(untrusted.path()));
    child.signal("KILL");
}

/// A program on the port an earlier `up`'s private Redis used, answering
/// `+OK` and `+PONG` to anything (so "taking the password"), is not adopted:
/// it does not hold the directory's owner mark. `up` refuses it and starts
/// no second server on the same files.
#[test]
fn up_refuses_what_answers_on_its_old_private_port_without_proving_to_be_its_redis() {
    let dir = tempfile::tempdir().unwrap();
    let redis_dir = dir.path().join(".paceline/redis");
    std::fs::create_dir_all(&redis_dir).unwrap();
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in fake.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                let mut buf = [0u8; 4096];
                while let Ok(n) = std::io::Read::read(&mut stream, &mut buf) {
                    if n == 0 || std::io::Write::write_all(&mut stream, b"+OK\r\n+PONG\r\n").is_err() {
                        break;
                    }
                }
            });
        }
    });
    std::fs::write(redis_dir.join("paceline-port"), port.to_string()).unwrap();
    std::fs::write(redis_dir.join("paceline-password"), "a-password").unwrap();
    std::fs::write(redis_dir.join("paceline-owner"), "the-mark").unwrap();
    let probe = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let mut child = up(dir.path(), &["--listen", "127.0.0.1:0", "--local-redis-probe", &probe], &[]);
    let status = child.wait_timeout(secs(15)).expect("up exits");
    let err = stderr_of(dir.path());
    assert!(!status.success(), "{err}");
    assert!(err.contains("does not prove to be that Redis"), "{err}");
    assert!(!redis_dir.join("redis.pid").exists(), "no second redis-server was started: {err}");
}

/// An `up` killed with SIGKILL leaves its private Redis running; the next
/// `up` in the same directory proves it is that Redis (its owner mark) and
/// uses it — no second server on the same files — and stops it on exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_up_adopts_the_private_redis_a_killed_one_left_running() {
    let dir = tempfile::tempdir().unwrap();
    let _leftover = PidFileGuard(dir.path().join(".paceline/redis/redis.pid"));
    let probe = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let http = reqwest::Client::builder().timeout(secs(2)).build().unwrap();
    let listen = format!("127.0.0.1:{}", paceline_tests::free_tcp_port());
    let args = ["--listen", listen.as_str(), "--local-redis-probe", probe.as_str(), "--concurrency", "2"];
    let mut first = up(dir.path(), &args, &[("PACELINE_PROVIDER_URL", "http://127.0.0.1:9/v1")]);
    eventually("the first up is ready", secs(20), || get(&http, format!("http://{listen}/readyz"))).await;
    first.signal("KILL");
    let _ = first.wait_timeout(secs(10));
    let mut second = up(dir.path(), &args, &[("PACELINE_PROVIDER_URL", "http://127.0.0.1:9/v1")]);
    eventually("the second up is ready", secs(20), || get(&http, format!("http://{listen}/readyz"))).await;
    let err = stderr_of(dir.path());
    assert!(err.contains("using the private redis-server an earlier `paceline up` left running"), "{err}");
    stop_cleanly(&mut second, dir.path(), secs(20));
    assert!(stderr_of(dir.path()).contains("the private redis-server stopped"), "{}", stderr_of(dir.path()));
}
