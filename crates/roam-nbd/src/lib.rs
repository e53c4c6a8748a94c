//! The server side of the NBD (Network Block Device) protocol, sans-IO:
//! bytes in, bytes out, no sockets, no clock, no tokio. `roam resume --vm
//! --demand-fetch` serves a VM's disk images to QEMU through it
//! (docs/NBD.md lists the subset; the protocol is NBD's `proto.md`).
//!
//! Two phases, one type each:
//! - [`Handshake`]: the fixed newstyle negotiation. It writes the greeting,
//!   reads the client's flags and options, answers `NBD_OPT_GO`,
//!   `NBD_OPT_INFO`, `NBD_OPT_EXPORT_NAME` and `NBD_OPT_ABORT`, and refuses
//!   every other option with `NBD_REP_ERR_UNSUP` (which clients treat as
//!   "fall back"). It ends in [`HandshakeEvent::Transmission`] or
//!   [`HandshakeEvent::Closed`].
//! - Transmission: [`decode_request`] reads one request (header and, for a
//!   write, its payload) and checks it against the export: an out-of-range
//!   offset, an oversized length or an unknown command becomes a
//!   [`Refusal`] (answered with an errno in a simple reply, the connection
//!   stays up); a bad magic or a write too large to skip is a fatal
//!   [`NbdError`]. [`encode_simple_reply`] writes the answer.
//!
//! Non-goals: structured replies, block status and metadata contexts, TLS,
//! `NBD_OPT_LIST` (refused as unsupported), resizing, the old-style
//! handshake. Nothing here panics on any input: every length is checked
//! before it is used and every buffer is bounded.

#![forbid(unsafe_code)]

use std::fmt;

/// `NBDMAGIC`: the first eight bytes a server sends.
pub const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: follows [`INIT_MAGIC`] in the greeting and starts every option.
pub const OPTION_MAGIC: u64 = 0x4948_4156_454f_5054;
/// Starts every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Starts every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Starts every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can leave out the 124 zero bytes after
/// `NBD_OPT_EXPORT_NAME`'s answer.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

/// Option `NBD_OPT_EXPORT_NAME`: choose an export and start transmission.
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option `NBD_OPT_ABORT`: the client gives up.
pub const OPT_ABORT: u32 = 2;
/// Option `NBD_OPT_INFO`: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option `NBD_OPT_GO`: describe an export and start transmission.
pub const OPT_GO: u32 = 7;

/// Option reply `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// Option reply `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// Option reply error `NBD_REP_ERR_UNSUP`: the option is not known here.
pub const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
/// Option reply error `NBD_REP_ERR_INVALID`: the option's data is malformed.
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
/// Option reply error `NBD_REP_ERR_UNKNOWN`: no export of that name.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;

/// Info type `NBD_INFO_EXPORT`: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Info type `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: the other flags are valid.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `NBD_CMD_FLUSH` is accepted.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `NBD_CMD_FLAG_FUA` is accepted.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: `NBD_CMD_TRIM` is accepted.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `NBD_CMD_WRITE_ZEROES` is accepted.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;

/// Command flag `NBD_CMD_FLAG_FUA`: the write is durable before the reply.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag `NBD_CMD_FLAG_NO_HOLE`: write zeroes without punching a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Errno `EPERM` in a reply: the export is read-only.
pub const EPERM: u32 = 1;
/// Errno `EIO` in a reply: the server could not read or write the data.
pub const EIO: u32 = 5;
/// Errno `EINVAL` in a reply: a malformed or unknown request.
pub const EINVAL: u32 = 22;
/// Errno `ENOSPC` in a reply: the request runs past the export's end.
pub const ENOSPC: u32 = 28;
/// Errno `EOVERFLOW` in a reply: a read longer than the server sends at once.
pub const EOVERFLOW: u32 = 75;
/// Errno `ENOTSUP` in a reply: a command this server does not implement.
pub const ENOTSUP: u32 = 95;

