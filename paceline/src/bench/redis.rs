//! The benches' Redis side: a private `redis-server` (Unix socket in a temp
//! dir, no persistence, killed on drop) and `INFO commandstats` deltas, the
//! measure behind every "Redis commands per turn" figure.

use anyhow::Context as _;
use shared::redis_server::{RedisChild, RedisServerOptions};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A private `redis-server` for a bench (Unix socket in a temp dir, nothing on
/// disk; `shared::redis_server` starts it), or a private local Redis Cluster
/// of them (3 primaries and 3 replicas on loopback ports: `--redis-cluster`),
/// killed and its dir removed on drop.
#[derive(Debug)]
pub struct BenchRedis {
    child: Option<RedisChild>,
    dir: PathBuf,
    /// A cluster's nodes and their ports (empty: the one server above).
    cluster: Vec<(RedisChild, u16)>,
}

impl BenchRedis {
    /// Starts one and waits (at most 10 s) until it answers.
    pub async fn start(label: &str) -> anyhow::Result<Self> {
        let dir = bench_dir(label);
        let options = RedisServerOptions::unix(&dir);
        let child = tokio::task::spawn_blocking(move || options.start()).await?.context("the bench's Redis")?;
        Ok(Self { child: Some(child), dir, cluster: vec![] })
    }

    /// Starts a local Redis Cluster of `primaries` primaries with one replica
    /// each and waits until it is `ok` with its replicas synced.
    pub async fn start_cluster(label: &str, primaries: usize) -> anyhow::Result<Self> {
        let dir = bench_dir(label);
        let nodes_dir = dir.clone();
        let cluster = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(RedisChild, u16)>> {
            let mut nodes = Vec::new();
            for i in 0..primaries * 2 {
                let free = shared::redis_server::free_tcp_port;
                let (port, bus) = (free()?, free()?);
                let node_dir = nodes_dir.join(format!("node-{i}"));
                let options = RedisServerOptions {
                    unix_socket: false,
                    tcp_port: Some(port),
                    extra_args: shared::redis_server::cluster_node_args(&node_dir.join("nodes.conf"), bus),
                    ..RedisServerOptions::unix(node_dir)
                };
                nodes.push((options.start().context("a node of the bench's cluster")?, port));
            }
            let ports: Vec<u16> = nodes.iter().map(|(_, p)| *p).collect();
            shared::redis_server::form_cluster(&ports).map_err(anyhow::Error::msg)?;
            Ok(nodes)
        })
        .await??;
        Ok(Self { child: None, dir, cluster })
    }

    /// `redis+unix://…`, for this process and the children it starts (a
    /// cluster: its first node's URL).
    pub fn url(&self) -> String {
        match self.cluster.first() {
            Some((_, port)) => format!("redis://127.0.0.1:{port}"),
            None => RedisServerOptions::unix(&self.dir).url(),
        }
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// Every node's URL (the one server's alone when not a cluster).
    pub fn node_urls(&self) -> Vec<String> {
        match self.is_cluster() {
            true => self.cluster.iter().map(|(_, port)| format!("redis://127.0.0.1:{port}")).collect(),
            false => vec![self.url()],
        }
    }

    /// A deployment under `prefix` on this Redis or cluster.
    pub fn args(&self, prefix: String) -> shared::config::RedisArgs {
        match self.is_cluster() {
            true => shared::config::RedisArgs::new("", prefix).on_cluster(self.node_urls()),
            false => shared::config::RedisArgs::new(self.url(), prefix),
        }
    }

    /// The environment a child process finds this Redis by (`REDIS_URL`, or
    /// `PACELINE_REDIS_CLUSTER_NODES` on a cluster).
    pub fn child_env(&self) -> (String, String) {
        match self.is_cluster() {
            true => ("PACELINE_REDIS_CLUSTER_NODES".to_owned(), self.node_urls().join(",")),
            false => ("REDIS_URL".to_owned(), self.url()),
        }
    }

    /// The server's own temp dir (logs of the bench's children go here too).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

/// A fresh temp dir's path for a bench's Redis.
fn bench_dir(label: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    std::env::temp_dir().join(format!("paceline-{label}-{}-{nanos:x}", std::process::id()))
}

impl Drop for BenchRedis {
    fn drop(&mut self) {
        drop(self.child.take());
        self.cluster.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `INFO commandstats` calls and time (µs) per command at one moment. Commands run inside
/// Lua scripts are counted too (Redis counts them under their own names), so a
/// script's inner calls cost what they cost.
#[derive(Debug, Clone, Default)]
pub struct CommandStats(BTreeMap<String, (u64, u64)>);

/// The server's CPU time so far (`INFO cpu`: `used_cpu_sys` + `used_cpu_user`), s.
pub async fn cpu_seconds(conn: &mut shared::redis_util::RedisConn) -> anyhow::Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    Ok(parse_cpu_seconds(&info))
}

/// See [`cpu_seconds`].
pub fn parse_cpu_seconds(info: &str) -> f64 {
    info.lines()
        .filter_map(|l| l.strip_prefix("used_cpu_sys:").or_else(|| l.strip_prefix("used_cpu_user:")))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

impl CommandStats {
    /// Reads the server's counters now.
    pub async fn read(conn: &mut shared::redis_util::RedisConn) -> anyhow::Result<Self> {
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
        Ok(Self::parse(&info))
    }

    /// Parses `INFO commandstats` text (`cmdstat_get:calls=3,usec=…`): each
    /// command's calls and time (µs).
    pub fn parse(info: &str) -> Self {
        let mut out = BTreeMap::new();
        for line in info.lines() {
            let Some(rest) = line.strip_prefix("cmdstat_") else { continue };
            let Some((name, fields)) = rest.split_once(':') else { continue };
            let field =
                |key: &str| fields.split(',').find_map(|f| f.strip_prefix(key)).map(|v| v.trim().parse().unwrap_or(0));
            if let Some(calls) = field("calls=") {
                out.insert(name.to_owned(), (calls, field("usec=").unwrap_or(0)));
            }
        }
        Self(out)
    }

    /// Calls and time per command since `before`, the most called first,
    /// without `INFO` (the bench's own reads).
    pub fn since(&self, before: &Self) -> CommandDelta {
        let mut by_command = vec![];
        let mut usec = BTreeMap::new();
        for (k, (calls, spent)) in self.0.iter().filter(|(k, _)| *k != "info") {
            let (calls_before, spent_before) = before.0.get(k).copied().unwrap_or_default();
            if calls > &calls_before {
                by_command.push((k.clone(), calls - calls_before));
                usec.insert(k.clone(), spent.saturating_sub(spent_before));
            }
        }
        by_command.sort_by_key(|(_, v)| std::cmp::Reverse(*v));
        CommandDelta { by_command, usec }
    }
}

/// Commands run between two [`CommandStats`].
#[derive(Debug, Clone, Default)]
pub struct CommandDelta {
    /// Calls per command, largest first.
    pub by_command: Vec<(String, u64)>,
    /// Time per command, µs (`INFO commandstats`' `usec`: wall time, and a
    /// script's includes the commands it calls). [`Self::take_out`] leaves it
    /// as it is: after it, a row's time over its calls is no time a call.
    pub usec: BTreeMap<String, u64>,
}

impl CommandDelta {
    /// Takes `n` calls out of each named command's row (the bench's own: its
    /// polls, the deliveries hook), dropping rows left empty.
    pub fn take_out(&mut self, own: &[(&str, u64)]) {
        for (name, n) in own {
            if let Some(row) = self.by_command.iter_mut().find(|(k, _)| k == name) {
                row.1 = row.1.saturating_sub(*n);
            }
        }
        self.by_command.retain(|(_, v)| *v > 0);
    }

    /// All calls.
    pub fn total(&self) -> u64 {
        self.by_command.iter().map(|(_, v)| v).sum()
    }

    /// `name 1.23, name 0.50, …` per `per` (e.g. per turn), the first `n` commands.
    pub fn breakdown(&self, per: f64, n: usize) -> String {
        let per = per.max(1.0);
        self.by_command
            .iter()
            .take(n)
            .map(|(k, v)| format!("{k} {:.2}", *v as f64 / per))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn cpu_seconds_add_sys_and_user() {
        let info = "# CPU\r\nused_cpu_sys:1.250000\r\nused_cpu_user:0.750000\r\nused_cpu_sys_children:9.0\r\n";
        assert!((parse_cpu_seconds(info) - 2.0).abs() < 1e-9);
    }
    use super::*;

    #[test]
    fn deltas_skip_info_and_idle_commands() {
        let before =
            CommandStats::parse("# Commandstats\r\ncmdstat_get:calls=3,usec=1\r\ncmdstat_info:calls=1,usec=2\r\n");
        let after = CommandStats::parse(
            "cmdstat_get:calls=10,usec=1,usec_per_call=0.1\r\ncmdstat_info:calls=9\r\ncmdstat_evalsha:calls=4\r\ncmdstat_set:calls=0\r\n",
        );
        let d = after.since(&before);
        assert_eq!(d.by_command, vec![("get".to_owned(), 7), ("evalsha".to_owned(), 4)]);
        assert_eq!(d.total(), 11);
        assert_eq!(d.breakdown(2.0, 1), "get 3.50");
    }

    #[test]
    fn deltas_carry_each_commands_time() {
        let before = CommandStats::parse("cmdstat_evalsha:calls=2,usec=100,usec_per_call=50.00\r\n");
        let after = CommandStats::parse(
            "cmdstat_evalsha:calls=6,usec=1300,usec_per_call=216.67\r\ncmdstat_zadd:calls=4,usec=40\r\ncmdstat_get:calls=1\r\n",
        );
        let d = after.since(&before);
        assert_eq!(d.usec.get("evalsha"), Some(&1200));
        assert_eq!(d.usec.get("zadd"), Some(&40));
        assert_eq!(d.usec.get("get"), Some(&0), "a row without usec counts none");
    }
}
