//! Connecting to Redis the same way everywhere.
//!
//! Commands go through a [`ConnectionManager`], which reconnects with backoff
//! when Redis goes away, so no process has to exit because Redis restarted.
//! Blocking reads (the queue's `BLPOP` on its wake-up list, `XREAD BLOCK` on
//! run streams) need their own connection whose response timeout is longer
//! than their block ([`manager_with_timeout`]): a response timeout cuts a
//! blocking command too, and the redis crate's async connections default to
//! 500 ms (ordinary commands here get [`COMMAND_TIMEOUT`]).

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::time::Duration;

/// How long a normal command may take before it is an error.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A reconnecting connection for ordinary commands and scripts.
pub async fn manager(url: &str) -> redis::RedisResult<ConnectionManager> {
    manager_with_timeout(url, COMMAND_TIMEOUT).await
}

/// A reconnecting connection whose commands may block up to `timeout`
/// (give blocking reads a timeout longer than their `BLOCK` argument).
pub async fn manager_with_timeout(url: &str, timeout: Duration) -> redis::RedisResult<ConnectionManager> {
    let client = redis::Client::open(url)?;
    ConnectionManager::new_with_config(client, config(timeout)).await
}

/// Like [`manager`], but does not connect until the first command; a process
/// can start while Redis is still down.
pub fn lazy_manager(url: &str, timeout: Duration) -> redis::RedisResult<ConnectionManager> {
    let client = redis::Client::open(url)?;
    ConnectionManager::new_lazy_with_config(client, config(timeout))
}

fn config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(2))
        .set_number_of_retries(3)
}

/// Whether a Redis error means "Redis is not there (now)" — the connection,
/// a timeout, a server loading, busy, down or failing over — rather than "the
/// command was wrong": trouble that passes, worth a retry (a fenced write) or
/// a 503 (the API), never a bug report.
pub fn unavailable(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match error.kind() {
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType | ErrorKind::InvalidClientConfig => false,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ),
        // Io, Client (a dropped or not-yet-reconnected manager), auth, cluster
        // routing: Redis is not usable now.
        _ => true,
    }
}

/// The Redis server's clock in milliseconds (`TIME`): the one clock shared state uses.
pub async fn server_time_ms<C: redis::aio::ConnectionLike + Send>(conn: &mut C) -> redis::RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// The oldest Redis the scripts run on: they use `ZADD … LT` (6.2).
pub const MIN_REDIS_VERSION: (u32, u32) = (6, 2);

/// The server's version from `INFO server` text (`redis_version:7.0.15`).
pub fn redis_version(info: &str) -> Option<(u32, u32)> {
    let v = info.lines().find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
}

/// Asks the server its version: `Err(message)` inside when it is older than
/// [`MIN_REDIS_VERSION`] (the scripts would fail at their first call with
/// "syntax error"), `Ok(())` when it is new enough or does not say; the
/// outer error when Redis did not answer.
pub async fn check_version<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<Result<(), String>> {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(match redis_version(&info) {
        Some(v) if v < MIN_REDIS_VERSION => Err(format!(
            "Redis {}.{} is too old: paceline needs Redis {}.{} or later",
            v.0, v.1, MIN_REDIS_VERSION.0, MIN_REDIS_VERSION.1
        )),
        _ => Ok(()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(redis_version(info), Some((7, 0)));
        assert_eq!(redis_version("redis_version:6.0.9\r\n"), Some((6, 0)));
        assert!(redis_version("redis_version:6.0.9\r\n").unwrap() < MIN_REDIS_VERSION);
        assert_eq!(redis_version("# Server\r\n"), None);
    }
}
