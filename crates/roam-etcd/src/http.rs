//! A minimal HTTP/1.1 client for the gateway: one POST per connection
//! (`Connection: close`), JSON body with `Content-Length`; the response may be
//! framed by `Content-Length`, `Transfer-Encoding: chunked` or the end of the
//! connection.
//!
//! The response is read by [`ResponseReader`], which holds no socket: `post`
//! reads and pushes what arrives, the `etcd_client` fuzz target pushes its
//! input the same way.

use std::io;
use std::mem;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest response accepted (headers and body). Fuzzing builds
/// (`cfg(fuzzing)`) use limits small enough for the fuzzer's inputs to reach.
pub(crate) const MAX_RESPONSE: usize = if cfg!(fuzzing) { 3000 } else { 64 << 20 };
/// Largest header block accepted (status line, headers and the blank line).
const MAX_HEADERS: usize = if cfg!(fuzzing) { 1000 } else { 64 << 10 };
/// Longest chunk-size line accepted (size and extensions, without its CRLF).
const MAX_CHUNK_LINE: usize = 1024;

/// A complete response.
#[derive(Debug, PartialEq, Eq)]
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

    let mut reader = ResponseReader::new();
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        let n = stream.read(&mut chunk).await.map_err(HttpError::Io)?;
        if n == 0 {
            return reader.finish();
        }
        if let Some(response) = reader.push(&chunk[..n])? {
            return Ok(response);
        }
    }
}

/// Reads one HTTP/1.1 response from bytes pushed as they arrive; holds no
/// socket and no clock.
///
/// [`push`](Self::push) each received piece: the answer is `Ok(None)` while
/// more is needed, then the [`Response`] or an [`HttpError`]; at the end of
/// the connection, [`finish`](Self::finish) gives the answer a close makes
/// (the body of a response framed by the close, or an error). The answer
/// depends only on the bytes, never on how they were split: every decision
/// (limits included) is a function of the bytes received so far. Bytes after
/// the end of the response are ignored.
///
/// Each byte is looked at a bounded number of times: the search for the end of
/// the headers and the chunk parser resume where they stopped.
#[derive(Debug)]
pub(crate) struct ResponseReader {
    /// The response's bytes so far; never more than [`MAX_RESPONSE`].
    buf: Vec<u8>,
    state: State,
}

#[derive(Debug)]
enum State {
    /// Before the blank line that ends the headers; `buf[..scanned]` was
    /// searched for it (a terminator may still straddle `scanned`).
    Head { scanned: usize },
    /// Headers read; the body starts at `buf[start]`.
    Body {
        status: u16,
        start: usize,
        framing: BodyFraming,
    },
    /// The answer was given.
    Spent,
}

/// How the body ends, with the chunk parser's progress.
#[derive(Debug)]
enum BodyFraming {
    Length(usize),
    Chunked(Dechunker),
    Close,
}

impl ResponseReader {
    /// A reader waiting for the status line.
    pub(crate) fn new() -> ResponseReader {
        ResponseReader {
            buf: Vec::with_capacity(4096),
            state: State::Head { scanned: 0 },
        }
    }

    /// Takes the next received bytes: `Ok(None)` while the response is
    /// incomplete. After a response or an error the reader is spent (another
    /// push is an error).
    pub(crate) fn push(&mut self, data: &[u8]) -> Result<Option<Response>, HttpError> {
        if matches!(self.state, State::Spent) {
            return Err(spent());
        }
        // Bytes beyond the limit are not looked at: a response that ends
        // within it is read, whatever follows it.
        let take = data.len().min(MAX_RESPONSE - self.buf.len());
        self.buf.extend_from_slice(&data[..take]);
        let answer = match self.advance() {
            Ok(None) if take < data.len() => Err(HttpError::Protocol(format!(
                "response larger than {MAX_RESPONSE} bytes"
            ))),
            other => other,
        };
        if !matches!(answer, Ok(None)) {
            self.state = State::Spent;
        }
        answer
    }

