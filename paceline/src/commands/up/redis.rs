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
/// A mark only this directory's owner can read, held by the server too
/// (`OWNER_KEY`): the proof an adopted server is the one started here.
const OWNER_FILE: &str = "paceline-owner";
const OWNER_KEY: &str = "paceline-up:owner";

/// A file's text without surrounding whitespace; `None` when missing or empty.
fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

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
        // used rather than a second one on the same files — when it proves it
        // is that server (it holds this directory's owner mark, which only the
        // directory's owner can read; taking the password proves nothing of a
        // server). Anything else on that port is refused, never joined by a
        // second server on the same files.
        let port = std::fs::read_to_string(dir.join(PORT_FILE)).ok().and_then(|s| s.trim().parse::<u16>().ok());
        if let Some(port) = port {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            if probe(addr).await != Probe::Nothing {
                let password = read_trimmed(&dir.join(PASSWORD_FILE)).unwrap_or_default();
                let owned = Self { dir: dir.clone(), port, password, child: None };
                if owned.holds_the_mark().await {
                    say(format!(
                        "REDIS_URL is not set; using the private redis-server an earlier `paceline up` left running \
                         on 127.0.0.1:{port} (data in {}); it stops when this one does",
                        dir.display()
                    ));
                    return Ok(owned);
                }
                anyhow::bail!(
                    "something answers on 127.0.0.1:{port}, where an earlier `paceline up` ran its private Redis \
                     (data in {}), but it does not prove to be that Redis: stop it, or remove {} if the port is \
                     another program's now",
                    dir.display(),
                    dir.join(PORT_FILE).display()
                );
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
        let own = Self { dir: dir.clone(), port, password: password.clone(), child: None };
        own.set_the_mark().await.context("marking the private redis-server as this directory's")?;
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

    /// Writes a fresh owner mark to the server and to `DIR/paceline-owner`
    /// (mode 600): a later `up` adopts the server only if it holds the mark.
    async fn set_the_mark(&self) -> anyhow::Result<()> {
        let mark = shared::redis_server::new_password();
        shared::redis_server::write_private(&self.dir.join(OWNER_FILE), &mark)?;
        let mut conn = redis::Client::open(self.url())?.get_multiplexed_async_connection().await?;
        let _: () = redis::cmd("SET").arg(OWNER_KEY).arg(&mark).query_async(&mut conn).await?;
        Ok(())
    }

    /// Whether the server on this port holds the mark in `DIR/paceline-owner`.
    async fn holds_the_mark(&self) -> bool {
        let Some(mark) = read_trimmed(&self.dir.join(OWNER_FILE)) else { return false };
        let read = async {
            let mut conn = redis::Client::open(self.url()).ok()?.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("GET").arg(OWNER_KEY).query_async::<Option<String>>(&mut conn).await.ok()?
        };
        tokio::time::timeout(Duration::from_secs(2), read).await.ok().flatten().is_some_and(|held| held == mark)
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
