//! The run store against real Redis: a submitted run is written whole with its
//! first turn queued; tenants see only their own runs; idempotency keys return
//! the first run; a turn's commit appends once and enqueues the next turn
//! atomically, fenced by the lease; cancelling stops a queued turn.

use paceline_tests::{unique_prefix, RedisServer};
use serde_json::{json, Value};
use shared::config::RedisArgs;
use shared::keys::Keys;
use shared::queue::{QueueConfig, Settled, TurnQueue};
use shared::runs::{
    Fence, Idempotency, Next, RunSpec, RunStatus, RunStore, StoreError, SubmitPolicy, Transition, TurnJob, Usage,
    WaitReason,
};
use std::time::Duration;

struct Env {
    _server: RedisServer,
    store: RunStore,
    queue: TurnQueue,
    keys: Keys,
}

async fn env() -> Env {
    let server = RedisServer::start();
    let prefix = unique_prefix();
    let conn = shared::redis_util::manager(&server.url()).await.unwrap();
    let store = RunStore::new(conn, Keys::new(&prefix), Duration::from_secs(60));
    let queue = shared::runs::run_queue(&RedisArgs::new(server.url(), &prefix), QueueConfig::default()).unwrap();
    Env { _server: server, store, queue, keys: Keys::new(&prefix) }
}

/// The kinds of run `id`'s events (tenant `alpha`), in order.
async fn event_kinds(env: &Env, id: &str) -> Vec<String> {
    env.store.events("alpha", id, None, None, 100).await.unwrap().unwrap().into_iter().map(|e| e.kind).collect()
}

/// A pacer ask of tenant `alpha` (a turn that waited for budget carries it).
fn asked() -> shared::runs::PacedAsk {
    shared::runs::PacedAsk {
        model: "gpt-test".into(),
        provider: None,
        mode: shared::pacer::Mode::Work,
        tenant: "alpha".into(),
        tokens: 10,
        requests: 1,
        output: 5,
    }
}

/// A call answered with `remaining` of its 100 000 tokens left (the commit tests' settle).
fn answered(remaining: u64) -> shared::pacer::CallOutcome {
    use shared::pacer::{CallOutcome, Observation};
    CallOutcome {
        used_tokens: Some(300),
        tokens: Observation { limit: Some(100_000), remaining: Some(remaining), reset_ms: Some(60_000) },
        requests: Observation { limit: Some(100), remaining: Some(99), reset_ms: Some(600) },
        ..CallOutcome::default()
    }
}

/// The commit tests' call: what it asks the pacer for.
const CALL: shared::pacer::Estimate = shared::pacer::Estimate { tokens: 300, requests: 1, output: 200 };

/// The commit tests' model output: one assistant message.
fn answer_items() -> [Value; 1] {
    [json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]})]
}

/// The commit tests' env, and the shared pacer of its default budget.
async fn pacer_env() -> (Env, shared::pacer::SharedPacer) {
    use shared::pacer::{PacingConfig, SharedPacer};
    let env = env().await;
    let pacer = SharedPacer::new(env.store.connection(), env.keys.clone(), "default", PacingConfig::default());
    (env, pacer)
}

/// The pacer ops of run `id`'s first turn's commit over `route`: its call's
/// settle (`remaining` tokens left) and turn 1's ask.
fn turn_zero_pacing(route: Value, id: &str, remaining: u64) -> shared::runs::CommitPacing {
    use shared::pacer::{AcquireOp, Mode, Op, SharedPacer, Who};
    let est = CALL;
    shared::runs::CommitPacing {
        route,
        settle: Some(SharedPacer::settle_op(&format!("{id}:0:1"), &answered(remaining))),
        ask: Some(Op::Acquire(AcquireOp::new(&format!("{id}:1:1"), est, Mode::Work, &Who::DEFAULT, 0.0))),
    }
}

/// Turn 1, to ask the pacer for `model` (not cleared).
fn turn_one_asking(model: &str) -> Next {
    Next::Paced {
        turn: shared::runs::Turn {
            job: TurnJob { turn: 1, attempt: 1 },
            ask: Some(shared::runs::PacedAsk { model: model.into(), ..asked() }),
            cleared: false,
            pause_ms: None,
            cached_until_ms: None,
        },
        wait: None,
    }
}

/// A shared pacer whose model `gpt-test` has a 1 000-token bucket, emptied by
/// its probe, that refills in `refill_ms`.
async fn emptied_pacer(env: &Env, refill_ms: u64) -> shared::pacer::SharedPacer {
    use shared::pacer::{CallOutcome, Decision, Estimate, Mode, Observation, PacingConfig, SharedPacer, Who};
    let pacer = SharedPacer::new(env.store.connection(), env.keys.clone(), "default", PacingConfig::default());
    let est = Estimate { tokens: 300, requests: 1, output: 200 };
    assert_eq!(pacer.acquire("gpt-test", "probe", est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
    let empty = CallOutcome {
        used_tokens: Some(300),
        tokens: Observation { limit: Some(1_000), remaining: Some(0), reset_ms: Some(refill_ms) },
        requests: Observation { limit: Some(100), remaining: Some(99), reset_ms: Some(600) },
        ..CallOutcome::default()
    };
    pacer.settle("gpt-test", "probe", &empty).await.unwrap();
    pacer
}

/// A new run whose first turn waited for budget and carries an ask of
/// `model`, as a fetch that asks the pacer finds it (due now): its id.
async fn waiting_with_ask(env: &Env, model: &str) -> String {
    let job = TurnJob { turn: 0, attempt: 1 };
    let run = env.store.create("alpha", &spec(model), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w0", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, run.id);
    let ask = shared::runs::PacedAsk { model: model.into(), ..asked() };
    let next = shared::runs::Turn { job, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms: None };
    let data = json!({"turn": 0, "owed_ms": 1, "reason": "budget"});
    let fence = env.store.wait_asking(&lease, job, next, 1, WaitReason::Budget, "turn.paced", &data).await.unwrap();
    assert_eq!(fence, Fence::Ok);
    tokio::time::sleep(Duration::from_millis(10)).await;
    run.id
}

/// A run of three turns at most that has one second (`max_run_seconds`).
fn one_second_run() -> RunSpec {
    RunSpec::from_json(
        &json!({"model": "gpt-test", "input": "x", "max_turns": 3, "max_run_seconds": 1}),
        &SubmitPolicy::default(),
    )
    .unwrap()
}

fn spec(input: &str) -> RunSpec {
    RunSpec::from_json(&json!({"model": "gpt-test", "input": input, "max_turns": 3}), &SubmitPolicy::default()).unwrap()
}

#[tokio::test]
async fn a_submitted_run_is_written_whole_and_its_first_turn_queued() {
    let env = env().await;
    let mut long = spec("hello");
    long.max_run_seconds = Some(600);
    let created = env.store.create("alpha", &long, None, None).await.unwrap();
    let run = created.run;
    assert!(!created.replayed);
    // What create hands back (built from what it wrote, not read back) is what a read finds.
    assert_eq!(env.store.get("alpha", &run.id).await.unwrap().as_ref(), Some(&run));
    assert_eq!(run.status, RunStatus::Queued);
    assert_eq!((run.turns_completed, run.max_turns), (0, 3));
    let tx = env.store.transcript("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(tx.len(), 1);
    assert_eq!(tx[0].item, json!({"role": "user", "content": "hello"}));
    assert_eq!(env.queue.counts().await.unwrap().ready, 1);
    assert_eq!(env.queue.payload::<TurnJob>(&run.id).await.unwrap(), Some(TurnJob { turn: 0, attempt: 1 }));
    let events = env.store.events("alpha", &run.id, None, None, 10).await.unwrap().unwrap();
    assert_eq!(events.iter().map(|e| e.kind.as_str()).collect::<Vec<_>>(), ["run.queued"]);
}

#[tokio::test]
async fn a_tenant_sees_only_its_own_runs() {
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    assert!(env.store.get("beta", &run.id).await.unwrap().is_none());
    assert!(env.store.transcript("beta", &run.id).await.unwrap().is_none());
    assert!(matches!(env.store.cancel("beta", &run.id).await, Err(StoreError::NotFound)));
    assert!(env.store.list("beta", None, 10, None).await.unwrap().0.is_empty());
    assert_eq!(env.store.get("alpha", &run.id).await.unwrap().unwrap().id, run.id);
    assert!(env.store.get("alpha", "run_nonsense").await.unwrap().is_none());
}

#[tokio::test]
async fn an_idempotency_key_returns_the_first_run_even_when_racing() {
    let env = env().await;
    let key = Idempotency { key: "k1".into(), fingerprint: "body-a".into() };
    let body = spec("x");
    let (a, b) = tokio::join!(
        env.store.create("alpha", &body, Some(&key), None),
        env.store.create("alpha", &body, Some(&key), None),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.run.id, b.run.id, "two concurrent submits with one key make one run");
    assert!(a.replayed != b.replayed);
    let other_body = Idempotency { key: "k1".into(), fingerprint: "body-b".into() };
    assert!(matches!(
        env.store.create("alpha", &spec("x"), Some(&other_body), None).await,
        Err(StoreError::IdempotencyMismatch)
    ));
    // Keys are per tenant.
    let beta = env.store.create("beta", &spec("x"), Some(&key), None).await.unwrap();
    assert_ne!(beta.run.id, a.run.id);
    assert_eq!(env.queue.counts().await.unwrap().ready, 2);
}

#[tokio::test]
async fn runs_list_newest_first_across_pages() {
    let env = env().await;
    let mut ids = vec![];
    for i in 0..7 {
        ids.push(env.store.create("alpha", &spec(&format!("r{i}")), None, None).await.unwrap().run.id);
    }
    ids.reverse();
    let mut seen = vec![];
    let mut cursor = None;
    for pages in 1.. {
        assert!(pages <= 7, "more pages than runs: {seen:?}");
        let (page, next) = env.store.list("alpha", None, 3, cursor.as_deref()).await.unwrap();
        seen.extend(page.into_iter().map(|r| r.id));
        match next {
            Some(c) if seen.len() < 7 => cursor = Some(c),
            _ => break,
        }
    }
    assert_eq!(seen, ids);
    let (queued, _) = env.store.list("alpha", Some(RunStatus::Queued), 50, None).await.unwrap();
    assert_eq!(queued.len(), 7);
    assert!(env.store.list("alpha", Some(RunStatus::Completed), 50, None).await.unwrap().0.is_empty());
}

#[tokio::test]
async fn a_retired_run_leaves_the_list_and_the_index() {
    let env = env().await;
    let mut ids = vec![];
    for i in 0..3 {
        ids.push(env.store.create("alpha", &spec(&format!("r{i}")), None, None).await.unwrap().run.id);
    }
    // The middle run's record expires (as retention does); its index entry stays.
    let mut conn = env.store.connection();
    let record: Vec<String> =
        redis::cmd("KEYS").arg(env.keys.run_record(&ids[1])).query_async(&mut conn).await.unwrap();
    let index: Vec<String> =
        redis::cmd("KEYS").arg(env.keys.tenant_runs("alpha")).query_async(&mut conn).await.unwrap();
    assert_eq!((record.len(), index.len()), (1, 1));
    let _: () = redis::cmd("DEL").arg(&record[0]).query_async(&mut conn).await.unwrap();
    let (page, next) = env.store.list("alpha", None, 10, None).await.unwrap();
    assert_eq!(page.into_iter().map(|r| r.id).collect::<Vec<_>>(), [ids[2].clone(), ids[0].clone()]);
    assert!(next.is_none());
    let left: u64 = redis::cmd("ZCARD").arg(&index[0]).query_async(&mut conn).await.unwrap();
    assert_eq!(left, 2, "the retired run is dropped from the index");
}

#[tokio::test]
async fn a_turn_commits_once_and_enqueues_the_next_atomically() {
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    assert_eq!(env.store.get("alpha", &run.id).await.unwrap().unwrap().status, RunStatus::Running);

    let items = [json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]})];
    let usage = Usage {
        input_tokens: 10,
        output_tokens: 2,
        total_tokens: 12,
        reasoning_tokens: 1,
        cached_input_tokens: 4,
        cache_write_tokens: 3,
    };
    assert_eq!(env.store.commit(&lease, job, &items, usage, &Next::Continue).await.unwrap(), Fence::Ok);
    // The same commit again (a redelivery, a retry after a lost reply) writes nothing.
    assert!(matches!(env.store.commit(&lease, job, &items, usage, &Next::Continue).await.unwrap(), Fence::Stop(_)));
    let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!((run_now.turns_completed, run_now.usage.total_tokens), (1, 12));
    assert_eq!(env.store.transcript("alpha", &run.id).await.unwrap().unwrap().len(), 2);
    assert_eq!(env.queue.payload::<TurnJob>(&run.id).await.unwrap(), Some(TurnJob { turn: 1, attempt: 1 }));

    // The next turn: a stale holder of the old lease is fenced.
    let lease2 = env.queue.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    let job2 = TurnJob { turn: 1, attempt: 1 };
    assert!(matches!(env.store.start(&lease, job2).await.unwrap(), Fence::Stop(_)));
    assert_eq!(env.store.start(&lease2, job2).await.unwrap(), Fence::Ok);
    let done = Next::Complete("the answer".into());
    assert_eq!(env.store.commit(&lease2, job2, &items, usage, &done).await.unwrap(), Fence::Ok);
    let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(run_now.status, RunStatus::Completed);
    // Reasoning, cached and cache-write tokens add up with the rest, turn by turn.
    assert_eq!(
        run_now.usage,
        Usage {
            input_tokens: 20,
            output_tokens: 4,
            total_tokens: 24,
            reasoning_tokens: 2,
            cached_input_tokens: 8,
            cache_write_tokens: 6
        }
    );
    assert_eq!(run_now.output_text.as_deref(), Some("the answer"));
    assert!(run_now.finished_at.is_some());
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight), (0, 0, 0));
    let kinds = event_kinds(&env, &run.id).await;
    assert_eq!(
        kinds,
        ["run.queued", "turn.started", "turn.completed", "turn.started", "turn.completed", "run.completed"]
    );
    assert!(matches!(env.store.cancel("alpha", &run.id).await, Err(StoreError::Conflict(s)) if s == "completed"));
}

