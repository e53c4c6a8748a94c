//! One TCP connection of a session: its socket, its read buffer and the
//! records waiting to be written, and the poll that writes and reads them.

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use roam_proto::{Session, TransportId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

/// Bytes read from a socket at a time.
const READ_CHUNK: usize = 64 * 1024;

thread_local! {
    /// Where sockets are read into before the session takes the bytes:
    /// one per worker thread instead of one per connection (64 KiB each).
    /// A read is always handed to the session before the task yields, so
    /// nothing stays here between polls.
    static READ_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0u8; READ_CHUNK]);
}
/// Ask the session for more records only while less than this is unwritten.
pub(super) const WRITE_LOW_WATER: usize = 64 * 1024;
/// Reads taken from one socket, without waiting, before a timer runs.
pub(super) const DRAIN_READS: usize = 16;

/// One TCP connection carrying (or about to carry) the session.
pub(crate) struct Conn {
    pub(super) tid: TransportId,
    pub(super) sock: TcpStream,
    pub(super) peer: SocketAddr,
    /// Records polled from the session, written from `pos` on.
    pub(super) out: Vec<u8>,
    pub(super) pos: usize,
    /// Set when the session is done with this transport: flush, then drop by then.
    pub(super) retire_by: Option<Instant>,
    /// Server: holds a slot of the connection cap for as long as the socket lives.
    _permit: Option<OwnedSemaphorePermit>,
}

impl Conn {
    pub(crate) fn new(
        tid: TransportId,
        sock: TcpStream,
        peer: SocketAddr,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Self {
            tid,
            sock,
            peer,
            out: Vec::new(),
            pos: 0,
            retire_by: None,
            _permit: permit,
        }
    }

    pub(super) fn unwritten(&self) -> usize {
        self.out.len() - self.pos
    }

    /// Whether the session should stop polling records until this one drains.
    pub(super) fn backed_up(&self) -> bool {
        self.retire_by.is_none() && self.unwritten() >= WRITE_LOW_WATER
    }

    /// Queues a record (or several) polled from the session.
    pub(super) fn queue(&mut self, records: &mut Vec<u8>) {
        if self.out.is_empty() {
            std::mem::swap(&mut self.out, records);
        } else {
            self.out.extend_from_slice(records);
        }
    }

    /// Feeds what the socket holds right now to `session`, without
    /// waiting: at most `reads` reads of up to [`READ_CHUNK`] bytes.
    pub(super) fn drain_ready(
        &mut self,
        session: &mut Session,
        now: std::time::Instant,
        reads: usize,
    ) -> Drained {
        // `poll_read` rather than `try_read`: a read that fills only part of
        // the buffer proves the socket empty and clears tokio's readiness
        // (on epoll), so the next wait sleeps instead of waking the driver
        // for one more read that would only say `WouldBlock` (a whole loop
        // iteration per round trip of a ping-pong). The no-op waker is
        // never relied on: every wait polls readiness with the task's own.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        READ_BUF.with_borrow_mut(|buf| {
            for _ in 0..reads {
                if self.retire_by.is_some() {
                    break;
                }
                let mut rb = ReadBuf::new(buf);
                match Pin::new(&mut self.sock).poll_read(&mut cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        let n = rb.filled().len();
                        if n == 0 {
                            return Drained::Eof;
                        }
                        if let Err(e) = session.handle_input(now, self.tid, &buf[..n]) {
                            tracing::debug!("transport {:?} from {}: {e}", self.tid, self.peer);
                        }
                        if n < buf.len() {
                            // Drained: the kernel had no more.
                            break;
                        }
                    }
                    Poll::Ready(Err(e)) => return Drained::Failed(e),
                    Poll::Pending => break,
                }
            }
            Drained::Open
        })
    }
}

/// How a connection came out of [`Conn::drain_ready`].
pub(super) enum Drained {
    /// Still open (nothing more to read now, or the read limit was reached).
    Open,
    /// The peer closed it.
    Eof,
    /// Reading failed.
    Failed(io::Error),
}

/// What the connections reported.
pub(super) enum Io {
    /// Connection `.0` has input (or end of stream) to read.
    Readable(usize),
    /// Connection `.0` failed.
    Failed(usize, io::Error),
    /// Some output was written (room for more records).
    Wrote,
}

/// Polls every connection: writes pending output, then checks for input
/// (readiness only: the bytes are read by [`Conn::drain_ready`], into a
/// buffer no connection holds).
pub(super) fn poll_conns(conns: &mut [Conn], cx: &mut Context<'_>) -> Poll<Io> {
    let mut wrote = false;
    for (i, c) in conns.iter_mut().enumerate() {
        while c.pos < c.out.len() {
            match Pin::new(&mut c.sock).poll_write(cx, &c.out[c.pos..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Io::Failed(i, io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => {
                    c.pos += n;
                    wrote = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Io::Failed(i, e)),
                Poll::Pending => break,
            }
        }
        if c.pos == c.out.len() && c.pos > 0 {
            c.out.clear();
            c.pos = 0;
        }
        if c.retire_by.is_none() {
            match c.sock.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => return Poll::Ready(Io::Readable(i)),
                Poll::Ready(Err(e)) => return Poll::Ready(Io::Failed(i, e)),
                Poll::Pending => {}
            }
        }
    }
    if wrote {
        Poll::Ready(Io::Wrote)
    } else {
        Poll::Pending
    }
}
