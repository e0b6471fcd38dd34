//! The integration-test harness: a private `redis-server` per test (Unix socket in a
//! temp dir, killed on drop), a unique key prefix per test, bounded waits, and the
//! path of the `paceline` binary for tests that need real processes.
//!
//! Every wait here is bounded; a test that waits for something that never comes
//! fails with a message instead of hanging CI.

use std::future::Future;
use std::path::{Path, PathBuf};

use shared::redis_server::{Persistence, RedisChild, RedisServerOptions};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Options for a private redis-server.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Turn on the append-only file (`appendfsync always`), so a restart keeps everything.
    pub aof: bool,
    /// Also listen on this TCP port on 127.0.0.1 (a replica's `REPLICAOF` needs one).
    pub tcp_port: Option<u16>,
    /// More `redis-server` arguments (a TLS port and its certificates).
    pub extra_args: Vec<String>,
}

/// A TCP port free on 127.0.0.1 now (bound and let go: another process may
/// take it in between, which a test sees as a start failure, not a wrong result).
pub fn free_tcp_port() -> u16 {
    shared::redis_server::free_tcp_port().expect("a free TCP port")
}

/// A private `redis-server` listening on a Unix socket in its own temp dir
/// (started by `shared::redis_server`, the launcher `paceline up` and the
/// bench use too). Killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    dir: tempfile::TempDir,
    child: Option<RedisChild>,
    opts: RedisOptions,
}

impl RedisServer {
    /// Starts a server with persistence off (the usual case).
    pub fn start() -> Self {
        Self::start_with(RedisOptions::default())
    }

    /// Starts a server with the given options.
    pub fn start_with(opts: RedisOptions) -> Self {
        let dir =
            tempfile::Builder::new().prefix("paceline-redis-").tempdir().expect("create temp dir for redis-server");
        let mut server = Self { dir, child: None, opts };
        server.spawn();
        server
    }

    fn options(&self) -> RedisServerOptions {
        RedisServerOptions {
            tcp_port: self.opts.tcp_port,
            persistence: if self.opts.aof { Persistence::AofAlways } else { Persistence::None },
            extra_args: self.opts.extra_args.clone(),
            ..RedisServerOptions::unix(self.dir.path())
        }
    }

    /// The end of its log (`redis.log`), at most `lines` lines.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Path of the Unix socket.
    pub fn socket(&self) -> PathBuf {
        self.options().socket()
    }

    /// `redis+unix://` URL for the redis crate and for child processes.
    pub fn url(&self) -> String {
        self.options().url()
    }

