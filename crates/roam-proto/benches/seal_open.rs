//! Data path throughput: application `write` on a client stream, `poll_transmit`
//! (frame encoding and AES-256-GCM sealing into the caller's buffer), server
//! `handle_input` (opening and frame decoding), server `read`. The server's
//! acknowledgements and window updates flow back each iteration, so the
//! numbers include the whole steady-state loop of two established sessions.
//!
//! The peer measured in the same run is `aead_only`: sealing and opening the
//! same bytes with the same cipher, in records of the same maximum size, and
//! nothing else. The ratio `roam / aead_only` is the protocol's own cost.
//!
//! Run: `cargo bench -p roam-proto --bench seal_open`. Before the benchmarks it
//! prints the bytes on the wire per 100-byte write.
//!
//! Measured on the 2-core development machine while other builds ran (so
//! noisy), `--warm-up-time 1 --measurement-time 3`:
//!
//! | write  | roam           | aead_only      | roam / aead_only |
//! |--------|----------------|----------------|------------------|
//! | 100 B  | 89-97 MiB/s    | 194-203 MiB/s  | 0.47             |
//! | 64 KiB | 1.49-1.59 GiB/s| 1.56-1.79 GiB/s| 0.92             |
//!
//! With the RustCrypto `aes-gcm` crate the record layer used before, the same
//! run gave 49-55 MiB/s at 100 B and 407-483 MiB/s at 64 KiB (aead_only
//! 570-630 MiB/s): `ring`'s AES-GCM made the whole loop 1.8x and 3.5x faster.
//!
//! Small writes pay per-record costs (one AEAD call each way plus session
//! bookkeeping); large ones are bound by AES-GCM itself. On the wire a
//! 100-byte write costs 126 bytes in steady state: 2-byte length, 16-byte tag
//! and an 8-byte `DATA` header (4-byte offset varint once past 16 KiB).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use roam_proto::record::{MAX_PLAINTEXT, TAG_LEN};
use roam_proto::{
    route_opening, ClientConfig, Config, Event, Keypair, Opening, ServerConfig, ServerTrust,
    Session, StreamId, TransportId,
};

/// Simulated time between two writes; the sessions never read a real clock.
const TICK: Duration = Duration::from_micros(10);

/// Application write sizes measured.
const SIZES: [(usize, &str); 2] = [(100, "100B"), (64 * 1024, "64KiB")];

/// Two established sessions joined by in-memory buffers.
struct Pair {
    now: Instant,
    client: Session,
    server: Session,
    client_tid: TransportId,
    server_tid: TransportId,
    /// The client's stream, and the same stream as the server names it.
    stream: StreamId,
    /// Client to server bytes of the current step.
    wire: Vec<u8>,
    /// Server to client bytes of the current step.
    back: Vec<u8>,
    read_buf: Vec<u8>,
    /// Totals, for the overhead report.
    wire_total: u64,
    back_total: u64,
}

fn drain_events(s: &mut Session) -> bool {
    let mut connected = false;
    while let Some(e) = s.poll_event() {
        connected |= matches!(e, Event::Connected { .. });
    }
    connected
}

impl Pair {
    fn new() -> Self {
        let now = Instant::now();
        let server_key = Keypair::generate().expect("random");
        let server_config = ServerConfig {
            keypair: server_key.clone(),
            authorized_keys: None,
            addresses: Vec::new(),
            session: Config::default(),
        };
        let mut client = Session::client(ClientConfig {
            keypair: Keypair::generate().expect("random"),
            server_trust: ServerTrust::Pinned(server_key.public()),
            session: Config::default(),
        });
        let client_tid = client.connect(now, None).expect("connect");
        let mut hello = Vec::new();
        while client.poll_transmit(now, &mut hello).is_some() {}
        let Opening::New { hello: h, used } = route_opening(&hello) else {
            panic!("the client's opening is a whole new-session hello");
        };
        let (server, server_tid) = Session::accept(&server_config, now, &h, None).expect("accept");
        let mut pair = Pair {
            now,
            client,
            server,
            client_tid,
            server_tid,
            stream: StreamId(0),
            wire: hello[used..].to_vec(),
            back: Vec::new(),
            read_buf: vec![0; 128 * 1024],
            wire_total: 0,
            back_total: 0,
        };
        let (mut client_up, mut server_up) = (false, false);
        for _ in 0..8 {
            pair.exchange();
            client_up |= drain_events(&mut pair.client);
            server_up |= drain_events(&mut pair.server);
            if client_up && server_up {
                break;
            }
        }
        assert!(client_up && server_up, "handshake did not complete");
        pair.stream = pair.client.open_stream(b"bench").expect("open stream");
        pair.transfer(b"x");
        pair.wire_total = 0;
        pair.back_total = 0;
        pair
    }

