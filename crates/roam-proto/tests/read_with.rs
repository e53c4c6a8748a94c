//! `Session::read_with` (received bytes lent to the reader, as a relay
//! writes them straight into its target's socket) against `read`: mixed
//! in any order and any amounts, they deliver every byte once and in order,
//! re-grant the windows (a transfer several windows long completes), end
//! the stream the same way, and take nothing when the borrower fails.

mod common;

use std::time::Instant;

use common::{numbered, pair, pump, server_config};
use proptest::prelude::*;
use roam_proto::{Event, Keypair, Lent, Session, StreamError, StreamId, TransportId};

/// Everything the client sent, after the server opened the stream.
struct Transfer {
    now: Instant,
    client: Session,
    ct: TransportId,
    server: Session,
    st: TransportId,
    /// The client's stream.
    id: StreamId,
    /// The server's side of it, once opened.
    sid: Option<StreamId>,
}

impl Transfer {
    fn new() -> Self {
        let now = Instant::now();
        let key = Keypair::generate().unwrap();
        let (mut client, ct, server, st) = pair(&server_config(&key), &key, now);
        let id = client.open_stream(b"").unwrap();
        Transfer {
            now,
            client,
            ct,
            server,
            st,
            id,
            sid: None,
        }
    }

    /// Moves records both ways until quiet, and notes the server's stream.
    fn pump(&mut self) {
        pump(
            self.now,
            &mut self.client,
            self.ct,
            &mut self.server,
            self.st,
        );
        while let Some(ev) = self.server.poll_event() {
            if let Event::StreamOpened { stream } = ev {
                self.sid = Some(stream);
            }
        }
    }
}

/// One way of reading: `read` into a buffer of `len`, or `read_with`
/// taking `take` of what is lent (more than lent means all of it).
#[derive(Debug, Clone)]
enum Reader {
    Read { len: usize },
    Lend { take: usize },
}

fn reader() -> impl Strategy<Value = Reader> {
    prop_oneof![
        (1usize..70_000).prop_map(|len| Reader::Read { len }),
        (0usize..70_000).prop_map(|take| Reader::Lend { take }),
        Just(Reader::Lend { take: usize::MAX }),
    ]
}

/// Reads once the given way; `None` when nothing was readable, `Some(None)`
/// at the end of the stream.
fn read_once(s: &mut Session, id: StreamId, how: &Reader) -> Option<Option<Vec<u8>>> {
    match *how {
        Reader::Read { len } => {
            let mut buf = vec![0u8; len];
            match s.read(id, &mut buf).expect("read") {
                None => None,
                Some(0) => Some(None),
                Some(n) => Some(Some(buf[..n].to_vec())),
            }
        }
        Reader::Lend { take } => {
            let mut got = Vec::new();
            let lent = s.read_with(id, |bytes: &[u8]| {
                assert!(!bytes.is_empty(), "lent an empty piece");
                let n = take.min(bytes.len());
                got.extend_from_slice(&bytes[..n]);
                Ok::<usize, ()>(take)
            });
            match lent.expect("read_with") {
                Lent::Nothing => None,
                Lent::End => Some(None),
                Lent::Lent(Ok(n)) => {
                    assert_eq!(n, got.len(), "the count taken is what was handed over");
                    Some(Some(got))
                }
                Lent::Lent(Err(())) => unreachable!(),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Three stream windows (3 MiB) in writes of the given sizes, read back
    /// with `read` and `read_with` in turn: every byte once, in order, then
    /// the end. Without `read_with` re-granting the window the client could
    /// not get past the first MiB.
    #[test]
    fn read_with_mixed_with_read_delivers_every_byte_and_the_end(
        writes in prop::collection::vec(1usize..200_000, 1..8),
        readers in prop::collection::vec(reader(), 1..12),
    ) {
        let total = 3 << 20;
        let data = numbered(0, (total / 4) as u32);
        let mut t = Transfer::new();
        let mut got = Vec::with_capacity(total);
        let (mut at, mut w, mut r) = (0, 0, 0);
        let mut ended = false;
        for _round in 0..100_000 {
            if at < total {
                let n = writes[w % writes.len()].min(total - at);
                w += 1;
                at += t.client.write(t.id, &data[at..at + n]).expect("write");
                if at == total {
                    t.client.finish_stream(t.id).unwrap();
                }
            }
            t.pump();
            let Some(sid) = t.sid else { continue };
            // Read until nothing is readable, switching ways each time.
            for _ in 0..10_000 {
                let how = &readers[r % readers.len()];
                r += 1;
                match read_once(&mut t.server, sid, how) {
                    None => break,
                    Some(None) => {
                        ended = true;
                        break;
                    }
                    Some(Some(bytes)) => got.extend_from_slice(&bytes),
                }
            }
            if ended {
                break;
            }
        }
        prop_assert!(ended, "the stream never ended: {} of {} bytes read", got.len(), total);
        prop_assert_eq!(got.len(), total);
        prop_assert!(got == data, "the bytes read differ from those written");
    }
}

/// A borrower that fails takes nothing: the same bytes are lent again.
#[test]
fn a_failing_borrower_takes_nothing() {
    let mut t = Transfer::new();
    let data = numbered(0, 1000);
    assert_eq!(t.client.write(t.id, &data), Ok(data.len()));
    t.pump();
    let sid = t.sid.expect("stream opened");
    let first = t
        .server
        .read_with(sid, |b: &[u8]| Err::<usize, _>(b.to_vec()))
        .unwrap();
    assert_eq!(first, Lent::Lent(Err(data.clone())));
    let mut again = Vec::new();
    let second = t.server.read_with(sid, |b: &[u8]| {
        again.extend_from_slice(b);
        Ok::<_, ()>(b.len())
    });
    assert_eq!(second, Ok(Lent::Lent(Ok(data.len()))));
    assert_eq!(again, data);
    assert_eq!(
        t.server.read_with(sid, |_: &[u8]| -> Result<usize, ()> {
            panic!("nothing is left to lend")
        }),
        Ok(Lent::Nothing)
    );
}

/// After the session closed, what arrived before the close is still lent,
/// then the stream ends (the peer finished it) and is forgotten.
#[test]
fn bytes_that_arrived_before_a_close_are_lent_then_the_end() {
    let mut t = Transfer::new();
    let data = numbered(0, 500);
    assert_eq!(t.client.write(t.id, &data), Ok(data.len()));
    t.client.finish_stream(t.id).unwrap();
    t.pump();
    let sid = t.sid.expect("stream opened");
    t.client.close(0, "done");
    t.pump();
    assert_eq!(t.server.state(), roam_proto::State::Closed);
    let mut got = Vec::new();
    let lent = t.server.read_with(sid, |b: &[u8]| {
        got.extend_from_slice(&b[..10]);
        Ok::<_, ()>(10)
    });
    assert_eq!(lent, Ok(Lent::Lent(Ok(10))));
    let lent = t.server.read_with(sid, |b: &[u8]| {
        got.extend_from_slice(b);
        Ok::<_, ()>(b.len())
    });
    assert_eq!(lent, Ok(Lent::Lent(Ok(data.len() - 10))));
    assert_eq!(got, data);
    let end = t.server.read_with(sid, |_: &[u8]| Ok::<_, ()>(0));
    assert_eq!(end, Ok(Lent::End));
    let gone = t.server.read_with(sid, |_: &[u8]| Ok::<_, ()>(0));
    assert_eq!(gone, Err(StreamError::SessionClosed));
}
