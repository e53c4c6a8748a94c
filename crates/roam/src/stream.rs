//! [`RoamStream`]: one reliable byte stream of a session, as `AsyncRead + AsyncWrite`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use roam_proto::{Lent, StreamError, StreamId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::handle::Guard;

/// A bidirectional stream of a roam session. It survives transport loss: while
/// the session is suspended, reads wait and writes fill the send buffer.
///
/// `poll_shutdown` finishes our direction (the peer reads end-of-stream after
/// every byte written). Dropping the stream finishes it too and discards
/// anything the peer still sends; if the peer has not finished its direction,
/// the stream is reset as soon as every byte we wrote is acknowledged, so
/// the peer stops sending to nobody (as a TCP close with unread data would
/// answer with a reset, but never cutting our own bytes short).
pub struct RoamStream {
    guard: Arc<Guard>,
    id: StreamId,
    /// End-of-stream was delivered to the reader.
    read_eof: bool,
    /// Our direction is finished (or the stream reset).
    write_done: bool,
}

impl std::fmt::Debug for RoamStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoamStream")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RoamStream {
    pub(crate) fn new(guard: Arc<Guard>, id: StreamId) -> Self {
        Self {
            guard,
            id,
            read_eof: false,
            write_done: false,
        }
    }

    /// The stream's id within its session.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// Aborts the stream in both directions with `code` (the peer sees a
    /// reset; unsent bytes are dropped).
    pub fn reset(&mut self, code: u64) {
        let inner = &self.guard.0;
        let mut sh = inner.lock();
        let _ = sh.session.reset_stream(self.id, code);
        sh.read_wakers.remove(&self.id);
        sh.write_wakers.remove(&self.id);
        drop(sh);
        self.read_eof = true;
        self.write_done = true;
        inner.notify.notify_one();
    }

    /// The error every stream operation gets once its session was detached.
    fn detached_error() -> io::Error {
        io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the session was detached: its streams' data now lives in the continuation",
        )
    }

    fn session_error(&self, sh: &crate::handle::Shared, e: StreamError) -> io::Error {
        if let (StreamError::UnknownStream, Some(code)) = (e, sh.reset_code(self.id)) {
            return StreamError::Reset(code).into();
        }
        match (sh.closed.as_deref(), e) {
            (Some(reason), StreamError::SessionClosed | StreamError::UnknownStream) => {
                io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    crate::error::describe_close(reason),
                )
            }
            (_, e) => e.into(),
        }
    }
}

/// A writer a stream can hand its received bytes to without copying them
/// out first ([`RoamStream::poll_write_to`]): an operating-system socket.
/// Sealed: the session's lock is held while the writer runs, so a writer
/// that could reach a session (another `RoamStream`) must never be one.
pub trait LendTarget: sealed::Sealed + AsyncWrite + Unpin {}

impl LendTarget for tokio::net::TcpStream {}
impl LendTarget for tokio::net::UnixStream {}

mod sealed {
    /// Only the socket types in this module are lend targets.
    pub trait Sealed {}
    impl Sealed for tokio::net::TcpStream {}
    impl Sealed for tokio::net::UnixStream {}
}

impl RoamStream {
    /// Writes received bytes straight from the session's receive buffer
    /// into `w`, as a relay does from a stream to its target: the bytes are
    /// not copied into a buffer of the caller's first. `Ready(Ok(n))`: `n`
    /// bytes were written and count as read (`n > 0`); `Ready(Ok(0))`: end
    /// of stream, as from `poll_read`. `Pending`: nothing has arrived yet
    /// (woken when something does) or `w` cannot take more (woken by `w`).
    /// Errors as `poll_read`'s, or `w`'s own.
    ///
    /// The session's lock is held while `w.poll_write` runs (one
    /// non-blocking socket write).
    pub fn poll_write_to<W: LendTarget + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        w: &mut W,
    ) -> Poll<io::Result<usize>> {
        if self.read_eof {
            return Poll::Ready(Ok(0));
        }
        let inner = self.guard.0.clone();
        let mut sh = inner.lock();
        if sh.detached {
            return Poll::Ready(Err(Self::detached_error()));
        }
        let log_before = sh.session.unacked_frames();
        let mut blocked = false;
        let lent = sh.session.read_with(self.id, |bytes| {
            match Pin::new(&mut *w).poll_write(cx, bytes) {
                Poll::Ready(Ok(0)) => Err(io::Error::from(io::ErrorKind::WriteZero)),
                Poll::Ready(Ok(n)) => Ok(n),
                Poll::Ready(Err(e)) => Err(e),
                Poll::Pending => {
                    blocked = true;
                    Ok(0)
                }
            }
        });
        match lent {
            Ok(Lent::Lent(Ok(_))) if blocked => Poll::Pending,
            Ok(Lent::Lent(Ok(n))) => {
                // Taking bytes may have queued a window update: let the
                // driver send it.
                let wake_driver = sh.session.unacked_frames() > log_before;
                drop(sh);
                if wake_driver {
                    inner.notify.notify_one();
                }
                Poll::Ready(Ok(n))
            }
            Ok(Lent::Lent(Err(e))) => Poll::Ready(Err(e)),
            Ok(Lent::End) => {
                drop(sh);
                self.read_eof = true;
                Poll::Ready(Ok(0))
            }
            Ok(Lent::Nothing) => {
                sh.read_wakers.insert(self.id, cx.waker().clone());
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(self.session_error(&sh, e))),
        }
    }
}