    /// Moves whatever each side has to send to the other, once each way.
    fn exchange(&mut self) {
        let now = self.now;
        while self.client.poll_transmit(now, &mut self.wire).is_some() {}
        if !self.wire.is_empty() {
            self.wire_total += self.wire.len() as u64;
            self.server
                .handle_input(now, self.server_tid, &self.wire)
                .expect("server input");
            self.wire.clear();
        }
        while self.server.poll_transmit(now, &mut self.back).is_some() {}
        if !self.back.is_empty() {
            self.back_total += self.back.len() as u64;
            self.client
                .handle_input(now, self.client_tid, &self.back)
                .expect("client input");
            self.back.clear();
        }
    }

    /// One application write of `data`, delivered and read on the other side.
    fn transfer(&mut self, data: &[u8]) {
        let mut written = 0;
        let mut read = 0;
        while read < data.len() {
            self.now += TICK;
            written += self
                .client
                .write(self.stream, &data[written..])
                .expect("write");
            self.exchange();
            while let Some(n) = self
                .server
                .read(self.stream, &mut self.read_buf)
                .expect("read")
            {
                black_box(&self.read_buf[..n]);
                read += n;
                if n == 0 {
                    break;
                }
            }
        }
        assert_eq!(read, data.len());
        drain_events(&mut self.client);
        drain_events(&mut self.server);
    }
}

/// The peer: AES-256-GCM (`ring`, as the record layer) seal and open of the
/// same bytes, nothing else.
struct AeadOnly {
    cipher: LessSafeKey,
    nonce: u64,
    buf: Vec<u8>,
}

impl AeadOnly {
    fn new() -> Self {
        let key = UnboundKey::new(&AES_256_GCM, &[7u8; 32]).expect("key");
        Self {
            cipher: LessSafeKey::new(key),
            nonce: 0,
            buf: Vec::new(),
        }
    }

    fn transfer(&mut self, data: &[u8]) {
        for chunk in data.chunks(MAX_PLAINTEXT) {
            self.buf.clear();
            self.buf.extend_from_slice(chunk);
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&self.nonce.to_be_bytes());
            self.nonce += 1;
            let tag = self
                .cipher
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key(n),
                    Aad::empty(),
                    &mut self.buf,
                )
                .expect("seal");
            self.cipher
                .open_in_place_separate_tag(
                    Nonce::assume_unique_for_key(n),
                    Aad::empty(),
                    tag,
                    &mut self.buf,
                    0..,
                )
                .expect("open");
            black_box(&self.buf);
        }
    }
}

/// Bytes on the wire per 100-byte write, printed once.
fn wire_overhead(_c: &mut Criterion) {
    let mut pair = Pair::new();
    let payload = [0xabu8; 100];
    pair.transfer(&payload);
    let first = pair.wire_total;
    const WRITES: u64 = 10_000;
    pair.wire_total = 0;
    pair.back_total = 0;
    for _ in 0..WRITES {
        pair.transfer(&payload);
    }
    println!(
        "wire overhead per 100-byte write: first write {first} B client->server \
         ({} B over the payload; a record adds {} B: 2-byte length + {TAG_LEN}-byte tag, \
         plus the DATA frame header); steady state over {WRITES} writes {:.1} B client->server \
         and {:.1} B server->client (ACKs, window updates)",
        first - 100,
        2 + TAG_LEN,
        pair.wire_total as f64 / WRITES as f64,
        pair.back_total as f64 / WRITES as f64,
    );
}

fn seal_open(c: &mut Criterion) {
    let mut group = c.benchmark_group("seal_open");
    for (size, label) in SIZES {
        let data = vec![0x5au8; size];
        group.throughput(Throughput::Bytes(size as u64));
        let mut pair = Pair::new();
        group.bench_with_input(BenchmarkId::new("roam", label), &data, |b, data| {
            b.iter(|| pair.transfer(data));
        });
        let mut peer = AeadOnly::new();
        group.bench_with_input(BenchmarkId::new("aead_only", label), &data, |b, data| {
            b.iter(|| peer.transfer(data));
        });
    }
    group.finish();
}

/// Private, so the undocumented `pub fn` that `criterion_group!` generates is not public API.
mod group {
    use super::{seal_open, wire_overhead};
    criterion::criterion_group!(benches, wire_overhead, seal_open);
}
criterion_main!(group::benches);
