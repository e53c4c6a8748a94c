//! A minimal HTTP/1.1 client for the gateway: one POST per connection
//! (`Connection: close`), JSON body with `Content-Length`; the response may be
//! framed by `Content-Length`, `Transfer-Encoding: chunked` or the end of the
//! connection.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted (headers and body).
const MAX_RESPONSE: usize = 64 << 20;
/// Largest header block accepted.
const MAX_HEADERS: usize = 64 << 10;

/// A complete response.
#[derive(Debug)]
pub(crate) struct Response {
    /// The status code.
    pub(crate) status: u16,
    /// The body, de-chunked.
    pub(crate) body: Vec<u8>,
}

/// Why a request failed.
#[derive(Debug)]
pub(crate) enum HttpError {
    /// The TCP connection could not be made: nothing was sent, another
    /// endpoint may be tried.
    Connect(io::Error),
    /// The connection failed or closed after it was made, before a whole
    /// answer came (the request may have been applied).
    Io(io::Error),
    /// The peer did not speak HTTP/1.1 as expected.
    Protocol(String),
}

/// POSTs `body` (JSON) to `path` on `addr` (`host:port`) and reads the whole answer.
pub(crate) async fn post(addr: &str, path: &str, body: &[u8]) -> Result<Response, HttpError> {
    let mut stream = TcpStream::connect(addr).await.map_err(HttpError::Connect)?;
    let _ = stream.set_nodelay(true);
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    stream.write_all(&request).await.map_err(HttpError::Io)?;

    let mut buf = Vec::with_capacity(4096);
    let mut head: Option<Head> = None;
    loop {
        let mut chunk = [0u8; 16 << 10];
        let n = stream.read(&mut chunk).await.map_err(HttpError::Io)?;
        let eof = n == 0;
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_RESPONSE {
            return Err(HttpError::Protocol(format!(
                "response larger than {MAX_RESPONSE} bytes"
            )));
        }
        if head.is_none() {
            head = parse_head(&buf)?;
            if head.is_none() {
                if buf.len() > MAX_HEADERS {
                    return Err(HttpError::Protocol(format!(
                        "response headers longer than {MAX_HEADERS} bytes"
                    )));
                }
                if eof {
                    return Err(HttpError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        if buf.is_empty() {
                            "connection closed without a response"
                        } else {
                            "connection closed inside the response headers"
                        },
                    )));
                }
                continue;
            }
        }
        if let Some(h) = &head {
            let rest = &buf[h.len..];
            let body = match h.framing {
                Framing::Length(len) => {
                    if rest.len() >= len {
                        Some(rest[..len].to_vec())
                    } else {
                        None
                    }
                }
                Framing::Chunked => dechunk(rest)?,
                Framing::Close => eof.then(|| rest.to_vec()),
            };
            if let Some(body) = body {
                return Ok(Response {
                    status: h.status,
                    body,
                });
            }
            if eof {
                return Err(HttpError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed inside the response body (status {}, {} body bytes read)",
                        h.status,
                        rest.len()
                    ),
                )));
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

#[derive(Debug)]
struct Head {
    status: u16,
    /// Bytes up to and including the blank line.
    len: usize,
    framing: Framing,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Parses the status line and headers once they are complete (`None` before).
fn parse_head(buf: &[u8]) -> Result<Option<Head>, HttpError> {
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return Ok(None);
    };
    let text = std::str::from_utf8(&buf[..end])
        .map_err(|_| HttpError::Protocol("response headers are not UTF-8".to_string()))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Protocol(format!(
            "not an HTTP/1.x response: {:?}",
            truncate(status_line)
        )));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| {
            HttpError::Protocol(format!("bad status line {:?}", truncate(status_line)))
        })?;
    let mut framing = Framing::Close;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(HttpError::Protocol(format!(
                "bad header line {:?}",
                truncate(line)
            )));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            if value.to_ascii_lowercase().ends_with("chunked") {
                framing = Framing::Chunked;
            } else {
                return Err(HttpError::Protocol(format!(
                    "unsupported transfer-encoding {value:?}"
                )));
            }
        } else if name.eq_ignore_ascii_case("content-length")
            && !matches!(framing, Framing::Chunked)
        {
            let len: usize = value.parse().map_err(|_| {
                HttpError::Protocol(format!("bad content-length {:?}", truncate(value)))
            })?;
            if len > MAX_RESPONSE {
                return Err(HttpError::Protocol(format!(
                    "content-length {len} larger than {MAX_RESPONSE} bytes"
                )));
            }
            framing = Framing::Length(len);
        }
    }
    if (100..200).contains(&status) || status == 204 || status == 304 {
        framing = Framing::Length(0);
    }
    Ok(Some(Head {
        status,
        len: end + 4,
        framing,
    }))
}

/// De-chunks a chunked body: `None` while incomplete.
fn dechunk(buf: &[u8]) -> Result<Option<Vec<u8>>, HttpError> {
    let mut pos = 0;
    let mut chunks: Vec<(usize, usize)> = Vec::new();
    loop {
        let Some(line_end) = find(&buf[pos..], b"\r\n") else {
            if buf.len() - pos > 1024 {
                return Err(HttpError::Protocol("chunk size line too long".to_string()));
            }
            return Ok(None);
        };
        let line = &buf[pos..pos + line_end];
        let size_text = line.split(|&c| c == b';').next().unwrap_or(b"");
        let size_text = std::str::from_utf8(size_text)
            .ok()
            .map(str::trim)
            .unwrap_or("");
        let size = usize::from_str_radix(size_text, 16)
            .ok()
            .filter(|&s| s <= MAX_RESPONSE)
            .ok_or_else(|| {
                HttpError::Protocol(format!(
                    "bad chunk size line {:?}",
                    truncate(&String::from_utf8_lossy(line))
                ))
            })?;
        pos += line_end + 2;
        if size == 0 {
            // Trailers, then a blank line.
            loop {
                let Some(end) = find(&buf[pos..], b"\r\n") else {
                    return Ok(None);
                };
                pos += end + 2;
                if end == 0 {
                    break;
                }
            }
            let mut body = Vec::with_capacity(chunks.iter().map(|c| c.1).sum());
            for (start, len) in chunks {
                body.extend_from_slice(&buf[start..start + len]);
            }
            return Ok(Some(body));
        }
        if buf.len() < pos + size + 2 {
            return Ok(None);
        }
        if &buf[pos + size..pos + size + 2] != b"\r\n" {
            return Err(HttpError::Protocol(
                "chunk not followed by CRLF".to_string(),
            ));
        }
        chunks.push((pos, size));
        pos += size + 2;
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(120).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunks() {
        assert_eq!(dechunk(b"3\r\nabc\r\n").unwrap(), None);
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n").unwrap(),
            Some(b"abcde".to_vec())
        );
        assert_eq!(
            dechunk(b"0\r\nTrailer: x\r\n\r\n").unwrap(),
            Some(Vec::new())
        );
        assert!(dechunk(b"zz\r\n").is_err());
        assert!(dechunk(b"1\r\nabc\r\n").is_err());
    }

    #[test]
    fn parses_heads() {
        let h = parse_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello")
            .unwrap()
            .unwrap();
        assert_eq!(h.status, 404);
        assert!(matches!(h.framing, Framing::Length(5)));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\n").unwrap().is_none());
        assert!(parse_head(b"SSH-2.0-x\r\n\r\n").is_err());
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n").is_err());
    }
}
