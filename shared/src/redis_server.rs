//! A private `redis-server` child: the one launcher behind `paceline up`
//! (when no Redis is given and none answers), the bench and the integration
//! tests. Each says where the server keeps its files, how it listens (a Unix
//! socket in that directory, a TCP port on 127.0.0.1, or both) and whether it
//! persists; the launcher builds the command line, starts it and waits until
//! it answers `PING`.
//!
//! Starting is synchronous (a child process and a blocking `PING`, at most
//! [`START_TIMEOUT`]): async callers run it on a blocking thread.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a started server has to answer `PING`.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server does with its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Persistence {
    /// Nothing on disk (benches, most tests).
    #[default]
    None,
    /// An append-only file, fsynced once a second (`paceline up`).
    AofEverySec,
    /// An append-only file, fsynced on every write (tests that restart the
    /// server and count on every acknowledged write).
    AofAlways,
}

/// Where and how one private server runs.
#[derive(Debug, Clone)]
pub struct RedisServerOptions {
    /// Its directory: data, `redis.log`, `redis.pid` and, with
    /// [`RedisServerOptions::unix_socket`], `redis.sock`.
    pub dir: PathBuf,
    /// Listen on `DIR/redis.sock` (mode 700).
    pub unix_socket: bool,
    /// Also listen on 127.0.0.1 on this port (`None`: no TCP).
    pub tcp_port: Option<u16>,
    /// What it keeps on disk.
    pub persistence: Persistence,
    /// Start it in its own process group, so a terminal's Ctrl-C reaches only
    /// its parent, which stops it after draining into it.
    pub own_process_group: bool,
    /// More `redis-server` arguments, after these (tests: a TLS port and its
    /// certificates).
    pub extra_args: Vec<String>,
    /// A password clients must give (`requirepass`), put in `DIR/redis.conf`
    /// (mode 600), never on the command line, where `ps` shows it.
    pub password: Option<String>,
}

impl RedisServerOptions {
    /// A server on a Unix socket in `dir`, nothing on disk.
    pub fn unix(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            unix_socket: true,
            tcp_port: None,
            persistence: Persistence::None,
            own_process_group: false,
            extra_args: vec![],
            password: None,
        }
    }

    /// The Unix socket's path (whether or not it listens there).
    pub fn socket(&self) -> PathBuf {
        self.dir.join("redis.sock")
    }

    /// The URL a client connects with: the Unix socket when there is one,
    /// else the TCP port.
    pub fn url(&self) -> String {
        let auth = self.password.as_ref().map(|p| format!(":{p}@")).unwrap_or_default();
        match (self.unix_socket, self.tcp_port) {
            (false, Some(port)) => format!("redis://{auth}127.0.0.1:{port}"),
            _ if auth.is_empty() => format!("redis+unix://{}", self.socket().display()),
            _ => format!("redis+unix://{}?pass={}", self.socket().display(), self.password.as_deref().unwrap_or("")),
        }
    }

    /// The `redis-server` command line these options describe.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new("redis-server");
        if self.password.is_some() {
            // A config file must come first; `start` writes it.
            cmd.arg(self.dir.join(CONF_FILE));
        }
        cmd.arg("--bind").arg("127.0.0.1").arg("--port").arg(self.tcp_port.unwrap_or(0).to_string());
        cmd.arg("--protected-mode").arg("yes");
        if self.unix_socket {
            cmd.arg("--unixsocket").arg(self.socket()).arg("--unixsocketperm").arg("700");
        }
        cmd.arg("--dir").arg(&self.dir).arg("--save").arg("");
        cmd.arg("--logfile").arg(self.dir.join("redis.log")).arg("--pidfile").arg(self.dir.join("redis.pid"));
        cmd.arg("--daemonize").arg("no");
        match self.persistence {
            Persistence::None => cmd.arg("--appendonly").arg("no"),
            Persistence::AofEverySec => cmd.arg("--appendonly").arg("yes").arg("--appendfsync").arg("everysec"),
            Persistence::AofAlways => cmd.arg("--appendonly").arg("yes").arg("--appendfsync").arg("always"),
        };
        cmd.args(&self.extra_args);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        #[cfg(unix)]
        if self.own_process_group {
            use std::os::unix::process::CommandExt as _;
            cmd.process_group(0);
        }
        cmd
    }

    /// Starts the server and waits until it answers `PING` (at most
    /// [`START_TIMEOUT`]); a server that exits or stays silent is killed and
    /// its log's end is in the error.
    pub fn start(&self) -> Result<RedisChild, LaunchError> {
        std::fs::create_dir_all(&self.dir).map_err(LaunchError::Io)?;
        if let Some(password) = &self.password {
            write_private(&self.dir.join(CONF_FILE), &format!("requirepass {password}\n")).map_err(LaunchError::Io)?;
        }
        let child = match self.command().spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(LaunchError::NotInstalled),
            Err(e) => return Err(LaunchError::Io(e)),
        };
        let mut server = RedisChild { child: Some(child), options: self.clone() };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if server.answers() {
                return Ok(server);
            }
            if let Some(Ok(Some(status))) = server.child.as_mut().map(Child::try_wait) {
                server.child = None;
                return Err(LaunchError::Exited { status, log: self.log_tail(10) });
            }
            if Instant::now() > deadline {
                server.kill();
                return Err(LaunchError::Silent { log: self.log_tail(10) });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Why a private server did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// There is no `redis-server` on `PATH`.
    #[error(
        "there is no `redis-server` on PATH (Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: `brew install redis`)"
    )]
    NotInstalled,
    /// It exited before it answered.
    #[error("redis-server exited at start ({status}); the end of its log:\n{log}")]
    Exited {
        /// Its exit status.
        status: ExitStatus,
        /// The end of its log.
        log: String,
    },
    /// It did not answer `PING` in time (it was killed).
    #[error("redis-server did not answer within {} s; the end of its log:\n{log}", START_TIMEOUT.as_secs())]
    Silent {
        /// The end of its log.
        log: String,
    },
    /// Its directory or the process could not be made.
    #[error("starting redis-server: {0}")]
    Io(std::io::Error),
}