#[tokio::test]
async fn a_started_holder_whose_lease_ended_writes_nothing_even_before_another_starts() {
    // The steps of a started turn are fenced off the run's record (its
    // `epoch` names the lease whose start it saw), not the queue's: whatever
    // ends that lease clears it — a reclaim of an expired lease, a settle of
    // the queue's own — so the old holder is fenced while the next holder has
    // leased the turn and not yet started it.
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let job = TurnJob { turn: 0, attempt: 1 };
    let items = [json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]})];
    let a = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&a, job).await.unwrap(), Fence::Ok);
    // Its lease expires (moved into the past) and a heartbeat takes it back.
    let mut conn = env._server.conn().await;
    let _: i64 = redis::cmd("ZADD")
        .arg(&env.queue.keys().lease)
        .arg("XX")
        .arg(1)
        .arg(&run.id)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(env.queue.heartbeat("reaper", None, &[]).await.unwrap().reclaimed, 1);
    assert!(matches!(
        env.store.commit(&a, job, &items, Usage::default(), &Next::Continue).await.unwrap(),
        Fence::Stop(_)
    ));
    let b = env.queue.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease;
    let stopped = |f: Fence| matches!(f, Fence::Stop(_));
    assert!(stopped(env.store.commit(&a, job, &items, Usage::default(), &Next::Continue).await.unwrap()));
    assert!(stopped(
        env.store.fail(&a, job, shared::runs::ErrorKind::ProviderError, "late", Usage::default()).await.unwrap()
    ));
    assert_eq!(env.queue.counts().await.unwrap().in_flight, 1, "the unstarted holder's lease stands");
    // The queue's own settle ends a started lease too.
    assert_eq!(env.store.start(&b, job).await.unwrap(), Fence::Ok);
    env.queue.release(&b).await.unwrap();
    assert!(stopped(env.store.commit(&b, job, &items, Usage::default(), &Next::Continue).await.unwrap()));
    let c = env.queue.fetch("w3", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&c, job).await.unwrap(), Fence::Ok);
    assert_eq!(env.store.commit(&c, job, &items, Usage::default(), &Next::Continue).await.unwrap(), Fence::Ok);
    let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!((run_now.turns_completed, run_now.status), (1, RunStatus::Queued));
    assert_eq!(env.store.transcript("alpha", &run.id).await.unwrap().unwrap().len(), 2, "one commit landed");
}

#[tokio::test]
async fn a_model_output_commits_with_its_tool_results_once_whether_or_not_its_own_step_ran() {
    // A turn whose tools answered at once commits the model's output with
    // their results (one script); one whose tools were slow had its output
    // committed first. Either way the output's items, events and usage are
    // written once, in order.
    use shared::runs::ModelOutput;
    let env = env().await;
    let call = json!({"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"});
    let answer = json!({"type": "function_call_output", "call_id": "c1", "output": "found"});
    let usage = Usage { input_tokens: 10, output_tokens: 2, total_tokens: 12, ..Usage::default() };
    for output_step_ran in [false, true] {
        let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
        let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
        let job = TurnJob { turn: 0, attempt: 1 };
        assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
        let announced = [("turn.tool_call", json!({"turn": 0, "call_id": "c1"}))];
        let output = ModelOutput { items: std::slice::from_ref(&call), usage, events: &announced };
        if output_step_ran {
            let fence = env.store.record_output_with_events(&lease, job, output.items, usage, &announced).await;
            assert_eq!(fence.unwrap(), Fence::Ok);
        }
        let results = [("turn.tool_result", json!({"turn": 0, "call_id": "c1"}))];
        let fence = env
            .store
            .commit_with_output(
                &lease,
                job,
                Some(&output),
                std::slice::from_ref(&answer),
                Usage::default(),
                &Next::Continue,
                &results,
                None,
            )
            .await;
        assert_eq!(fence.unwrap().fence, Fence::Ok, "output step ran: {output_step_ran}");
        let done = env.store.get("alpha", &run.id).await.unwrap().unwrap();
        assert_eq!((done.turns_completed, done.usage.total_tokens), (1, 12), "output step ran: {output_step_ran}");
        let tx = env.store.transcript("alpha", &run.id).await.unwrap().unwrap();
        let items: Vec<&Value> = tx.iter().map(|e| &e.item).collect();
        assert_eq!(items[1..], [&call, &answer], "output step ran: {output_step_ran}");
        assert!(tx[1..].iter().all(|e| e.turn == 1));
        let kinds = event_kinds(&env, &run.id).await;
        assert_eq!(kinds, ["run.queued", "turn.started", "turn.tool_call", "turn.tool_result", "turn.completed"]);
        // The next turn reads the whole history, in order.
        let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
        let started = env.store.start_turn_with_history(&lease, TurnJob { turn: 1, attempt: 1 }, 24).await;
        let shared::runs::Started::Run(ctx) = started.unwrap() else { panic!("the next turn did not start") };
        assert_eq!(ctx.transcript.len(), 3);
        assert_eq!(ctx.phase, shared::runs::Phase::Model);
    }
}