/// Longest option data accepted (4 KiB: an export name is at most 4 KiB).
pub const MAX_OPTION_LEN: u32 = 4096;
/// Longest read or write payload accepted (32 MiB, as QEMU's own server).
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Longest export name (NBD's limit: 4096 bytes).
pub const MAX_NAME_LEN: usize = 4096;
/// Most options a client may send before choosing an export (a client
/// looping on refused options is cut off).
pub const MAX_OPTIONS: u32 = 64;

/// Length of a transmission request's header.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Length of a simple reply's header.
pub const SIMPLE_REPLY_LEN: usize = 16;

/// A fatal protocol violation: the connection must be closed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NbdError {
    /// The client set flags this server does not know, or not
    /// `NBD_FLAG_C_FIXED_NEWSTYLE` (the old newstyle is not served).
    BadClientFlags(u32),
    /// An option did not start with `IHAVEOPT`.
    BadOptionMagic(u64),
    /// An option's data was longer than [`MAX_OPTION_LEN`].
    OptionTooLong {
        /// The option's code.
        option: u32,
        /// The length the client declared.
        len: u32,
    },
    /// More than [`MAX_OPTIONS`] options before an export was chosen.
    TooManyOptions,
    /// A request did not start with the request magic.
    BadRequestMagic(u32),
    /// A write's payload was longer than [`MAX_PAYLOAD`]: it cannot be
    /// skipped without reading it, so the connection ends.
    WriteTooLarge {
        /// The length the client declared.
        len: u32,
    },
}

impl fmt::Display for NbdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdError::BadClientFlags(x) => write!(
                f,
                "NBD client flags {x:#x}: not fixed newstyle or unknown bits (only 0x1 and 0x2 \
                 are served)"
            ),
            NbdError::BadOptionMagic(m) => {
                write!(f, "NBD option with magic {m:#018x}, not IHAVEOPT")
            }
            NbdError::OptionTooLong { option, len } => write!(
                f,
                "NBD option {option} with {len} bytes of data (at most {MAX_OPTION_LEN})"
            ),
            NbdError::TooManyOptions => write!(
                f,
                "NBD client sent more than {MAX_OPTIONS} options without choosing an export"
            ),
            NbdError::BadRequestMagic(m) => {
                write!(
                    f,
                    "NBD request with magic {m:#010x}, not {REQUEST_MAGIC:#010x}"
                )
            }
            NbdError::WriteTooLarge { len } => write!(
                f,
                "NBD write of {len} bytes (at most {MAX_PAYLOAD} in one request)"
            ),
        }
    }
}

impl std::error::Error for NbdError {}

/// One export the server offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    /// Its name (clients ask for it by name; `""` is the default export).
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// Whether writes are refused.
    pub read_only: bool,
}

impl Export {
    /// The transmission flags sent for this export: flush, FUA, trim and
    /// write-zeroes are accepted; read-only if it is.
    pub fn transmission_flags(&self) -> u16 {
        let mut flags = TFLAG_HAS_FLAGS
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_SEND_TRIM
            | TFLAG_SEND_WRITE_ZEROES;
        if self.read_only {
            flags |= TFLAG_READ_ONLY;
        }
        flags
    }
}

/// What [`Handshake::handle`] reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeEvent {
    /// More bytes are needed.
    NeedMore,
    /// The client chose export number `export` (an index into the list
    /// given to [`Handshake::new`]); the bytes after those consumed are
    /// transmission requests.
    Transmission {
        /// Index of the chosen export.
        export: usize,
    },
    /// The negotiation ended without an export (`NBD_OPT_ABORT`, or
    /// `NBD_OPT_EXPORT_NAME` of an unknown name): send what was written,
    /// then close.
    Closed,
}

/// Where the handshake is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the client's 4 flag bytes.
    ClientFlags,
    /// Reading options.
    Options,
    /// Transmission or closed: nothing more to read here.
    Done,
}