    /// A fresh multiplexed client for test assertions.
    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("redis url")
    }

    /// A multiplexed async connection.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        self.client().get_multiplexed_async_connection().await.expect("connect to private redis-server")
    }

    /// Kills the server (SIGKILL) and leaves it down; `restart` brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    /// Brings the server back on the same socket (with the same data when AOF is on).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Starts the server process again on the same socket and dir.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "redis-server already running");
        match self.options().start() {
            Ok(child) => self.child = Some(child),
            Err(e) => panic!("cannot start a private redis-server: {e}"),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A key prefix no other test uses.
pub fn unique_prefix() -> String {
    format!("t{:016x}", rand::random::<u64>())
}

/// Polls `check` until it returns `Some`, or fails the test after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    match poll_until(timeout, check).await {
        Some(value) => value,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// Polls `check` every 10 ms until it returns `Some`, or gives `None` after `timeout`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How many calls of `command` (lower case: `lpush`, `evalsha`) an `INFO
/// commandstats` reply counts (0 if none).
pub fn command_calls(info: &str, command: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Every key of the Redis at `url` whose name holds `pattern` (a `SCAN`
/// pattern), with its value, one line each: what a test prints when it times
/// out waiting, so a stall in CI leaves the queue's and the pacer's state
/// behind it. Long values are cut; a Redis that does not answer says so.
pub async fn dump_redis(url: &str, pattern: &str) -> String {
    use redis::AsyncCommands;
    let mut out = String::new();
    let client = match redis::Client::open(url) {
        Ok(client) => client,
        Err(e) => return format!("(no dump: {e})"),
    };
    let mut conn = match client.get_multiplexed_async_connection().await {
        Ok(conn) => conn,
        Err(e) => return format!("(no dump: {e})"),
    };
    let mut keys: Vec<String> = match conn.scan_match::<_, String>(pattern).await {
        Ok(iter) => {
            use futures::StreamExt;
            iter.filter_map(|k| async move { k.ok() }).collect().await
        }
        Err(e) => return format!("(no dump: {e})"),
    };
    keys.sort();
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    out.push_str(&format!("redis dump at {now_ms} ms, {} keys matching {pattern}\n", keys.len()));
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(&key).query_async(&mut conn).await.unwrap_or_default();
        let value = match kind.as_str() {
            "string" => conn.get::<_, Option<String>>(&key).await.map(|v| format!("{v:?}")),
            // (The pacer's records are packed numbers: shown escaped.)
            "hash" => conn.hgetall::<_, Vec<(String, Vec<u8>)>>(&key).await.map(|v| {
                let fields: Vec<String> = v.iter().map(|(f, b)| format!("{f}={}", b.escape_ascii())).collect();
                fields.join(" ")
            }),
            "zset" => conn.zrange_withscores::<_, Vec<(String, f64)>>(&key, 0, -1).await.map(|v| format!("{v:?}")),
            "list" => conn.lrange::<_, Vec<String>>(&key, 0, -1).await.map(|v| format!("{v:?}")),
            "set" => conn.smembers::<_, Vec<String>>(&key).await.map(|v| format!("{v:?}")),
            "stream" => conn.xlen::<_, u64>(&key).await.map(|n| format!("stream of {n} entries")),
            other => Ok(format!("({other})")),
        };
        let mut value = value.unwrap_or_else(|e| format!("(error: {e})"));
        if value.len() > 4_000 {
            let mut cut = 4_000;
            while !value.is_char_boundary(cut) {
                cut -= 1;
            }
            value = format!("{}… ({} bytes)", &value[..cut], value.len());
        }
        out.push_str(&format!("{key} [{kind}] {value}\n"));
    }
    out
}

/// Runs a future with a bound; panics naming `what` when it is exceeded.
pub async fn within<T>(what: &str, timeout: Duration, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(timeout, fut).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {timeout:?}: {what}"),
    }
}

/// Path of the `paceline` binary built by `cargo test --workspace`
/// (the `paceline` package's own CLI test makes cargo build it).
pub fn paceline_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/integration-xxxx -> target/debug/paceline
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = dir.join("paceline");
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo test --workspace` so the binary is built",
        bin.display()
    );
    bin
}

/// A child process killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Sends a signal by name (`TERM`, `KILL`, `STOP`, `CONT`) with the `kill` command.
    pub fn signal(&self, name: &str) {
        let status =
            Command::new("kill").arg(format!("-{name}")).arg(self.0.id().to_string()).status().expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits for the process to exit, at most `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.0.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Unix-socket endpoint that forwards each connection to a Redis server
/// that can be switched: what a managed Redis's primary endpoint (or a
/// Sentinel-aware DNS name) does at a failover. `switch` points new connections
/// at another server and cuts every open one, as a failover does.
pub struct SwitchingEndpoint {
    dir: tempfile::TempDir,
    target: std::sync::Arc<std::sync::Mutex<PathBuf>>,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl SwitchingEndpoint {
    /// Listens on a socket of its own, forwarding to `target`'s socket.
    pub fn start(target: &Path) -> Self {
        let dir = tempfile::Builder::new().prefix("paceline-endpoint-").tempdir().expect("temp dir");
        let listener = tokio::net::UnixListener::bind(dir.path().join("endpoint.sock")).expect("bind the endpoint");
        let target = std::sync::Arc::new(std::sync::Mutex::new(target.to_path_buf()));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (t, c) = (target.clone(), cut.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = t.lock().expect("target lock").clone();
                let mut cut = c.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::UnixStream::connect(&to).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self { dir, target, cut, task }
    }

    /// `redis+unix://` URL of the endpoint.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.dir.path().join("endpoint.sock").display())
    }

    /// New connections go to `target`; open ones are cut.
    pub fn switch(&self, target: &Path) {
        *self.target.lock().expect("target lock") = target.to_path_buf();
        self.cut.send_modify(|n| *n += 1);
    }
}

impl Drop for SwitchingEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A local Redis Cluster: `primaries` primaries and one replica each, every
/// node a private `redis-server` (its Unix socket for the tests, a loopback
/// TCP port for the cluster bus), formed with `redis-cli --cluster create`
/// (issue 42's test bed: `docs/redis-cluster-plan.md`). Killed when dropped.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in the order `redis-cli` was given them (it makes the
    /// first `primaries` the primaries).
    pub nodes: Vec<RedisServer>,
    /// Each node's TCP port.
    pub ports: Vec<u16>,
}

/// One line of `CLUSTER NODES`: a node's port, whether it is a primary that
/// is not failed, and the slot ranges it serves.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    /// Its TCP port.
    pub port: u16,
    /// A primary the cluster does not think failed.
    pub primary: bool,
    /// A replica.
    pub replica: bool,
    /// The slots it serves, as inclusive ranges.
    pub slots: Vec<(u16, u16)>,
}