    /// The connection closed: the response if it was framed by the close (or
    /// complete, which a push already answered), else why it is incomplete.
    pub(crate) fn finish(mut self) -> Result<Response, HttpError> {
        let eof = |msg: String| HttpError::Io(io::Error::new(io::ErrorKind::UnexpectedEof, msg));
        match mem::replace(&mut self.state, State::Spent) {
            State::Head { .. } => Err(eof(if self.buf.is_empty() {
                "connection closed without a response".to_string()
            } else {
                "connection closed inside the response headers".to_string()
            })),
            State::Body {
                status,
                start,
                framing: BodyFraming::Close,
            } => {
                self.buf.drain(..start);
                Ok(Response {
                    status,
                    body: self.buf,
                })
            }
            State::Body { status, start, .. } => Err(eof(format!(
                "connection closed inside the response body (status {status}, {} body bytes read)",
                self.buf.len() - start
            ))),
            State::Spent => Err(spent()),
        }
    }

    /// Parses what the last push added.
    fn advance(&mut self) -> Result<Option<Response>, HttpError> {
        if let State::Head { scanned } = &mut self.state {
            // A header block ending beyond MAX_HEADERS is refused, so the
            // search stops there.
            let limit = self.buf.len().min(MAX_HEADERS);
            let from = scanned.saturating_sub(3);
            let Some(end) = find(&self.buf[from..limit], b"\r\n\r\n").map(|i| from + i) else {
                *scanned = limit;
                if self.buf.len() > MAX_HEADERS {
                    return Err(HttpError::Protocol(format!(
                        "response headers longer than {MAX_HEADERS} bytes"
                    )));
                }
                return Ok(None);
            };
            let head = parse_head(&self.buf[..end])?;
            self.state = State::Body {
                status: head.status,
                start: end + 4,
                framing: match head.framing {
                    Framing::Length(len) => BodyFraming::Length(len),
                    Framing::Chunked => BodyFraming::Chunked(Dechunker::default()),
                    Framing::Close => BodyFraming::Close,
                },
            };
        }
        let State::Body {
            status,
            start,
            framing,
        } = &mut self.state
        else {
            return Ok(None);
        };
        let rest = &self.buf[*start..];
        let body = match framing {
            BodyFraming::Length(len) if rest.len() >= *len => {
                let len = *len;
                let mut body = mem::take(&mut self.buf);
                body.drain(..*start);
                body.truncate(len);
                body
            }
            BodyFraming::Chunked(d) => match d.advance(rest)? {
                Some(body) => body,
                None => return Ok(None),
            },
            BodyFraming::Length(_) | BodyFraming::Close => return Ok(None),
        };
        Ok(Some(Response {
            status: *status,
            body,
        }))
    }
}