/// The server's fixed newstyle handshake. Feed it the client's bytes with
/// [`Handshake::handle`]; it appends its answers to the caller's buffer.
#[derive(Debug)]
pub struct Handshake {
    /// What the client may choose.
    exports: Vec<Export>,
    /// Where the negotiation is.
    phase: Phase,
    /// The client asked for no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
    no_zeroes: bool,
    /// Options seen so far (bounded by [`MAX_OPTIONS`]).
    options: u32,
}

impl Handshake {
    /// Starts a handshake offering `exports`; appends the greeting to `out`.
    pub fn new(exports: Vec<Export>, out: &mut Vec<u8>) -> Handshake {
        out.extend_from_slice(&INIT_MAGIC.to_be_bytes());
        out.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Handshake {
            exports,
            phase: Phase::ClientFlags,
            no_zeroes: false,
            options: 0,
        }
    }

    /// Processes as much of `input` as holds whole messages, appending
    /// answers to `out`. Returns the bytes consumed and where the
    /// negotiation is; after `Transmission` or `Closed`, further calls
    /// consume nothing.
    pub fn handle(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(usize, HandshakeEvent), NbdError> {
        let mut used = 0;
        loop {
            let rest = &input[used..];
            match self.phase {
                Phase::Done => return Ok((used, HandshakeEvent::Closed)),
                Phase::ClientFlags => {
                    let Some(flags) = be_u32(rest, 0) else {
                        return Ok((used, HandshakeEvent::NeedMore));
                    };
                    if flags & CLIENT_FIXED_NEWSTYLE == 0
                        || flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0
                    {
                        self.phase = Phase::Done;
                        return Err(NbdError::BadClientFlags(flags));
                    }
                    self.no_zeroes = flags & CLIENT_NO_ZEROES != 0;
                    self.phase = Phase::Options;
                    used += 4;
                }
                Phase::Options => {
                    let Some((option, n)) = decode_option(rest)? else {
                        return Ok((used, HandshakeEvent::NeedMore));
                    };
                    used += n;
                    self.options += 1;
                    if self.options > MAX_OPTIONS {
                        self.phase = Phase::Done;
                        return Err(NbdError::TooManyOptions);
                    }
                    if let Some(event) = self.answer(&option, out) {
                        self.phase = Phase::Done;
                        return Ok((used, event));
                    }
                }
            }
        }
    }

    /// Answers one option; `Some` if it ends the negotiation.
    fn answer(&mut self, option: &ClientOption, out: &mut Vec<u8>) -> Option<HandshakeEvent> {
        let code = option.code;
        match parse_option(option) {
            Ok(ParsedOption::ExportName(name)) => {
                let Some(i) = self.find(&name) else {
                    // The protocol has no error reply here: close.
                    return Some(HandshakeEvent::Closed);
                };
                let e = &self.exports[i];
                out.extend_from_slice(&e.size.to_be_bytes());
                out.extend_from_slice(&e.transmission_flags().to_be_bytes());
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                Some(HandshakeEvent::Transmission { export: i })
            }
            Ok(ParsedOption::Abort) => {
                encode_option_reply(code, REP_ACK, &[], out);
                Some(HandshakeEvent::Closed)
            }
            Ok(ParsedOption::Info { name, go, .. }) => {
                let Some(i) = self.find(&name) else {
                    let msg = format!("no export named {name:?}");
                    encode_option_reply(code, REP_ERR_UNKNOWN, msg.as_bytes(), out);
                    return None;
                };
                let e = &self.exports[i];
                let mut info = Vec::with_capacity(12);
                info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                info.extend_from_slice(&e.size.to_be_bytes());
                info.extend_from_slice(&e.transmission_flags().to_be_bytes());
                encode_option_reply(code, REP_INFO, &info, out);
                // Block sizes are always sent: any alignment of 1 byte up
                // to MAX_PAYLOAD works, 4 KiB preferred.
                let mut sizes = Vec::with_capacity(14);
                sizes.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                sizes.extend_from_slice(&1u32.to_be_bytes());
                sizes.extend_from_slice(&4096u32.to_be_bytes());
                sizes.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                encode_option_reply(code, REP_INFO, &sizes, out);
                encode_option_reply(code, REP_ACK, &[], out);
                go.then_some(HandshakeEvent::Transmission { export: i })
            }
            Ok(ParsedOption::Other(_)) => {
                let msg = format!("option {code} is not supported by roam's NBD server");
                encode_option_reply(code, REP_ERR_UNSUP, msg.as_bytes(), out);
                None
            }
            Err(why) => {
                encode_option_reply(code, REP_ERR_INVALID, why.as_bytes(), out);
                None
            }
        }
    }

    /// The index of the export called `name`.
    fn find(&self, name: &str) -> Option<usize> {
        self.exports.iter().position(|e| e.name == name)
    }
}

/// One option as sent: its code and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOption {
    /// `NBD_OPT_*`.
    pub code: u32,
    /// Its data (at most [`MAX_OPTION_LEN`] bytes).
    pub data: Vec<u8>,
}

