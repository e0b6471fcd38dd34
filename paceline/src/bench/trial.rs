//! One trial of a bench: one configuration measured on its own — a fresh key
//! prefix on the bench's Redis, a fresh in-process mock provider, the API
//! in-process, and a fleet of worker processes — then taken down, leaving
//! what was measured. The pacing scenario runs one trial per pacer; the
//! throughput scenario one with an unlimited mock; a fairness scenario can
//! run its own with tenants (`TrialSpec::tokens`) and its own submits.

use anyhow::Context as _;
use mock_provider::{MockConfig, MockServer, Stats};
use serde_json::Value;
use shared::config::RedisArgs;
use shared::queue::{QueueConfig, TurnQueue};
use shared::runs::{Run, RunStore};
use std::time::{Duration, Instant};

use super::fleet::{Fleet, FleetSpec};
use super::redis::{BenchRedis, CommandDelta, CommandStats};
use super::workload::{api_server, submit_all, tool_server, Served};

/// How often [`Trial::wait_drained`] reads the queue's depth.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// What every trial of one bench invocation shares: Redis and the tool endpoint.
#[derive(Debug)]
pub struct Env {
    /// The private redis-server.
    pub redis: BenchRedis,
    /// The tool endpoint.
    pub tools: Served,
    trials: std::sync::atomic::AtomicUsize,
}

impl Env {
    /// Starts Redis — a local cluster of `cluster` primaries (and as many
    /// replicas) when given — with its timers at `hz` a second when given, and
    /// the tool endpoint.
    pub async fn start(hz: Option<u32>, cluster: Option<usize>) -> anyhow::Result<Self> {
        let redis = match cluster {
            Some(primaries) => BenchRedis::start_cluster("bench", primaries).await?,
            None => BenchRedis::start("bench").await?,
        };
        if let Some(hz) = hz {
            for url in redis.node_urls() {
                let mut conn = shared::redis_util::manager(&url).await?;
                let _: () = redis::cmd("CONFIG").arg("SET").arg("hz").arg(hz).query_async(&mut conn).await?;
            }
        }
        let tools = tool_server().await?;
        Ok(Self { redis, tools, trials: Default::default() })
    }

    /// The tool endpoint's URL (`POST` target of every run's tool calls).
    pub fn tool_url(&self) -> String {
        format!("{}/tools", self.tools.url())
    }
}

/// Redis's CPU rate over a span ([`Trial::cpu_rate_over`]).
#[derive(Debug, Clone, Default)]
pub struct CpuRate {
    /// CPU, ms a second.
    pub cpu_ms_per_s: f64,
    /// Calls a second, by command (the bench's polls in them).
    pub commands_per_s: Vec<(String, f64)>,
    /// Time a call, µs, by command (`INFO commandstats`: a script's time
    /// includes the commands it calls).
    pub us_per_call: Vec<(String, f64)>,
}

impl CpuRate {
    /// Scripts' time (`EVALSHA`), µs a second.
    pub fn script_us_per_s(&self) -> f64 {
        let rate = |rows: &[(String, f64)]| rows.iter().find(|(k, _)| k == "evalsha").map_or(0.0, |(_, v)| *v);
        rate(&self.commands_per_s) * rate(&self.us_per_call)
    }
}

/// One trial's configuration.
#[derive(Debug, Clone)]
pub struct TrialSpec {
    /// Names the trial (key prefix, log files).
    pub label: String,
    /// Worker processes.
    pub workers: usize,
    /// Slots per worker process.
    pub concurrency: usize,
    /// `paceline worker` arguments beyond Redis, provider and tools (e.g. `--pacer local`).
    pub worker_args: Vec<String>,
    /// The mock provider.
    pub mock: MockConfig,
    /// API tenants (`tenant`, `token`); empty: open mode, tenant `default`.
    pub tokens: Vec<(String, String)>,
    /// Log every delivery (run, due, leased, outcome) for lateness figures.
    pub log_deliveries: bool,
}