/// Whether `redis-cli` can create a cluster here; when not, a line on
/// stderr says the test is skipped — unless `PACELINE_CI` is set, where that
/// fails the test.
pub fn cluster_supported() -> bool {
    let supported = Command::new("redis-cli").args(["--cluster", "help"]).output().is_ok_and(|o| {
        let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        text.contains("create")
    });
    if !supported {
        assert!(std::env::var("PACELINE_CI").is_err(), "redis-cli cannot create a cluster here");
        eprintln!("SKIPPED: redis-cli cannot create a cluster here (redis-cli --cluster help)");
    }
    supported
}

impl RedisCluster {
    /// Starts and forms a cluster; `None` (with a line on stderr) where this
    /// machine's `redis-server` or `redis-cli` cannot — unless `PACELINE_CI`
    /// is set, where that fails the test.
    pub async fn start(primaries: usize) -> Option<Self> {
        if !cluster_supported() {
            return None;
        }
        let mut nodes = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..primaries * 2 {
            // Two free ports (its own and its cluster bus's), taken afresh when another
            // process took one between their check and the server's bind.
            let mut tries = 0;
            let (server, port) = loop {
                let (port, bus) = (free_tcp_port(), free_tcp_port());
                let dir = tempfile::Builder::new().prefix("paceline-cluster-").tempdir().expect("a temp dir");
                let opts = RedisOptions {
                    tcp_port: Some(port),
                    extra_args: shared::redis_server::cluster_node_args(&dir.path().join("nodes.conf"), bus),
                    ..Default::default()
                };
                let mut server = RedisServer { dir, child: None, opts };
                match server.options().start() {
                    Ok(child) => {
                        server.child = Some(child);
                        break (server, port);
                    }
                    Err(e) if tries < 5 => {
                        tries += 1;
                        eprintln!("a cluster node did not start ({e}); again on other ports");
                    }
                    Err(e) => panic!("cannot start a cluster node: {e}"),
                }
            };
            nodes.push(server);
            ports.push(port);
        }
        shared::redis_server::form_cluster(&ports).expect("a local cluster");
        let cluster = Self { nodes, ports };
        Some(cluster)
    }

    /// `CLUSTER INFO` of node `i` (empty when it does not answer).
    pub async fn info(&self, i: usize) -> String {
        let Ok(mut conn) = self.nodes[i].client().get_multiplexed_async_connection().await else {
            return String::new();
        };
        redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await.unwrap_or_default()
    }

    /// The cluster as node `i` sees it (`CLUSTER NODES`).
    pub async fn view(&self, i: usize) -> Vec<ClusterNode> {
        let mut conn = self.nodes[i].conn().await;
        let text: String = redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await.expect("CLUSTER NODES");
        text.lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let port = fields.get(1)?.split('@').next()?.rsplit(':').next()?.parse().ok()?;
                let flags = fields.get(2)?;
                let primary = flags.contains("master") && !flags.contains("fail");
                let replica = flags.contains("slave");
                let slots = fields
                    .iter()
                    .skip(8)
                    .filter(|s| !s.starts_with('['))
                    .filter_map(|s| match s.split_once('-') {
                        Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                        None => s.parse().ok().map(|n| (n, n)),
                    })
                    .collect();
                Some(ClusterNode { port, primary, replica, slots })
            })
            .collect()
    }

    /// The slot of `key` (its hash tag's), as the first node that answers computes it.
    pub async fn slot_of(&self, key: &str) -> u16 {
        for node in &self.nodes {
            let Ok(mut conn) = node.client().get_multiplexed_async_connection().await else { continue };
            if let Ok(slot) = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut conn).await {
                return slot;
            }
        }
        panic!("no node answers CLUSTER KEYSLOT");
    }

    /// The index of the node serving `key`'s slot, as node `seen_by` sees it.
    pub async fn owner_of(&self, key: &str, seen_by: usize) -> Option<usize> {
        let slot = self.slot_of(key).await;
        let view = self.view(seen_by).await;
        let owner = view.iter().find(|n| n.primary && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))?;
        self.ports.iter().position(|p| *p == owner.port)
    }
}