/// Reads one option from the front of `buf`: `Ok(None)` if it is not all
/// there yet, else the option and the bytes it took.
pub fn decode_option(buf: &[u8]) -> Result<Option<(ClientOption, usize)>, NbdError> {
    let Some(magic) = be_u64(buf, 0) else {
        return Ok(None);
    };
    if magic != OPTION_MAGIC {
        return Err(NbdError::BadOptionMagic(magic));
    }
    let (Some(code), Some(len)) = (be_u32(buf, 8), be_u32(buf, 12)) else {
        return Ok(None);
    };
    if len > MAX_OPTION_LEN {
        return Err(NbdError::OptionTooLong { option: code, len });
    }
    let end = 16 + len as usize;
    let Some(data) = buf.get(16..end) else {
        return Ok(None);
    };
    Ok(Some((
        ClientOption {
            code,
            data: data.to_vec(),
        },
        end,
    )))
}

/// Appends `option` as a client sends it (tests and fuzz round trips).
pub fn encode_option(option: &ClientOption, out: &mut Vec<u8>) {
    out.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.code.to_be_bytes());
    out.extend_from_slice(&(option.data.len() as u32).to_be_bytes());
    out.extend_from_slice(&option.data);
}

/// An option's meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParsedOption {
    /// `NBD_OPT_EXPORT_NAME` of this name.
    ExportName(String),
    /// `NBD_OPT_ABORT`.
    Abort,
    /// `NBD_OPT_INFO` (`go` false) or `NBD_OPT_GO` (`go` true).
    Info {
        /// The export's name.
        name: String,
        /// The information types asked for (answered or not, the export
        /// info is always sent).
        requests: Vec<u16>,
        /// Transmission starts after the answer.
        go: bool,
    },
    /// Any other option: refused with `NBD_REP_ERR_UNSUP`.
    Other(u32),
}

/// What `option` asks for, or why its data is malformed (the text of an
/// `NBD_REP_ERR_INVALID`).
pub fn parse_option(option: &ClientOption) -> Result<ParsedOption, String> {
    let data = &option.data;
    match option.code {
        OPT_EXPORT_NAME => name_of(data).map(ParsedOption::ExportName),
        OPT_ABORT => Ok(ParsedOption::Abort),
        OPT_INFO | OPT_GO => {
            let Some(len) = be_u32(data, 0) else {
                return Err("NBD_OPT_INFO/GO data shorter than its name length".into());
            };
            let name_end = 4usize.saturating_add(len as usize);
            let Some(name) = data.get(4..name_end) else {
                return Err(format!(
                    "NBD_OPT_INFO/GO name of {len} bytes in {} bytes of data",
                    data.len()
                ));
            };
            let name = name_of(name)?;
            let Some(count) = be_u16(data, name_end) else {
                return Err("NBD_OPT_INFO/GO data ends before its request count".into());
            };
            let list = &data[name_end + 2..];
            if list.len() != 2 * count as usize {
                return Err(format!(
                    "NBD_OPT_INFO/GO announces {count} info requests in {} bytes",
                    list.len()
                ));
            }
            let requests = list
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect();
            Ok(ParsedOption::Info {
                name,
                requests,
                go: option.code == OPT_GO,
            })
        }
        other => Ok(ParsedOption::Other(other)),
    }
}

