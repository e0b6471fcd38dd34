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
