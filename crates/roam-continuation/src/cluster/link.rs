//! The host-to-host channel (`docs/PROTOCOL.md` §14.2): TCP, then
//! `Noise_IK_25519_AESGCM_SHA256` — the same primitives as roam's sessions,
//! no new ones. The initiator knows the responder's host key from the
//! cluster file; the responder learns the initiator's key from message 1
//! and accepts it only if the cluster file lists it (a host, or an operator
//! for operator requests). The prologue binds the cluster's name, so a key
//! listed in two clusters cannot carry a message from one to the other.
//!
//! After the handshake a message is a `u32` total length followed by its
//! bytes, cut into Noise transport messages of at most 65,535 bytes, each
//! sent as `u16 length ‖ ciphertext`.

use std::io;

use roam_proto::{Keypair, PublicKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{Msg, MAX_BLOB};

const PATTERN: &str = "Noise_IK_25519_AESGCM_SHA256";
/// First bytes of a cluster connection.
const MAGIC: &[u8; 4] = b"RMCL";
/// Version of this channel.
const LINK_VERSION: u8 = 1;
/// Largest Noise message.
const NOISE_MAX: usize = 65_535;
/// AES-GCM tag length.
const TAG: usize = 16;
/// Largest logical message: a continuation plus the message's own fields.
const MAX_MESSAGE: usize = MAX_BLOB + (1 << 20);

/// Why a cluster connection failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LinkError {
    /// The connection failed or closed.
    Io(io::Error),
    /// The peer does not speak the cluster protocol.
    NotCluster,
    /// The Noise handshake failed: the peer does not hold the key the
    /// cluster file lists for it, or belongs to another cluster.
    Handshake,
    /// The peer's key is in no `host`/`operator` line of our cluster file.
    NotMember(PublicKey),
    /// A message failed authentication or decoding.
    Corrupt(String),
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "cluster connection: {e}"),
            Self::NotCluster => write!(f, "the peer does not speak the roam cluster protocol"),
            Self::Handshake => write!(
                f,
                "cluster handshake failed: the peer does not hold the host key the cluster file lists, or is in another cluster"
            ),
            Self::NotMember(k) => write!(f, "key {k} is not a member of this cluster"),
            Self::Corrupt(what) => write!(f, "cluster message rejected: {what}"),
        }
    }
}

impl std::error::Error for LinkError {}

impl From<io::Error> for LinkError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn prologue(cluster: &str) -> Vec<u8> {
    let mut p = b"roam-cluster/1\0".to_vec();
    p.extend_from_slice(cluster.as_bytes());
    p
}

/// An authenticated, encrypted connection to another host (or operator).
pub struct Link {
    sock: TcpStream,
    noise: snow::TransportState,
    /// The peer's proven key.
    peer: PublicKey,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("peer", &self.peer).finish()
    }
}

async fn read_frame(sock: &mut TcpStream, buf: &mut Vec<u8>) -> Result<(), LinkError> {
    let mut len = [0u8; 2];
    sock.read_exact(&mut len).await?;
    let n = usize::from(u16::from_be_bytes(len));
    buf.resize(n, 0);
    sock.read_exact(buf).await?;
    Ok(())
}

fn frame(out: &mut Vec<u8>, ct: &[u8]) {
    out.extend_from_slice(&(ct.len() as u16).to_be_bytes());
    out.extend_from_slice(ct);
}

impl Link {
    /// Connects to `addr` and proves `me` to the host whose key is `them`.
    pub async fn connect(
        addr: &str,
        cluster: &str,
        me: &Keypair,
        them: &PublicKey,
    ) -> Result<Self, LinkError> {
        let mut sock = TcpStream::connect(addr).await?;
        let _ = sock.set_nodelay(true);
        let private = me.private_bytes();
        let pro = prologue(cluster);
        let mut hs = snow::Builder::new(PATTERN.parse().map_err(|_| LinkError::Handshake)?)
            .local_private_key(&private)
            .and_then(|b| b.remote_public_key(&them.0))
            .and_then(|b| b.prologue(&pro))
            .and_then(|b| b.build_initiator())
            .map_err(|_| LinkError::Handshake)?;
        let mut msg = [0u8; 256];
        let n = hs
            .write_message(&[], &mut msg)
            .map_err(|_| LinkError::Handshake)?;
        let mut out = MAGIC.to_vec();
        out.push(LINK_VERSION);
        frame(&mut out, &msg[..n]);
        sock.write_all(&out).await?;
        let mut head = [0u8; 5];
        sock.read_exact(&mut head).await?;
        if &head[..4] != MAGIC || head[4] != LINK_VERSION {
            return Err(LinkError::NotCluster);
        }
        let mut buf = Vec::new();
        read_frame(&mut sock, &mut buf).await?;
        let mut scratch = [0u8; 256];
        hs.read_message(&buf, &mut scratch)
            .map_err(|_| LinkError::Handshake)?;
        let noise = hs.into_transport_mode().map_err(|_| LinkError::Handshake)?;
        Ok(Self {
            sock,
            noise,
            peer: *them,
            buf,
        })
    }

