//! Serving HTTP/1.1 connections, each one bounded (README, "Security"): a
//! client that opens connections and never finishes a request cannot hold
//! the process's file descriptors, which in `paceline up` the workers share.
//!
//! - **Header timeout**: a connection has [`Limits::header_timeout`] from its
//!   accept, and again from each response, to deliver a request's complete
//!   headers; one that does not (a slowloris, a kept-alive connection left
//!   idle) is closed. One timer serves both, as hyper keeps it: the wait for
//!   the next request's headers is the idle time. A response in progress (an
//!   event stream) is not timed by it.
//! - **Write timeout**: a write that cannot make progress for
//!   [`Limits::write_timeout`] (a client that stopped reading, its buffers
//!   full) closes the connection. Nothing else would: a response body that
//!   cannot be sent is not polled, so an event stream's own lifetime never
//!   comes, and its place among the open streams would be held for good.
//! - **Connection caps**: at most [`Limits::max_connections`] open in the
//!   process, at most [`Limits::max_per_client`] from one client (an IPv4
//!   address, an IPv6 /64: one host's usual share). A connection over
//!   either is answered `503` with `Retry-After` at once, best effort, and
//!   closed — the accept loop never waits, so a flood from one client does
//!   not queue the others' connections behind it in the kernel's backlog.
//!
//! The process cap is also held under half the process's file descriptors
//! ([`Limits::fitted`]), so connections can never take the ones Redis, the
//! event hub and the workers need.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Default of `--header-timeout`.
pub const DEFAULT_HEADER_TIMEOUT: &str = "10s";
/// Default of `--write-timeout`.
pub const DEFAULT_WRITE_TIMEOUT: &str = "30s";
/// Default of `--body-timeout` (routes/mod.rs `body_within_deadline`).
pub const DEFAULT_BODY_TIMEOUT: &str = "30s";
/// Default of `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default of `--max-client-connections`.
pub const DEFAULT_MAX_CLIENT_CONNECTIONS: usize = 512;

/// What an over-cap connection is told before it is closed.
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
/// How often a refused connection is logged at `warn` at most.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The bounds on one process's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From a connection's accept, and from each response, to a request's
    /// complete headers.
    pub header_timeout: Duration,
    /// The longest a write may wait for the client to read.
    pub write_timeout: Duration,
    /// Connections open at once in the process.
    pub max_connections: usize,
    /// Connections open at once from one client (0: no cap per client, for
    /// a process behind a proxy that brings every client from its address).
    pub max_per_client: usize,
}

impl Limits {
    /// These limits with the process cap held under half of `fd_limit`, the
    /// process's file descriptors (`None`: unknown, kept as given).
    pub fn fitted(self, fd_limit: Option<u64>) -> Self {
        let Some(fds) = fd_limit else { return self };
        let room = usize::try_from(fds / 2).unwrap_or(usize::MAX).max(1);
        if self.max_connections <= room {
            return self;
        }
        tracing::warn!(
            message = "too few file descriptors for the connection cap: lowered to half of them",
            configured = self.max_connections,
            max_connections = room,
            fd_limit = fds
        );
        Self { max_connections: room, ..self }
    }
}

/// Raises this process's soft limit of open files to its hard limit and
/// returns the soft limit it then has (`None` where it cannot be read).
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let limit = getrlimit(Resource::Nofile);
        if limit.current != limit.maximum {
            let raised = Rlimit { current: limit.maximum, maximum: limit.maximum };
            if let Err(error) = setrlimit(Resource::Nofile, raised) {
                tracing::debug!(message = "could not raise the open-files limit", %error);
            }
        }
        getrlimit(Resource::Nofile).current
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves;
/// then it accepts no more, each open connection finishes its request in
/// progress and closes, and it returns when they all have.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let gate = Gate::new(limits);
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let pass = match gate.admit(peer.ip()) {
            Ok(pass) => pass,
            Err(refusal) => {
                gate.refused(peer, refusal);
                turn_away(stream);
                continue;
            }
        };
        no_delay(&stream);
        let service = TowerToHyperService::new(router.clone());
        let io = TokioIo::new(WriteTimeout::new(stream, limits.write_timeout));
        let connection = graceful.watch(http.serve_connection(io, service));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(message = "connection ended with an error", %error);
            }
            drop(pass);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// An accept that failed. A connection reset before its accept is the
/// client's business; out of file descriptors (the caps fitted, a leak
/// elsewhere) waits a moment rather than spinning on the error.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(error.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted) {
        return;
    }
    tracing::warn!(message = "accepting a connection failed", %error);
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Says 503 to a connection over a cap and closes it. One non-blocking
/// write into a fresh socket's buffer: a client that does not read it is
/// not waited for.
fn turn_away(stream: TcpStream) {
    let _ = stream.try_write(BUSY);
}

/// Sends each write of an accepted connection at once. An event stream's
/// events are small writes: under Nagle's algorithm each waited for the
/// client's ACK of the one before, which a client may delay by up to 40 ms.
fn no_delay(stream: &TcpStream) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(message = "could not set TCP_NODELAY", %error);
    }
}

/// A connection whose writes fail once one has waited `limit` for the
/// client to read: hyper then closes the connection and drops the response.
#[derive(Debug)]
struct WriteTimeout {
    stream: TcpStream,
    limit: Duration,
    /// Since when a write has been waiting, as the deadline it may wait to.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteTimeout {
    fn new(stream: TcpStream, limit: Duration) -> Self {
        Self { stream, limit, stalled: None }
    }

