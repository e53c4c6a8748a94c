//! Moving a live transport to another process (`docs/PROTOCOL.md` §13.6).
//!
//! A continuation (`export`) leaves the active transport behind: the
//! restored session waits for the peer's resume, a round trip with a fresh
//! handshake. A relay that hands its sessions to a new process (relay
//! takeover) can do better: it passes each connection's descriptor along,
//! and with it this *transport state* — the record keys and nonces, the
//! sequence cursors and the partial record already read — so the new
//! process continues the same connection where the old one stopped. The peer
//! sees a pause, no resume.
//!
//! Format: an [`envelope`](super::envelope) with magic `"RMLT"` and one
//! required section, `transport`. It holds both directions' traffic keys:
//! it must travel only as the continuation does (to a process of the same
//! user, over a Unix socket), never be stored.
//!
//! Only a transport at rest may move: established, both `SYNC`s exchanged,
//! no handshake bytes or `SESSION_INFO` still to send, not retiring, no
//! resume candidate beside it. Anything else is exported without it (the
//! peer resumes, as after any lost transport).

use std::net::SocketAddr;
use std::time::Instant;

use super::envelope::{Envelope, EnvelopeWriter, SectionKind};
use super::transport::{Phase, Transport};
use super::{RestoreError, Session, State};
use crate::codec::{put_lp_bytes, put_varint, Reader};
use crate::event::TransportId;
use crate::handshake::Established;
use crate::record::{RecordCipher, MAX_RECORD};

/// Magic of a transport state blob.
const MAGIC: [u8; 4] = *b"RMLT";

/// The one section of a transport state blob.
const TRANSPORT: SectionKind = SectionKind {
    id: 0x02,
    name: "transport",
    version: 1,
    repeatable: false,
};

/// Most received bytes a moved transport may bring (a partial record).
const MAX_INBUF: usize = 2 + MAX_RECORD;

impl Session {
    /// The active transport's state, for continuing the same connection in
    /// another process (relay takeover): see the module docs. Take it
    /// together with [`Session::export`], after the last `poll_transmit`
    /// whose bytes go with the connection. `None` when the transport is not
    /// at rest (or there is none): then the connection must be dropped and
    /// the peer resumes.
    pub fn export_transport(&self) -> Option<Vec<u8>> {
        if self.state != State::Active || self.pending.is_some() || self.final_close.is_some() {
            return None;
        }
        let t = self.active.as_deref()?;
        let Phase::Open(keys) = &t.phase else {
            return None;
        };
        if !t.may_send
            || !t.sync_sent
            || !t.sync_received
            || t.retire
            || t.info_due
            || t.pending_resume
            || !t.out.is_empty()
            || t.inbuf.len() > MAX_INBUF
        {
            return None;
        }
        let mut w = EnvelopeWriter::new(MAGIC, 160 + t.inbuf.len());
        w.section(&TRANSPORT, |o| {
            put_varint(o, t.id.0);
            put_lp_bytes(
                o,
                t.peer.map(|p| p.to_string()).unwrap_or_default().as_bytes(),
            );
            for c in [&keys.tx, &keys.rx] {
                let (key, nonce) = c.state();
                o.extend_from_slice(key);
                put_varint(o, nonce);
            }
            for v in [
                self.send_cursor,
                self.in_cursor,
                self.ack_sent,
                self.unacked_bytes,
                self.ping_token,
            ] {
                put_varint(o, v);
            }
            match self.pong_due {
                Some(token) => {
                    o.push(1);
                    put_varint(o, token);
                }
                None => o.push(0),
            }
            put_lp_bytes(o, &t.inbuf);
        });
        Some(w.finish())
    }

    /// Continues a connection moved from another process: installs the
    /// transport state `blob` ([`Session::export_transport`]) as this
    /// session's active transport. The session must have just been restored
    /// from the continuation exported with it (suspended, no transport).
    /// The session is active at once and emits no event; the caller feeds
    /// the connection's input to the returned transport and writes first
    /// whatever output the old process had not yet written. Refused (the
    /// session unchanged) when the blob is malformed or the session has a
    /// transport.
    pub fn adopt_transport(
        &mut self,
        now: Instant,
        blob: &[u8],
    ) -> Result<TransportId, RestoreError> {
        if self.active.is_some() || self.pending.is_some() {
            return Err(RestoreError::Invalid("the session already has a transport"));
        }
        if self.state != State::Suspended {
            return Err(RestoreError::Invalid("the session is not suspended"));
        }
        let env = Envelope::open(MAGIC, blob, &[TRANSPORT])?;
        let body = env.require(&TRANSPORT)?;
        let mut r = Reader::new(body);
        let id = TransportId(r.varint()?);
        let peer = r.lp_bytes(64, "peer address")?;
        let peer = if peer.is_empty() {
            None
        } else {
            Some(
                std::str::from_utf8(peer)
                    .ok()
                    .and_then(|p| p.parse::<SocketAddr>().ok())
                    .ok_or(RestoreError::Invalid("peer address"))?,
            )
        };
        let tx_key: [u8; 32] = r.array()?;
        let tx_nonce = r.varint()?;
        let rx_key: [u8; 32] = r.array()?;
        let rx_nonce = r.varint()?;
        let send_cursor = r.varint()?;
        let in_cursor = r.varint()?;
        let ack_sent = r.varint()?;
        let unacked_bytes = r.varint()?;
        let ping_token = r.varint()?;
        let pong_due = match r.u8()? {
            0 => None,
            1 => Some(r.varint()?),
            _ => return Err(RestoreError::Invalid("pong flag")),
        };
        let inbuf = r.lp_bytes(MAX_INBUF, "received bytes")?.to_vec();
        r.finish()
            .map_err(|_| RestoreError::Invalid("transport length"))?;
        // The cursors must fit the restored sequence (§7): nothing sent
        // beyond what was ever sent, nothing acknowledged beyond what was
        // received.
        let high_sent = self.high_sent.max(self.log_base);
        if send_cursor < self.log_base
            || send_cursor > high_sent
            || ack_sent > self.recv_seq
            || in_cursor > self.recv_seq
        {
            return Err(RestoreError::Invalid("transport cursors"));
        }
        let mut t = Transport::new(
            id,
            now,
            peer,
            Phase::Open(Box::new(Established {
                tx: RecordCipher::at(&tx_key, tx_nonce),
                rx: RecordCipher::at(&rx_key, rx_nonce),
            })),
        );
        t.inbuf = inbuf;
        t.may_send = true;
        t.sync_sent = true;
        t.sync_received = true;
        self.active = Some(Box::new(t));
        self.next_transport = self.next_transport.max(id.0 + 1);
        self.peer_addr = peer.or(self.peer_addr);
        self.send_cursor = send_cursor;
        self.in_cursor = in_cursor;
        self.ack_sent = ack_sent;
        self.unacked_bytes = unacked_bytes;
        // Whatever the old process still owed the peer goes out promptly.
        self.ack_now = self.recv_seq > ack_sent;
        self.ack_deadline = None;
        self.ping_token = ping_token;
        self.ping_outstanding = None;
        self.pong_due = pong_due;
        self.suspended_since = None;
        self.state = State::Active;
        Ok(id)
    }
}
