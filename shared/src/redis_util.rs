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
/// reconnecting [`ConnectionManager`], or a Redis Cluster through the redis
/// crate's cluster client, which follows `MOVED` and `ASK` and reconnects to
/// a promoted replica. Cheap to clone: clones share the connection.
#[derive(Clone)]
pub enum RedisConn {
    /// One Redis (a primary, with replicas or not).
    Single(ConnectionManager),
    /// A Redis Cluster. A command that names no key (`TIME`, `INFO`,
    /// `CLIENT`, a script given no key) goes to the primary of the route's
    /// slot — the deployment's own, where all its keys live — rather than to
    /// a random node; `SCRIPT LOAD` to every node.
    Cluster(redis::cluster_async::ClusterConnection, redis::cluster_routing::Route),
    /// One connection to one Redis that does not reconnect: a blocking read
    /// whose `CLIENT ID` must stay its own.
    Direct(redis::aio::MultiplexedConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "RedisConn::Single",
            Self::Cluster(..) => "RedisConn::Cluster",
            Self::Direct(_) => "RedisConn::Direct",
        })
    }
}

impl From<ConnectionManager> for RedisConn {
    fn from(conn: ConnectionManager) -> Self {
        Self::Single(conn)
    }
}

/// `cmd`'s arguments, its name first.
fn words(cmd: &redis::Cmd) -> impl Iterator<Item = &[u8]> {
    cmd.args_iter().filter_map(|a| match a {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    })
}

/// Whether `cmd` names no key the cluster client could route it by, so it
/// goes to the deployment's home slot ([`RedisConn::Cluster`]).
fn keyless(cmd: &redis::Cmd) -> bool {
    let mut args = words(cmd);
    let Some(name) = args.next() else { return false };
    const KEYLESS: [&[u8]; 9] =
        [b"TIME", b"INFO", b"CONFIG", b"CLIENT", b"PING", b"SCRIPT", b"DBSIZE", b"MEMORY", b"CLUSTER"];
    if KEYLESS.iter().any(|k| name.eq_ignore_ascii_case(k)) {
        return true;
    }
    (name.eq_ignore_ascii_case(b"EVAL") || name.eq_ignore_ascii_case(b"EVALSHA"))
        && args.nth(1) == Some(b"0".as_slice())
}

/// Whether `cmd` is `SCRIPT LOAD`.
fn script_load(cmd: &redis::Cmd) -> bool {
    let mut args = words(cmd);
    args.next().is_some_and(|a| a.eq_ignore_ascii_case(b"SCRIPT"))
        && args.next().is_some_and(|a| a.eq_ignore_ascii_case(b"LOAD"))
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        // (Asked of a cluster's commands only: one Redis's go straight on.)
        let to_home = matches!(self, Self::Cluster(..)) && keyless(cmd);
        match (self, to_home) {
            (Self::Single(c), _) => c.req_packed_command(cmd),
            (Self::Cluster(c, _), false) => c.req_packed_command(cmd),
            (Self::Cluster(c, home), true) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
                let to_home = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(*home));
                if !script_load(cmd) {
                    return Box::pin(c.route_command(cmd.clone(), to_home));
                }
                // A script is loaded on every node, replicas too, so a replica
                // promoted later has it; with a node down, on the slot's primary.
                let everywhere = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllNodes,
                    Some(redis::cluster_routing::ResponsePolicy::AllSucceeded),
                ));
                Box::pin(async move {
                    match c.route_command(cmd.clone(), everywhere).await {
                        Ok(sha) => Ok(sha),
                        Err(_) => c.route_command(cmd.clone(), to_home).await,
                    }
                })
            }
            (Self::Direct(c), _) => c.req_packed_command(cmd),
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
            Self::Cluster(c, _) => c.req_packed_commands(pipeline, offset, count),
            Self::Direct(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c, _) => c.get_db(),
            Self::Direct(c) => c.get_db(),
        }
    }
}

impl RedisConn {
    /// Whether this is a cluster's connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(..))
    }

    /// `cmd` sent to every primary of the cluster, each answer by its node's
    /// address; on one Redis, its one answer (address `""`).
    pub async fn on_every_primary(&mut self, cmd: &redis::Cmd) -> redis::RedisResult<Vec<(String, redis::Value)>> {
        use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
        match self {
            Self::Cluster(c, _) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd.clone(), routing).await? {
                    redis::Value::Map(pairs) => Ok(pairs
                        .into_iter()
                        .map(|(k, v)| (redis::from_redis_value::<String>(k).unwrap_or_default(), v))
                        .collect()),
                    one => Ok(vec![(String::new(), one)]),
                }
            }
            other => Ok(vec![(String::new(), cmd.query_async(other).await?)]),
        }
    }
}

