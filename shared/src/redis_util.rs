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

/// A connection for ordinary commands and scripts: one Redis through a
/// reconnecting [`ConnectionManager`] (every deployment today), or a Redis
/// Cluster through the redis crate's cluster client, which follows `MOVED`
/// and `ASK` and reconnects to a promoted replica (issue 42; the scripts do
/// not keep to one slot yet: `docs/redis-cluster-plan.md`). Cheap to clone:
/// clones share the connection.
#[derive(Clone)]
pub enum RedisConn {
    /// One Redis (a primary, with replicas or not).
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(redis::cluster_async::ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "RedisConn::Single",
            Self::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl From<ConnectionManager> for RedisConn {
    fn from(conn: ConnectionManager) -> Self {
        Self::Single(conn)
    }
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A connection to the Redis Cluster whose nodes include `nodes` (URLs; any
/// reachable one tells the client the rest), its commands timed as
/// [`manager`]'s.
pub async fn cluster(nodes: &[String]) -> redis::RedisResult<RedisConn> {
    let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(COMMAND_TIMEOUT)
        .build()?;
    Ok(RedisConn::Cluster(client.get_async_connection().await?))
}

/// How long a normal command may take before it is an error.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A reconnecting connection for ordinary commands and scripts.
pub async fn manager(url: &str) -> redis::RedisResult<RedisConn> {
    manager_with_timeout(url, COMMAND_TIMEOUT).await
}

/// A reconnecting connection whose commands may block up to `timeout`
/// (give blocking reads a timeout longer than their `BLOCK` argument).
pub async fn manager_with_timeout(url: &str, timeout: Duration) -> redis::RedisResult<RedisConn> {
    let client = redis::Client::open(url)?;
    Ok(ConnectionManager::new_with_config(client, config(timeout)).await?.into())
}

/// Like [`manager`], but does not connect until the first command; a process
/// can start while Redis is still down.
pub fn lazy_manager(url: &str, timeout: Duration) -> redis::RedisResult<RedisConn> {
    let client = redis::Client::open(url)?;
    Ok(ConnectionManager::new_lazy_with_config(client, config(timeout))?.into())
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

/// Why a Redis whose `INFO cluster` reads `info` cannot be paceline's one
/// Redis: a node of a Redis Cluster serves some slots only, and answers a
/// key of another with `MOVED` — every script would fail on most runs, in
/// the middle of the work. Refused at start instead (cluster mode is issue
/// 42's, not built: `docs/redis-cluster-plan.md`).
pub fn cluster_refused(info: &str) -> Option<String> {
    (info_field(info, "cluster_enabled") == Some("1")).then(|| {
        "REDIS_URL names a node of a Redis Cluster (cluster_enabled:1): paceline keeps its state in one Redis \
         (a primary, with replicas or not) and does not run on a cluster yet. Give it a Redis with \
         cluster-enabled no"
            .to_owned()
    })
}

/// The one `maxmemory-policy` that keeps every key: any other drops keys
/// under memory pressure.
pub const NO_EVICTION: &str = "noeviction";

/// The server's `maxmemory-policy`: `CONFIG GET`, or `INFO memory`'s
/// `maxmemory_policy` where `CONFIG` is disabled or renamed (managed Redis
/// services often do that); `None` when neither says.
pub async fn maxmemory_policy<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<Option<String>> {
    let config: redis::RedisResult<Vec<String>> =
        redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").query_async(conn).await;
    if let Ok(pair) = config {
        if let [_, policy] = pair.as_slice() {
            return Ok(Some(policy.clone()));
        }
    }
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    Ok(info_field(&info, "maxmemory_policy").map(str::to_owned))
}

/// A field of `INFO` text (`name:value` lines).
pub fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
}

/// Why a Redis whose policy is `policy` cannot hold paceline's state, if it
/// cannot: an evicting policy would drop a queued turn, a run record or a
/// transcript without a trace, and the run would stay stuck (SPEC §1).
pub fn eviction_refused(policy: &str) -> Option<String> {
    (policy != NO_EVICTION).then(|| {
        format!(
            "Redis evicts keys (maxmemory-policy {policy}): it would silently drop queued turns and runs. \
             Set `maxmemory-policy {NO_EVICTION}` (redis.conf, or CONFIG SET maxmemory-policy {NO_EVICTION}) \
             and give Redis the memory it needs"
        )
    })
}

/// Whether this Redis can hold paceline's state: new enough for the scripts
/// ([`check_version`]), not a cluster's node ([`cluster_refused`]) and
/// evicting no key ([`eviction_refused`]). Redis
/// not answering within `wait` is no refusal: a process starts before its
/// Redis and waits for it. Every process (`paceline api`, `worker`, `up`)
/// asks at start and exits with the reason when this is `Err`.
pub async fn refuse_unfit<C: redis::aio::ConnectionLike + Send>(conn: &mut C, wait: Duration) -> Result<(), String> {
    let checked = tokio::time::timeout(wait, async {
        if let Err(too_old) = check_version(conn).await? {
            return Ok(Err(too_old));
        }
        // (A Redis that will not say is not refused for it: the policy is still checked.)
        let cluster: redis::RedisResult<String> = redis::cmd("INFO").arg("cluster").query_async(conn).await;
        if let Some(why) = cluster.ok().as_deref().and_then(cluster_refused) {
            return Ok(Err(why));
        }
        let policy = maxmemory_policy(conn).await?;
        Ok::<_, redis::RedisError>(policy.as_deref().and_then(eviction_refused).map_or(Ok(()), Err))
    })
    .await;
    match checked {
        Ok(Ok(verdict)) => verdict,
        // Not up yet, or not answering: said by the first command that needs it.
        Ok(Err(_)) | Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_but_noeviction_is_refused_naming_it() {
        assert_eq!(eviction_refused("noeviction"), None);
        for policy in ["allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-lfu", "allkeys-random", "volatile-ttl"] {
            let why = eviction_refused(policy).unwrap();
            assert!(why.contains(&format!("maxmemory-policy {policy}")), "{why}");
        }
        let info = "# Memory\r\nused_memory:1024\r\nmaxmemory_policy:allkeys-lru\r\n";
        assert_eq!(info_field(info, "maxmemory_policy"), Some("allkeys-lru"));
        assert_eq!(info_field(info, "maxmemory"), None, "a field is its whole name");
    }

    #[test]
    fn a_cluster_node_is_refused_and_a_standalone_redis_is_not() {
        assert!(cluster_refused("# Cluster\r\ncluster_enabled:1\r\n").unwrap().contains("cluster_enabled:1"));
        assert_eq!(cluster_refused("# Cluster\r\ncluster_enabled:0\r\n"), None);
        assert_eq!(cluster_refused(""), None, "a Redis that says nothing of clusters");
    }

    #[test]
    fn the_version_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(redis_version(info), Some((7, 0)));
        assert_eq!(redis_version("redis_version:6.0.9\r\n"), Some((6, 0)));
        assert!(redis_version("redis_version:6.0.9\r\n").unwrap() < MIN_REDIS_VERSION);
        assert_eq!(redis_version("# Server\r\n"), None);
    }
}