#[tokio::test]
async fn the_fetch_starts_the_turns_it_leases_as_a_start_would_but_not_one_that_asks_first() {
    // The worker's fetch starts each turn it leases in the same script: the
    // delivery carries what a start returns (the run marked running, its
    // context), a run past its deadline fails there, and a turn back from a
    // budget wait (its payload carries the pacer's ask) is leased only.
    use shared::runs::{Started, StopReason, Turn};
    let env = env().await;
    // A turn that waited for budget, carrying its ask.
    let asking = env.store.create("alpha", &spec("asking"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w0", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, asking.id);
    let ask = asked();
    let job = TurnJob { turn: 0, attempt: 1 };
    let data = json!({"turn": 0, "owed_ms": 1, "reason": "budget"});
    let next = Turn { job, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms: None };
    let fence = env.store.wait_asking(&lease, job, next, 1, WaitReason::Budget, "turn.paced", &data).await.unwrap();
    assert_eq!(fence, Fence::Ok);
    let plain = env.store.create("alpha", &spec("plain"), None, None).await.unwrap().run;
    let late = one_second_run();
    let late = env.store.create("alpha", &late, None, None).await.unwrap().run;
    // Past the late run's deadline.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let fetched = env.queue.fetch_with("w1", 10, Some(&env.store.fetch_script(24))).await.unwrap();
    assert_eq!(fetched.deliveries.len(), 3);
    let lease = |id: &str| fetched.deliveries.iter().find(|d| d.lease.id == id).unwrap().lease.clone();
    let plain_lease = lease(&plain.id);
    let Some(Ok(Started::Run(ctx))) = env.store.started(&plain_lease) else { panic!("the plain turn was not started") };
    assert_eq!(ctx.spec.model, "gpt-test");
    assert_eq!(ctx.transcript.len(), 1);
    assert_eq!(ctx.transcript[0].item, json!({"role": "user", "content": "plain"}));
    assert_eq!(env.store.get("alpha", &plain.id).await.unwrap().unwrap().status, RunStatus::Running);
    let kinds = event_kinds(&env, &plain.id).await;
    assert_eq!(kinds, ["run.queued", "turn.started"]);
    // Its commit goes on from there: the start was a real one.
    let fence = env.store.commit(&plain_lease, job, &[], Usage::default(), &Next::Continue).await.unwrap();
    assert_eq!(fence, Fence::Ok);

    let late_lease = lease(&late.id);
    let Some(Ok(Started::Stop(why))) = env.store.started(&late_lease) else { panic!("the late turn was started") };
    assert_eq!(why, StopReason::Deadline);
    let failed = env.store.get("alpha", &late.id).await.unwrap().unwrap();
    assert_eq!((failed.status, failed.error.unwrap().kind.as_str()), (RunStatus::Failed, "deadline"));

    let asking_lease = lease(&asking.id);
    assert!(asking_lease.extra().is_none(), "a turn that asks first is leased, not started");
    assert!(env.store.started(&asking_lease).is_none());
    assert_eq!(env.store.get("alpha", &asking.id).await.unwrap().unwrap().status, RunStatus::Waiting);
}

#[tokio::test]
async fn a_commit_settles_its_call_and_makes_the_next_turns_ask_in_its_own_script() {
    // A commit carries the pacer ops of its turn (store.rs `CommitPacing`):
    // the call's settle, made first and whatever the fence says, and the
    // next turn's ask, made only when the commit lands — cleared, the next
    // turn is queued cleared; owed, the run waits from this commit on.
    use shared::pacer::{AcquireOp, Decision, Mode, Op, SharedPacer, Who};
    use shared::runs::{CommitPacing, Turn};
    let (env, pacer) = pacer_env().await;
    let est = CALL;
    let job = TurnJob { turn: 0, attempt: 1 };
    let items = answer_items();
    // One run per model (each unknown to the pacer: its first call is its probe).
    for (model, remaining) in [("gpt-empty", 0), ("gpt-open", 99_000)] {
        let run = env.store.create("alpha", &spec(model), None, None).await.unwrap().run;
        let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
        assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
        let call = format!("{}:0:1", run.id);
        assert_eq!(pacer.acquire(model, &call, est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
        let next_job = TurnJob { turn: 1, attempt: 1 };
        let ask = shared::runs::PacedAsk { model: model.into(), ..asked() };
        let next = Next::Paced {
            turn: Turn { job: next_job, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms: None },
            wait: None,
        };
        let pacing = CommitPacing {
            route: pacer.commit_route(model).unwrap(),
            settle: Some(SharedPacer::settle_op(&call, &answered(remaining))),
            ask: Some(Op::Acquire(AcquireOp::new(&format!("{}:1:1", run.id), est, Mode::Work, &Who::DEFAULT, 0.0))),
        };
        let committed = env
            .store
            .commit_with_output(&lease, job, None, &items, Usage::default(), &next, &[], Some(&pacing))
            .await
            .unwrap();
        assert_eq!(committed.fence, Fence::Ok);
        let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
        let payload: Turn = env.queue.payload(&run.id).await.unwrap().unwrap();
        if remaining == 0 {
            // The settle came first (the bucket it named is empty: a budget
            // wait, not the probe's), then the ask, owed: the run waits now.
            assert!(
                matches!(committed.asked, Some(Decision::Owed { ms, reason: shared::pacer::OwedReason::Budget, .. }) if ms > 1_000),
                "{:?}",
                committed.asked
            );
            assert_eq!((run_now.status, run_now.pacing.budget_waits), (RunStatus::Waiting, 1));
            assert_eq!(event_kinds(&env, &run.id).await.last().map(String::as_str), Some("turn.paced"));
            assert!(!payload.cleared);
        } else {
            assert_eq!(committed.asked, Some(Decision::Clear));
            assert_eq!(run_now.status, RunStatus::Queued);
            assert!(payload.cleared, "the next turn calls without asking again");
            let c = env.queue.counts().await.unwrap();
            assert_eq!(c.ready, 1);
        }
        assert_eq!(run_now.turns_completed, 1);
        // Out of the queue for the next case.
        let mut conn = env._server.conn().await;
        let _: i64 = redis::cmd("ZADD")
            .arg(&env.queue.keys().due)
            .arg(i64::MAX / 4)
            .arg(&run.id)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    // A commit its fence stops still settles its call (it happened), and asks nothing.
    let run = env.store.create("alpha", &spec("gpt-late"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let call = format!("{}:0:1", run.id);
    assert_eq!(pacer.acquire("gpt-late", &call, est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
    env.queue.release(&lease).await.unwrap();
    let pacing = turn_zero_pacing(pacer.commit_route("gpt-late").unwrap(), &run.id, 99_000);
    let next = turn_one_asking("gpt-late");
    let committed = env
        .store
        .commit_with_output(&lease, job, None, &items, Usage::default(), &next, &[], Some(&pacing))
        .await
        .unwrap();
    assert!(matches!(committed.fence, Fence::Stop(_)), "{committed:?}");
    assert_eq!(committed.asked, None);
    assert!(!committed.unsettled);
    // Settled: the probe is answered and the bucket known, so another call clears at once.
    assert_eq!(pacer.acquire("gpt-late", "other", est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);

    // A commit whose pacer ops fail (here the pacer's state is not a hash)
    // still lands, the next turn asking at its fetch, and says that its settle
    // was not made: the worker sends it alone (pacing.rs `SettleGuard::made_by`).
    let mut conn = env._server.conn().await;
    let _: i64 = redis::cmd("ZADD")
        .arg(&env.queue.keys().due)
        .arg(i64::MAX / 4)
        .arg(&lease.id)
        .query_async(&mut conn)
        .await
        .unwrap();
    let run = env.store.create("alpha", &spec("gpt-broken"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, run.id);
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let route = pacer.commit_route("gpt-broken").unwrap();
    let state = route["keys"][0].as_str().unwrap().to_owned();
    let _: () = redis::cmd("SET").arg(&state).arg("not a hash").query_async(&mut conn).await.unwrap();
    let pacing = turn_zero_pacing(route, &run.id, 99_000);
    let next = turn_one_asking("gpt-broken");
    let committed = env
        .store
        .commit_with_output(&lease, job, None, &items, Usage::default(), &next, &[], Some(&pacing))
        .await
        .unwrap();
    assert_eq!((committed.fence, committed.asked, committed.unsettled), (Fence::Ok, None, true));
    let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!((run_now.status, run_now.turns_completed), (RunStatus::Queued, 1));
    let payload: Turn = env.queue.payload(&run.id).await.unwrap().unwrap();
    assert!(!payload.cleared, "asked nothing: its fetch asks");
    // So does one that makes the settle alone (another turn is due and
    // untaken: it leaves the ask to the fetch), and one its fence stops.
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, run.id);
    let job = TurnJob { turn: 1, attempt: 1 };
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let other = env.store.create("alpha", &spec("gpt-broken"), None, None).await.unwrap().run;
    let route = pacer.commit_route("gpt-broken").unwrap();
    let committed = env
        .store
        .commit_with_output(
            &lease,
            job,
            None,
            &items,
            Usage::default(),
            &next,
            &[],
            Some(&turn_zero_pacing(route.clone(), &run.id, 99_000)),
        )
        .await
        .unwrap();
    assert_eq!((committed.fence, committed.asked, committed.unsettled), (Fence::Ok, None, true));
    let _: i64 = redis::cmd("ZADD")
        .arg(&env.queue.keys().due)
        .arg(i64::MAX / 4)
        .arg(&run.id)
        .query_async(&mut conn)
        .await
        .unwrap();
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, other.id);
    env.queue.release(&lease).await.unwrap();
    let committed = env
        .store
        .commit_with_output(
            &lease,
            TurnJob { turn: 0, attempt: 1 },
            None,
            &items,
            Usage::default(),
            &next,
            &[],
            Some(&turn_zero_pacing(route, &other.id, 99_000)),
        )
        .await
        .unwrap();
    assert!(matches!(committed.fence, Fence::Stop(_)) && committed.unsettled, "{committed:?}");
}

#[tokio::test]
async fn a_commit_leaves_the_next_turns_ask_to_its_fetch_while_turns_wait_for_a_slot() {
    // A turn cleared at its run's commit holds a reservation until a worker
    // takes it, and every pacer op reads every reservation held: while other
    // turns are due and untaken (every slot busy), the commit makes the
    // call's settle alone and queues the next turn uncleared, to ask when it
    // is fetched.
    use shared::pacer::{Decision, Mode, Who};
    use shared::runs::Turn;
    let (env, pacer) = pacer_env().await;
    let est = CALL;
    let job = TurnJob { turn: 0, attempt: 1 };
    let items = answer_items();
    let run = env.store.create("alpha", &spec("gpt-busy"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(lease.id, run.id);
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    // Another run's turn is due, and no slot takes it.
    let waiting = env.store.create("alpha", &spec("gpt-busy"), None, None).await.unwrap().run;
    let call = format!("{}:0:1", run.id);
    assert_eq!(pacer.acquire("gpt-busy", &call, est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
    let pacing = turn_zero_pacing(pacer.commit_route("gpt-busy").unwrap(), &run.id, 99_000);
    let next = turn_one_asking("gpt-busy");
    let committed = env
        .store
        .commit_with_output(&lease, job, None, &items, Usage::default(), &next, &[], Some(&pacing))
        .await
        .unwrap();
    assert_eq!((committed.fence, committed.asked, committed.unsettled), (Fence::Ok, None, false));
    let payload: Turn = env.queue.payload(&run.id).await.unwrap().unwrap();
    assert!(!payload.cleared && payload.ask.is_some(), "the next turn asks at its fetch");
    // The call settled, and nothing reserved for a turn no slot took.
    let snapshot = pacer.snapshot().await.unwrap();
    let budget = snapshot.iter().find(|b| b.model == "gpt-busy").unwrap();
    assert_eq!((budget.reserved_tokens, budget.reserved_requests), (0, 0), "{budget:?}");
    assert_eq!(budget.remaining_tokens, Some(99_000), "the call's settle was not made");
    // The waiting turn is still there to take.
    assert_eq!(env.queue.fetch("w2", 1).await.unwrap().deliveries.remove(0).lease.id, waiting.id);
}

#[tokio::test]
async fn a_fetch_that_asks_the_pacer_keeps_an_owed_turn_queued_and_starts_a_cleared_one() {
    // The worker's fetch asks the shared pacer itself for a turn back from a
    // budget wait: still owed, the turn waits again in the queue as the
    // worker's wait would have left it (its due time, the run's counter and
    // wait fields, a `turn.paced` event) and no worker sees it; cleared, it is
    // leased and started as a cleared turn, its reservation held.
    use shared::pacer::{Decision, Estimate, Mode, Who};
    use shared::runs::{FetchAsks, Started, Turn};
    let env = env().await;
    // Model `gpt-test`'s bucket is empty and refills over a minute; `gpt-free` is unknown.
    let pacer = emptied_pacer(&env, 60_000).await;
    let est = Estimate { tokens: 300, requests: 1, output: 200 };
    let job = TurnJob { turn: 0, attempt: 1 };
    let data = json!({"turn": 0, "owed_ms": 1, "reason": "budget"});
    let mut waiting = vec![];
    for model in ["gpt-test", "gpt-free"] {
        waiting.push(env.store.create("alpha", &spec(model), None, None).await.unwrap().run);
    }
    // Both leased before either waits (a turn due again in 1 ms must not be the next one leased here).
    let leases = env.queue.fetch("w0", 2).await.unwrap().deliveries;
    assert_eq!(leases.len(), 2);
    for (run, model) in waiting.iter().zip(["gpt-test", "gpt-free"]) {
        let lease = &leases.iter().find(|d| d.lease.id == run.id).unwrap().lease;
        let next = Turn {
            job,
            ask: Some(shared::runs::PacedAsk { model: model.into(), ..asked() }),
            cleared: false,
            pause_ms: None,
            cached_until_ms: None,
        };
        let fence = env.store.wait_asking(lease, job, next, 1, WaitReason::Budget, "turn.paced", &data).await.unwrap();
        assert_eq!(fence, Fence::Ok);
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let asks = FetchAsks {
        routes: [("default".to_owned(), pacer.script_route().unwrap())].into(),
        first: "default".into(),
        ..FetchAsks::default()
    };
    let fetched = env.queue.fetch_with("w1", 10, Some(&env.store.fetch_script_asking(24, Some(&asks)))).await.unwrap();

    // The owed one: not delivered, queued again for what it owes.
    assert_eq!(fetched.held, 1);
    assert_eq!(fetched.deliveries.len(), 1);
    let owed = env.store.get("alpha", &waiting[0].id).await.unwrap().unwrap();
    assert_eq!(owed.status, RunStatus::Waiting);
    // (It waits on: one budget wait, its estimate now the pacer's.)
    assert_eq!(owed.pacing.budget_waits, 1);
    assert!(owed.next_attempt_at.is_some(), "a wait names its next attempt");
    assert!(owed.pacing.waited_ms > 1_000, "owed most of a minute's refill: {:?}", owed.pacing);
    assert_eq!(event_kinds(&env, &waiting[0].id).await.last().map(String::as_str), Some("turn.paced"));
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight), (0, 1, 1));
    assert!(c.next_due_ms.unwrap() > fetched.now_ms + 1_000, "{c:?} at {}", fetched.now_ms);

    // The cleared one: leased and started, marked cleared, its reservation in flight.
    let lease = &fetched.deliveries[0].lease;
    assert_eq!(lease.id, waiting[1].id);
    let turn: Turn = serde_json::from_str(&fetched.deliveries[0].payload).unwrap();
    assert!(turn.cleared, "{}", fetched.deliveries[0].payload);
    assert!(matches!(env.store.started(lease), Some(Ok(Started::Run(_)))));
    assert_eq!(env.store.get("alpha", &waiting[1].id).await.unwrap().unwrap().status, RunStatus::Running);
    // Its call went as the model's probe: asked again, it is still clear; any other waits.
    let reservation = format!("{}:0:1", waiting[1].id);
    assert_eq!(pacer.acquire("gpt-free", &reservation, est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
    let other = pacer.acquire("gpt-free", "other", est, Mode::Work, &Who::DEFAULT).await.unwrap();
    assert!(matches!(other, Decision::Owed { .. }), "{other:?}");

    // Owed a moment for that probe (its answer clears the turns that waited
    // for it): leased with the pause, and started here, not by its worker.
    waiting_with_ask(&env, "gpt-free").await;
    let patient = FetchAsks { in_place_ms: 120_000, ..asks.clone() };
    let fetched =
        env.queue.fetch_with("w1", 10, Some(&env.store.fetch_script_asking(24, Some(&patient)))).await.unwrap();
    assert_eq!((fetched.held, fetched.deliveries.len()), (0, 1));
    let turn: Turn = serde_json::from_str(&fetched.deliveries[0].payload).unwrap();
    assert!(!turn.cleared && turn.pause_ms.is_some(), "{}", fetched.deliveries[0].payload);
    assert!(matches!(env.store.started(&fetched.deliveries[0].lease), Some(Ok(Started::Run(_)))));

    // Owed no longer than the worker's in-place wait (here a long one, so the
    // empty bucket's wait is within it): leased with that pause, to wait in
    // its worker and ask again there — no requeue, no budget wait counted,
    // and not started (it may be owed again after its pause).
    let soon = waiting_with_ask(&env, "gpt-test").await;
    let patient = FetchAsks { in_place_ms: 120_000, ..asks };
    let fetched =
        env.queue.fetch_with("w1", 10, Some(&env.store.fetch_script_asking(24, Some(&patient)))).await.unwrap();
    assert_eq!((fetched.held, fetched.deliveries.len()), (0, 1));
    let turn: Turn = serde_json::from_str(&fetched.deliveries[0].payload).unwrap();
    assert!(!turn.cleared, "{}", fetched.deliveries[0].payload);
    let pause = turn.pause_ms.expect("the pause it owes");
    assert!((1_000..=120_000).contains(&pause), "owed most of a minute's refill: {pause}");
    assert!(env.store.started(&fetched.deliveries[0].lease).is_none());
    let run = env.store.get("alpha", &soon).await.unwrap().unwrap();
    assert_eq!((run.status, run.pacing.budget_waits), (RunStatus::Waiting, 1));
    // Asked again before the pause is over, it is owed the rest.
    let reservation = format!("{soon}:0:1");
    let rest = pacer.acquire("gpt-test", &reservation, est, Mode::Work, &Who::DEFAULT).await.unwrap();
    assert!(matches!(rest, Decision::Owed { ms, .. } if ms <= pause), "{rest:?}");
}

#[tokio::test]
async fn a_first_turn_carrying_its_submits_ask_waits_in_the_queue_unstarted_until_clear() {
    // A run submitted with its first turn's ask (the API's `FirstAsk`) is
    // asked for by the fetch that would lease it: owed, it waits in the queue
    // (the run `waiting`, a `turn.paced` event, no `turn.started`) and no
    // worker sees it; once clear, that fetch starts it as a cleared turn.
    use shared::runs::{FetchAsks, Started, Turn};
    let env = env().await;
    // The bucket is empty and refills 1 000 tokens a second.
    let pacer = emptied_pacer(&env, 1_000).await;
    let ask = shared::runs::PacedAsk { tokens: 400, output: 100, ..asked() };
    let run = env.store.create("alpha", &spec("hello"), None, Some(ask.clone())).await.unwrap().run;
    let asks = FetchAsks {
        routes: [("default".to_owned(), pacer.script_route().unwrap())].into(),
        first: "default".into(),
        ..FetchAsks::default()
    };
    let fetch = env.store.fetch_script_asking(24, Some(&asks));
    let fetched = env.queue.fetch_with("w1", 10, Some(&fetch)).await.unwrap();
    assert_eq!((fetched.held, fetched.deliveries.len()), (1, 0));
    let waiting = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!((waiting.status, waiting.pacing.budget_waits), (RunStatus::Waiting, 1));
    assert_eq!(event_kinds(&env, &run.id).await, ["run.queued", "turn.paced"]);
    let due = env.queue.counts().await.unwrap().next_due_ms.expect("queued again");
    assert!(due > fetched.now_ms + 100, "owed its refill: due {due} at {}", fetched.now_ms);

    // Due again, and clear by then: leased, started and marked cleared.
    tokio::time::sleep(Duration::from_millis((due - fetched.now_ms + 20) as u64)).await;
    let fetched = env.queue.fetch_with("w1", 10, Some(&fetch)).await.unwrap();
    assert_eq!(fetched.deliveries.len(), 1, "held {}", fetched.held);
    let turn: Turn = serde_json::from_str(&fetched.deliveries[0].payload).unwrap();
    assert!(turn.cleared, "{}", fetched.deliveries[0].payload);
    assert_eq!(turn.ask, Some(ask));
    assert!(matches!(env.store.started(&fetched.deliveries[0].lease), Some(Ok(Started::Run(_)))));
    assert_eq!(event_kinds(&env, &run.id).await, ["run.queued", "turn.paced", "turn.started"]);
}

#[tokio::test]
async fn a_first_turns_ask_that_no_worker_makes_is_started_as_any_turn() {
    // A worker that paces nothing (`--pacer off`) has no ask to make: its
    // fetch starts a run's first turn though the turn carries its submit's
    // ask; a fetch that would have the worker ask (a local pacer) leaves it.
    use shared::runs::{FetchAsks, Started};
    let env = env().await;
    let ask = shared::runs::PacedAsk { tokens: 400, output: 100, ..asked() };
    for (unpaced, starts) in [(vec!["default".to_owned()], true), (vec![], false)] {
        let run = env.store.create("alpha", &spec("hello"), None, Some(ask.clone())).await.unwrap().run;
        let asks = FetchAsks { first: "default".into(), unpaced, ..FetchAsks::default() };
        let fetch = env.store.fetch_script_asking(24, Some(&asks));
        let fetched = env.queue.fetch_with("w1", 10, Some(&fetch)).await.unwrap();
        let lease = &fetched.deliveries.iter().find(|d| d.lease.id == run.id).expect("leased").lease;
        assert_eq!(matches!(env.store.started(lease), Some(Ok(Started::Run(_)))), starts, "{:?}", asks.unpaced);
    }
}

#[tokio::test]
async fn a_commit_queues_a_next_turn_the_pacer_cleared_or_puts_it_to_wait_at_once() {
    // The worker asks the pacer for the next turn as it commits: cleared, the
    // turn is queued due now, marked cleared, and its fetch starts it; owed,
    // the run waits from the commit on — status, reason, due time, counters
    // and turn.paced written in the same step — and the turn comes back with
    // its ask, leased but not started.
    use shared::runs::{BudgetWait, Turn};
    let env = env().await;
    let fetch = env.store.fetch_script(24);
    let ask = asked();
    let job = TurnJob { turn: 0, attempt: 1 };
    let next_job = TurnJob { turn: 1, attempt: 1 };
    for owed in [false, true] {
        let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
        let lease = env.queue.fetch_with("w", 1, Some(&fetch)).await.unwrap().deliveries.remove(0).lease;
        let wait = owed.then(|| BudgetWait {
            ms: 1_000,
            reason: WaitReason::Budget,
            data: json!({"turn": 1, "owed_ms": 1_000, "reason": "budget"}),
        });
        let turn =
            Turn { job: next_job, ask: Some(ask.clone()), cleared: !owed, pause_ms: None, cached_until_ms: None };
        let next = Next::Paced { turn: turn.clone(), wait };
        assert_eq!(env.store.commit(&lease, job, &[], Usage::default(), &next).await.unwrap(), Fence::Ok);
        let now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
        assert_eq!(env.queue.payload::<Turn>(&run.id).await.unwrap(), Some(turn));
        let kinds = event_kinds(&env, &run.id).await;
        if owed {
            assert_eq!((now.status, now.wait_reason), (RunStatus::Waiting, Some(WaitReason::Budget)));
            assert_eq!((now.pacing.budget_waits, now.pacing.waited_ms), (1, 1_000));
            assert!(now.next_attempt_at.is_some());
            assert_eq!(kinds, ["run.queued", "turn.started", "turn.completed", "turn.paced"]);
            let c = env.queue.counts().await.unwrap();
            assert_eq!((c.ready, c.delayed), (0, 1), "due when its wait is paid");
            tokio::time::sleep(Duration::from_millis(1_050)).await;
            let lease = env.queue.fetch_with("w", 1, Some(&fetch)).await.unwrap().deliveries.remove(0).lease;
            assert!(lease.extra().is_none(), "it asks again before it starts");
        } else {
            assert_eq!((now.status, now.pacing.budget_waits), (RunStatus::Queued, 0));
            assert_eq!(kinds, ["run.queued", "turn.started", "turn.completed"]);
            let lease = env.queue.fetch_with("w", 1, Some(&fetch)).await.unwrap().deliveries.remove(0).lease;
            assert!(
                matches!(env.store.started(&lease), Some(Ok(shared::runs::Started::Run(_)))),
                "started by its fetch"
            );
        }
    }
}

/// The stall CI found (`worker::work_and_companion_runs_all_finish…` timed
/// out on ten runs waiting at a five-minute safety deadline): a worker asks
/// for the turn it holds and is parked in line; before its requeue lands, the
/// probe's answer lets the line go. The release found the turn leased, moved
/// nothing, and the requeue put it at its safety deadline, out of the line
/// with its reservation held for nothing. Now the release marks the leased
/// record and the requeue makes the turn due now, released; the fetch after
/// it starts it, cleared.
#[tokio::test]
async fn a_turn_the_line_lets_go_while_its_worker_requeues_it_is_due_at_once() {
    use shared::pacer::{CallOutcome, Decision, Estimate, Mode, Observation, PacingConfig, SharedPacer, Who};
    use shared::runs::{FetchAsks, Started, Turn};
    let env = env().await;
    let pacer = SharedPacer::new(env.store.connection(), env.keys.clone(), "default", PacingConfig::default())
        .with_host(shared::runs::pacer_host(&env.keys));
    let est = Estimate { tokens: 300, requests: 1, output: 200 };
    // A cold start: the probe is out, nothing is known.
    assert_eq!(pacer.acquire("gpt-test", "probe", est, Mode::Work, &Who::DEFAULT).await.unwrap(), Decision::Clear);
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w0", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    let reservation = format!("{}:0:1", run.id);
    let owed = pacer.acquire("gpt-test", &reservation, est, Mode::Work, &Who::DEFAULT).await.unwrap();
    let Decision::Owed { ms, eta_ms, .. } = owed else { panic!("the probe is out: {owed:?}") };
    assert!(ms >= 1_000, "parked until the probe's answer: {owed:?}");
    // The probe answers with room: the line lets the turn go while its worker holds it.
    let room = CallOutcome {
        used_tokens: Some(300),
        tokens: Observation { limit: Some(100_000), remaining: Some(99_000), reset_ms: Some(60_000) },
        requests: Observation { limit: Some(1_000), remaining: Some(999), reset_ms: Some(600) },
        ..CallOutcome::default()
    };
    pacer.settle("gpt-test", "probe", &room).await.unwrap();
    // The worker's requeue, as its ask left it.
    let next = Turn { job, ask: Some(asked()), cleared: false, pause_ms: None, cached_until_ms: None };
    let data = json!({"turn": 0, "owed_ms": eta_ms, "reason": "probe"});
    let fence = env.store.wait_parked(&lease, job, next, ms, eta_ms, WaitReason::Budget, "turn.paced", &data).await;
    assert_eq!(fence.unwrap(), Fence::Ok);
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed), (1, 0), "due now, not when its ask said: {c:?}");
    // The fetch after it tells the pacer its worker has it, and starts it.
    let asks = FetchAsks {
        routes: [("default".to_owned(), pacer.script_route().unwrap())].into(),
        first: "default".into(),
        ..FetchAsks::default()
    };
    let fetched = env.queue.fetch_with("w1", 10, Some(&env.store.fetch_script_asking(24, Some(&asks)))).await.unwrap();
    assert_eq!((fetched.held, fetched.deliveries.len()), (0, 1));
    let turn: Turn = serde_json::from_str(&fetched.deliveries[0].payload).unwrap();
    assert!(turn.cleared, "{}", fetched.deliveries[0].payload);
    assert!(matches!(env.store.started(&fetched.deliveries[0].lease), Some(Ok(Started::Run(_)))));
}

#[tokio::test]
async fn a_waiting_run_shows_why_and_its_turn_comes_back_when_due() {
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    let fence = env
        .store
        .wait(&lease, job, job, 60_000, WaitReason::Budget, "turn.paced", &json!({"owed_ms": 60_000}))
        .await
        .unwrap();
    assert_eq!(fence, Fence::Ok);
    let run_now = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(run_now.status, RunStatus::Waiting);
    assert_eq!(run_now.wait_reason, Some(WaitReason::Budget));
    assert!(run_now.next_attempt_at.is_some());
    assert_eq!((run_now.pacing.budget_waits, run_now.pacing.waited_ms), (1, 60_000));
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed), (0, 1));
}

#[tokio::test]
async fn cancelling_removes_the_queued_turn_and_stops_one_in_flight() {
    let env = env().await;
    let queued = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let cancelled = env.store.cancel("alpha", &queued.id).await.unwrap();
    assert_eq!(cancelled.status, RunStatus::Cancelled);
    assert_eq!(env.queue.counts().await.unwrap().ready, 0, "its queued turn is gone");

    let flying = env.store.create("alpha", &spec("y"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    env.store.cancel("alpha", &flying.id).await.unwrap();
    let fence = env.store.commit(&lease, job, &[], Usage::default(), &Next::Continue).await.unwrap();
    assert_eq!(fence, Fence::Stop(shared::runs::StopReason::Finished(shared::runs::RunStatus::Cancelled)));
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight), (0, 0, 0), "no turn of a cancelled run is left");
    let tail = env.store.events("alpha", &flying.id, None, None, 50).await.unwrap().unwrap();
    assert_eq!(tail.last().map(|e| e.kind.as_str()), Some("run.cancelled"));
    let _: Value = tail.last().unwrap().data.clone();
}

/// A turn the queue buries — a handler's verdict, or a retry that used its
/// last delivery (a worker killed mid-turn, Redis blips) — fails its run in
/// the same script: `dead_lettered` with the reason, `run.failed`, and the
/// retention started, so no run is left running with no turn to run it.
#[tokio::test]
async fn a_dead_turn_fails_its_run_in_the_same_step() {
    let env = env().await;
    let mut conn = env.store.connection();
    let job = TurnJob { turn: 0, attempt: 1 };
    let buried = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    env.queue.dead(&lease, "the payload could not be read").await.unwrap();

    let run = env.store.get("alpha", &buried.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("a failed run says why");
    assert_eq!(error.kind, "dead_lettered");
    assert!(error.message.contains("the payload could not be read"), "{}", error.message);
    assert!(run.finished_at.is_some());
    let events = env.store.events("alpha", &buried.id, None, None, 50).await.unwrap().unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, "run.failed");
    assert_eq!(last.data["error"]["kind"], "dead_lettered");
    for key in [env.keys.run_record(&buried.id), env.keys.run_transcript(&buried.id), env.keys.run_events(&buried.id)] {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
        assert!(ttl > 0 && ttl <= 60_000, "{key}: the retention runs ({ttl} ms)");
    }
    assert_eq!(env.queue.list_dead(10).await.unwrap().len(), 1);

    // Deliveries used up: the retry that used the last one buries the turn.
    let spent = env.store.create("alpha", &spec("y"), None, None).await.unwrap().run;
    let max = QueueConfig::default().max_deliveries;
    for delivery in 1..=max {
        let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
        let settled = env.queue.retry(&lease, 0, "the handler failed").await.unwrap();
        assert_eq!(settled == Settled::Dead, delivery == max, "delivery {delivery} of {max}");
    }
    let run = env.store.get("alpha", &spent.id).await.unwrap().unwrap();
    assert_eq!((run.status, run.error.map(|e| e.kind)), (RunStatus::Failed, Some("dead_lettered".to_string())));

    // A finished run's turn buried later (a stale record) leaves the run as it was.
    let done = env.store.create("alpha", &spec("z"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    env.store.cancel("alpha", &done.id).await.unwrap();
    let _ = env.queue.dead(&lease, "late").await;
    let run = env.store.get("alpha", &done.id).await.unwrap().unwrap();
    assert_eq!((run.status, run.error), (RunStatus::Cancelled, None));
}

/// `runs/state.rs` is the table of the run's moves; `store.lua` makes them in
/// Redis. Every move the store makes here — start, wait, continue, complete,
/// fail, cancel — is one the table allows, to the status the table says; and
/// the one the table refuses (cancelling a finished run), the store refuses.
#[tokio::test]
async fn every_move_the_store_makes_is_one_the_state_table_allows() {
    let env = env().await;
    let status = |id: String| {
        let store = env.store.clone();
        async move { store.get("alpha", &id).await.unwrap().unwrap().status }
    };
    fn moved(from: RunStatus, t: Transition, to: RunStatus) {
        assert_eq!(from.apply(t), Ok(to), "the store moved a {from:?} run to {to:?} on {t:?}");
    }
    let items = [json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]})];
    let usage = Usage::default();

    // queued -> running -> waiting -> running -> (continue) -> running -> completed
    let id = env.store.create("alpha", &spec("a"), None, None).await.unwrap().run.id;
    let mut at = status(id.clone()).await;
    assert_eq!(at, RunStatus::Queued);
    let job = TurnJob { turn: 0, attempt: 1 };
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Start, now);
    at = now;
    let waited = env.store.wait(&lease, job, job, 0, WaitReason::Budget, "turn.paced", &json!({})).await.unwrap();
    assert_eq!(waited, Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Wait(WaitReason::Budget), now);
    at = now;
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Start, now);
    at = now;
    assert_eq!(env.store.commit(&lease, job, &items, usage, &Next::Continue).await.unwrap(), Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Continue, now);
    at = now;
    let job = TurnJob { turn: 1, attempt: 1 };
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Start, now);
    at = now;
    let done = Next::Complete("done".into());
    assert_eq!(env.store.commit(&lease, job, &items, usage, &done).await.unwrap(), Fence::Ok);
    let now = status(id.clone()).await;
    moved(at, Transition::Complete, now);
    assert!(now.apply(Transition::Cancel).is_err());
    assert!(matches!(env.store.cancel("alpha", &id).await, Err(StoreError::Conflict(_))));

    // queued -> running -> failed
    let id = env.store.create("alpha", &spec("b"), None, None).await.unwrap().run.id;
    let job = TurnJob { turn: 0, attempt: 1 };
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let at = status(id.clone()).await;
    assert_eq!(
        env.store.fail(&lease, job, shared::runs::ErrorKind::ProviderError, "gone", usage).await.unwrap(),
        Fence::Ok
    );
    moved(at, Transition::Fail, status(id.clone()).await);

    // failed -> (retry) queued, its turn enqueued again; a queued run is not retried.
    let at = status(id.clone()).await;
    env.store.retry(Some("alpha"), &id).await.unwrap();
    moved(at, Transition::Retry, status(id.clone()).await);
    assert!(matches!(env.store.retry(None, &id).await, Err(StoreError::Conflict(_))));
    assert!(matches!(env.store.retry(Some("beta"), &id).await, Err(StoreError::NotFound)));
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok, "the retried turn starts where it failed");

    // queued -> cancelled
    let id = env.store.create("alpha", &spec("c"), None, None).await.unwrap().run.id;
    let at = status(id.clone()).await;
    env.store.cancel("alpha", &id).await.unwrap();
    moved(at, Transition::Cancel, status(id.clone()).await);
}

/// A retry re-drives a failed run from its last committed turn: a run that
/// failed after its model output was committed but before its tool calls ran
/// resumes at those tool calls (the model is not asked again); the retry
/// cancels the retention, and a stale holder of an earlier lease stays fenced.
#[tokio::test]
async fn a_retried_run_resumes_at_its_last_committed_turn() {
    let env = env().await;
    let mut conn = env.store.connection();
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let job = TurnJob { turn: 0, attempt: 1 };
    let stale = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&stale, job).await.unwrap(), Fence::Ok);
    let call = json!({"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"});
    assert_eq!(env.store.record_output(&stale, job, &[call], Usage::default()).await.unwrap(), Fence::Ok);
    env.queue.dead(&stale, "the tool runner crashed").await.unwrap();
    let failed = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(failed.error.map(|e| e.kind), Some("dead_lettered".to_string()));

    let retried = env.store.retry(None, &run.id).await.unwrap();
    assert_eq!((retried.status, retried.error, retried.finished_at), (RunStatus::Queued, None, None));
    assert!(env.queue.list_dead(10).await.unwrap().is_empty());
    for key in [env.keys.run_record(&run.id), env.keys.run_transcript(&run.id), env.keys.run_events(&run.id)] {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
        assert_eq!(ttl, -1, "{key}: the retention is cancelled");
    }

    // The stale holder changes nothing; the new delivery starts turn 0 at its tools.
    assert!(matches!(
        env.store.commit(&stale, job, &[], Usage::default(), &Next::Continue).await.unwrap(),
        Fence::Stop(_)
    ));
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    assert!(lease.epoch > stale.epoch);
    assert_eq!(lease.deliveries, 1, "fresh deliveries");
    let payload: TurnJob = env.queue.payload(&run.id).await.unwrap().unwrap();
    assert_eq!(payload, job);
    match env.store.start_turn(&lease, job).await.unwrap() {
        shared::runs::Started::Run(ctx) => {
            assert_eq!(ctx.phase, shared::runs::Phase::Tools, "the model's output stays committed")
        }
        shared::runs::Started::Stop(why) => panic!("stopped: {why}"),
    }
    let events = env.store.events("alpha", &run.id, None, None, 50).await.unwrap().unwrap();
    let queued = events.iter().rev().find(|e| e.kind == "run.queued").unwrap();
    assert_eq!(queued.data["retried"], true);
    assert_eq!(queued.data["previous_error"]["kind"], "dead_lettered");
}

#[tokio::test]
async fn a_turn_reads_only_the_history_its_model_sees() {
    use worker::context::prepare_context;
    let env = env().await;
    let long = RunSpec::from_json(
        &json!({"model": "gpt-test", "input": "the task", "max_turns": 100}),
        &SubmitPolicy::default(),
    )
    .unwrap();
    let run = env.store.create("alpha", &long, None, None).await.unwrap().run;
    // 40 turns, each a tool call (recorded first, as the worker does) and its output.
    for turn in 0..40u32 {
        let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
        let job = TurnJob { turn, attempt: 1 };
        assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
        let id = format!("c{turn}");
        let call = json!({"type": "function_call", "call_id": id, "name": "search", "arguments": "{}"});
        let out = json!({"type": "function_call_output", "call_id": id, "output": format!("result {turn}")});
        assert_eq!(env.store.record_output(&lease, job, &[call], Usage::default()).await.unwrap(), Fence::Ok);
        assert_eq!(env.store.commit(&lease, job, &[out], Usage::default(), &Next::Continue).await.unwrap(), Fence::Ok);
    }
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 40, attempt: 1 };
    let ctx = match env.store.start_turn_with_history(&lease, job, 24).await.unwrap() {
        shared::runs::Started::Run(ctx) => ctx,
        shared::runs::Started::Stop(why) => panic!("stopped: {why}"),
    };
    let whole = env.store.transcript("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(whole.len(), 1 + 2 * 40);
    // The task, and turns 16..=40 (the window of 24 and the turn before it).
    assert_eq!(ctx.transcript.len(), 1 + 2 * 25, "read only what the window needs");
    assert_eq!(ctx.transcript[0].turn, 0);
    assert_eq!(ctx.transcript[1].turn, 16);
    // The model is sent exactly what the whole transcript would have given it.
    for depth in [1, 2, 24, 25] {
        let ctx = match env.store.start_turn_with_history(&lease, job, depth).await.unwrap() {
            shared::runs::Started::Run(ctx) => ctx,
            shared::runs::Started::Stop(why) => panic!("stopped: {why}"),
        };
        assert_eq!(prepare_context(&ctx.transcript, depth), prepare_context(&whole, depth), "depth {depth}");
    }
    // A depth beyond the run reads it all.
    match env.store.start_turn_with_history(&lease, job, 100).await.unwrap() {
        shared::runs::Started::Run(ctx) => assert_eq!(ctx.transcript.len(), whole.len()),
        shared::runs::Started::Stop(why) => panic!("stopped: {why}"),
    }
}

#[tokio::test]
async fn a_run_past_its_deadline_fails_at_its_next_turn_before_any_call() {
    let env = env().await;
    let spec = one_second_run();
    let run = env.store.create("alpha", &spec, None, None).await.unwrap().run;
    let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    // Within its second the turn starts; a redelivery of it after the deadline does not.
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Stop(shared::runs::StopReason::Deadline));
    let failed = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(failed.status, RunStatus::Failed);
    let error = failed.error.expect("an error");
    assert_eq!(error.kind, "deadline");
    assert!(error.message.contains("max_run_seconds"), "{}", error.message);
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight, c.dead), (0, 0, 0, 0), "its turn is gone from the queue");
    let events = env.store.events("alpha", &run.id, None, None, 50).await.unwrap().unwrap();
    assert_eq!(events.last().map(|e| e.kind.as_str()), Some("run.failed"));
}