    /// Answers a connection from another host or an operator: runs the
    /// handshake as responder and returns the link once the peer proved a
    /// key that `member` accepts (the caller looks it up in the cluster
    /// file). A peer whose key is not a member gets no answer at all.
    pub async fn accept(
        mut sock: TcpStream,
        cluster: &str,
        me: &Keypair,
        member: impl Fn(&PublicKey) -> bool,
    ) -> Result<Self, LinkError> {
        let _ = sock.set_nodelay(true);
        let mut head = [0u8; 5];
        sock.read_exact(&mut head).await?;
        if &head[..4] != MAGIC || head[4] != LINK_VERSION {
            return Err(LinkError::NotCluster);
        }
        let mut buf = Vec::new();
        read_frame(&mut sock, &mut buf).await?;
        let private = me.private_bytes();
        let pro = prologue(cluster);
        let mut hs = snow::Builder::new(PATTERN.parse().map_err(|_| LinkError::Handshake)?)
            .local_private_key(&private)
            .and_then(|b| b.prologue(&pro))
            .and_then(|b| b.build_responder())
            .map_err(|_| LinkError::Handshake)?;
        let mut scratch = [0u8; 256];
        hs.read_message(&buf, &mut scratch)
            .map_err(|_| LinkError::Handshake)?;
        let peer = hs
            .get_remote_static()
            .and_then(|k| <[u8; 32]>::try_from(k).ok())
            .map(PublicKey)
            .ok_or(LinkError::Handshake)?;
        if !member(&peer) {
            return Err(LinkError::NotMember(peer));
        }
        let mut msg = [0u8; 256];
        let n = hs
            .write_message(&[], &mut msg)
            .map_err(|_| LinkError::Handshake)?;
        let mut out = MAGIC.to_vec();
        out.push(LINK_VERSION);
        frame(&mut out, &msg[..n]);
        sock.write_all(&out).await?;
        let noise = hs.into_transport_mode().map_err(|_| LinkError::Handshake)?;
        Ok(Self {
            sock,
            noise,
            peer,
            buf,
        })
    }

    /// The peer's proven key.
    pub fn peer(&self) -> PublicKey {
        self.peer
    }

    /// Sends one message.
    pub async fn send(&mut self, msg: &Msg) -> Result<(), LinkError> {
        let body = msg.to_bytes();
        let mut plain = Vec::with_capacity(4 + body.len());
        plain.extend_from_slice(&(body.len() as u32).to_be_bytes());
        plain.extend_from_slice(&body);
        let mut out = Vec::with_capacity(plain.len() + plain.len() / 1000 + 64);
        let mut ct = vec![0u8; NOISE_MAX];
        for chunk in plain.chunks(NOISE_MAX - TAG) {
            let n = self
                .noise
                .write_message(chunk, &mut ct)
                .map_err(|e| LinkError::Corrupt(format!("encrypt: {e}")))?;
            frame(&mut out, &ct[..n]);
        }
        self.sock.write_all(&out).await?;
        Ok(())
    }

    /// Receives one message.
    pub async fn recv(&mut self) -> Result<Msg, LinkError> {
        let mut plain = Vec::new();
        let mut want = None;
        let mut pt = vec![0u8; NOISE_MAX];
        loop {
            read_frame(&mut self.sock, &mut self.buf).await?;
            let n = self
                .noise
                .read_message(&self.buf, &mut pt)
                .map_err(|_| LinkError::Corrupt("failed authentication".into()))?;
            plain.extend_from_slice(&pt[..n]);
            if want.is_none() && plain.len() >= 4 {
                let total = u32::from_be_bytes(plain[..4].try_into().expect("4 bytes")) as usize;
                if total > MAX_MESSAGE {
                    return Err(LinkError::Corrupt(format!("message of {total} bytes")));
                }
                want = Some(total + 4);
            }
            match want {
                Some(w) if plain.len() > w => {
                    return Err(LinkError::Corrupt("bytes past the message's end".into()))
                }
                Some(w) if plain.len() == w => break,
                _ => {}
            }
        }
        Msg::decode(&plain[4..]).map_err(|e| LinkError::Corrupt(e.to_string()))
    }

    /// Sends `msg` and waits for the answer.
    pub async fn call(&mut self, msg: &Msg) -> Result<Msg, LinkError> {
        self.send(msg).await?;
        self.recv().await
    }
}