fn spent() -> HttpError {
    HttpError::Protocol("response reader used after its answer".to_string())
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
    framing: Framing,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Parses the status line and headers: `block` is everything before the
/// blank line (`\r\n\r\n`) that ends them.
fn parse_head(block: &[u8]) -> Result<Head, HttpError> {
    let text = std::str::from_utf8(block)
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
            let len = parse_digits(value, 10).ok_or_else(|| {
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
    Ok(Head { status, framing })
}

/// A chunked body's parser. It is handed the whole body received so far each
/// time (the same bytes, more of them) and resumes where it stopped: only
/// whole size lines, whole chunks with their CRLF and whole trailer lines are
/// consumed, and a line's end is searched for only in bytes not yet searched.
#[derive(Debug, Default)]
struct Dechunker {
    /// Body bytes consumed.
    pos: usize,
    /// Bytes after `pos` already searched for a CRLF without finding one
    /// (a CRLF may still straddle their end).
    scanned: usize,
    /// What comes at `pos`.
    phase: Phase,
    /// The chunks' data so far.
    body: Vec<u8>,
}

#[derive(Debug, Default, Clone, Copy)]
enum Phase {
    /// A chunk-size line.
    #[default]
    Size,
    /// A chunk's data of this many bytes, then CRLF.
    Data(usize),
    /// Trailer lines after the last chunk, up to a blank line.
    Trailers,
}

impl Dechunker {
    /// Parses on from where the last call stopped: the de-chunked body once
    /// the last chunk and its trailers are complete, `None` before.
    fn advance(&mut self, buf: &[u8]) -> Result<Option<Vec<u8>>, HttpError> {
        loop {
            match self.phase {
                Phase::Size => {
                    let Some(line) = self.line(buf) else {
                        // Whatever comes, the line is longer than the limit.
                        if buf.len() - self.pos > MAX_CHUNK_LINE + 1 {
                            return Err(HttpError::Protocol(
                                "chunk size line too long".to_string(),
                            ));
                        }
                        return Ok(None);
                    };
                    if line.len() > MAX_CHUNK_LINE {
                        return Err(HttpError::Protocol("chunk size line too long".to_string()));
                    }
                    let size_text = line.split(|&c| c == b';').next().unwrap_or(b"");
                    let size_text = std::str::from_utf8(size_text)
                        .ok()
                        .map(str::trim)
                        .unwrap_or("");
                    let size = parse_digits(size_text, 16)
                        .filter(|&s| s <= MAX_RESPONSE)
                        .ok_or_else(|| {
                            HttpError::Protocol(format!(
                                "bad chunk size line {:?}",
                                truncate(&String::from_utf8_lossy(line))
                            ))
                        })?;
                    self.phase = if size == 0 {
                        Phase::Trailers
                    } else {
                        Phase::Data(size)
                    };
                }
                Phase::Data(size) => {
                    if buf.len() - self.pos < size + 2 {
                        return Ok(None);
                    }
                    let data = &buf[self.pos..self.pos + size];
                    if &buf[self.pos + size..self.pos + size + 2] != b"\r\n" {
                        return Err(HttpError::Protocol(
                            "chunk not followed by CRLF".to_string(),
                        ));
                    }
                    self.body.extend_from_slice(data);
                    self.pos += size + 2;
                    self.phase = Phase::Size;
                }
                Phase::Trailers => {
                    let Some(line) = self.line(buf) else {
                        return Ok(None);
                    };
                    if line.is_empty() {
                        return Ok(Some(mem::take(&mut self.body)));
                    }
                }
            }
        }
    }

    /// The line at `pos` without its CRLF, consumed; `None` while its CRLF
    /// has not come.
    fn line<'a>(&mut self, buf: &'a [u8]) -> Option<&'a [u8]> {
        let from = self.pos + self.scanned;
        match find(&buf[from..], b"\r\n") {
            Some(i) => {
                let line = &buf[self.pos..from + i];
                self.pos = from + i + 2;
                self.scanned = 0;
                Some(line)
            }
            None => {
                // The last byte may be the CR of a CRLF.
                self.scanned = (buf.len() - self.pos).saturating_sub(1);
                None
            }
        }
    }
}

/// `text` as a number in `radix` if it is digits only: HTTP's lengths and
/// chunk sizes have no sign (`str::parse` and `from_str_radix` take a `+`).
fn parse_digits(text: &str, radix: u32) -> Option<usize> {
    if text.is_empty() || !text.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    usize::from_str_radix(text, radix).ok()
}

fn truncate(s: &str) -> String {
    s.chars().take(120).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// De-chunks a whole chunked body at once: `None` while incomplete.
    fn dechunk(buf: &[u8]) -> Result<Option<Vec<u8>>, HttpError> {
        Dechunker::default().advance(buf)
    }

    /// Parses the status line and headers once they are complete (`None` before).
    fn parse_head(buf: &[u8]) -> Result<Option<Head>, HttpError> {
        match find(buf, b"\r\n\r\n") {
            Some(end) => super::parse_head(&buf[..end]).map(Some),
            None => Ok(None),
        }
    }

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

    /// A final answer, comparable: the response, or the error's kind and text.
    fn render(r: Result<Response, HttpError>) -> Result<Response, String> {
        r.map_err(|e| match e {
            HttpError::Io(e) => format!("io {:?}: {e}", e.kind()),
            HttpError::Protocol(m) => format!("protocol: {m}"),
            HttpError::Connect(e) => format!("connect: {e}"),
        })
    }

    /// Pushes `pieces` in order, then closes the connection unless answered.
    fn read(pieces: &[&[u8]]) -> Result<Response, String> {
        let mut reader = ResponseReader::new();
        for piece in pieces {
            match reader.push(piece) {
                Ok(None) => {}
                Ok(Some(response)) => return Ok(response),
                Err(e) => return render(Err(e)),
            }
        }
        render(reader.finish())
    }

    /// The answer to `bytes` pushed at once, checked to be the same when
    /// they are split in two at every position, and pushed byte by byte.
    fn read_split(bytes: &[u8]) -> Result<Response, String> {
        let whole = read(&[bytes]);
        for i in 0..=bytes.len() {
            assert_eq!(read(&[&bytes[..i], &bytes[i..]]), whole, "split at {i}");
        }
        let bytes: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(read(&bytes), whole, "byte by byte");
        whole
    }

    fn ok(status: u16, body: &[u8]) -> Result<Response, String> {
        Ok(Response {
            status,
            body: body.to_vec(),
        })
    }

    #[test]
    fn reads_each_framing() {
        // Content-Length: what follows the body is not looked at.
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 junk"),
            ok(200, b"hello")
        );
        // Chunked, with an extension and a trailer; it wins over a length.
        assert_eq!(
            read_split(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n\
                  3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nTrailer: t\r\n\r\nrest"
            ),
            ok(200, b"abcde")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            ok(200, b"")
        );
        // The end of the connection.
        assert_eq!(
            read_split(b"HTTP/1.0 404 Not Found\r\nServer: x\r\n\r\n{\"a\":1}\r\n\r\n"),
            ok(404, b"{\"a\":1}\r\n\r\n")
        );
        assert_eq!(read_split(b"HTTP/1.1 200 OK\r\n\r\n"), ok(200, b""));
        // No body whatever the headers say.
        for status in [100, 204, 304] {
            let response =
                format!("HTTP/1.1 {status} X\r\nContent-Length: 3\r\n\r\nabc").into_bytes();
            assert_eq!(read_split(&response), ok(status, b""));
        }
        // A status line without a reason.
        assert_eq!(
            read_split(b"HTTP/1.1 200\r\ncontent-length: 0\r\n\r\n"),
            ok(200, b"")
        );
    }

    #[test]
    fn refuses_each_error() {
        let io = |m: &str| Err(format!("io UnexpectedEof: {m}"));
        let protocol = |m: &str| Err(format!("protocol: {m}"));
        assert_eq!(read_split(b""), io("connection closed without a response"));
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Le"),
            io("connection closed inside the response headers")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel"),
            io("connection closed inside the response body (status 200, 3 body bytes read)")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"),
            io("connection closed inside the response body (status 503, 8 body bytes read)")
        );
        assert_eq!(
            read_split(b"SSH-2.0-x\r\n\r\n"),
            protocol("not an HTTP/1.x response: \"SSH-2.0-x\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 99 X\r\n\r\n"),
            protocol("bad status line \"HTTP/1.1 99 X\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"),
            protocol("bad header line \"no colon\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nX: \xff\r\n\r\n"),
            protocol("response headers are not UTF-8")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
            protocol("unsupported transfer-encoding \"gzip\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
            protocol("bad content-length \"-1\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello"),
            protocol("bad content-length \"+5\"")
        );
        assert_eq!(
            read_split(b"HTTP/1.1 200 OK\r\nContent-Length: 67108865\r\n\r\n"),
            protocol("content-length 67108865 larger than 67108864 bytes")
        );
        let chunked = |body: &[u8]| {
            let mut r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            r.extend_from_slice(body);
            r
        };
        assert_eq!(
            read_split(&chunked(b"zz\r\n")),
            protocol("bad chunk size line \"zz\"")
        );
        assert_eq!(
            read_split(&chunked(b"+3\r\nabc\r\n0\r\n\r\n")),
            protocol("bad chunk size line \"+3\"")
        );
        assert_eq!(
            read_split(&chunked(b"4000001\r\n")),
            protocol("bad chunk size line \"4000001\"")
        );
        assert_eq!(
            read_split(&chunked(b"1\r\nabc\r\n")),
            protocol("chunk not followed by CRLF")
        );
        // Too long whether or not its end has come (one byte more than the
        // limit may be the CR of its CRLF).
        let mut line = vec![b'0'; MAX_CHUNK_LINE + 2];
        assert_eq!(
            read(&[&chunked(&line)]),
            protocol("chunk size line too long")
        );
        line.pop();
        line.extend_from_slice(b"\r\n\r\n");
        assert_eq!(
            read_split(&chunked(&line)),
            protocol("chunk size line too long")
        );
        line.truncate(MAX_CHUNK_LINE);
        line.extend_from_slice(b"\r\n\r\n");
        assert_eq!(read(&[&chunked(&line)]), ok(200, b""));
    }

    /// Found by the split property: the old loop checked the header limit
    /// only while the blank line had not come, so a header block longer than
    /// MAX_HEADERS arriving in one read was accepted, and refused when it
    /// came in smaller reads.
    #[test]
    fn header_limit_does_not_depend_on_reads() {
        let block = |len: usize| {
            let mut r = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
            r.resize(len - 4, b'a');
            r.extend_from_slice(b"\r\n\r\nbody");
            r
        };
        let too_long = Err(format!(
            "protocol: response headers longer than {MAX_HEADERS} bytes"
        ));
        let longest = block(MAX_HEADERS);
        assert_eq!(read(&[&longest]), ok(200, b"body"));
        let pieces: Vec<&[u8]> = longest.chunks(1000).collect();
        assert_eq!(read(&pieces), ok(200, b"body"));
        let over = block(MAX_HEADERS + 1);
        assert_eq!(read(&[&over]), too_long);
        let pieces: Vec<&[u8]> = over.chunks(1000).collect();
        assert_eq!(read(&pieces), too_long);
        assert_eq!(read(&[&over[..MAX_HEADERS + 1]]), too_long);
        assert_eq!(
            read(&[&over[..MAX_HEADERS]]),
            Err("io UnexpectedEof: connection closed inside the response headers".to_string())
        );
    }

    #[test]
    fn response_limit_counts_only_the_response() {
        let head = b"HTTP/1.1 200 OK\r\n\r\n";
        let mut bytes = head.to_vec();
        bytes.resize(MAX_RESPONSE, b'x');
        // Up to the limit, then closed: read.
        let mut reader = ResponseReader::new();
        assert!(reader.push(&bytes[..1000]).unwrap().is_none());
        assert!(reader.push(&bytes[1000..]).unwrap().is_none());
        let response = reader.finish().unwrap();
        assert_eq!(response.body.len(), MAX_RESPONSE - head.len());
        // One byte more, in one push or another.
        let too_large = Err(format!(
            "protocol: response larger than {MAX_RESPONSE} bytes"
        ));
        bytes.push(b'x');
        assert_eq!(read(&[&bytes]), too_large);
        assert_eq!(read(&[&bytes[..MAX_RESPONSE], b"x"]), too_large);
        // A response that ends within the limit is read whatever follows.
        let mut bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
        bytes.resize(MAX_RESPONSE + 10, b'x');
        assert_eq!(read(&[&bytes]), ok(200, b"ok"));
    }

    #[test]
    fn a_spent_reader_answers_an_error() {
        let mut reader = ResponseReader::new();
        let response = reader
            .push(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            .unwrap();
        assert_eq!(
            response,
            Some(Response {
                status: 200,
                body: Vec::new()
            })
        );
        assert_eq!(
            render(reader.push(b"more").map(|_| unreachable!())),
            Err("protocol: response reader used after its answer".to_string())
        );
        assert!(reader.finish().is_err());
    }

    /// A long body pushed in small pieces: each push looks only at its own
    /// bytes (the old loop re-scanned and re-de-chunked everything it had).
    #[test]
    fn reads_a_long_chunked_body_in_small_pieces() {
        let mut bytes = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        let mut expected = Vec::new();
        for i in 0..2000u32 {
            let data = i.to_string().repeat(100);
            bytes.extend_from_slice(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes());
            expected.extend_from_slice(data.as_bytes());
        }
        bytes.extend_from_slice(b"0\r\n\r\n");
        let pieces: Vec<&[u8]> = bytes.chunks(7).collect();
        assert_eq!(read(&pieces), ok(200, &expected));
    }
}
