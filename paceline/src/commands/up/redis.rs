//! Which Redis `paceline up` uses: `REDIS_URL` when set; else a private
//! `redis-server` child (`shared::redis_server`) on a free port of 127.0.0.1,
//! with a generated password (in `DATA_DIR/redis`, mode 600) and its data and
//! AOF there, adopted again by a later `up` if this one is killed — only when
//! it answers to that password, so `up` never writes to a Redis it cannot tell
//! is its own. An open Redis on 127.0.0.1:6379 (any local process may read
//! and write it) is named, and used only when `REDIS_URL` names it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use shared::redis_server::{LaunchError, Persistence, RedisChild, RedisServerOptions};

use super::{say, Args};

/// The Redis `up` uses.
pub(super) enum RedisSource {
    /// `REDIS_URL` (or `REDIS_URL_FILE`).
    Given(String),
    /// A child (or one a killed `up` left behind) that `up` stops on exit.
    Private(OwnRedis),
}

impl RedisSource {
    pub(super) fn url(&self) -> String {
        match self {
            Self::Given(u) => u.clone(),
            Self::Private(p) => p.url(),
        }
    }

    pub(super) async fn stop(self) {
        if let Self::Private(p) = self {
            p.stop().await;
        }
    }
}

pub(super) async fn find_redis(args: &Args) -> anyhow::Result<RedisSource> {
    if let Some(url) = args.redis_url.as_deref().map(str::trim).filter(|u| !u.is_empty()) {
        say(format!("using Redis at {} (REDIS_URL)", shared::config::redact_url(url)));
        return Ok(RedisSource::Given(url.to_owned()));
    }
    let probe_addr = args.local_redis_probe;
    if probe(probe_addr).await == Probe::Pong {
        say(format!(
            "REDIS_URL is not set; an open Redis answers on {probe_addr}, but paceline up does not use a Redis it \
             cannot tell is its own (any local process may read and write an open one): set \
             REDIS_URL=redis://{probe_addr} to use it"
        ));
    }
    Ok(RedisSource::Private(OwnRedis::start(&args.data_dir.join("redis")).await?))
}

#[derive(Debug, PartialEq)]
pub(super) enum Probe {
    /// `+PONG`: an open Redis.
    Pong,
    /// Something answered, not `+PONG` (`-NOAUTH …`, another protocol).
    Other(String),
    /// Nothing listens (or nothing answered in time).
    Nothing,
}

/// One PING with short timeouts.
pub(super) async fn probe(addr: SocketAddr) -> Probe {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let t = Duration::from_millis(300);
    let Ok(Ok(mut s)) = tokio::time::timeout(t, tokio::net::TcpStream::connect(addr)).await else {
        return Probe::Nothing;
    };
    if s.write_all(b"PING\r\n").await.is_err() {
        return Probe::Nothing;
    }
    let mut buf = [0u8; 128];
    match tokio::time::timeout(t, s.read(&mut buf)).await {
        Ok(Ok(n)) if buf[..n].starts_with(b"+PONG") => Probe::Pong,
        Ok(Ok(n)) if n > 0 => Probe::Other(String::from_utf8_lossy(&buf[..n]).trim().chars().take(80).collect()),
        // Accepted but silent, or closed: something that is not Redis.
        Ok(_) | Err(_) => Probe::Other("no answer to PING".into()),
    }
}

const PORT_FILE: &str = "paceline-port";
/// The private server's password, mode 600 beside its data.
const PASSWORD_FILE: &str = "paceline-password";

/// A private `redis-server` on 127.0.0.1 with its data and AOF in `dir`.
pub(super) struct OwnRedis {
    dir: PathBuf,
    port: u16,
    password: String,
    /// `None` when it was adopted from a killed earlier `up`.
    child: Option<RedisChild>,
}