    /// Passes on a write's result: one that went through ends a wait; one
    /// still waiting starts (or checks) the deadline, and past it is an error.
    fn written<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        self.waiting(cx)
    }

    /// A flush or shutdown: one still waiting is held to the deadline too,
    /// but only a write's progress ends a wait.
    fn flushed(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<()>>) -> Poll<io::Result<()>> {
        if polled.is_ready() {
            return polled;
        }
        self.waiting(cx)
    }

    /// Still waiting for the client: `Pending` until the deadline, then an error.
    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let deadline = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.written(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.written(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_flush(cx);
        self.flushed(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.stream).poll_shutdown(cx);
        self.flushed(cx, polled)
    }
}

/// Which cap a connection would have passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The process's.
    Process,
    /// Its client's.
    Client,
}

/// A client as the per-client cap counts it: an IPv4 address (also when it
/// comes IPv4-mapped), or the /64 an IPv6 address is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Client(IpAddr);

impl Client {
    fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self(IpAddr::V4(v4)),
                None => Self(IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into())),
            },
        }
    }
}

/// The open connections, counted in all and by client.
#[derive(Debug, Clone)]
struct Gate {
    limits: Limits,
    state: Arc<Mutex<Open>>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_client: HashMap<Client, usize>,
    warned_at: Option<Instant>,
}

/// A connection's place under the caps, given back when it is dropped.
#[derive(Debug)]
struct Pass {
    gate: Gate,
    client: Client,
}

impl Gate {
    fn new(limits: Limits) -> Self {
        Self { limits, state: Arc::default() }
    }

    /// A place for a connection from `ip`, or the cap it would pass.
    fn admit(&self, ip: IpAddr) -> Result<Pass, Refusal> {
        let client = Client::of(ip);
        let mut open = self.lock();
        if open.total >= self.limits.max_connections {
            return Err(Refusal::Process);
        }
        let mine = open.by_client.get(&client).copied().unwrap_or(0);
        if self.limits.max_per_client > 0 && mine >= self.limits.max_per_client {
            return Err(Refusal::Client);
        }
        open.total += 1;
        open.by_client.insert(client, mine + 1);
        Ok(Pass { gate: self.clone(), client })
    }

    /// Logs a refusal: every one at `debug`, at most one per [`WARN_EVERY`] at `warn`.
    fn refused(&self, peer: SocketAddr, refusal: Refusal) {
        tracing::debug!(message = "connection refused: over a cap", %peer, cap = ?refusal);
        let mut open = self.lock();
        if open.warned_at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return;
        }
        open.warned_at = Some(Instant::now());
        let (cap, limit) = match refusal {
            Refusal::Process => ("the process's", self.limits.max_connections),
            Refusal::Client => ("one client's", self.limits.max_per_client),
        };
        tracing::warn!(message = "connections refused: a cap is reached", cap, limit, %peer, open = open.total);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // The counts stay right even if a holder panicked: nothing is left half-done.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut open = self.gate.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.by_client.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_connections: usize, max_per_client: usize) -> Limits {
        Limits {
            header_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            max_connections,
            max_per_client,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn connections_are_capped_per_client_and_in_all_and_a_closed_one_gives_its_place_back() {
        let gate = Gate::new(limits(3, 2));
        let a1 = gate.admit(ip("10.0.0.1")).unwrap();
        let a2 = gate.admit(ip("::ffff:10.0.0.1")).unwrap();
        assert_eq!(gate.admit(ip("10.0.0.1")).unwrap_err(), Refusal::Client, "an IPv4-mapped address is its IPv4 one");
        let _b1 = gate.admit(ip("2001:db8::1")).unwrap();
        assert_eq!(gate.admit(ip("10.0.0.2")).unwrap_err(), Refusal::Process);
        drop(a1);
        let _b2 = gate.admit(ip("2001:db8::2")).unwrap();
        drop(a2);
        assert_eq!(gate.admit(ip("2001:db8::3")).unwrap_err(), Refusal::Client, "one IPv6 /64 is one client");
        let _c1 = gate.admit(ip("2001:db8:0:1::2")).unwrap();
        assert_eq!(gate.lock().total, 3);
    }

    #[test]
    fn no_cap_per_client_when_it_is_0() {
        let gate = Gate::new(limits(3, 0));
        let passes: Vec<Pass> = (0..3).map(|_| gate.admit(ip("127.0.0.1")).unwrap()).collect();
        assert_eq!(gate.admit(ip("127.0.0.1")).unwrap_err(), Refusal::Process);
        drop(passes);
        let open = gate.lock();
        assert_eq!((open.total, open.by_client.len()), (0, 0), "every place given back");
    }

    #[test]
    fn the_process_cap_stays_under_half_the_file_descriptors() {
        assert_eq!(limits(4096, 512).fitted(Some(1024)).max_connections, 512);
        assert_eq!(limits(4096, 512).fitted(Some(1_048_576)).max_connections, 4096);
        assert_eq!(limits(4096, 512).fitted(None).max_connections, 4096);
        assert_eq!(limits(4096, 512).fitted(Some(1)).max_connections, 1);
    }
}