/// A trial that is up: submit into it, wait for it, then [`Trial::finish`].
#[derive(Debug)]
pub struct Trial {
    /// Its Redis URL and fresh prefix.
    pub redis: RedisArgs,
    /// The mock provider (read its `summary()` for progress).
    pub mock: MockServer,
    /// The turn queue under this trial's prefix.
    pub queue: TurnQueue,
    mock_started: Instant,
    first_submit: Option<Instant>,
    api: Served,
    fleet: Fleet,
    admin: shared::redis_util::RedisConn,
    store: RunStore,
    before: CommandStats,
    cpu_before: f64,
    /// Commands this bench itself sent between the snapshots (polls).
    own_commands: u64,
    deliveries_key: Option<String>,
    /// Deliveries the hook logged before the last mark (their `RPUSH`es
    /// belong to the span before it).
    deliveries_at_mark: u64,
    /// (tenant, run id) of every submit.
    submitted: Vec<(String, String)>,
}

/// One delivery of a turn, as the worker hook logged it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Run id.
    pub run: String,
    /// Turn index.
    pub turn: u32,
    /// Due (server clock, ms).
    pub due_ms: i64,
    /// Leased (server clock, ms).
    pub fetched_ms: i64,
    /// `continued`, `completed`, `failed`, `requeued`, `stopped` or `error`.
    pub outcome: String,
}

impl Delivery {
    /// `run turn attempt due_ms fetched_ms outcome`, as the hook writes it.
    fn parse(line: &str) -> Option<Self> {
        let f: Vec<&str> = line.split(' ').collect();
        let [run, turn, _attempt, due, fetched, outcome] = f.as_slice() else { return None };
        Some(Self {
            run: (*run).to_owned(),
            turn: turn.parse().ok()?,
            due_ms: due.parse().ok()?,
            fetched_ms: fetched.parse().ok()?,
            outcome: (*outcome).to_owned(),
        })
    }

    /// Start lateness against the due time, ms.
    pub fn lateness_ms(&self) -> i64 {
        self.fetched_ms - self.due_ms
    }
}

/// Deliveries that came back after a wait: those whose previous delivery of
/// the same turn of the same run ended requeued (budget, 429, retry) or in a
/// handler error.
pub fn requeued(deliveries: &[Delivery]) -> Vec<&Delivery> {
    let mut by_run: std::collections::HashMap<(&str, u32), Vec<&Delivery>> = Default::default();
    for d in deliveries {
        by_run.entry((d.run.as_str(), d.turn)).or_default().push(d);
    }
    let mut out = vec![];
    for list in by_run.values_mut() {
        list.sort_by_key(|d| d.fetched_ms);
        for pair in list.windows(2) {
            if matches!(pair[0].outcome.as_str(), "requeued" | "error") {
                out.push(pair[1]);
            }
        }
    }
    out
}

/// What a finished trial measured.
#[derive(Debug)]
pub struct TrialData {
    /// Redis commands between the snapshots, the bench's own polls and the
    /// delivery hook's RPUSHes taken out of their rows.
    pub commands: CommandDelta,
    /// The mock's stats (with its log and kept bodies).
    pub mock: Stats,
    /// When the first submit came, on the mock's clock, s.
    pub mock_offset_s: f64,
    /// Every submitted run, as it ended (or stood when the bench gave up).
    pub runs: Vec<Run>,
    /// Every delivery (empty unless `log_deliveries`).
    pub deliveries: Vec<Delivery>,
    /// The largest worker peak RSS, MB.
    pub worker_peak_rss_mb: f64,
    /// The Redis server's CPU time over the trial, s (`INFO cpu`).
    pub redis_cpu_s: f64,
    /// Fetches that found nothing due (a worker woken for nothing).
    pub empty_fetches: u64,
    /// Of them, by what made the worker fetch (`queue::FetchWhy`: token,
    /// watch, kick, safety, again, unsaid), the most first.
    pub empty_by_cause: Vec<(String, u64)>,
    /// Leases the workers lost while they held them (their heartbeat did not
    /// renew them in time: a stalled process, a starved runtime).
    pub lease_losses: usize,
    /// Whether the queue drained before the timeout.
    pub drained: bool,
}

impl TrialData {
    /// Commands per completed turn, the bench's own taken out.
    pub fn commands_per_turn(&self) -> f64 {
        let turns = self.turns_completed().max(1) as f64;
        self.commands.total() as f64 / turns
    }

