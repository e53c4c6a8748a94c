//! A bidirectional copy between a stream of a session and a TCP connection
//! (`roam serve`'s target side, `roam forward`'s local side) that holds no
//! buffer of its own while idle.
//!
//! `tokio::io::copy_bidirectional_with_sizes` keeps two 64 KiB buffers per
//! stream for its whole life: a relay holding suspended sessions (an ssh
//! connection whose laptop sleeps) paid them, resident once touched, for
//! days. Here each read goes into one scratch buffer per thread and is
//! written on at once; only bytes the writer does not take (it pushes back)
//! are kept, in a buffer of that direction that is released as soon as
//! it has drained and the reader has nothing more.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read at a time (the size of the per-thread scratch buffer).
const CHUNK: usize = 64 * 1024;
/// Reads one direction may do in a poll before it lets other tasks run.
const READS_PER_POLL: usize = 16;

thread_local! {
    /// Where reads land; never holds bytes between polls (whatever the
    /// writer did not take is moved to the direction's own buffer).
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0u8; CHUNK]);
}

/// One end of a copy: a byte stream, which may also be a roam stream or
/// a socket. From a roam stream to a socket the bytes move directly (the
/// stream's receive buffer is written into the socket), saving the copy
/// through the scratch buffer.
pub(crate) trait End: AsyncRead + AsyncWrite + Unpin {
    /// This end as a roam stream, whose received bytes can be lent.
    fn as_stream(&mut self) -> Option<&mut roam::RoamStream> {
        None
    }
    /// This end as a socket a roam stream can lend its bytes to.
    fn as_socket(&mut self) -> Option<&mut dyn roam::LendTarget> {
        None
    }
}

impl End for roam::RoamStream {
    fn as_stream(&mut self) -> Option<&mut roam::RoamStream> {
        Some(self)
    }
}

impl End for tokio::net::TcpStream {
    fn as_socket(&mut self) -> Option<&mut dyn roam::LendTarget> {
        Some(self)
    }
}

impl End for tokio::io::DuplexStream {}

/// One direction of the copy.
#[derive(Default)]
struct Half {
    /// Bytes read but not yet taken by the writer, from `pos` on; empty
    /// (no allocation) unless the writer pushed back.
    pending: Vec<u8>,
    pos: usize,
    /// Bytes written so far.
    total: u64,
    /// The reader reached end-of-file.
    eof: bool,
    /// Something was written since the writer was last flushed.
    unflushed: bool,
    /// Finished: end-of-file passed on (the writer shut down).
    done: bool,
}