/// The connection a deployment's commands and scripts take (`redis`: one
/// Redis's URL or a cluster's seed nodes), each command allowed `timeout`
/// (give a blocking read a timeout longer than its block). It does not
/// connect until the first command, so a process can start while Redis is
/// still down. On a cluster, keyless commands go to the primary of the
/// deployment's slot ([`RedisConn::Cluster`]).
pub fn connect(redis: &crate::config::RedisArgs, timeout: Duration) -> redis::RedisResult<RedisConn> {
    if !redis.is_cluster() {
        return lazy_manager(&redis.url, timeout);
    }
    let client = redis::cluster::ClusterClient::builder(redis.cluster_nodes.0.clone())
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(timeout)
        .build()?;
    let config =
        redis::cluster::ClusterConfig::new().set_connection_timeout(CONNECT_TIMEOUT).set_response_timeout(timeout);
    let home =
        redis::cluster_routing::Route::with_key(redis.keys().slot_tag(), redis::cluster_routing::SlotAddr::Master);
    Ok(RedisConn::Cluster(client.get_pending_async_connection_with_config(config), home))
}

/// A connection of its own for one blocking read that may cancel it with
/// `CLIENT UNBLOCK`, and that connection's `CLIENT ID`: on one Redis, one
/// connection; on a cluster, a cluster connection of its own whose
/// connection to the deployment's slot both answers the `CLIENT ID` and
/// carries the read (the `CLIENT UNBLOCK`, keyless, reaches that node from
/// any [`connect`]ed connection). `Ok(-1)` for the id where `CLIENT` is
/// forbidden (a managed Redis, an ACL).
pub async fn blocking(redis: &crate::config::RedisArgs, timeout: Duration) -> redis::RedisResult<(RedisConn, i64)> {
    let mut conn = if redis.is_cluster() {
        let conn = connect(redis, timeout)?;
        // Connected now: the id must be of a connection that stays.
        let _: String = redis::cmd("PING").query_async(&mut conn.clone()).await?;
        conn
    } else {
        let client = redis::Client::open(redis.url.as_str())?;
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(CONNECT_TIMEOUT));
        RedisConn::Direct(client.get_multiplexed_async_connection_with_config(&config).await?)
    };
    let id = match redis::cmd("CLIENT").arg("ID").query_async::<i64>(&mut conn).await {
        Ok(id) => id,
        Err(error) if error.code().is_some() => -1,
        Err(error) => return Err(error),
    };
    Ok((conn, id))
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
    Ok(version_refused(&info, MIN_REDIS_VERSION).map_or(Ok(()), Err))
}

/// Why a Redis whose `INFO server` reads `info` is too old, if it is older
/// than `min` (one that does not say is not refused for it).
fn version_refused(info: &str, min: (u32, u32)) -> Option<String> {
    let v = redis_version(info).filter(|v| *v < min)?;
    Some(format!("Redis {}.{} is too old: paceline needs Redis {}.{} or later", v.0, v.1, min.0, min.1))
}

/// Why a Redis whose `INFO cluster` reads `info` cannot be paceline's one
/// Redis: a node of a Redis Cluster serves some slots only, and answers a
/// key of another with `MOVED` — every script would fail on most runs, in
/// the middle of the work. Refused at start instead, naming the way to run
/// on a cluster.
pub fn cluster_refused(info: &str) -> Option<String> {
    (info_field(info, "cluster_enabled") == Some("1")).then(|| {
        "REDIS_URL names a node of a Redis Cluster (cluster_enabled:1): one node serves some slots only. \
         Name the cluster's nodes in PACELINE_REDIS_CLUSTER_NODES instead (comma-separated redis:// URLs)"
            .to_owned()
    })
}

/// The oldest Redis a cluster deployment runs on (SPEC §1: Redis 7+ or Valkey).
pub const MIN_CLUSTER_REDIS_VERSION: (u32, u32) = (7, 0);

/// Why the cluster whose `CLUSTER INFO` reads `info` cannot take work now:
/// `cluster_state` not `ok` (slots not covered, a majority of primaries
/// unreachable), so some keys would not be served.
pub fn cluster_unready(info: &str) -> Option<String> {
    match info_field(info, "cluster_state").map(str::trim) {
        Some("ok") => None,
        state => Some(format!(
            "the Redis Cluster is not ready (cluster_state:{}): some of its slots are served by no node. \
             Start paceline once `redis-cli cluster info` says cluster_state:ok",
            state.unwrap_or("unknown")
        )),
    }
}

/// Why seed nodes that are no cluster's cannot serve as one.
const NOT_A_CLUSTER: &str = "PACELINE_REDIS_CLUSTER_NODES names a Redis that is not in cluster mode (cluster \
support disabled): give one Redis as REDIS_URL instead, or the nodes of a Redis Cluster";

