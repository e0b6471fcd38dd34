//! The harness itself: a private server starts, answers, restarts with its data
//! (AOF), and is gone when dropped.

use paceline_tests::{RedisOptions, RedisServer};

#[tokio::test]
async fn a_private_redis_starts_and_survives_a_restart_with_aof() {
    let mut server = RedisServer::start_with(RedisOptions { aof: true, ..RedisOptions::default() });
    let mut conn = server.conn().await;
    let _: () = redis::cmd("SET").arg("k").arg("v").query_async(&mut conn).await.unwrap();
    server.restart();
    let mut conn = server.conn().await;
    let v: String = redis::cmd("GET").arg("k").query_async(&mut conn).await.unwrap();
    assert_eq!(v, "v");
    let socket = server.socket();
    drop(server);
    assert!(!socket.exists(), "socket left behind after drop");
}