    /// Turns committed over all runs.
    pub fn turns_completed(&self) -> u64 {
        self.runs.iter().map(|r| r.turns_completed as u64).sum()
    }

    /// First submit → last finish (Redis clock), s; `None` when no run has both.
    pub fn makespan_s(&self) -> Option<f64> {
        let created = self.runs.iter().filter_map(|r| parse_ms(&r.created_at)).min()?;
        let finished = self.runs.iter().filter_map(|r| r.finished_at.as_deref().and_then(parse_ms)).max()?;
        Some((finished - created).max(0) as f64 / 1000.0)
    }
}

fn parse_ms(rfc3339: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339).ok()?;
    Some((t.unix_timestamp_nanos() / 1_000_000) as i64)
}

impl Trial {
    /// Starts the mock, the API and the workers (waiting until every worker
    /// has registered), then takes the "before" command snapshot.
    pub async fn start(env: &Env, spec: &TrialSpec) -> anyhow::Result<Self> {
        let n = env.trials.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let redis = env.redis.args(format!("bench{n}{}", spec.label));
        let queue = shared::runs::run_queue(&redis, QueueConfig::default())?;
        // (On a cluster, its `INFO`s go to the primary of the trial's one slot: the node doing its work.)
        let admin = shared::redis_util::connect(&redis, shared::redis_util::COMMAND_TIMEOUT)
            .context("connect to the bench's Redis")?;
        let store = RunStore::new(admin.clone(), redis.keys(), Duration::from_secs(24 * 3600));
        let mock_started = Instant::now();
        let mock = MockServer::start(spec.mock.clone()).await.context("start the mock provider")?;
        let tool_url = env.tool_url();
        let api = api_server(redis.clone(), &tool_url, &spec.tokens).await?;
        let deliveries_key = spec.log_deliveries.then(|| redis.keys().bench_deliveries());
        // Redis's URL goes by the environment, not the command line (every
        // process on the machine can read a command line).
        // Anthropic's client adds `/v1/messages` to its URL; OpenAI's, `/responses` to its `/v1`.
        let anthropic = spec.worker_args.windows(2).any(|w| w[0] == "--api-style" && w[1] == "anthropic");
        let mut args: Vec<String> = vec![
            "--prefix".into(),
            redis.prefix.clone(),
            "--provider-url".into(),
            if anthropic { mock.url() } else { mock.base_url() },
            "--tool-endpoints".into(),
            tool_url,
            "--concurrency".into(),
            spec.concurrency.to_string(),
        ];
        if let Some(key) = &deliveries_key {
            // The bench-only hook in `worker::handle_turn`: one line per delivery.
            args.extend(["--bench-deliveries-key".into(), key.clone()]);
        }
        args.extend(spec.worker_args.iter().cloned());
        let fleet_spec = FleetSpec {
            workers: spec.workers,
            args,
            env: vec![env.redis.child_env()],
            log_dir: env.redis.dir().to_path_buf(),
            label: format!("{n}-{}", spec.label),
        };
        let fleet = Fleet::start(&fleet_spec, &queue, Duration::from_secs(60)).await?;
        let mut trial = Self {
            redis,
            mock,
            queue,
            mock_started,
            first_submit: None,
            api,
            fleet,
            admin,
            store,
            before: CommandStats::default(),
            cpu_before: 0.0,
            own_commands: 0,
            deliveries_key,
            deliveries_at_mark: 0,
            submitted: vec![],
        };
        trial.before = CommandStats::read(&mut trial.admin).await?;
        trial.cpu_before = super::redis::cpu_seconds(&mut trial.admin).await?;
        Ok(trial)
    }

    /// Submits `bodies` through the API as `tenant` (with its `token`; `None`
    /// in open mode, tenant `default`), `parallel` at a time.
    pub async fn submit(
        &mut self,
        tenant: Option<(&str, &str)>,
        bodies: Vec<Value>,
        parallel: usize,
    ) -> anyhow::Result<Vec<String>> {
        self.first_submit.get_or_insert_with(Instant::now);
        let api = crate::api_client::ApiClient::new(&self.api.url(), tenant.map(|t| shared::config::Secret::new(t.1)))?;
        let ids = submit_all(&api, bodies, parallel).await?;
        let name = tenant.map(|t| t.0).unwrap_or("default");
        self.submitted.extend(ids.iter().map(|id| (name.to_owned(), id.clone())));
        Ok(ids)
    }