/// What a seed node that is no cluster's answers `CLUSTER …` with.
fn not_a_cluster(error: &redis::RedisError) -> bool {
    error.to_string().to_ascii_lowercase().contains("cluster support disabled")
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
/// evicting no key ([`eviction_refused`]); on a cluster, a cluster in
/// `cluster_state:ok` ([`cluster_unready`]) whose every primary runs Redis
/// 7+ and evicts no key. Redis not answering within `wait` is no refusal: a
/// process starts before its Redis and waits for it. Every process
/// (`paceline api`, `worker`, `up`) asks at start and exits with the reason
/// when this is `Err`.
pub async fn refuse_unfit(
    conn: &mut RedisConn,
    redis: &crate::config::RedisArgs,
    wait: Duration,
) -> Result<(), String> {
    if redis.is_cluster() {
        return refuse_unfit_cluster(conn, &redis.cluster_nodes.0, wait).await;
    }
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

/// [`refuse_unfit`] on a cluster: first what a seed node says of the
/// cluster (asked on a plain connection of its own, since the cluster client
/// cannot map the slots of a cluster that is not `ok`), then every primary.
async fn refuse_unfit_cluster(conn: &mut RedisConn, nodes: &[String], wait: Duration) -> Result<(), String> {
    let checked = tokio::time::timeout(wait, async {
        match seeds_say(nodes).await {
            Some(Err(why)) => return Ok(Err(why)),
            Some(Ok(())) => {}
            // No seed answers: not up yet.
            None => return Ok(Ok(())),
        }
        // (Plain `INFO`'s default sections hold both the version and the policy, on every Redis.)
        for (node, value) in conn.on_every_primary(&redis::cmd("INFO")).await? {
            let info: String = redis::from_redis_value(value)?;
            let policy = info_field(&info, "maxmemory_policy").map(str::trim);
            let why = version_refused(&info, MIN_CLUSTER_REDIS_VERSION).or_else(|| policy.and_then(eviction_refused));
            if let Some(why) = why {
                return Ok(Err(format!("{why} (node {node})")));
            }
        }
        Ok::<_, redis::RedisError>(Ok(()))
    })
    .await;
    match checked {
        Ok(Ok(verdict)) => verdict,
        Ok(Err(_)) | Err(_) => Ok(()),
    }
}

/// What the first seed node to answer says of its cluster, all asked at
/// once (one that does not answer costs the others no time): `Err` when it
/// is not in cluster mode or its cluster is not `ok`; `None` when none answers.
async fn seeds_say(nodes: &[String]) -> Option<Result<(), String>> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(COMMAND_TIMEOUT));
    let ask = |node: &String| {
        let config = config.clone();
        let node = node.clone();
        async move {
            let client = redis::Client::open(node.as_str()).ok()?;
            let mut conn = client.get_multiplexed_async_connection_with_config(&config).await.ok()?;
            match redis::cmd("CLUSTER").arg("INFO").query_async::<String>(&mut conn).await {
                Ok(info) => Some(cluster_unready(&info).map_or(Ok(()), Err)),
                Err(error) if not_a_cluster(&error) => Some(Err(NOT_A_CLUSTER.to_owned())),
                Err(_) => None,
            }
        }
    };
    let mut asked: futures::stream::FuturesUnordered<_> = nodes.iter().map(ask).collect();
    while let Some(said) = futures::StreamExt::next(&mut asked).await {
        if said.is_some() {
            return said;
        }
    }
    None
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
    fn keyless_commands_are_told_from_keyed_ones() {
        assert!(keyless(&redis::cmd("TIME")));
        assert!(keyless(redis::cmd("INFO").arg("memory")));
        assert!(keyless(redis::cmd("client").arg("UNBLOCK").arg(7)));
        assert!(keyless(redis::cmd("SCRIPT").arg("LOAD").arg("return 1")));
        assert!(script_load(redis::cmd("script").arg("load").arg("return 1")));
        assert!(!script_load(redis::cmd("SCRIPT").arg("EXISTS").arg("abc")));
        assert!(keyless(redis::cmd("EVALSHA").arg("abc").arg(0)));
        assert!(!keyless(redis::cmd("EVALSHA").arg("abc").arg(1).arg("k")));
        assert!(!keyless(redis::cmd("GET").arg("k")));
        assert!(!keyless(redis::cmd("BLPOP").arg("k").arg(1)));
    }

    #[test]
    fn a_cluster_not_ok_is_not_ready_and_says_its_state() {
        assert_eq!(cluster_unready("cluster_state:ok\r\ncluster_slots_assigned:16384\r\n"), None);
        assert!(cluster_unready("cluster_state:fail\r\n").unwrap().contains("cluster_state:fail"));
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