impl AsyncRead for RoamStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.read_eof || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let inner = self.guard.0.clone();
        let mut sh = inner.lock();
        if sh.detached {
            return Poll::Ready(Err(Self::detached_error()));
        }
        let log_before = sh.session.unacked_frames();
        let dst = buf.initialize_unfilled();
        match sh.session.read(self.id, dst) {
            Ok(Some(0)) => {
                drop(sh);
                self.read_eof = true;
                Poll::Ready(Ok(()))
            }
            Ok(Some(n)) => {
                // Reading may have queued a window update: let the driver send it.
                let wake_driver = sh.session.unacked_frames() > log_before;
                drop(sh);
                buf.advance(n);
                if wake_driver {
                    inner.notify.notify_one();
                }
                Poll::Ready(Ok(()))
            }
            Ok(None) => {
                sh.read_wakers.insert(self.id, cx.waker().clone());
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(self.session_error(&sh, e))),
        }
    }
}

impl AsyncWrite for RoamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let inner = &self.guard.0;
        let mut sh = inner.lock();
        if sh.detached {
            return Poll::Ready(Err(Self::detached_error()));
        }
        match sh.session.write(self.id, data) {
            Ok(0) => {
                sh.write_wakers.insert(self.id, cx.waker().clone());
                Poll::Pending
            }
            Ok(n) => {
                drop(sh);
                inner.notify.notify_one();
                Poll::Ready(Ok(n))
            }
            Err(e) => Poll::Ready(Err(self.session_error(&sh, e))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written bytes are already in the session's send buffer; the driver
        // transmits them as soon as the transport allows.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.write_done {
            return Poll::Ready(Ok(()));
        }
        let inner = self.guard.0.clone();
        let mut sh = inner.lock();
        if sh.detached {
            return Poll::Ready(Err(Self::detached_error()));
        }
        let r = sh.session.finish_stream(self.id);
        let r = r.map_err(|e| self.session_error(&sh, e));
        drop(sh);
        self.write_done = true;
        inner.notify.notify_one();
        Poll::Ready(r)
    }
}

impl Drop for RoamStream {
    fn drop(&mut self) {
        let inner = &self.guard.0;
        let mut sh = inner.lock();
        sh.read_wakers.remove(&self.id);
        sh.write_wakers.remove(&self.id);
        if let Some(r) = sh.rare_if_any() {
            r.resets.remove(&self.id);
        }
        if sh.closed.is_none() {
            if !self.write_done {
                let _ = sh.session.finish_stream(self.id);
            }
            if !self.read_eof {
                // Discard whatever the peer still sends (now and later), and
                // once our own direction is complete (every byte written was
                // acknowledged) reset the stream, so the peer stops sending
                // to nobody: a relay's target of a closed download would
                // otherwise stream on across the session (see the driver's
                // `StreamSendComplete`). Our bytes are never cut short.
                let mut scratch = [0u8; 4096];
                while let Ok(Some(n)) = sh.session.read(self.id, &mut scratch) {
                    if n == 0 {
                        break;
                    }
                }
                if sh.session.stream_send_complete(self.id) {
                    let _ = sh.session.reset_stream(self.id, roam_proto::code::NO_ERROR);
                } else {
                    sh.rare().orphans.insert(self.id);
                }
            }
        }
        drop(sh);
        inner.notify.notify_one();
    }
}
