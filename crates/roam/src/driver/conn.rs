//! One TCP connection of a session: its socket, its read buffer and the
//! records waiting to be written, and the poll that writes and reads them.

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use roam_proto::{Session, TransportId};

use socket2::SockRef;

use crate::tcpmem::{self, Advice};
use crate::transport::Transport;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

/// Bytes read from a socket at a time: four of the largest records, so
/// that most records of a bulk transfer lie whole in one read and are
/// decrypted there (`Session::handle_input_in_place`); only those that
/// straddle two reads are copied into the transport's input buffer.
const READ_CHUNK: usize = 256 * 1024;

thread_local! {
    /// Where sockets are read into before the session takes the bytes:
    /// one per worker thread instead of one per connection. A read is
    /// always handed to the session before the task yields, so nothing
    /// stays here between polls (the session decrypts records in it).
    static READ_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0u8; READ_CHUNK]);
}
/// Ask the session for more records only while less than this is unwritten.
pub(super) const WRITE_LOW_WATER: usize = 64 * 1024;
/// Reads taken from one socket, without waiting, before a timer runs.
pub(super) const DRAIN_READS: usize = 16;

/// One TCP connection carrying (or about to carry) the session.
pub(crate) struct Conn {
    pub(super) tid: TransportId,
    pub(super) sock: Transport,
    pub(super) peer: SocketAddr,
    /// Records polled from the session, written from `pos` on.
    pub(super) out: Vec<u8>,
    pub(super) pos: usize,
    /// Set when the session is done with this transport: flush, then drop by then.
    pub(super) retire_by: Option<Instant>,
    /// The receive buffer this connection was held to under the kernel's
    /// TCP memory pressure (`None`: never held, or given back).
    held: Option<usize>,
    /// The pressure reading this connection last checked itself against.
    memory_checked: u64,
    /// Server: holds a slot of the connection cap for as long as the socket lives.
    _permit: Option<OwnedSemaphorePermit>,
}

impl Conn {
    pub(crate) fn new(
        tid: TransportId,
        sock: Transport,
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
            held: None,
            memory_checked: 0,
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
    pub(crate) fn queue(&mut self, records: &mut Vec<u8>) {
        if self.out.is_empty() {
            std::mem::swap(&mut self.out, records);
        } else {
            self.out.extend_from_slice(records);
        }
    }

    /// Follows the kernel's TCP memory pressure (see `crate::tcpmem`): while
    /// it lasts, a connection whose receive buffer outgrew its share of
    /// socket memory is held to the share, so the connection that carries
    /// every stream is not the one whose segments the kernel drops; a held
    /// connection gets a large fixed buffer back when pressure is over.
    /// Checked once per reading (`reading`, at most every 100 ms).
    pub(super) fn fit_memory(&mut self, reading: u64, advice: Advice) {
        if reading == self.memory_checked {
            return;
        }
        self.memory_checked = reading;
        // Unix-domain transports have no TCP buffers to fit.
        let Some(tcp) = self.sock.tcp() else { return };
        let want = match (advice, self.held) {
            (Advice::Hold(n), None) => {
                // Sockets within their share are never the ones dropped:
                // leave their auto-tuning alone (the kernel reports the
                // doubled size it books).
                let booked = SockRef::from(tcp).recv_buffer_size().unwrap_or(usize::MAX);
                if booked <= 2 * n {
                    return;
                }
                n
            }
            (Advice::Hold(n), Some(h)) if n < h - h / 4 || n > h + h / 4 => n,
            (Advice::Free, Some(_)) => tcpmem::released_rcvbuf(),
            _ => return,
        };
        let held = matches!(advice, Advice::Hold(_)).then_some(want);
        match crate::sockopt::set_rcvbuf(tcp, want) {
            Ok(()) => tracing::debug!(
                "transport {:?} to {}: receive buffer {} KiB ({})",
                self.tid,
                self.peer,
                want / 1024,
                if held.is_some() {
                    "TCP memory pressure"
                } else {
                    "TCP memory pressure over"
                }
            ),
            Err(e) => tracing::debug!("SO_RCVBUF: {e}"),
        }
        self.held = held;
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
                        if let Err(e) = session.handle_input_in_place(now, self.tid, &mut buf[..n])
                        {
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
pub(crate) enum Io {
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

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::net::TcpStream;

    async fn pair() -> (Conn, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        let a = a.unwrap();
        (
            Conn::new(TransportId(1), a.into(), addr, None),
            b.unwrap().0,
        )
    }

    fn booked(c: &Conn) -> usize {
        SockRef::from(c.sock.tcp().unwrap())
            .recv_buffer_size()
            .unwrap()
    }

    /// Under pressure a connection whose buffer outgrew its share is held
    /// to it, once per reading; given a large buffer back when pressure is
    /// over; and bytes still flow through the held socket, every one checked.
    #[tokio::test]
    async fn a_big_buffer_is_held_under_pressure_and_given_back() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut c, mut peer) = pair().await;
        crate::sockopt::set_rcvbuf(c.sock.tcp().unwrap(), 2 * 1024 * 1024).unwrap();
        let big = booked(&c);
        c.fit_memory(1, Advice::Hold(128 * 1024));
        let held = booked(&c);
        assert!(held < big && held <= 2 * 128 * 1024, "{big} -> {held}");
        // The same reading again changes nothing (no syscall either).
        crate::sockopt::set_rcvbuf(c.sock.tcp().unwrap(), 1024 * 1024).unwrap();
        c.fit_memory(1, Advice::Hold(64 * 1024));
        assert!(booked(&c) > held);
        // A small change of the share is not followed; a large one is.
        c.fit_memory(2, Advice::Hold(120 * 1024));
        assert_eq!(c.held, Some(128 * 1024));
        c.fit_memory(3, Advice::Hold(64 * 1024));
        assert_eq!(c.held, Some(64 * 1024));
        assert!(booked(&c) <= 2 * 64 * 1024);
        // Bytes pass through the held socket intact.
        let data: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let w = tokio::spawn(async move {
            peer.write_all(&sent).await.unwrap();
            peer
        });
        let mut got = vec![0u8; data.len()];
        c.sock.read_exact(&mut got).await.unwrap();
        assert!(got == data, "bytes differ");
        w.await.unwrap();
        // Pressure over: the large fixed buffer.
        c.fit_memory(4, Advice::Free);
        assert_eq!(c.held, None);
        assert!(booked(&c) >= tcpmem::released_rcvbuf(), "{}", booked(&c));
    }

    /// A socket already within its share keeps the kernel's auto-tuning.
    #[tokio::test]
    async fn a_socket_within_its_share_is_left_alone() {
        let (mut c, _peer) = pair().await;
        let before = booked(&c);
        c.fit_memory(1, Advice::Hold(before));
        assert_eq!(c.held, None);
        assert_eq!(booked(&c), before);
        c.fit_memory(2, Advice::Free);
        assert_eq!(booked(&c), before);
    }
}
