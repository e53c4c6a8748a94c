//! The transport seam: what a session's driver reads and writes. A TCP
//! connection it dialed or accepted itself, or one it is handed (a Unix
//! socket, a descriptor adopted from another process), all look the same
//! to the driver.

use std::io;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// How the far end of a Unix-domain transport is named in logs and counted
/// by the per-address session cap: every local client of one socket shares
/// it (`[::]:0`, an address no TCP peer has).
pub const UNIX_PEER: SocketAddr = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0));

/// A stream a session runs over: TCP, or a Unix-domain socket (a local
/// relay's socket, a socket pair, a descriptor handed over by another
/// process). Datagram sockets are not transports.
#[derive(Debug)]
pub enum Transport {
    /// A TCP connection.
    Tcp(TcpStream),
    /// A Unix-domain stream socket.
    Unix(UnixStream),
}

impl Transport {
    /// Gives the socket back as a plain descriptor (out of the runtime, still
    /// connected): the other direction of [`Transport::adopt`].
    pub fn into_fd(self) -> io::Result<OwnedFd> {
        match self {
            Transport::Tcp(s) => s.into_std().map(OwnedFd::from),
            Transport::Unix(s) => s.into_std().map(OwnedFd::from),
        }
    }

    /// Takes over a connected stream socket someone else opened (a
    /// descriptor received over `SCM_RIGHTS`, inherited from a parent, or
    /// restored): TCP (IPv4 or IPv6) or Unix-domain. Must be called within a
    /// tokio runtime. Errors: a socket of another kind (`InvalidInput`), a
    /// descriptor that is not a socket, or a failure to register it.
    pub fn adopt(fd: OwnedFd) -> io::Result<Transport> {
        let sock = socket2::Socket::from(fd);
        if sock.r#type()? != socket2::Type::STREAM {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a stream socket: a session needs a TCP or Unix stream",
            ));
        }
        let domain = sock.local_addr()?.domain();
        sock.set_nonblocking(true)?;
        let fd = OwnedFd::from(sock);
        if domain == socket2::Domain::UNIX {
            Ok(Transport::Unix(UnixStream::from_std(
                std::os::unix::net::UnixStream::from(fd),
            )?))
        } else if domain == socket2::Domain::IPV4 || domain == socket2::Domain::IPV6 {
            Ok(Transport::Tcp(TcpStream::from_std(
                std::net::TcpStream::from(fd),
            )?))
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a TCP or Unix-domain socket",
            ))
        }
    }

    /// The peer's address: the TCP peer, or [`UNIX_PEER`] for a Unix socket.
    pub fn peer(&self) -> io::Result<SocketAddr> {
        match self {
            Transport::Tcp(s) => s.peer_addr(),
            Transport::Unix(_) => Ok(UNIX_PEER),
        }
    }

    /// The TCP connection, if this is one (socket options apply to it only).
    pub(crate) fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Transport::Tcp(s) => Some(s),
            Transport::Unix(_) => None,
        }
    }

    /// Waits until the socket is readable (or failed).
    pub(crate) fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Transport::Tcp(s) => s.poll_read_ready(cx),
            Transport::Unix(s) => s.poll_read_ready(cx),
        }
    }

    /// Writes what the socket takes now, without waiting.
    pub(crate) fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Tcp(s) => s.try_write(buf),
            Transport::Unix(s) => s.try_write(buf),
        }
    }
}

/// Where a server accepts its transports: a TCP listener, or a Unix-domain
/// socket's (for local clients: `roam::connect("unix:PATH", ...)`).
#[derive(Debug)]
pub enum Listener {
    /// TCP connections.
    Tcp(TcpListener),
    /// Unix-domain connections; their peers are all [`UNIX_PEER`].
    Unix(UnixListener),
}

impl Listener {
    /// The next connection and its peer's address ([`UNIX_PEER`] for Unix).
    pub(crate) async fn accept(&self) -> io::Result<(Transport, SocketAddr)> {
        match self {
            Listener::Tcp(l) => l.accept().await.map(|(s, a)| (s.into(), a)),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| (s.into(), UNIX_PEER)),
        }
    }
}

impl From<TcpListener> for Listener {
    fn from(l: TcpListener) -> Self {
        Listener::Tcp(l)
    }
}

impl From<UnixListener> for Listener {
    fn from(l: UnixListener) -> Self {
        Listener::Unix(l)
    }
}

/// The address a transport's peer is given to the protocol core as: none
/// for a Unix socket (it has no network address to report or change).
pub(crate) fn network_peer(peer: SocketAddr) -> Option<SocketAddr> {
    (peer != UNIX_PEER).then_some(peer)
}

impl From<TcpStream> for Transport {
    fn from(s: TcpStream) -> Self {
        Transport::Tcp(s)
    }
}

impl From<UnixStream> for Transport {
    fn from(s: UnixStream) -> Self {
        Transport::Unix(s)
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Adopted descriptors become the right kind of transport, carry bytes,
    /// and a datagram socket is refused with a clear error.
    #[tokio::test]
    async fn adopted_descriptors_carry_bytes_and_datagrams_are_refused() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut t = Transport::adopt(OwnedFd::from(a)).unwrap();
        assert!(matches!(t, Transport::Unix(_)));
        assert_eq!(t.peer().unwrap(), UNIX_PEER);
        t.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 5];
        std::io::Read::read_exact(&mut b, &mut got).unwrap();
        assert_eq!(&got, b"hello");

        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut t = Transport::adopt(OwnedFd::from(c)).unwrap();
        assert!(matches!(t, Transport::Tcp(_)));
        assert_eq!(t.peer().unwrap(), l.local_addr().unwrap());
        std::io::Write::write_all(&mut s, b"back").unwrap();
        let mut got = [0u8; 4];
        t.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"back");

        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = Transport::adopt(OwnedFd::from(u)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("not a stream socket"), "{e}");
    }
}