impl Half {
    /// Moves bytes from `r` to `w` until one of them would block, the
    /// reader ends (then `w` is shut down and this returns `Ready`), or an
    /// error.
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        r: &mut R,
        w: &mut W,
    ) -> Poll<io::Result<()>>
    where
        R: End + ?Sized,
        W: End + ?Sized,
    {
        let mut reads = 0;
        loop {
            while self.pos < self.pending.len() {
                match Pin::new(&mut *w).poll_write(cx, &self.pending[self.pos..]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => {
                        self.pos += n;
                        self.total += n as u64;
                        self.unflushed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            self.pending.clear();
            self.pos = 0;
            if self.eof {
                if self.unflushed {
                    std::task::ready!(Pin::new(&mut *w).poll_flush(cx))?;
                    self.unflushed = false;
                }
                std::task::ready!(Pin::new(&mut *w).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            if reads == READS_PER_POLL {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            reads += 1;
            let direct = match (r.as_stream(), w.as_socket()) {
                (Some(stream), Some(socket)) => Some(stream.poll_write_to(cx, socket)),
                _ => None,
            };
            let read = match direct {
                Some(Poll::Ready(Ok(0))) => {
                    self.eof = true;
                    Poll::Ready(Ok(()))
                }
                Some(Poll::Ready(Ok(n))) => {
                    self.total += n as u64;
                    self.unflushed = true;
                    Poll::Ready(Ok(()))
                }
                Some(other) => other.map_ok(|_| ()),
                None => self.read_through_scratch(cx, r, w),
            };
            match read {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    // Idle: give back the push-back buffer, flush what was written.
                    if self.pending.capacity() > 0 {
                        self.pending = Vec::new();
                    }
                    if self.unflushed {
                        std::task::ready!(Pin::new(&mut *w).poll_flush(cx))?;
                        self.unflushed = false;
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    /// One read into the per-thread scratch buffer, written on at once;
    /// what the writer does not take is kept in `pending`.
    fn read_through_scratch<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        r: &mut R,
        w: &mut W,
    ) -> Poll<io::Result<()>>
    where
        R: End + ?Sized,
        W: End + ?Sized,
    {
        SCRATCH.with_borrow_mut(|buf| {
            let mut rb = ReadBuf::new(buf);
            match Pin::new(&mut *r).poll_read(cx, &mut rb) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    if n == 0 {
                        self.eof = true;
                        return Poll::Ready(Ok(()));
                    }
                    let mut off = 0;
                    while off < n {
                        match Pin::new(&mut *w).poll_write(cx, &buf[off..n]) {
                            Poll::Ready(Ok(0)) => {
                                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()))
                            }
                            Poll::Ready(Ok(k)) => {
                                off += k;
                                self.total += k as u64;
                                self.unflushed = true;
                            }
                            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                            Poll::Pending => break,
                        }
                    }
                    // The writer pushed back: keep the rest (this
                    // direction reads no more until it is written).
                    self.pending.extend_from_slice(&buf[off..n]);
                    Poll::Ready(Ok(()))
                }
            }
        })
    }
}

/// One direction of a copy stopped part-way ([`pump_until`]), as a relay
/// hands it to another process: the bytes read and not yet written, and
/// how far the direction got.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct HalfState {
    /// Read from the source, not yet taken by the destination.
    pub(crate) pending: Vec<u8>,
    /// The source reached end-of-file (the destination may not be shut
    /// down yet).
    pub(crate) eof: bool,
    /// End-of-file was passed on: the destination is shut down.
    pub(crate) done: bool,
    /// Bytes written to the destination so far.
    pub(crate) total: u64,
}

impl Half {
    fn from_state(s: HalfState) -> Self {
        Half {
            pending: s.pending,
            pos: 0,
            total: s.total,
            eof: s.eof,
            unflushed: false,
            done: s.done,
        }
    }

    fn into_state(mut self) -> HalfState {
        self.pending.drain(..self.pos);
        HalfState {
            pending: self.pending,
            eof: self.eof,
            done: self.done,
            total: self.total,
        }
    }
}

/// How [`pump_until`] ended.
#[derive(Debug)]
pub(crate) enum PumpEnd {
    /// Both directions finished (`Ok((a to b, b to a))`) or one failed.
    Finished(io::Result<(u64, u64)>),
    /// `stop` completed first: each direction's state `(a to b, b to a)`,
    /// nothing lost (a stop lands only between polls, where every byte read
    /// is either written or in `pending`).
    Stopped(HalfState, HalfState),
}

/// Copies `a` to `b` and `b` to `a` until both directions reached
/// end-of-file (each end-of-file shuts the other side's writing down), as
/// `tokio::io::copy_bidirectional` does; returns the bytes copied
/// `(a to b, b to a)`, or the first error.
pub(crate) async fn pump<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: End + ?Sized,
    B: End + ?Sized,
{
    let mut ab = Half::default();
    let mut ba = Half::default();
    copy_both(a, b, &mut ab, &mut ba).await
}

/// [`pump`], starting from the given direction states (those a stopped pump
/// returned, or defaults), until both finish or `stop` completes.
pub(crate) async fn pump_until<A, B>(
    a: &mut A,
    b: &mut B,
    ab: HalfState,
    ba: HalfState,
    stop: impl std::future::Future<Output = ()>,
) -> PumpEnd
where
    A: End + ?Sized,
    B: End + ?Sized,
{
    let mut ab = Half::from_state(ab);
    let mut ba = Half::from_state(ba);
    let finished = tokio::select! {
        r = copy_both(a, b, &mut ab, &mut ba) => Some(r),
        _ = stop => None,
    };
    match finished {
        Some(r) => PumpEnd::Finished(r),
        None => PumpEnd::Stopped(ab.into_state(), ba.into_state()),
    }
}

/// Finishes one direction alone, from the state a stopped pump returned:
/// writes what it held, then copies until `r` ends (then `w` is shut down)
/// or fails. A relay uses it when a session closes gracefully with bytes
/// still on their way to the target (a slow reader): they are delivered
/// before the connection closes. Returns the bytes written.
pub(crate) async fn finish_one<R, W>(r: &mut R, w: &mut W, state: HalfState) -> io::Result<u64>
where
    R: End + ?Sized,
    W: End + ?Sized,
{
    let mut half = Half::from_state(state);
    if half.done {
        return Ok(0);
    }
    poll_fn(|cx| half.poll_copy(cx, r, w)).await?;
    Ok(half.total)
}

async fn copy_both<A, B>(
    a: &mut A,
    b: &mut B,
    ab: &mut Half,
    ba: &mut Half,
) -> io::Result<(u64, u64)>
where
    A: End + ?Sized,
    B: End + ?Sized,
{
    poll_fn(|cx| {
        if !ab.done {
            if let Poll::Ready(Err(e)) = ab.poll_copy(cx, a, b) {
                return Poll::Ready(Err(e));
            }
        }
        if !ba.done {
            if let Poll::Ready(Err(e)) = ba.poll_copy(cx, b, a) {
                return Poll::Ready(Err(e));
            }
        }
        if ab.done && ba.done {
            Poll::Ready(Ok((ab.total, ba.total)))
        } else {
            Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Both directions arrive whole and in order, through writers that
    /// take little at a time (a 1 KiB duplex pipe pushes back on every
    /// 64 KiB read), and each end-of-file reaches the other side.
    #[tokio::test]
    async fn copies_both_ways_with_push_back_and_passes_eof() {
        let (app_a, mut a) = tokio::io::duplex(1024);
        let (mut b, app_b) = tokio::io::duplex(1024);
        let task = tokio::spawn(async move { pump(&mut a, &mut b).await });
        let up: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        let (up2, down2) = (up.clone(), down.clone());
        let (mut ar, mut aw) = tokio::io::split(app_a);
        let (mut br, mut bw) = tokio::io::split(app_b);
        let wa = tokio::spawn(async move {
            aw.write_all(&up2).await.unwrap();
            aw.shutdown().await.unwrap();
        });
        let wb = tokio::spawn(async move {
            bw.write_all(&down2).await.unwrap();
            bw.shutdown().await.unwrap();
        });
        let mut got_up = Vec::new();
        br.read_to_end(&mut got_up).await.unwrap();
        let mut got_down = Vec::new();
        ar.read_to_end(&mut got_down).await.unwrap();
        wa.await.unwrap();
        wb.await.unwrap();
        assert_eq!(got_up, up);
        assert_eq!(got_down, down);
        let (n_up, n_down) = task.await.unwrap().unwrap();
        assert_eq!((n_up, n_down), (up.len() as u64, down.len() as u64));
    }

    /// A pump stopped again and again mid-transfer (as a relay handing over
    /// does) and restarted from the states it returned loses and repeats
    /// nothing, through writers that push back, and passes end-of-file.
    #[tokio::test]
    async fn stopped_and_restarted_pump_loses_nothing() {
        let (app_a, mut a) = tokio::io::duplex(1024);
        let (mut b, app_b) = tokio::io::duplex(1024);
        let up: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
        let (up2, down2) = (up.clone(), down.clone());
        let (mut ar, mut aw) = tokio::io::split(app_a);
        let (mut br, mut bw) = tokio::io::split(app_b);
        let wa = tokio::spawn(async move {
            aw.write_all(&up2).await.unwrap();
            aw.shutdown().await.unwrap();
        });
        let wb = tokio::spawn(async move {
            bw.write_all(&down2).await.unwrap();
            bw.shutdown().await.unwrap();
        });
        let ra = tokio::spawn(async move {
            let mut v = Vec::new();
            ar.read_to_end(&mut v).await.unwrap();
            v
        });
        let rb = tokio::spawn(async move {
            let mut v = Vec::new();
            br.read_to_end(&mut v).await.unwrap();
            v
        });
        let (mut ab, mut ba) = (HalfState::default(), HalfState::default());
        let mut stops = 0;
        let totals = loop {
            // Stops after a few polls: a count, not a time, so that the
            // pump is stopped mid-transfer however fast the machine is (a
            // 1 KiB pipe moves at most 16 KiB per poll).
            let mut polls = 0;
            let stop = poll_fn(move |cx| {
                polls += 1;
                if polls > 3 {
                    Poll::Ready(())
                } else {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
            });
            match pump_until(&mut a, &mut b, ab, ba, stop).await {
                PumpEnd::Finished(r) => break r.unwrap(),
                PumpEnd::Stopped(x, y) => {
                    stops += 1;
                    (ab, ba) = (x, y);
                }
            }
            assert!(stops < 100_000, "the pump never finished");
        };
        wa.await.unwrap();
        wb.await.unwrap();
        assert_eq!(rb.await.unwrap(), up);
        assert_eq!(ra.await.unwrap(), down);
        assert_eq!(totals, (up.len() as u64, down.len() as u64));
        assert!(stops > 0, "the test must stop the pump at least once");
    }

    /// A session on loopback: the client's handle and the server's side
    /// of the client's first stream, opened with `open`; the server's
    /// shutdown and task.
    async fn one_stream<T>(
        open: impl FnOnce(roam::SessionHandle) -> T,
    ) -> (
        T,
        roam::RoamStream,
        roam::SessionHandle,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<io::Result<()>>,
    ) {
        let key = roam_proto::Keypair::generate().unwrap();
        let server_key = key.public();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (streams_tx, mut streams) = tokio::sync::mpsc::unbounded_channel();
        let (shut, shut_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(roam::serve(
            listener,
            roam::ServerConfig::new(roam_proto::ServerConfig {
                keypair: key,
                authorized_keys: None,
                addresses: Vec::new(),
                session: roam_proto::Config::default(),
            }),
            async move {
                let _ = shut_rx.await;
            },
            move |session: roam::SessionHandle| {
                let tx = streams_tx.clone();
                tokio::spawn(async move {
                    let (stream, _) = session.accept_stream().await.unwrap();
                    let _ = tx.send((stream, session));
                });
            },
        ));
        let mut client = roam::ClientConfig::new(roam_proto::ClientConfig {
            keypair: roam_proto::Keypair::generate().unwrap(),
            server_trust: roam_proto::ServerTrust::Pinned(server_key),
            session: roam_proto::Config::default(),
        });
        client.watch_network = false;
        let session = roam::connect(&addr, client).await.unwrap();
        let opened = open(session);
        let (stream, server_session) = streams.recv().await.unwrap();
        (opened, stream, server_session, shut, server)
    }

    /// Pumps `a` to `b` (and back) stopped every 5 ms and restarted from
    /// the states returned, until `a`'s direction is done; with `direct`,
    /// asserts the pump kept no bytes of its own there. Returns the stops.
    async fn pump_with_stops<A: End, B: End>(a: &mut A, b: &mut B, direct: bool) -> usize {
        let (mut ab, mut ba) = (HalfState::default(), HalfState::default());
        let mut stops = 0;
        loop {
            let stop = tokio::time::sleep(std::time::Duration::from_millis(5));
            match pump_until(a, b, ab, ba, stop).await {
                PumpEnd::Finished(_) => unreachable!("the other direction never finishes"),
                PumpEnd::Stopped(x, y) => {
                    stops += 1;
                    assert!(
                        !direct || x.pending.is_empty(),
                        "the direct direction kept bytes"
                    );
                    if x.done {
                        return stops;
                    }
                    (ab, ba) = (x, y);
                }
            }
            assert!(stops < 100_000, "the pump never finished its direction");
        }
    }

    /// Reads `r` to its end 3 KiB at a time, pausing 1 ms every 64 reads
    /// (so that the writer's side fills up and waits).
    async fn read_slowly(mut r: impl AsyncRead + Unpin) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 3072];
        for reads in 1usize.. {
            let n = r.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if reads % 64 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
        got
    }

    /// A roam stream writes its received bytes straight into a socket (no
    /// scratch buffer, nothing kept by the pump): 8 MiB through a target
    /// that reads slowly in small pieces arrive whole and in order, with
    /// the pump stopped and restarted again and again on the way (as a
    /// relay handing over is), and the end of the stream passes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_writes_into_a_slow_socket_every_byte_across_stops() {
        const UPLOAD: usize = 8 << 20;
        let upload: Vec<u8> = (0..UPLOAD).map(|i| (i % 251) as u8).collect();
        let run = async {
            let (mut out, mut stream, _server_session, shut, server) =
                one_stream(|s| s.open_stream(b"").unwrap()).await;
            let up = upload.clone();
            let writer = tokio::spawn(async move {
                out.write_all(&up).await.unwrap();
                out.shutdown().await.unwrap();
                out
            });
            let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let target_addr = target.local_addr().unwrap();
            let reader = tokio::spawn(async move {
                let (c, _) = target.accept().await.unwrap();
                read_slowly(c).await
            });
            let mut tcp = tokio::net::TcpStream::connect(target_addr).await.unwrap();
            let stops = pump_with_stops(&mut stream, &mut tcp, true).await;
            drop(tcp);
            let _keep = writer.await.unwrap();
            let _ = shut.send(());
            let _ = server.await;
            (reader.await.unwrap(), stops)
        };
        let (got, stops) = tokio::time::timeout(std::time::Duration::from_secs(60), run)
            .await
            .expect("8 MiB within 60 s");
        assert_eq!(got.len(), UPLOAD, "bytes at the target");
        assert!(got == upload, "the target got other bytes");
        assert!(stops > 1, "the pump must be stopped on the way");
    }

    /// A socket copied into a roam stream (through the scratch buffer):
    /// 8 MiB from a socket, through a stream whose far end reads slowly
    /// (so the send buffers fill and the pump must wait for room), arrive
    /// whole and in order across stops, and the socket's end finishes the
    /// stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_is_copied_into_a_stream_every_byte_across_stops() {
        const UPLOAD: usize = 8 << 20;
        let upload: Vec<u8> = (0..UPLOAD).map(|i| (i % 251) as u8).collect();
        let run = async {
            let (client, mut stream, _server_session, shut, server) = one_stream(|s| {
                let mut out = s.open_stream(b"").unwrap();
                let opened = tokio::spawn(async move {
                    // The server learns of the stream from its first byte.
                    out.write_all(b"!").await.unwrap();
                    out
                });
                (s, opened)
            })
            .await;
            let (_session, opened) = client;
            let mut back = opened.await.unwrap();
            let source = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let source_addr = source.local_addr().unwrap();
            let up = upload.clone();
            let writer = tokio::spawn(async move {
                let (mut c, _) = source.accept().await.unwrap();
                c.write_all(&up).await.unwrap();
                c.shutdown().await.unwrap();
                c
            });
            let mut tcp = tokio::net::TcpStream::connect(source_addr).await.unwrap();
            let reader = tokio::spawn(async move {
                let got = read_slowly(&mut back).await;
                (got, back)
            });
            let _ = stream.read(&mut [0u8; 1]).await.unwrap();
            let stops = pump_with_stops(&mut tcp, &mut stream, false).await;
            let _keep = writer.await.unwrap();
            let (got, _back) = reader.await.unwrap();
            let _ = shut.send(());
            let _ = server.await;
            (got, stops)
        };
        let (got, stops) = tokio::time::timeout(std::time::Duration::from_secs(60), run)
            .await
            .expect("8 MiB within 60 s");
        assert_eq!(got.len(), UPLOAD, "bytes through the stream");
        assert!(got == upload, "the stream carried other bytes");
        assert!(stops > 1, "the pump must be stopped on the way");
    }

    /// A direction that went idle after push-back holds no buffer.
    #[tokio::test]
    async fn idle_direction_releases_its_buffer() {
        let (mut src, mut r) = tokio::io::duplex(CHUNK);
        let (mut w, mut sink) = tokio::io::duplex(1024);
        let mut half = Half::default();
        src.write_all(&[7u8; 8192]).await.unwrap();
        // The sink takes 1 KiB: the rest waits in `pending`.
        let p = poll_fn(|cx| Poll::Ready(half.poll_copy(cx, &mut r, &mut w))).await;
        assert!(p.is_pending());
        assert!(half.pending.capacity() > 0);
        let mut got = vec![0u8; 8192];
        let mut have = 0;
        while have < got.len() {
            let _ = poll_fn(|cx| Poll::Ready(half.poll_copy(cx, &mut r, &mut w))).await;
            have += sink.read(&mut got[have..]).await.unwrap();
        }
        assert_eq!(got, vec![7u8; 8192]);
        let p = poll_fn(|cx| Poll::Ready(half.poll_copy(cx, &mut r, &mut w))).await;
        assert!(p.is_pending());
        assert_eq!(half.pending.capacity(), 0);
        assert_eq!(half.total, 8192);
    }
}
