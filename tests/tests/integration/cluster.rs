//! Redis Cluster, the test bed of issue 42 (`docs/redis-cluster-plan.md`):
//! a local cluster of six `redis-server`s forms and survives a primary's
//! death, and the facts of script routing the plan is built on hold on this
//! machine's Redis — so an upgrade that changes them is seen here first.

use std::time::Duration;

use paceline_tests::{eventually, RedisCluster};
use shared::keys::Keys;

/// The keys of prefix `paceline`: its queue and runs under `{paceline}`, a
/// budget's pacer state under `{<budget>}`.
fn keys() -> Keys {
    Keys::new("paceline")
}

/// The pacer state key of a budget whose slot a primary other than `not`'s serves.
async fn budget_elsewhere(cluster: &RedisCluster, not: usize) -> String {
    for i in 0..1_000 {
        let key = keys().pacer_state(&format!("budget-{i}"), "m");
        if cluster.owner_of(&key, 0).await.is_some_and(|o| o != not) {
            return key;
        }
    }
    panic!("no budget on another primary in 1 000 tries");
}

/// The pacer state key of a budget of another slot than `not_slot` that `on`'s node serves too.
async fn budget_on(cluster: &RedisCluster, on: usize, not_slot: u16) -> String {
    for i in 0..10_000 {
        let key = keys().pacer_state(&format!("same-node-{i}"), "m");
        if cluster.owner_of(&key, 0).await == Some(on) && cluster.slot_of(&key).await != not_slot {
            return key;
        }
    }
    panic!("no other slot of the same node in 10 000 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_cluster_forms_and_a_replica_takes_over_a_killed_primary() {
    let Some(mut cluster) = RedisCluster::start(3).await else { return };
    let view = cluster.view(0).await;
    assert_eq!(view.iter().filter(|n| n.primary).count(), 3, "{view:?}");
    let covered: u32 = view.iter().flat_map(|n| n.slots.iter()).map(|(a, b)| u32::from(b - a) + 1).sum();
    assert_eq!(covered, 16_384, "every slot served");

    // The primary of the queue's slot dies; its replica is promoted, and the slot is served again.
    let queue = keys().run_record("run_probe");
    let owner = cluster.owner_of(&queue, 0).await.expect("an owner");
    let witness = (0..cluster.nodes.len()).find(|i| *i != owner).unwrap();
    cluster.nodes[owner].kill();
    let dead_port = cluster.ports[owner];
    let c = &cluster;
    let promoted = paceline_tests::poll_until(Duration::from_secs(30), || async move {
        c.owner_of(&keys().run_record("run_probe"), witness).await.filter(|o| c.ports[*o] != dead_port)
    })
    .await;
    let Some(promoted) = promoted else {
        let mut conn = cluster.nodes[witness].conn().await;
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await.unwrap();
        let logs: Vec<String> =
            cluster.nodes.iter().zip(&cluster.ports).map(|(n, p)| format!("{p}:\n{}", n.log_tail(12))).collect();
        panic!("no replica took over the slot of {dead_port} within 30 s:\n{nodes}\n{}", logs.join("\n"));
    };
    assert_ne!(promoted, owner);
    eventually("the cluster ok again", Duration::from_secs(30), || async move {
        c.info(witness).await.contains("cluster_state:ok").then_some(())
    })
    .await;
    let mut conn = cluster.nodes[promoted].conn().await;
    let _: () = redis::cmd("SET").arg(&queue).arg("1").query_async(&mut conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_on_a_cluster_keep_to_one_slot_as_the_plan_assumes() {
    let Some(cluster) = RedisCluster::start(3).await else { return };
    let q = keys().run_record("run_probe");
    let node = cluster.owner_of(&q, 0).await.expect("an owner");
    let queue_slot = cluster.slot_of(&q).await;
    let budget = budget_elsewhere(&cluster, node).await;
    let neighbour = budget_on(&cluster, node, queue_slot).await;
    let mut conn = cluster.nodes[node].conn().await;
    let eval = |script: &str, keys: &[String]| {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(script).arg(keys.len());
        for k in keys {
            cmd.arg(k);
        }
        cmd
    };

    // Declared keys of two slots: refused before the script runs (the run
    // store's fetch and commit with a budget's pacer keys, today).
    let two = eval("return 1", &[q.clone(), budget.clone()]);
    let e = two.query_async::<i64>(&mut conn).await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("crossslot"), "{e}");

    // One slot declared, another of the same node touched without declaring it:
    // a script without flags may (today's same-node derivations would pass
    // on a fresh cluster: the plan's trap) ...
    let touch = "return redis.call('SET', ARGV[1], '1')";
    let mut legacy = eval(touch, std::slice::from_ref(&q));
    legacy.arg(&neighbour);
    let ok: redis::Value = legacy.query_async(&mut conn).await.unwrap();
    assert_eq!(ok, redis::Value::Okay);
    // ... a key of another node fails inside the script ...
    let mut far = eval(touch, std::slice::from_ref(&q));
    far.arg(&budget);
    let e = far.query_async::<redis::Value>(&mut conn).await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("non local key") || e.to_string().contains("slot"), "{e}");
    // ... and a script with the `#!lua` flags line is held to its declared slot: the strict
    // mode cluster scripts are to carry.
    let mut strict = eval(&format!("#!lua\n{touch}"), std::slice::from_ref(&q));
    strict.arg(&neighbour);
    let e = strict.query_async::<redis::Value>(&mut conn).await.unwrap_err();
    assert!(e.to_string().contains("same slot") || e.to_string().contains("slot"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connection_finds_each_keys_primary_and_the_replica_promoted_in_its_place() {
    let Some(mut cluster) = RedisCluster::start(3).await else { return };
    // One node named: the client learns the rest.
    let mut conn = shared::redis_util::cluster(&[format!("redis://127.0.0.1:{}", cluster.ports[0])]).await.unwrap();
    // Sixty budgets' state keys: sixty hash tags.
    let key = |i: i64| keys().pacer_state(&format!("b{i}"), "m");
    for i in 0..60 {
        let _: () = redis::cmd("SET").arg(key(i)).arg(i).query_async(&mut conn).await.unwrap();
    }
    for i in 0..60 {
        let v: i64 = redis::cmd("GET").arg(key(i)).query_async(&mut conn).await.unwrap();
        assert_eq!(v, i);
    }
    // Spread over the primaries by their slots.
    let mut held = Vec::new();
    for (i, node) in cluster.nodes.iter().enumerate() {
        if cluster.view(0).await.iter().any(|n| n.primary && n.port == cluster.ports[i] && !n.slots.is_empty()) {
            let mut c = node.conn().await;
            held.push(redis::cmd("DBSIZE").query_async::<i64>(&mut c).await.unwrap());
        }
    }
    assert_eq!(held.len(), 3);
    assert!(held.iter().all(|n| *n > 0) && held.iter().sum::<i64>() == 60, "{held:?}");

    // Its primary killed, a key is written again through the same connection once a replica took over.
    let first = key(0);
    let owner = cluster.owner_of(&first, 0).await.unwrap();
    let witness = (0..cluster.nodes.len()).find(|i| *i != owner).unwrap();
    cluster.nodes[owner].kill();
    let (conn, first) = (&conn, &first);
    eventually("the key writable again through the cluster connection", Duration::from_secs(40), || async move {
        let mut conn = conn.clone();
        redis::cmd("SET").arg(first).arg("again").query_async::<()>(&mut conn).await.ok()
    })
    .await;
    let mut conn = conn.clone();
    let v: String = redis::cmd("GET").arg(first).query_async(&mut conn).await.unwrap();
    assert_eq!(v, "again");
    assert!(cluster.owner_of(first, witness).await.is_some_and(|o| o != owner));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_worker_and_up_refuse_a_cluster_node_as_their_one_redis_and_say_why() {
    let Some(cluster) = RedisCluster::start(3).await else { return };
    for args in [&["api", "--listen", "127.0.0.1:0"][..], &["worker"], &["up", "--listen", "127.0.0.1:0"]] {
        let mut child = paceline_tests::ChildGuard(
            std::process::Command::new(paceline_tests::paceline_bin())
                .args(args)
                .env("REDIS_URL", cluster.nodes[0].url())
                .env("PACELINE_PREFIX", paceline_tests::unique_prefix())
                .env_remove("PACELINE_API_TOKENS")
                .env("RUST_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run paceline"),
        );
        let status = child.wait_timeout(Duration::from_secs(20));
        let mut stderr = String::new();
        if status.is_none() {
            let _ = child.0.kill();
        }
        std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        let out = status.unwrap_or_else(|| panic!("{args:?} kept running on a cluster node: {stderr}"));
        assert!(!out.success(), "{args:?} ran on a cluster node: {stderr}");
        assert!(stderr.contains("node of a Redis Cluster"), "{args:?} does not say why: {stderr}");
    }
}
