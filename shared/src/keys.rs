//! Every Redis key paceline uses, in one place.
//!
//! Keys start with the configured prefix (`PACELINE_PREFIX`, default `paceline`)
//! and carry a hash tag (`{...}`) wherever one script touches several keys, so
//! they share a Redis Cluster slot. Names are constants, never derived from Rust
//! type paths, so a rename cannot move a queue.

/// The key namespace of one deployment (or of one test).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
    /// Every key in one slot (a Redis Cluster): the budgets' keys carry the
    /// prefix's hash tag too, so no script, pipeline or multi-key command
    /// spans two slots.
    one_slot: bool,
}

impl Keys {
    /// Keys under `prefix`, one Redis's layout: each budget's keys under a
    /// hash tag of their own (`{budget}`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self { prefix: prefix.into(), one_slot: false }
    }

    /// Keys under `prefix`, a Redis Cluster's layout: every key under the
    /// prefix's hash tag, the budgets' too (`prefix:{prefix}:pacer:<budget>:…`),
    /// so the deployment lives in one slot, where the queue's scripts may
    /// carry the pacer's ops as they do on one Redis. (Partitions, which
    /// would spread the queue over the primaries, are not built yet: the
    /// budget's own slot comes with them, `docs/redis-cluster-plan.md`.)
    pub fn one_slot(prefix: impl Into<String>) -> Self {
        Self { prefix: prefix.into(), one_slot: true }
    }

    /// Whether every key lives in one slot ([`one_slot`](Self::one_slot)).
    pub fn is_one_slot(&self) -> bool {
        self.one_slot
    }

    /// The start of a budget's keys: `prefix:pacer:{budget}` (its own slot)
    /// or, in one slot, `prefix:{prefix}:pacer:budget`.
    fn pacer_base(&self, budget: &str) -> String {
        if self.one_slot {
            format!("{}:{}:pacer:{}", self.prefix, self.slot_tag(), budget)
        } else {
            format!("{}:pacer:{{{}}}", self.prefix, budget)
        }
    }

    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The pacer's state hash for one budget and model, its calls in flight
    /// beside its numbers (field `fl`). The hash tag is the budget, so one
    /// budget's keys (state, reservations, fairness) share a slot. `v5` is the
    /// script's storage format (`pacer/lua/line.lua`: records packed, the calls in
    /// flight in one field of the state's hash, each noting whether its worker
    /// started it; the line parked, its head kept in the state): a worker of an
    /// older format keeps its own keys and never reads these as its own.
    pub fn pacer_state(&self, budget: &str, model: &str) -> String {
        format!("{}:v5:state:{}", self.pacer_base(budget), model)
    }

    /// The pacer's waiters for one budget and model: reservation id -> its
    /// record (its place in line, what it is expected to use, when it is due).
    pub fn pacer_waiters(&self, budget: &str, model: &str) -> String {
        format!("{}:v5:waiters:{}", self.pacer_base(budget), model)
    }

    /// A set the pacer's tests keep beside its keys: the ended runs of a test
    /// host (`tests/tests/integration/pacer.rs`, `TEST_HOST`), whose turns it
    /// no longer holds.
    pub fn test_gone(&self) -> String {
        format!("{}:test:gone", self.prefix)
    }

    /// The line of a budget and model's waiters: id -> its place (an index of
    /// [`pacer_waiters`](Self::pacer_waiters), written with it).
    pub fn pacer_line(&self, budget: &str, model: &str) -> String {
        format!("{}:v5:line:{}", self.pacer_base(budget), model)
    }

    /// The base of the pacer's history for one budget and model (the
    /// dashboard's chart): the script writes one hash per minute,
    /// `<base>:<minute>`, with per-second counters. Same hash tag as the
    /// budget's other keys, so the script's writes stay in its slot.
    pub fn pacer_history(&self, budget: &str, model: &str) -> String {
        format!("{}:hist:{}", self.pacer_base(budget), model)
    }

    /// One minute of the pacer's history (`minute` = Unix seconds / 60).
    pub fn pacer_history_minute(&self, budget: &str, model: &str, minute: i64) -> String {
        format!("{}:{}", self.pacer_history(budget, model), minute)
    }

    /// The set of models known under one budget (for `GET /v1/pacer`).
    pub fn pacer_models(&self, budget: &str) -> String {
        format!("{}:models", self.pacer_base(budget))
    }

    /// The set of budget names known to this deployment.
    pub fn pacer_budgets(&self) -> String {
        if self.one_slot {
            format!("{}:{}:pacer:budgets", self.prefix, self.slot_tag())
        } else {
            format!("{}:pacer:budgets", self.prefix)
        }
    }

    /// The hash tag of everything that one turn-commit script touches: the
    /// prefix itself (`{paceline}`). The queue's keys carry it, and the run
    /// store's keys may too, so a script can commit a turn and enqueue the next
    /// in one slot.
    pub fn slot_tag(&self) -> String {
        format!("{{{}}}", self.prefix)
    }

    /// The pub/sub channel a cancel is announced on (the run id), so a worker
    /// holding that run's turn aborts its call: `prefix:{prefix}:cancels`.
    pub fn cancel_channel(&self) -> String {
        format!("{}:{}:cancels", self.prefix, self.slot_tag())
    }

    /// One key of the turn queue: `prefix:{prefix}:q:name` (see `queue::QueueKeys`,
    /// which names them). Crate-private: a new key outside the queue gets a
    /// method of its own here.
    pub(crate) fn queue_key(&self, name: &str) -> String {
        format!("{}:{}:q:{}", self.prefix, self.slot_tag(), name)
    }

    /// The start every key of the runs' slot shares (`prefix:{prefix}:`): a
    /// script that learns a run's or a webhook event's id as it meets it
    /// builds that key from this base, by the shapes below.
    pub fn run_base(&self) -> String {
        format!("{}:{}:", self.prefix, self.slot_tag())
    }

    /// A run's record, a HASH (`runs::RunRecord`'s fields; `runs/store.lua`
    /// writes it): `prefix:{prefix}:run:<id>`. Under the queue's hash tag, so
    /// one script commits a turn and enqueues the next; the queue's hooks
    /// (`runs/hooks.lua`) find it beside the queue's keys by this shape.
    pub fn run_record(&self, id: &str) -> String {
        format!("{}:{}:run:{}", self.prefix, self.slot_tag(), id)
    }

    /// A run's transcript, a LIST of Responses-shape items tagged by turn:
    /// `prefix:{prefix}:tx:<id>`.
    pub fn run_transcript(&self, id: &str) -> String {
        format!("{}:{}:tx:{}", self.prefix, self.slot_tag(), id)
    }

    /// A run's events, a STREAM (`run.*` events, read by the API's SSE hub):
    /// `prefix:{prefix}:ev:<id>`.
    pub fn run_events(&self, id: &str) -> String {
        format!("{}:{}:ev:{}", self.prefix, self.slot_tag(), id)
    }

    /// A tenant's runs, a ZSET id -> created ms (the run list's index):
    /// `prefix:{prefix}:tenant:<tenant>:runs`.
    pub fn tenant_runs(&self, tenant: &str) -> String {
        format!("{}:{}:tenant:{}:runs", self.prefix, self.slot_tag(), tenant)
    }

    /// A tenant's unfinished runs, a ZSET id -> created ms, joined when a run
    /// is created or retried and left when it finishes (`store.lua` and
    /// `runs/hooks.lua`'s `run_active`, which derives it from the run record's
    /// key): `prefix:{prefix}:tenant:<tenant>:active`.
    pub fn tenant_active(&self, tenant: &str) -> String {
        format!("{}:{}:tenant:{}:active", self.prefix, self.slot_tag(), tenant)
    }

    /// A tenant's spend on one day (`runs/spend.rs`), a HASH: `spent` (micro-USD)
    /// and one `r:<reservation>` = `<micro-USD>|<expiry ms>` per call in
    /// flight: `prefix:{prefix}:tenant:<tenant>:spend:<day>`.
    pub fn tenant_spend(&self, tenant: &str, day: u64) -> String {
        format!("{}:{}:tenant:{}:spend:{}", self.prefix, self.slot_tag(), tenant, day)
    }

    /// What every tenant's calls used and cost on one UTC day (`runs/usage.rs`),
    /// a HASH `<tenant>|<model>|<kind>` -> count: `prefix:{prefix}:usage:<day>`.
    pub fn usage_day(&self, day: u64) -> String {
        format!("{}:{}:usage:{}", self.prefix, self.slot_tag(), day)
    }

    /// A submit's idempotency record, a STRING `run id|fingerprint` that
    /// expires with the idempotency window: `prefix:{prefix}:idem:<tenant>:<key>`.
    pub fn idempotency(&self, tenant: &str, key: &str) -> String {
        format!("{}:{}:idem:{}:{}", self.prefix, self.slot_tag(), tenant, key)
    }

    /// Webhook deliveries due (`runs/webhooks.rs`), a ZSET event id -> due ms,
    /// written in the script that ends a run (`runs/hooks.lua`
    /// `webhook_enqueue`, which derives it from the run record's key):
    /// `prefix:{prefix}:wh:due`.
    pub fn webhooks_due(&self) -> String {
        format!("{}:{}:wh:due", self.prefix, self.slot_tag())
    }

    /// Webhook deliveries being sent, a ZSET event id -> lease deadline ms (a
    /// worker that dies mid-delivery leaves its lease to expire, and the next
    /// claim takes it back): `prefix:{prefix}:wh:leased`.
    pub fn webhooks_leased(&self) -> String {
        format!("{}:{}:wh:leased", self.prefix, self.slot_tag())
    }

    /// Webhook deliveries that used every attempt, a ZSET event id -> ms they
    /// gave up (`GET /v1/dead` shows them; a retry takes one back):
    /// `prefix:{prefix}:wh:dead`.
    pub fn webhooks_dead(&self) -> String {
        format!("{}:{}:wh:dead", self.prefix, self.slot_tag())
    }

    /// Wake-up tokens of the webhook senders, a LIST (one pushed when an event
    /// becomes due, at most 64 kept; each worker's sender waits on it with
    /// `BLPOP`): `prefix:{prefix}:wh:wake`.
    pub fn webhooks_wake(&self) -> String {
        format!("{}:{}:wh:wake", self.prefix, self.slot_tag())
    }

    /// One webhook event, a HASH (run, type, event ms, url, tenant, attempts,
    /// state, the body once built, the claim of the worker sending it):
    /// `prefix:{prefix}:wh:e:<event id>`.
    pub fn webhook_event(&self, event: &str) -> String {
        format!("{}:{}:wh:e:{}", self.prefix, self.slot_tag(), event)
    }

    /// Bench only: a LIST of one line per turn delivery (run, turn, attempt,
    /// due and leased ms, outcome) that a worker started with
    /// `--bench-deliveries-key` pushes to; `paceline bench` reads it.
    pub fn bench_deliveries(&self) -> String {
        self.queue_key("bench:deliveries")
    }

    /// Queue probe only (`paceline queue-probe`): a HASH turn id -> times the
    /// no-op consumer ran it (a turn run twice shows as 2).
    pub fn probe_done(&self) -> String {
        self.queue_key("probe:done")
    }

    /// Queue probe only: a LIST of each delivery's lateness (leased - due, ms).
    pub fn probe_lateness(&self) -> String {
        self.queue_key("probe:lateness")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_start_with_the_prefix_and_tag_the_budget() {
        let k = Keys::new("pl");
        assert_eq!(k.pacer_state("default", "gpt-4.1"), "pl:pacer:{default}:v5:state:gpt-4.1");
        assert_eq!(k.pacer_waiters("b", "m"), "pl:pacer:{b}:v5:waiters:m");
        assert_eq!(k.queue_key("due"), "pl:{pl}:q:due");
        assert_eq!(k.pacer_history_minute("b", "m", 7), "pl:pacer:{b}:hist:m:7");
        assert_eq!(k.run_record("r1"), "pl:{pl}:run:r1");
        assert_eq!(k.tenant_active("t"), "pl:{pl}:tenant:t:active");
        assert_eq!(k.idempotency("t", "k"), "pl:{pl}:idem:t:k");
    }

    #[test]
    fn in_one_slot_every_key_carries_the_prefixs_tag() {
        let k = Keys::one_slot("pl");
        assert_eq!(k.pacer_state("default", "gpt-4.1"), "pl:{pl}:pacer:default:v5:state:gpt-4.1");
        assert_eq!(k.pacer_waiters("b", "m"), "pl:{pl}:pacer:b:v5:waiters:m");
        assert_eq!(k.pacer_line("b", "m"), "pl:{pl}:pacer:b:v5:line:m");
        assert_eq!(k.pacer_history_minute("b", "m", 7), "pl:{pl}:pacer:b:hist:m:7");
        assert_eq!(k.pacer_models("b"), "pl:{pl}:pacer:b:models");
        assert_eq!(k.pacer_budgets(), "pl:{pl}:pacer:budgets");
        assert_eq!(k.run_record("r1"), "pl:{pl}:run:r1", "the rest as on one Redis");
        assert_eq!(k.queue_key("due"), Keys::new("pl").queue_key("due"));
    }

    /// The workspace's root (this crate is one level below it).
    fn workspace() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
    }

    /// Every file under `dir` whose name ends with `ext`, outside `target/`
    /// and hidden directories.
    fn sources(dir: &std::path::Path, ext: &str, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    sources(&path, ext, out);
                }
            } else if name.ends_with(ext) {
                out.push(path);
            }
        }
    }

    /// The key families this file builds (the segment after the prefix or the
    /// hash tag): a format string with one of them between colons builds a key.
    const FAMILIES: &[&str] = &[
        "run", "tx", "ev", "tenant", "idem", "runs", "active", "q", "cancels", "pacer", "state", "expiry", "records",
        "line", "hist", "models", "budgets", "workers", "wh",
    ];

    /// Whether a `format!` string looks like a Redis key: a literal hash tag
    /// beside a separator (`:{{…}}:`), `{prefix}:`, or a key family as a
    /// segment after a colon (`"{}:{}:run:{}"`). A family word before the first
    /// colon is prose (`"state: {s}"`), not a key.
    fn looks_like_a_key(format: &str) -> bool {
        format.contains(":{{")
            || format.contains("}}:")
            || format.contains("{prefix}:")
            || format.split(':').skip(1).any(|segment| FAMILIES.contains(&segment))
    }

    /// The format string of each `format!(` in `text` (plain and raw
    /// literals), with its line.
    fn format_strings(text: &str) -> Vec<(usize, String)> {
        let mut out = vec![];
        for (at, _) in text.match_indices("format!(") {
            let rest = text[at + "format!(".len()..].trim_start();
            let literal = if let Some(raw) = rest.strip_prefix('r') {
                let hashes = raw.chars().take_while(|&c| c == '#').count();
                let body = &raw[hashes..];
                let Some(body) = body.strip_prefix('"') else { continue };
                let close = format!("\"{}", "#".repeat(hashes));
                body.find(&close).map(|end| body[..end].to_owned())
            } else if let Some(body) = rest.strip_prefix('"') {
                let mut end = None;
                let mut escaped = false;
                for (i, c) in body.char_indices() {
                    match (escaped, c) {
                        (true, _) => escaped = false,
                        (false, '\\') => escaped = true,
                        (false, '"') => {
                            end = Some(i);
                            break;
                        }
                        _ => {}
                    }
                }
                end.map(|end| body[..end].to_owned())
            } else {
                None // a format string from a variable or a macro: not a literal key
            };
            if let Some(literal) = literal {
                out.push((text[..at].matches('\n').count() + 1, literal));
            }
        }
        out
    }

    #[test]
    fn the_key_detector_knows_a_key_from_prose() {
        for key in ["{}:{}:run:{}", "{p}:{{{p}}}:tx:{id}", "{}:pacer:{{{}}}:state:{}", "{prefix}:x", "{}:q:due"] {
            assert!(looks_like_a_key(key), "{key}");
        }
        for prose in ["state: {s}", "`{prefix}` is not a URL ({e})", "{ms}:{id}", "127.0.0.1:{port}", "{t}:{w}"] {
            assert!(!looks_like_a_key(prose), "{prose}");
        }
        let text = "let a = format!(\"{}:{}:ev:{}\", p, t, id);\nlet b = format!(r#\"{}:run\"#, p);\n";
        let found: Vec<_> = format_strings(text).into_iter().map(|(_, f)| f).collect();
        assert_eq!(found, ["{}:{}:ev:{}", "{}:run"]);
    }

    /// Architecture invariant: every Redis key is built here. A `format!` that
    /// builds a key anywhere else in the workspace (run store, API, worker,
    /// bench, tests: a test that inspects a key asks `Keys` for it too) fails
    /// this test. What it cannot see: a key assembled by `+`, `concat!` or
    /// `join` — the queue's names go through the crate-private `queue_key`.
    #[test]
    fn no_redis_key_is_built_outside_keys_rs() {
        // (path from the workspace root, format string): a key-shaped format
        // string that is not a key, with the reason. None today.
        const ALLOWED: &[(&str, &str)] = &[];
        let root = workspace();
        let mut files = vec![];
        sources(&root, ".rs", &mut files);
        assert!(files.len() > 50, "the scan found the workspace's sources ({} files)", files.len());
        let mut found = vec![];
        for file in files {
            let relative = file.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
            if relative == "shared/src/keys.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (line, format) in format_strings(&text) {
                if looks_like_a_key(&format) && !ALLOWED.contains(&(relative.as_str(), format.as_str())) {
                    found.push(format!("{relative}:{line}: format!(\"{format}\")"));
                }
            }
        }
        assert!(
            found.is_empty(),
            "Redis keys built outside shared/src/keys.rs (add a `Keys` method):\n{}",
            found.join("\n")
        );
    }

    /// Lua scripts receive their keys as `KEYS[]`; a key family joined with
    /// `..` (`base .. 'run:' .. id`), or anything joined onto a given key
    /// (`KEYS[6] .. ':'`), builds a key name in the script. (Hash fields such
    /// as `'tw:' .. tenant` are not keys.) The ones that must stay are listed
    /// with their reason: each derives a key from one it was given, by the
    /// shape the method named here documents.
    #[test]
    fn lua_scripts_build_no_key_names_but_the_listed_ones() {
        const ALLOWED: &[(&str, &str)] = &[
            // `Q_HOOKS.buried` / `lease_ended` (runs/hooks.lua): a turn buried
            // or reclaimed by fetch, heartbeat or settle ends its run or its
            // fence, whose id the script only learns then; the run's record,
            // transcript and events sit beside the queue's dead set
            // (`Keys::run_record`, `run_transcript`, `run_events`).
            ("shared/src/runs/hooks.lua", "run:"),
            ("shared/src/runs/hooks.lua", "ev:"),
            ("shared/src/runs/hooks.lua", "tx:"),
            // The run store's fetch starts each turn it leases: the run's id is
            // the turn's, which the script learns as it leases it
            // (`Keys::run_record`, `run_transcript`, `run_events`).
            ("shared/src/runs/fetch.lua", "run:"),
            ("shared/src/runs/fetch.lua", "tx:"),
            ("shared/src/runs/fetch.lua", "ev:"),
            // `run_active` (runs/hooks.lua): the tenant is read from the run's
            // record inside the script (`Keys::tenant_active`).
            ("shared/src/runs/hooks.lua", "tenant:"),
            ("shared/src/runs/hooks.lua", ":active"),
            // `webhook_enqueue` (runs/hooks.lua): a run's end enqueues its
            // webhook event beside the run's record, in the same script
            // (`Keys::webhooks_due`, `webhook_event`); the claim and finish
            // scripts learn an event's id as they meet it (`runs/webhooks.lua`,
            // given the base the keys share).
            ("shared/src/runs/hooks.lua", "wh:due"),
            ("shared/src/runs/hooks.lua", "wh:e:"),
            ("shared/src/runs/hooks.lua", "wh:wake"),
            ("shared/src/runs/webhooks.lua", "wh:e:"),
            ("shared/src/runs/webhooks.lua", "run:"),
            // `hist`: one hash per minute of the Redis clock under the base it
            // is given (`Keys::pacer_history_minute`).
            ("shared/src/pacer/lua/state.lua", "KEYS[4] .."),
            // A tenant's submit rate beside its unfinished runs' set (`active`:
            // `Keys::tenant_submits`), and in the idempotency check the record of
            // the run a key named before (`Keys::run_record`): cut from a key the
            // script was given, so in its slot.
            ("shared/src/runs/store.lua", "string.sub("),
            // The pacer's keys of a budget and model, given in ARGV (a route's
            // key bases, the model joined on) and not in KEYS: **another slot**,
            // the budget's — the fetch's and the commit's pacer calls cross
            // slots, which one Redis runs and a cluster refuses
            // (docs/redis-cluster-plan.md, stage c).
            ("shared/src/runs/fetch.lua", "keys[…] .."),
            ("shared/src/runs/fetch.lua", "pacer_batch(keys"),
            ("shared/src/runs/store.lua", "pacer_batch(pacing.keys"),
        ];
        let root = workspace();
        let mut files = vec![];
        sources(&root, ".lua", &mut files);
        assert!(files.len() >= 5, "the scan found the Lua scripts ({} files)", files.len());
        let mut found = vec![];
        let mut used = vec![false; ALLOWED.len()];
        for file in files {
            let relative = file.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("--").next().unwrap_or("");
                let mut built = vec![];
                // The pacer called on keys that are not the script's KEYS.
                if let Some(at) = code.find("pacer_batch(") {
                    let arg = code[at + "pacer_batch(".len()..].split([',', ')']).next().unwrap_or("").trim();
                    if !arg.starts_with("KEYS") && !code.contains("local function pacer_batch") {
                        built.push(format!("pacer_batch({arg}"));
                    }
                }
                // The rest: a name joined together.
                let joins = code.contains("..");
                // A key family among the line's quoted literals (every other
                // piece between quotes).
                for literal in code.split('\'').skip(1).step_by(2).filter(|_| joins) {
                    let key_like = literal.contains(':')
                        && literal.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == ':')
                        && literal.split(':').any(|segment| FAMILIES.contains(&segment));
                    if key_like {
                        built.push(literal.to_owned());
                    }
                }
                // Something joined onto a key the script was given.
                if let Some(at) = code.find("KEYS[") {
                    if let Some(close) = code[at..].find("] ..") {
                        built.push(code[at..at + close + "] ..".len()].to_owned());
                    }
                }
                // A key cut from another and joined onto (`string.sub(RUN, …) .. id`).
                if code.contains("string.sub(") && code.contains(") ..") {
                    built.push("string.sub(".to_owned());
                }
                // A key name from a table the script decoded (ARGV's JSON), joined onto.
                if let Some(at) = code.find("keys[") {
                    if code[at..].contains("] ..") {
                        built.push("keys[…] ..".to_owned());
                    }
                }
                for b in built {
                    match ALLOWED.iter().position(|a| *a == (relative.as_str(), b.as_str())) {
                        Some(i) => used[i] = true,
                        None => found.push(format!("{relative}:{}: {b}", n + 1)),
                    }
                }
            }
        }
        assert!(found.is_empty(), "Lua builds key names (pass them as KEYS[]):\n{}", found.join("\n"));
        let stale: Vec<_> = ALLOWED.iter().zip(&used).filter(|(_, u)| !**u).map(|(a, _)| a).collect();
        assert!(stale.is_empty(), "allowed, and found nowhere (drop them): {stale:?}");
    }

    /// Layers point down: the queue's Lua knows nothing of runs. What a run
    /// needs when a queue script ends a lease or buries a turn is a hook the
    /// run store sets (`runs/hooks.lua`, `Q_HOOKS`); no queue script names a
    /// run's keys or its record's fields.
    #[test]
    fn the_queues_lua_names_no_run_key_or_field() {
        let root = workspace();
        let mut files = vec![];
        sources(&root.join("shared/src/queue"), ".lua", &mut files);
        assert!(files.len() >= 5, "the scan found the queue's scripts ({} files)", files.len());
        let run_words = ["'run:", "'tx:", "'ev:", "'tenant:", "'status'", "'retention_ms'", "'error_kind'", "'epoch'"];
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("--").next().unwrap_or("");
                for word in run_words {
                    assert!(!code.contains(word), "{}:{}: `{word}` is the run store's", file.display(), n + 1);
                }
            }
        }
    }
}
