//! Worker processes of this same binary (`paceline worker`), started by a
//! bench as separate OS processes, with their logs in files, their peak RSS
//! read from `/proc`, stopped with SIGTERM (SIGKILL after a grace).

use anyhow::Context as _;
use shared::queue::TurnQueue;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How to start the fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Worker processes.
    pub workers: usize,
    /// `paceline worker` arguments (after `worker`), the same for each process.
    pub args: Vec<String>,
    /// Extra environment of each process.
    pub env: Vec<(String, String)>,
    /// Where each process's stderr goes (`<dir>/<label>-worker-<i>.log`).
    pub log_dir: PathBuf,
    /// Names the log files.
    pub label: String,
}

/// Running worker processes; killed when dropped.
#[derive(Debug)]
pub struct Fleet {
    children: Vec<Child>,
    logs: Vec<PathBuf>,
}

impl Fleet {
    /// Starts the processes and waits until `queue` lists all of them
    /// (registered, heartbeating), at most `timeout`.
    pub async fn start(spec: &FleetSpec, queue: &TurnQueue, timeout: Duration) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("the path of this binary")?;
        let mut fleet = Self { children: vec![], logs: vec![] };
        for i in 0..spec.workers {
            let log = spec.log_dir.join(format!("{}-worker-{i}.log", spec.label));
            let file = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker").args(&spec.args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(file);
            if std::env::var_os("RUST_LOG").is_none() {
                cmd.env("RUST_LOG", "warn");
            }
            for (k, v) in &spec.env {
                cmd.env(k, v);
            }
            fleet.children.push(cmd.spawn().context("start a worker process")?);
            fleet.logs.push(log);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let up = queue.list_workers().await.map(|w| w.len()).unwrap_or(0);
            if up >= spec.workers {
                return Ok(fleet);
            }
            for (child, log) in fleet.children.iter_mut().zip(&fleet.logs) {
                if let Ok(Some(status)) = child.try_wait() {
                    anyhow::bail!("a worker process exited at start ({status}); its log:\n{}", tail(log));
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{up} of {} workers registered within {timeout:?}",
                spec.workers
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The largest peak resident set (`VmHWM`) of the processes, in MB; 0
    /// where `/proc` cannot tell (not Linux).
    pub fn peak_rss_mb(&self) -> f64 {
        self.children.iter().filter_map(|c| vm_hwm_kb(c.id())).max().unwrap_or(0) as f64 / 1024.0
    }

    /// The processes' log files (they outlive the processes).
    pub fn logs(&self) -> Vec<PathBuf> {
        self.logs.clone()
    }

    /// Sends SIGTERM to each process, waits up to `grace` for all to exit,
    /// then kills the rest.
    pub async fn stop(mut self, grace: Duration) {
        for child in &self.children {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).stderr(Stdio::null()).status();
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && self.children.iter_mut().any(|c| matches!(c.try_wait(), Ok(None))) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill();
    }

    fn kill(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `VmHWM` of a process, kB.
fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The last lines of a log file.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Lines of `logs` that contain `needle` (e.g. the queue's "lease lost while
/// held" warning).
pub fn log_lines_with(logs: &[PathBuf], needle: &str) -> usize {
    logs.iter()
        .filter_map(|log| std::fs::read_to_string(log).ok())
        .map(|text| text.lines().filter(|l| l.contains(needle)).count())
        .sum()
}
