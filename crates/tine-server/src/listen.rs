//! Accepting connections, bounded: at most `max_connections` at once (one
//! more is closed at once, so idle sockets cannot exhaust the daemon's
//! descriptors), request headers within `header_timeout` (also an idle
//! keep-alive connection's next request), a stalled request body fails
//! after the same time; on TCP and on a Unix socket alike. Shutdown stops
//! accepting and gives open requests a grace period.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, watch};

/// How connections are bounded.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// What every accept loop shares.
#[derive(Clone)]
pub(crate) struct Acceptor {
    router: Router,
    limits: ConnLimits,
    slots: Arc<Semaphore>,
    graceful: Arc<GracefulShutdown>,
}

impl Acceptor {
    pub(crate) fn new(router: Router, limits: ConnLimits) -> Acceptor {
        let router = router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            limits.header_timeout,
        ));
        Acceptor {
            router,
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            graceful: Arc::new(GracefulShutdown::new()),
        }
    }

    /// Serves one accepted connection on a task of its own, or closes it at
    /// once when every slot is taken.
    pub(crate) fn take<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            drop(stream);
            return;
        };
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_timeout)
            .max_buf_size(64 << 10);
        let service = TowerToHyperService::new(self.router.clone());
        let conn = http.serve_connection(TokioIo::new(stream), service);
        let conn = self.graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }

    /// Waits for open connections to finish their requests, at most `grace`.
    pub(crate) async fn drain(self, grace: Duration) {
        if let Ok(g) = Arc::try_unwrap(self.graceful) {
            let _ = tokio::time::timeout(grace, g.shutdown()).await;
        }
    }
}

/// A socket connections come in on (TCP or Unix).
pub(crate) trait Listener: Send + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn next(&self) -> impl std::future::Future<Output = std::io::Result<Self::Stream>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn next(&self) -> std::io::Result<Self::Stream> {
        let (s, _) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn next(&self) -> std::io::Result<Self::Stream> {
        Ok(self.accept().await?.0)
    }
}

/// Accepts on `listener` until `stop` turns true.
pub(crate) async fn accept(
    listener: impl Listener,
    acceptor: Acceptor,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            r = listener.next() => match r {
                Ok(s) => acceptor.take(s),
                // Out of descriptors and the like: the next accept may work.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
            _ = stop.changed() => return,
        }
    }
}