    /// [`Trial::submit`] in open mode, with how long each submit took.
    pub async fn submit_timed(
        &mut self,
        bodies: Vec<Value>,
        parallel: usize,
    ) -> anyhow::Result<(Vec<String>, Vec<Duration>)> {
        self.first_submit.get_or_insert_with(Instant::now);
        let api = crate::api_client::ApiClient::new(&self.api.url(), None)?;
        let (ids, took): (Vec<String>, Vec<Duration>) =
            super::workload::submit_all_timed(&api, bodies, parallel).await?.into_iter().unzip();
        self.submitted.extend(ids.iter().map(|id| ("default".to_owned(), id.clone())));
        Ok((ids, took))
    }

    /// Waits until no turn is due and none is leased (every submitted turn
    /// asked and parked, and the first wave the full bucket let through
    /// answered and committed: its commits are setup's, as its admissions
    /// are), polling every 100 ms, at most `timeout`; whether it came to that.
    pub async fn wait_parked(&mut self, timeout: Duration) -> anyhow::Result<bool> {
        let deadline = Instant::now() + timeout;
        let (due, lease) = (self.queue.keys().due.clone(), self.queue.keys().lease.clone());
        loop {
            let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut self.admin).await?;
            let now_ms = secs * 1000 + micros / 1000;
            let (n, leased): (u64, u64) = redis::pipe()
                .cmd("ZCOUNT")
                .arg(&due)
                .arg("-inf")
                .arg(now_ms)
                .zcard(&lease)
                .query_async(&mut self.admin)
                .await?;
            if n == 0 && leased == 0 {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What Redis did since the trial started or the last mark — its
    /// commands (the bench's own taken out) and CPU seconds — and starts the
    /// figures [`Trial::finish`] reports from now.
    pub async fn mark(&mut self) -> anyhow::Result<(CommandDelta, f64)> {
        // (Read first: this `LLEN` is counted in the span it ends, with our polls.)
        let logged: u64 = match &self.deliveries_key {
            Some(key) => redis::cmd("LLEN").arg(key).query_async(&mut self.admin).await?,
            None => 0,
        };
        let now = CommandStats::read(&mut self.admin).await?;
        let cpu = super::redis::cpu_seconds(&mut self.admin).await?;
        let mut delta = now.since(&self.before);
        // Our polls, and the hook's RPUSHes in this span, out of their rows.
        let hooked = logged.saturating_sub(self.deliveries_at_mark);
        delta.take_out(&[
            ("zcard", self.own_commands),
            ("rpush", hooked),
            ("llen", u64::from(self.deliveries_key.is_some())),
        ]);
        let spent = cpu - self.cpu_before;
        (self.before, self.cpu_before, self.own_commands, self.deliveries_at_mark) = (now, cpu, 0, logged);
        Ok((delta, spent))
    }

    /// Budget waits counted so far over every submitted run (one read each).
    pub async fn budget_waits_now(&self) -> anyhow::Result<u64> {
        let mut waits = 0;
        for (tenant, id) in &self.submitted {
            if let Some(run) = self.store.get(tenant, id).await? {
                waits += run.pacing.budget_waits;
            }
        }
        Ok(waits)
    }

    /// The in-process API's base URL.
    pub fn api_url(&self) -> String {
        self.api.url()
    }

    /// The Redis server's `used_memory`, bytes (`INFO memory`: not counted
    /// among the product's commands).
    pub async fn used_memory(&mut self) -> anyhow::Result<u64> {
        let info: String = redis::cmd("INFO").arg("memory").query_async(&mut self.admin).await?;
        Ok(shared::redis_util::info_field(&info, "used_memory").and_then(|v| v.trim().parse().ok()).unwrap_or(0))
    }

    /// Now on the mock's clock (its log's `at_us`), µs: the mock starts its
    /// clock just after this trial's `mock_started`, so this reads at most the
    /// bind's duration (well under 1 ms) late.
    pub fn mock_clock_us(&self) -> u64 {
        self.mock_started.elapsed().as_micros() as u64
    }

    /// The tenants every one of whose submitted runs has finished (completed,
    /// failed or cancelled), in name order. One run-store read per run.
    pub async fn tenants_finished(&self) -> anyhow::Result<Vec<String>> {
        use shared::runs::RunStatus;
        let mut open: std::collections::BTreeMap<&str, bool> = Default::default();
        for (tenant, id) in &self.submitted {
            let done = match self.store.get(tenant, id).await? {
                Some(run) => matches!(run.status, RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled),
                None => false,
            };
            *open.entry(tenant.as_str()).or_insert(false) |= !done;
        }
        Ok(open.into_iter().filter(|(_, any_open)| !any_open).map(|(t, _)| t.to_owned()).collect())
    }

    /// Waits until nothing is queued or in flight (every run finished or its
    /// turn dead), polling every 50 ms (two `ZCARD`s, counted as the bench's
    /// own); calls `on_poll` each time. Returns false when `timeout` passed first.
    pub async fn wait_drained(
        &mut self,
        timeout: Duration,
        mut on_poll: impl FnMut(&MockServer),
    ) -> anyhow::Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            let (due, leased) = self.poll_queue().await?;
            on_poll(&self.mock);
            if due + leased == 0 {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// Polls as [`Self::wait_drained`] does, for `span`, whatever it reads: an
    /// idle rate measured meanwhile holds the polls' own Redis CPU, which a
    /// trial's net figure then leaves out.
    pub async fn poll_for(&mut self, span: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + span;
        while Instant::now() < until {
            self.poll_queue().await?;
            tokio::time::sleep(DRAIN_POLL).await;
        }
        Ok(())
    }

    /// Polls as [`Self::wait_drained`] does until the mock has admitted a
    /// call of each of `runs` one-turn runs (its `ok` counts a call as it is
    /// admitted, not as it answers): how many are leased then, which is how
    /// many calls are in flight at once (a run leaves the count when it
    /// commits: the first budget's probe, answered before the others go, is
    /// among them only while its commit still runs as the last is admitted);
    /// `None` once `timeout` passes, or when none is leased by then.
    pub async fn wait_all_leased(&mut self, runs: u64, timeout: Duration) -> anyhow::Result<Option<u64>> {
        let deadline = Instant::now() + timeout;
        loop {
            let (_, leased) = self.poll_queue().await?;
            if self.mock.summary().ok >= runs {
                return Ok((leased > 0).then_some(leased));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// Redis's CPU rate over `span` spent polling as [`Self::wait_drained`]
    /// does, ms a second, its commands a second meanwhile (the polls' and
    /// these reads' own among them) and each one's time a call; the figures
    /// [`Self::mark`] and [`Self::finish`] report are left as they are.
    pub async fn cpu_rate_over(&mut self, span: Duration) -> anyhow::Result<CpuRate> {
        let before = CommandStats::read(&mut self.admin).await?;
        let from = super::redis::cpu_seconds(&mut self.admin).await?;
        let at = Instant::now();
        self.poll_for(span).await?;
        let to = super::redis::cpu_seconds(&mut self.admin).await?;
        let took = at.elapsed().as_secs_f64();
        let commands = CommandStats::read(&mut self.admin).await?.since(&before);
        let us_per_call = commands
            .by_command
            .iter()
            .map(|(k, n)| (k.clone(), commands.usec.get(k).copied().unwrap_or(0) as f64 / (*n).max(1) as f64))
            .collect();
        let per_s = commands.by_command.into_iter().map(|(k, n)| (k, n as f64 / took)).collect();
        Ok(CpuRate { cpu_ms_per_s: (to - from) * 1000.0 / took, commands_per_s: per_s, us_per_call })
    }

    /// How many turns are queued and leased (two `ZCARD`s, the bench's own).
    async fn poll_queue(&mut self) -> anyhow::Result<(u64, u64)> {
        let keys = self.queue.keys();
        let counts = redis::pipe().zcard(&keys.due).zcard(&keys.lease).query_async(&mut self.admin).await?;
        self.own_commands += 2;
        Ok(counts)
    }

    /// The fetches that found nothing so far, by what made the worker fetch
    /// (the queue's counters, `empty_fetches:<cause>`; unsaid: `empty_fetches`),
    /// the most first. Read outside the command snapshots (call it before
    /// [`Self::mark`] or after the last).
    pub async fn empty_fetches_by_cause(&mut self) -> anyhow::Result<Vec<(String, u64)>> {
        let stats: Vec<(String, u64)> =
            redis::cmd("HGETALL").arg(&self.queue.keys().stats).query_async(&mut self.admin).await?;
        let mut by: Vec<(String, u64)> = stats
            .into_iter()
            .filter_map(|(field, n)| {
                let cause = field.strip_prefix("empty_fetches")?;
                Some((cause.strip_prefix(':').unwrap_or("unsaid").to_owned(), n))
            })
            .collect();
        by.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        Ok(by)
    }

    /// Takes the "after" snapshot and the workers' peak RSS, stops everything
    /// and reads the runs and deliveries.
    pub async fn finish(mut self, drained: bool) -> anyhow::Result<TrialData> {
        let after = CommandStats::read(&mut self.admin).await?;
        let redis_cpu_s = super::redis::cpu_seconds(&mut self.admin).await? - self.cpu_before;
        let empty_by_cause = self.empty_fetches_by_cause().await?;
        let empty_fetches = empty_by_cause.iter().map(|(_, n)| n).sum();
        let worker_peak_rss_mb = self.fleet.peak_rss_mb();
        let logs = self.fleet.logs();
        self.fleet.stop(Duration::from_secs(15)).await;
        let lease_losses = super::fleet::log_lines_with(&logs, shared::queue::LEASE_LOST_MESSAGE);
        let mut commands = after.since(&self.before);
        let mut deliveries = vec![];
        let mut logged = 0;
        if let Some(key) = &self.deliveries_key {
            let lines: Vec<String> = redis::cmd("LRANGE").arg(key).arg(0).arg(-1).query_async(&mut self.admin).await?;
            // Each line was one RPUSH of the hook, inside the measured span.
            deliveries = lines.iter().filter_map(|l| Delivery::parse(l)).collect();
            logged = lines.len() as u64;
        }
        // The hook's RPUSHes and our ZCARDs, taken out of their own rows too,
        // so the breakdown shows the product's commands only.
        // (Only those after the last mark: the earlier ones' RPUSHes were in its span.)
        let hooked = logged.saturating_sub(self.deliveries_at_mark);
        commands.take_out(&[("rpush", hooked), ("zcard", self.own_commands)]);
        commands.by_command.sort_by_key(|(_, v)| std::cmp::Reverse(*v));
        let mut runs = Vec::with_capacity(self.submitted.len());
        for (tenant, id) in &self.submitted {
            if let Some(run) = self.store.get(tenant, id).await? {
                runs.push(run);
            }
        }
        self.api.stop().await;
        let mock = self.mock.stats();
        let mock_offset_s = self.first_submit.map(|t| t.duration_since(self.mock_started).as_secs_f64()).unwrap_or(0.0);
        self.mock.shutdown().await;
        Ok(TrialData {
            commands,
            mock,
            mock_offset_s,
            runs,
            deliveries,
            worker_peak_rss_mb,
            redis_cpu_s,
            empty_fetches,
            empty_by_cause,
            lease_losses,
            drained,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::CpuRate;

    #[test]
    fn a_rates_script_time_is_its_scripts_calls_a_second_times_their_time_a_call() {
        let rate = CpuRate {
            cpu_ms_per_s: 5.0,
            commands_per_s: vec![("zcard".into(), 20.0), ("evalsha".into(), 4.0)],
            us_per_call: vec![("evalsha".into(), 250.0), ("zcard".into(), 3.0)],
        };
        assert!((rate.script_us_per_s() - 1000.0).abs() < 1e-9);
        assert_eq!(CpuRate::default().script_us_per_s(), 0.0, "no script, no time");
    }
}