/// A running private server. Dropping it kills it (SIGKILL): stop it with
/// `SHUTDOWN` first when its data matters.
#[derive(Debug)]
pub struct RedisChild {
    child: Option<Child>,
    options: RedisServerOptions,
}

impl RedisChild {
    /// How it was started.
    pub fn options(&self) -> &RedisServerOptions {
        &self.options
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether it answers `PING` now (a blocking probe of at most 0.5 s).
    pub fn answers(&self) -> bool {
        let password = self.options.password.as_deref();
        if self.options.unix_socket {
            ping_unix(&self.options.socket(), password)
        } else {
            self.options.tcp_port.is_some_and(|p| ping_tcp(std::net::SocketAddr::from(([127, 0, 0, 1], p)), password))
        }
    }

    /// Kills it (SIGKILL) and reaps it; its socket file is removed.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.options.unix_socket {
            let _ = std::fs::remove_file(self.options.socket());
        }
    }

    /// Waits up to `timeout` for it to exit on its own (after `SHUTDOWN`);
    /// false when it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let Some(child) = self.child.as_mut() else { return true };
        loop {
            if let Ok(Some(_)) | Err(_) = child.try_wait() {
                self.child = None;
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP port free on 127.0.0.1 now (bound and let go: another process may
/// take it in between, which its server sees as a start failure).
pub fn free_tcp_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The `redis-server` arguments of a node of a local Redis Cluster (the
/// integration tests' and the bench's): cluster mode, its node file at
/// `conf`, its bus on `bus` (given: the default, port + 10 000, passes
/// 65 535 for half the ephemeral range), a 2-s node timeout, and replicas
/// that sync at once (a replica that never synced cannot take over).
pub fn cluster_node_args(conf: &Path, bus: u16) -> Vec<String> {
    let args = ["--cluster-enabled", "yes", "--cluster-config-file"];
    let mut out: Vec<String> = args.map(str::to_owned).to_vec();
    out.push(conf.display().to_string());
    for (k, v) in [("--cluster-port", bus.to_string()), ("--cluster-node-timeout", "2000".to_owned())] {
        out.extend([k.to_owned(), v]);
    }
    out.extend(["--repl-diskless-sync-delay".to_owned(), "0".to_owned()]);
    out
}

/// Forms a Redis Cluster of the servers on 127.0.0.1 at `ports` (each started
/// with [`cluster_node_args`]) with `redis-cli --cluster create`, one replica
/// per primary (the first half of `ports` become the primaries), and waits
/// (at most 30 s) until every node says `cluster_state:ok` and every replica
/// has synced. `Err` says what `redis-cli` or a node said.
pub fn form_cluster(ports: &[u16]) -> Result<(), String> {
    let mut create = Command::new("redis-cli");
    create.arg("--cluster").arg("create");
    for port in ports {
        create.arg(format!("127.0.0.1:{port}"));
    }
    let out = create
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .output()
        .map_err(|e| format!("cannot run redis-cli: {e}"))?;
    if !out.status.success() {
        return Err(format!("redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout)));
    }
    let cli = |port: u16, args: &[&str]| {
        Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    for port in ports {
        loop {
            let ok = cli(*port, &["cluster", "info"]).contains("cluster_state:ok");
            let replication = cli(*port, &["info", "replication"]);
            let synced = replication.contains("role:master") || replication.contains("master_link_status:up");
            let replicas = cli(*port, &["cluster", "nodes"]).lines().filter(|l| l.contains("slave")).count();
            if ok && synced && replicas == ports.len() / 2 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("node 127.0.0.1:{port} not ok with its replicas synced within 30 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// A blocking `PING` over a Unix socket: true on `+PONG`.
fn ping_unix(socket: &Path, password: Option<&str>) -> bool {
    #[cfg(unix)]
    {
        std::os::unix::net::UnixStream::connect(socket).is_ok_and(|mut stream| {
            let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
            pong(&mut stream, password)
        })
    }
    #[cfg(not(unix))]
    {
        let _ = (socket, password);
        false
    }
}

/// A blocking `PING` over TCP (after `AUTH` with a password): true on `+PONG`.
fn ping_tcp(addr: std::net::SocketAddr, password: Option<&str>) -> bool {
    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok_and(|mut stream| {
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        pong(&mut stream, password)
    })
}

/// Sends `PING` on `stream`, `AUTH` first with a password; true when the
/// answer is `+PONG` (after `+OK`).
fn pong(stream: &mut (impl std::io::Read + std::io::Write), password: Option<&str>) -> bool {
    let (send, want) = match password {
        Some(p) => (format!("AUTH {p}\r\nPING\r\n"), &b"+OK\r\n+PONG"[..]),
        None => ("PING\r\n".to_owned(), &b"+PONG"[..]),
    };
    if stream.write_all(send.as_bytes()).is_err() {
        return false;
    }
    let mut buf = Vec::new();
    let mut piece = [0u8; 32];
    while buf.len() < want.len() {
        match stream.read(&mut piece) {
            Ok(n) if n > 0 => buf.extend_from_slice(&piece[..n]),
            _ => return false,
        }
    }
    buf.starts_with(want)
}

/// A fresh password for a private server: 128 random bits, in hex (safe in
/// a URL and an inline command).
pub fn new_password() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The config file a server with a password starts from.
const CONF_FILE: &str = "redis.conf";

/// Writes `text` to `path`, readable by this user alone.
pub fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    file.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_says_what_the_options_say() {
        let mut o = RedisServerOptions::unix("/tmp/x");
        let args = |o: &RedisServerOptions| -> Vec<String> {
            o.command().get_args().map(|a| a.to_string_lossy().into_owned()).collect()
        };
        let a = args(&o);
        assert!(a.windows(2).any(|w| w == ["--unixsocket", "/tmp/x/redis.sock"]), "{a:?}");
        assert!(a.windows(2).any(|w| w == ["--port", "0"]) && a.windows(2).any(|w| w == ["--appendonly", "no"]));
        assert_eq!(o.url(), "redis+unix:///tmp/x/redis.sock");
        o.unix_socket = false;
        o.tcp_port = Some(7001);
        o.persistence = Persistence::AofEverySec;
        let a = args(&o);
        assert!(!a.contains(&"--unixsocket".to_owned()));
        assert!(a.windows(2).any(|w| w == ["--appendfsync", "everysec"]), "{a:?}");
        assert_eq!(o.url(), "redis://127.0.0.1:7001");
    }
}