/// Redis commands run since `before` (`INFO commandstats`; a script's inner
/// commands count under their own names, as the bench counts them), without
/// the `INFO` calls themselves.
async fn commands(conn: &mut shared::redis_util::RedisConn) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await.unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
        .sum()
}

/// What each step of a turn costs in Redis commands, scripts' inner commands
/// included (the lean turn): a turn that calls its model and one tool (its
/// output announcing the call, its commit the result), the next turn that
/// answers, one budget wait, and the wait again of a turn still owed when it
/// comes back (it asks before it starts, so no start). Each step is held to a ceiling
/// a little above what it costs now, so a change that makes a step dearer is
/// seen here; `--nocapture` prints the table (README's figures).
#[tokio::test]
async fn each_step_of_a_turn_costs_few_redis_commands() {
    use shared::pacer::{CallOutcome, Decision, Estimate, Mode, Observation, PacingConfig, SharedPacer, Who};
    use shared::runs::ModelOutput;
    let server = RedisServer::start();
    let prefix = unique_prefix();
    let conn = shared::redis_util::manager(&server.url()).await.unwrap();
    let store = RunStore::new(conn.clone(), Keys::new(&prefix), Duration::from_secs(60));
    let queue = shared::runs::run_queue(&RedisArgs::new(server.url(), &prefix), QueueConfig::default()).unwrap();
    let pacer = SharedPacer::new(conn.clone(), Keys::new(&prefix), "default", PacingConfig::default());
    let mut stats = conn.clone();
    let est = Estimate { tokens: 300, requests: 1, output: 200 };
    let headers = CallOutcome {
        used_tokens: Some(120),
        input_tokens: Some(100),
        tokens: Observation { limit: Some(1_000_000), remaining: Some(990_000), reset_ms: Some(600) },
        requests: Observation { limit: Some(10_000), remaining: Some(9_990), reset_ms: Some(6) },
        ..CallOutcome::default()
    };
    let usage = Usage { input_tokens: 100, output_tokens: 20, total_tokens: 120, ..Usage::default() };
    let call = json!({"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"});
    let answer = json!({"type": "function_call_output", "call_id": "c1", "output": "found"});
    let mut costs: Vec<(&str, u64)> = vec![];
    macro_rules! step {
        ($name:expr, $e:expr) => {{
            let before = commands(&mut stats).await;
            let out = $e;
            costs.push(($name, commands(&mut stats).await - before));
            out
        }};
    }
    let run = store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let fetch = store.fetch_script(0);
    // Two warm-up turns (the pacer learns its bucket; the run has history),
    // then one whose tool is slow (its output committed first, in a step of
    // its own) and one whose tool answers at once (the output committed with
    // the result): their steps are counted.
    for turn in 0..4u32 {
        if turn < 3 {
            costs.clear();
        }
        let slow = turn < 3;
        let job = TurnJob { turn, attempt: 1 };
        // The worker's fetch starts the turn it leases (one script).
        let lease =
            step!("fetch+start", queue.fetch_with("w", 4, Some(&fetch)).await.unwrap().deliveries.remove(0).lease);
        assert!(matches!(store.started(&lease), Some(Ok(shared::runs::Started::Run(_)))));
        let id = format!("{}:{turn}:1", run.id);
        let d = step!("pacer acquire", pacer.acquire("gpt-test", &id, est, Mode::Work, &Who::DEFAULT).await.unwrap());
        assert!(matches!(d, Decision::Clear), "{d:?}");
        step!("pacer settle", pacer.settle("gpt-test", &id, &headers).await.unwrap());
        // The output announces its tool call, the commit its result.
        let announced = [("turn.tool_call", json!({"turn": turn}))];
        let output = ModelOutput { items: std::slice::from_ref(&call), usage, events: &announced };
        if slow {
            let fence = step!(
                "record output",
                store.record_output_with_events(&lease, job, output.items, usage, &announced).await.unwrap()
            );
            assert_eq!(fence, Fence::Ok);
        }
        let fence = step!(
            if slow { "commit" } else { "commit+output" },
            store
                .commit_with_output(
                    &lease,
                    job,
                    (!slow).then_some(&output),
                    std::slice::from_ref(&answer),
                    Usage::default(),
                    &Next::Continue,
                    &[("turn.tool_result", json!({"turn": turn}))],
                    None,
                )
                .await
        );
        assert_eq!(fence.unwrap().fence, Fence::Ok);
    }
    let turn = 4u32;
    let job = TurnJob { turn, attempt: 1 };
    let lease = step!("fetch+start", queue.fetch_with("w", 4, Some(&fetch)).await.unwrap().deliveries.remove(0).lease);
    let data = json!({"turn": turn, "owed_ms": 5, "reason": "budget"});
    let ask = shared::runs::PacedAsk {
        model: "gpt-test".into(),
        provider: None,
        mode: Mode::Work,
        tenant: "alpha".into(),
        tokens: est.tokens,
        requests: est.requests,
        output: est.output,
    };
    let next =
        shared::runs::Turn { job, ask: Some(ask.clone()), cleared: false, pause_ms: None, cached_until_ms: None };
    let fence = step!(
        "budget wait",
        store.wait_asking(&lease, job, next, 5, WaitReason::Budget, "turn.paced", &data).await.unwrap()
    );
    assert_eq!(fence, Fence::Ok);
    // Back from its wait, the turn asks the pacer before it starts (the ask
    // rides in its payload, and its fetch leases it without starting it);
    // still owed, it waits again.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let lease = step!("fetch again", queue.fetch_with("w", 4, Some(&fetch)).await.unwrap().deliveries.remove(0).lease);
    assert!(lease.extra().is_none(), "a turn that asks first is not started by its fetch");
    // It waits again, now for a model whose bucket is empty (set up outside the
    // count) …
    let empty = CallOutcome {
        used_tokens: Some(300),
        tokens: Observation { limit: Some(1_000), remaining: Some(0), reset_ms: Some(60_000) },
        requests: Observation { limit: Some(100), remaining: Some(99), reset_ms: Some(600) },
        ..CallOutcome::default()
    };
    assert!(matches!(
        pacer.acquire("gpt-slow", "probe", est, Mode::Work, &Who::DEFAULT).await.unwrap(),
        Decision::Clear
    ));
    pacer.settle("gpt-slow", "probe", &empty).await.unwrap();
    let ask = shared::runs::PacedAsk { model: "gpt-slow".into(), ..ask };
    let next = shared::runs::Turn { job, ask: Some(ask), cleared: false, pause_ms: None, cached_until_ms: None };
    let fence = step!(
        "wait again",
        store.wait_asking(&lease, job, next, 5, WaitReason::Budget, "turn.paced", &data).await.unwrap()
    );
    assert_eq!(fence, Fence::Ok);
    // … and the fetch of a worker whose pacer is shared asks for it itself:
    // still owed, it waits again inside the fetch (no delivery, no ask and no
    // requeue of a worker's).
    tokio::time::sleep(Duration::from_millis(10)).await;
    let asks = shared::runs::FetchAsks {
        routes: [("default".to_owned(), pacer.script_route().unwrap())].into(),
        first: "default".into(),
        ..shared::runs::FetchAsks::default()
    };
    let asking = store.fetch_script_asking(0, Some(&asks));
    let fetched = step!("fetch, owed", queue.fetch_with("w", 4, Some(&asking)).await.unwrap());
    assert_eq!((fetched.held, fetched.deliveries.len()), (1, 0));
    let total: u64 = costs.iter().map(|(_, n)| n).sum();
    for (name, n) in &costs {
        eprintln!("{name:>14}: {n}");
    }
    eprintln!("{:>14}: {total}", "all");
    // Ceilings: a step may not grow unnoticed.
    let ceiling = |name: &str| match name {
        "fetch again" => 8,
        "fetch+start" => 12,
        // (A pacer step that opens a new second also folds the last one's
        // counts, up to 3 commands: its ceilings leave room for that.)
        "pacer acquire" => 4 + 3,
        "pacer settle" => 4 + 3,
        "record output" => 5,
        "commit" | "commit+output" => 9,
        // (A wait that becomes the queue's earliest due time also claims its
        // watch, one SET: the worker its token wakes then fetches nothing.)
        "budget wait" | "wait again" => 11,
        "fetch, owed" => 14 + 3,
        _ => 0,
    };
    for (name, n) in &costs {
        assert!(*n <= ceiling(name), "{name} costs {n} Redis commands (ceiling {})", ceiling(name));
    }
}