/// An export name: UTF-8 of at most [`MAX_NAME_LEN`] bytes.
fn name_of(bytes: &[u8]) -> Result<String, String> {
    if bytes.len() > MAX_NAME_LEN {
        return Err(format!("export name of {} bytes", bytes.len()));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| "export name is not UTF-8".into())
}

/// Appends an option reply.
pub fn encode_option_reply(option: u32, reply: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A transmission command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_READ` (0).
    Read,
    /// `NBD_CMD_WRITE` (1): a payload of `len` bytes follows the header.
    Write,
    /// `NBD_CMD_DISC` (2): the client disconnects; no reply.
    Disc,
    /// `NBD_CMD_FLUSH` (3).
    Flush,
    /// `NBD_CMD_TRIM` (4).
    Trim,
    /// `NBD_CMD_WRITE_ZEROES` (6).
    WriteZeroes,
}

impl Command {
    /// The command's code on the wire.
    pub fn code(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disc => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::WriteZeroes => 6,
        }
    }

    /// The command of `code`, if served here.
    pub fn from_code(code: u16) -> Option<Command> {
        Some(match code {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disc,
            3 => Command::Flush,
            4 => Command::Trim,
            6 => Command::WriteZeroes,
            _ => return None,
        })
    }
}

/// A request's header fields, as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// `NBD_CMD_FLAG_*`.
    pub flags: u16,
    /// The command code (served or not).
    pub command: u16,
    /// The client's cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A request this server will carry out: checked against the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub command: Command,
    /// `NBD_CMD_FLAG_*` (FUA, NO_HOLE matter here).
    pub flags: u16,
    /// Echoed in the reply.
    pub cookie: u64,
    /// Byte offset in the export (`offset + len <= size`).
    pub offset: u64,
    /// Length in bytes (at most [`MAX_PAYLOAD`] for reads and writes).
    pub len: u32,
}

/// A request refused with an errno; the connection stays up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The request's cookie, for the reply.
    pub cookie: u64,
    /// The errno sent back (`EINVAL`, `ENOSPC`, `EOVERFLOW`, `EPERM`).
    pub errno: u32,
    /// Why, for a log line.
    pub reason: String,
}

/// One decoded request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded<'a> {
    /// The header as sent.
    pub header: RequestHeader,
    /// The request to carry out, or why it is refused.
    pub request: Result<Request, Refusal>,
    /// A write's payload (empty otherwise), borrowed from the input.
    pub payload: &'a [u8],
    /// Bytes taken from the input: the header and any payload.
    pub consumed: usize,
}

/// Reads one request from the front of `buf` for an export of `size`
/// bytes (`read_only`: writes are refused): `Ok(None)` if the header or a
/// write's payload is not all there yet.
pub fn decode_request(
    buf: &[u8],
    size: u64,
    read_only: bool,
) -> Result<Option<Decoded<'_>>, NbdError> {
    let Some(magic) = be_u32(buf, 0) else {
        return Ok(None);
    };
    if magic != REQUEST_MAGIC {
        return Err(NbdError::BadRequestMagic(magic));
    }
    let (Some(flags), Some(command), Some(cookie), Some(offset), Some(len)) = (
        be_u16(buf, 4),
        be_u16(buf, 6),
        be_u64(buf, 8),
        be_u64(buf, 16),
        be_u32(buf, 24),
    ) else {
        return Ok(None);
    };
    let header = RequestHeader {
        flags,
        command,
        cookie,
        offset,
        len,
    };
    let is_write = command == Command::Write.code();
    let mut consumed = REQUEST_HEADER_LEN;
    let mut payload: &[u8] = &[];
    if is_write {
        if len > MAX_PAYLOAD {
            return Err(NbdError::WriteTooLarge { len });
        }
        let end = REQUEST_HEADER_LEN + len as usize;
        let Some(p) = buf.get(REQUEST_HEADER_LEN..end) else {
            return Ok(None);
        };
        payload = p;
        consumed = end;
    }
    let request = check(header, size, read_only);
    Ok(Some(Decoded {
        header,
        request,
        payload,
        consumed,
    }))
}

/// `header` checked against an export of `size` bytes.
fn check(h: RequestHeader, size: u64, read_only: bool) -> Result<Request, Refusal> {
    let refuse = |errno, reason: String| Refusal {
        cookie: h.cookie,
        errno,
        reason,
    };
    let Some(command) = Command::from_code(h.command) else {
        return Err(refuse(
            EINVAL,
            format!("unknown NBD command {} (served: 0-4, 6)", h.command),
        ));
    };
    let ranged = !matches!(command, Command::Disc | Command::Flush);
    if ranged {
        if matches!(command, Command::Read | Command::Write) && h.len > MAX_PAYLOAD {
            return Err(refuse(
                EOVERFLOW,
                format!("{command:?} of {} bytes (at most {MAX_PAYLOAD})", h.len),
            ));
        }
        match h.offset.checked_add(u64::from(h.len)) {
            Some(end) if end <= size => {}
            _ => {
                let errno = if command == Command::Read {
                    EINVAL
                } else {
                    ENOSPC
                };
                return Err(refuse(
                    errno,
                    format!(
                        "{command:?} of {} bytes at offset {} runs past the export's {size} bytes",
                        h.len, h.offset
                    ),
                ));
            }
        }
    }
    if read_only
        && matches!(
            command,
            Command::Write | Command::Trim | Command::WriteZeroes
        )
    {
        return Err(refuse(EPERM, format!("{command:?} on a read-only export")));
    }
    Ok(Request {
        command,
        flags: h.flags,
        cookie: h.cookie,
        offset: h.offset,
        len: h.len,
    })
}

/// Appends a request as a client sends it: the header, then `payload` (a
/// write's data; pass `&[]` otherwise). For tests and fuzz round trips.
pub fn encode_request(header: &RequestHeader, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&header.flags.to_be_bytes());
    out.extend_from_slice(&header.command.to_be_bytes());
    out.extend_from_slice(&header.cookie.to_be_bytes());
    out.extend_from_slice(&header.offset.to_be_bytes());
    out.extend_from_slice(&header.len.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Appends a simple reply: `errno` 0 for success, then `data` (a
/// successful read's bytes; empty otherwise).
pub fn encode_simple_reply(cookie: u64, errno: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&errno.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(data);
}

/// A simple reply's header as a client reads it: `(errno, cookie)`, or
/// `None` if `buf` is shorter than [`SIMPLE_REPLY_LEN`] or the magic is
/// wrong. For tests and fuzz round trips.
pub fn decode_simple_reply(buf: &[u8]) -> Option<(u32, u64)> {
    if be_u32(buf, 0)? != SIMPLE_REPLY_MAGIC {
        return None;
    }
    Some((be_u32(buf, 4)?, be_u64(buf, 8)?))
}

/// Big-endian u16 at `at`, if there.
fn be_u16(buf: &[u8], at: usize) -> Option<u16> {
    let b = buf.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([b[0], b[1]]))
}

/// Big-endian u32 at `at`, if there.
fn be_u32(buf: &[u8], at: usize) -> Option<u32> {
    let b = buf.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes(b.try_into().ok()?))
}

/// Big-endian u64 at `at`, if there.
fn be_u64(buf: &[u8], at: usize) -> Option<u64> {
    let b = buf.get(at..at.checked_add(8)?)?;
    Some(u64::from_be_bytes(b.try_into().ok()?))
}

#[cfg(test)]
mod tests;