impl OwnRedis {
    async fn start(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir = dir.canonicalize().with_context(|| format!("{}", dir.display()))?;
        // A private server an earlier `up` left running (it was SIGKILLed):
        // used rather than a second one on the same files — when it answers to
        // this directory's password, which only its owner can read.
        let port = std::fs::read_to_string(dir.join(PORT_FILE)).ok().and_then(|s| s.trim().parse::<u16>().ok());
        let password = std::fs::read_to_string(dir.join(PASSWORD_FILE)).ok().map(|p| p.trim().to_owned());
        if let (Some(port), Some(password)) = (port, password.filter(|p| !p.is_empty())) {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let pw = password.clone();
            if tokio::task::spawn_blocking(move || shared::redis_server::ping_tcp(addr, Some(&pw))).await? {
                say(format!(
                    "REDIS_URL is not set; using the private redis-server an earlier `paceline up` left running on \
                     127.0.0.1:{port} (it answers to the password in {}); it stops when this one does",
                    dir.display()
                ));
                return Ok(Self { dir, port, password, child: None });
            }
        }
        // A new password each start, readable by this user alone.
        let password = shared::redis_server::new_password();
        shared::redis_server::write_private(&dir.join(PASSWORD_FILE), &password)
            .with_context(|| format!("writing {}", dir.join(PASSWORD_FILE).display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("finding a free port for redis-server")?
            .port();
        let options = RedisServerOptions {
            dir: dir.clone(),
            unix_socket: false,
            tcp_port: Some(port),
            persistence: Persistence::AofEverySec,
            // Its own process group: a terminal's Ctrl-C reaches only us, and
            // we stop Redis after the workers have drained into it.
            own_process_group: true,
            extra_args: vec![],
            password: Some(password.clone()),
        };
        let child = match tokio::task::spawn_blocking(move || options.start()).await? {
            Ok(child) => child,
            Err(LaunchError::NotInstalled) => anyhow::bail!(
                "no Redis to use: REDIS_URL is not set, and there is no `redis-server` on PATH to start a private \
                 one. Install Redis (Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: `brew install \
                 redis`), or set REDIS_URL to a Redis you have."
            ),
            Err(e) => return Err(e.into()),
        };
        let pid = child.pid().unwrap_or(0);
        let _ = std::fs::write(dir.join(PORT_FILE), port.to_string());
        say(format!(
            "REDIS_URL is not set, so paceline started a private redis-server (pid {pid}) on 127.0.0.1:{port}, with a \
             generated password (in {}), data and AOF in {}; it stops when paceline up stops",
            dir.join(PASSWORD_FILE).display(),
            dir.display()
        ));
        Ok(Self { dir, port, password, child: Some(child) })
    }

    fn url(&self) -> String {
        format!("redis://:{}@127.0.0.1:{}", self.password, self.port)
    }

    /// `SHUTDOWN` (Redis writes its AOF and exits), then waits for it; a kill
    /// when it does not go within 10 s.
    async fn stop(mut self) {
        let t = Duration::from_secs(5);
        if let Ok(client) = redis::Client::open(self.url()) {
            if let Ok(Ok(mut conn)) = tokio::time::timeout(t, client.get_multiplexed_async_connection()).await {
                // Answers with a closed connection when it worked.
                let _ = tokio::time::timeout(t, redis::cmd("SHUTDOWN").query_async::<()>(&mut conn)).await;
            }
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let gone = match self.child.take() {
            Some(mut child) => tokio::task::spawn_blocking(move || {
                let gone = child.wait_exit(Duration::from_secs(10));
                child.kill();
                gone
            })
            .await
            .unwrap_or(false),
            None => {
                let deadline = Instant::now() + Duration::from_secs(10);
                while probe(addr).await != Probe::Nothing && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                probe(addr).await == Probe::Nothing
            }
        };
        let _ = std::fs::remove_file(self.dir.join(PORT_FILE));
        if gone {
            say(format!("the private redis-server stopped (its data stays in {})", self.dir.display()));
        } else {
            say("the private redis-server did not stop within 10 s after SHUTDOWN");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_answers_nothing() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert_eq!(probe(port).await, Probe::Nothing);
    }
}