/// A run is retried at most `MAX_RETRIES` times: a run whose turn keeps
/// killing its worker cannot be re-driven without end into workers other
/// tenants' turns share. The operator's retry counts too.
#[tokio::test]
async fn a_run_is_retried_at_most_max_retries_times() {
    let env = env().await;
    let id = env.store.create("alpha", &spec("r"), None, None).await.unwrap().run.id;
    let job = TurnJob { turn: 0, attempt: 1 };
    let usage = Default::default();
    for round in 0..=shared::runs::store::MAX_RETRIES {
        let lease = env.queue.fetch("w", 1).await.unwrap().deliveries.remove(0).lease;
        assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
        let failed = env.store.fail(&lease, job, shared::runs::ErrorKind::ProviderError, "boom", usage).await;
        assert_eq!(failed.unwrap(), Fence::Ok);
        let retried = env.store.retry(if round % 2 == 0 { Some("alpha") } else { None }, &id).await;
        if round < shared::runs::store::MAX_RETRIES {
            assert!(retried.is_ok(), "retry {round}: {retried:?}");
        } else {
            let Err(StoreError::Conflict(why)) = retried else { panic!("retry {round}: {retried:?}") };
            assert!(why.contains("retried 10 times"), "{why}");
        }
    }
}

/// A due turn whose queue record is gone (a Redis that evicts keys does that)
/// is buried with the reason and its run failed — never dropped unseen, with
/// its run `queued` for ever.
#[tokio::test]
async fn a_due_turn_whose_record_is_missing_is_buried_and_its_run_failed() {
    let env = env().await;
    let mut conn = env.store.connection();
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let jobs = shared::queue::QueueKeys::new(&env.keys).jobs;
    let _: () = redis::cmd("HDEL").arg(&jobs).arg(&run.id).query_async(&mut conn).await.unwrap();
    assert!(env.queue.fetch("w1", 1).await.unwrap().deliveries.is_empty());
    let run = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Failed);
    let error = run.error.expect("a failed run says why");
    assert_eq!(error.kind, "dead_lettered");
    assert!(
        error.message.contains("queue record is missing") && error.message.contains("noeviction"),
        "{}",
        error.message
    );
    assert_eq!(env.queue.counts().await.unwrap().dead, 1, "in the dead set, where the operator sees it");
}

/// An answer with thousands of function calls commits (Lua's `unpack` holds
/// ~8 000 values: the step's events once went to one `XADD` call, and a turn
/// of ~2 000 calls could never commit, paying its call again each delivery),
/// and its events read back whole.
#[tokio::test]
async fn a_turn_with_thousands_of_tool_calls_commits_with_all_its_events() {
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let job = TurnJob { turn: 0, attempt: 1 };
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let calls = 5_000;
    let mut items = vec![];
    let mut events = vec![];
    for i in 0..calls {
        let call_id = format!("call_{i}");
        items.push(serde_json::json!({"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}));
        items.push(serde_json::json!({"type": "function_call_output", "call_id": call_id, "output": "ok"}));
        events.push(("tool.result", serde_json::json!({"call_id": call_id})));
    }
    let done = Next::Complete("done".into());
    let fence = env.store.commit_with_events(&lease, job, &items, Default::default(), &done, &events).await.unwrap();
    assert_eq!(fence, Fence::Ok);
    let read = env.store.events("alpha", &run.id, None, None, 3 * calls).await.unwrap().unwrap();
    let results = read.iter().filter(|e| e.kind == "tool.result").count();
    assert_eq!(results, calls);
    assert_eq!(read.last().map(|e| e.kind.as_str()), Some("run.completed"));
    let run = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Completed);
}

/// `max_run_seconds` holds while a turn waits: a turn put to wait for longer
/// than its run has left (a parked turn's safety deadline may be hours out)
/// is due at the run's deadline, and its start there fails the run.
#[tokio::test]
async fn a_turn_waiting_past_its_runs_deadline_is_due_at_the_deadline_and_fails_the_run() {
    use shared::runs::{Started, StopReason, Turn};
    let env = env().await;
    let spec = one_second_run();
    let run = env.store.create("alpha", &spec, None, None).await.unwrap().run;
    let lease = env.queue.fetch("w0", 1).await.unwrap().deliveries.remove(0).lease;
    let job = TurnJob { turn: 0, attempt: 1 };
    let data = json!({"turn": 0, "owed_ms": 3_600_000, "reason": "budget"});
    let next = Turn { job, ask: Some(asked()), cleared: false, pause_ms: None, cached_until_ms: None };
    let hour = 3_600_000;
    let fence = env.store.wait_asking(&lease, job, next, hour, WaitReason::Budget, "turn.paced", &data).await.unwrap();
    assert_eq!(fence, Fence::Ok);
    let mut conn = env.store.connection();
    let due: f64 = redis::cmd("ZSCORE")
        .arg(shared::queue::QueueKeys::new(&env.keys).due)
        .arg(&run.id)
        .query_async(&mut conn)
        .await
        .unwrap();
    let created: f64 = redis::cmd("HGET")
        .arg(env.keys.run_record(&run.id))
        .arg("created_ms")
        .query_async::<String>(&mut conn)
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert!(due <= created + 1_000.0, "due {} ms after its creation, past its 1-s deadline", due - created);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let fetched = env.queue.fetch_with("w1", 1, Some(&env.store.fetch_script(24))).await.unwrap();
    let lease = fetched.deliveries[0].lease.clone();
    assert!(env.store.started(&lease).is_none(), "a turn that carries its ask is leased, not started");
    match env.store.start_turn_with_history(&lease, job, 24).await.unwrap() {
        Started::Stop(why) => assert_eq!(why, StopReason::Deadline),
        Started::Run(_) => panic!("a run past its deadline started its turn"),
    }
    let failed = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!((failed.status, failed.error.unwrap().kind.as_str()), (RunStatus::Failed, "deadline"));
}

/// A search reads at most `LIST_SCAN_BYTES` of run records a page: past it
/// the page ends early with a cursor, and following the cursors finds what
/// the bound left for later.
#[tokio::test]
async fn a_search_reads_a_bounded_number_of_bytes_a_page_and_its_cursor_goes_on() {
    let env = env().await;
    let big = "x".repeat(15_000);
    let mut spec = spec("x");
    spec.metadata = json!({"blob": big});
    // The needle ~350 runs from the newest: past the bytes of one page (~280
    // runs' records), within the 20 batches of records a page scanned before.
    let runs = 560;
    let mut oldest = None;
    for i in 0..runs {
        if i == runs - 350 {
            let mut needle = spec.clone();
            needle.metadata = json!({"blob": big, "tag": "needle"});
            oldest = Some(env.store.create("alpha", &needle, None, None).await.unwrap().run.id);
        } else {
            env.store.create("alpha", &spec, None, None).await.unwrap();
        }
    }
    let (page, cursor) = env.store.list_matching("alpha", None, Some("needle"), 10, None).await.unwrap();
    assert!(page.is_empty(), "the needle is past the first page's bytes");
    let mut cursor = cursor.expect("a page cut short by the byte bound hands a cursor on");
    let mut pages = 1;
    let found = loop {
        let (page, next) = env.store.list_matching("alpha", None, Some("needle"), 10, Some(&cursor)).await.unwrap();
        pages += 1;
        if let Some(run) = page.first() {
            break run.id.clone();
        }
        cursor = next.expect("not found yet, so not the end");
    };
    assert_eq!(Some(found), oldest);
    assert!(pages >= 2, "{pages}");
}

/// An idempotency key whose run is gone (its retention ran out before the
/// key's day did) names nothing to replay: the submit creates a run (once,
/// however many race) instead of answering 404 for ever.
#[tokio::test]
async fn an_idempotency_key_whose_run_expired_makes_a_new_run_not_a_404() {
    let env = env().await;
    let key = Idempotency { key: "k1".into(), fingerprint: "body-a".into() };
    let first = env.store.create("alpha", &spec("x"), Some(&key), None).await.unwrap().run;
    let mut conn = env.store.connection();
    // Its retention ran out: the run's keys are gone, the key's are not.
    let _: () = redis::cmd("DEL").arg(env.keys.run_record(&first.id)).query_async(&mut conn).await.unwrap();
    let body = spec("x");
    let (a, b) = tokio::join!(
        env.store.create("alpha", &body, Some(&key), None),
        env.store.create("alpha", &body, Some(&key), None),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a.run.id, first.id);
    assert_eq!(a.run.id, b.run.id, "the key names the new run from then on");
    assert!(a.replayed != b.replayed);
}

/// A run stores at most 32 MiB (its spec and transcript): a commit that takes
/// it past fails the run with `run_too_large`, its turn kept, rather than let
/// it grow on turn after turn.
#[tokio::test]
async fn a_run_past_its_stored_size_bound_fails_with_run_too_large_and_keeps_its_turn() {
    let env = env().await;
    let run = env.store.create("alpha", &spec("x"), None, None).await.unwrap().run;
    let job = TurnJob { turn: 0, attempt: 1 };
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let big = json!({"type": "function_call_output", "call_id": "c", "output": "x".repeat(33 << 20)});
    let fence = env.store.commit(&lease, job, &[big], Usage::default(), &Next::Continue).await.unwrap();
    assert_eq!(fence, Fence::Ok);
    let failed = env.store.get("alpha", &run.id).await.unwrap().unwrap();
    assert_eq!(failed.status, RunStatus::Failed);
    let error = failed.error.unwrap();
    assert_eq!(error.kind, "run_too_large");
    assert!(error.message.contains("32 MiB"), "{}", error.message);
    assert_eq!(failed.turns_completed, 1, "its turn is kept");
    let c = env.queue.counts().await.unwrap();
    assert_eq!((c.ready, c.delayed, c.in_flight), (0, 0, 0), "no next turn");
    // A run under the bound goes on as before.
    let small = env.store.create("alpha", &spec("y"), None, None).await.unwrap().run;
    let lease = env.queue.fetch("w1", 1).await.unwrap().deliveries.remove(0).lease;
    assert_eq!(env.store.start(&lease, job).await.unwrap(), Fence::Ok);
    let item = json!({"type": "function_call_output", "call_id": "c", "output": "ok"});
    assert_eq!(env.store.commit(&lease, job, &[item], Usage::default(), &Next::Continue).await.unwrap(), Fence::Ok);
    assert_eq!(env.store.get("alpha", &small.id).await.unwrap().unwrap().status, RunStatus::Queued);
}
