//! The codec against hand-built client bytes.

use super::*;

fn exports() -> Vec<Export> {
    vec![
        Export {
            name: "disk.img".into(),
            size: 1 << 20,
            read_only: false,
        },
        Export {
            name: "ro".into(),
            size: 4096,
            read_only: true,
        },
    ]
}

fn opt(code: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_option(
        &ClientOption {
            code,
            data: data.to_vec(),
        },
        &mut out,
    );
    out
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// Splits option replies: (option, type, data) each.
fn replies(mut buf: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while !buf.is_empty() {
        assert_eq!(be_u64(buf, 0), Some(REPLY_MAGIC));
        let len = be_u32(buf, 16).unwrap() as usize;
        v.push((
            be_u32(buf, 8).unwrap(),
            be_u32(buf, 12).unwrap(),
            buf[20..20 + len].to_vec(),
        ));
        buf = &buf[20 + len..];
    }
    v
}

fn started() -> Handshake {
    let mut out = Vec::new();
    let mut hs = Handshake::new(exports(), &mut out);
    assert_eq!(out.len(), 18);
    assert_eq!(&out[..8], b"NBDMAGIC");
    assert_eq!(&out[8..16], b"IHAVEOPT");
    assert_eq!(out[16..], [0, 3]);
    let (n, ev) = hs.handle(&3u32.to_be_bytes(), &mut Vec::new()).unwrap();
    assert_eq!((n, ev), (4, HandshakeEvent::NeedMore));
    hs
}

#[test]
fn go_answers_info_and_starts_transmission() {
    let mut hs = started();
    let mut input = opt(OPT_GO, &go_data("disk.img", &[INFO_BLOCK_SIZE]));
    input.extend_from_slice(b"trailing request bytes");
    let mut out = Vec::new();
    let (n, ev) = hs.handle(&input, &mut out).unwrap();
    assert_eq!(ev, HandshakeEvent::Transmission { export: 0 });
    assert_eq!(&input[n..], b"trailing request bytes");
    let r = replies(&out);
    assert_eq!(r.len(), 3);
    assert_eq!((r[0].0, r[0].1), (OPT_GO, REP_INFO));
    assert_eq!(be_u16(&r[0].2, 0), Some(INFO_EXPORT));
    assert_eq!(be_u64(&r[0].2, 2), Some(1 << 20));
    assert_eq!(be_u16(&r[0].2, 10), Some(exports()[0].transmission_flags()));
    assert_eq!(be_u16(&r[1].2, 0), Some(INFO_BLOCK_SIZE));
    assert_eq!(r[2].1, REP_ACK);
    // Nothing more is consumed after the end.
    assert_eq!(hs.handle(b"x", &mut out).unwrap().0, 0);
}

#[test]
fn info_then_unknown_then_unsupported_then_go() {
    let mut hs = started();
    let mut input = opt(OPT_INFO, &go_data("ro", &[]));
    input.extend(opt(OPT_GO, &go_data("nope", &[])));
    input.extend(opt(8, &[])); // NBD_OPT_STRUCTURED_REPLY
    input.extend(opt(OPT_GO, &go_data("ro", &[])));
    // Byte by byte: partial input is never an error.
    let mut out = Vec::new();
    let mut fed = Vec::new();
    let mut done = None;
    for b in &input {
        fed.push(*b);
        let (n, ev) = hs.handle(&fed, &mut out).unwrap();
        fed.drain(..n);
        if ev != HandshakeEvent::NeedMore {
            done = Some(ev);
        }
    }
    assert_eq!(done, Some(HandshakeEvent::Transmission { export: 1 }));
    let r = replies(&out);
    let types: Vec<_> = r.iter().map(|x| x.1).collect();
    assert_eq!(
        types,
        [
            REP_INFO,
            REP_INFO,
            REP_ACK,
            REP_ERR_UNKNOWN,
            REP_ERR_UNSUP,
            REP_INFO,
            REP_INFO,
            REP_ACK
        ]
    );
    assert_eq!(r[4].0, 8);
    assert!(String::from_utf8_lossy(&r[4].2).contains("not supported"));
    assert_eq!(
        be_u16(&r[5].2, 10).unwrap() & TFLAG_READ_ONLY,
        TFLAG_READ_ONLY
    );
}

#[test]
fn export_name_with_and_without_zeroes() {
    for (flags, zeroes) in [(1u32, 124usize), (3, 0)] {
        let mut hs = Handshake::new(exports(), &mut Vec::new());
        let mut input = flags.to_be_bytes().to_vec();
        input.extend(opt(OPT_EXPORT_NAME, b"disk.img"));
        let mut out = Vec::new();
        let (n, ev) = hs.handle(&input, &mut out).unwrap();
        assert_eq!(n, input.len());
        assert_eq!(ev, HandshakeEvent::Transmission { export: 0 });
        assert_eq!(out.len(), 10 + zeroes);
        assert_eq!(be_u64(&out, 0), Some(1 << 20));
    }
    let mut hs = started();
    let (_, ev) = hs
        .handle(&opt(OPT_EXPORT_NAME, b"other"), &mut Vec::new())
        .unwrap();
    assert_eq!(ev, HandshakeEvent::Closed);
}

#[test]
fn abort_is_acknowledged() {
    let mut hs = started();
    let mut out = Vec::new();
    let (_, ev) = hs.handle(&opt(OPT_ABORT, &[]), &mut out).unwrap();
    assert_eq!(ev, HandshakeEvent::Closed);
    assert_eq!(replies(&out), vec![(OPT_ABORT, REP_ACK, vec![])]);
}

#[test]
fn malformed_handshakes_are_precise_errors() {
    let mut hs = Handshake::new(exports(), &mut Vec::new());
    assert_eq!(
        hs.handle(&0u32.to_be_bytes(), &mut Vec::new()),
        Err(NbdError::BadClientFlags(0))
    );
    let mut hs = Handshake::new(exports(), &mut Vec::new());
    assert_eq!(
        hs.handle(&5u32.to_be_bytes(), &mut Vec::new()),
        Err(NbdError::BadClientFlags(5))
    );
    let mut hs = started();
    let mut bad = opt(OPT_GO, &[]);
    bad[0] ^= 1;
    assert!(matches!(
        hs.handle(&bad, &mut Vec::new()),
        Err(NbdError::BadOptionMagic(_))
    ));
    let mut hs = started();
    let mut long = OPTION_MAGIC.to_be_bytes().to_vec();
    long.extend_from_slice(&OPT_GO.to_be_bytes());
    long.extend_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
    assert_eq!(
        hs.handle(&long, &mut Vec::new()),
        Err(NbdError::OptionTooLong {
            option: OPT_GO,
            len: MAX_OPTION_LEN + 1
        })
    );
    // Malformed GO data: an INVALID reply, the negotiation goes on.
    let mut hs = started();
    let mut out = Vec::new();
    let mut d = go_data("disk.img", &[1, 2]);
    d.pop();
    let (_, ev) = hs.handle(&opt(OPT_GO, &d), &mut out).unwrap();
    assert_eq!(ev, HandshakeEvent::NeedMore);
    assert_eq!(replies(&out)[0].1, REP_ERR_INVALID);
    // A client looping on refused options is cut off.
    let mut hs = started();
    let many: Vec<u8> = (0..=MAX_OPTIONS).flat_map(|_| opt(99, &[])).collect();
    assert_eq!(
        hs.handle(&many, &mut Vec::new()),
        Err(NbdError::TooManyOptions)
    );
}

fn header(command: u16, offset: u64, len: u32) -> RequestHeader {
    RequestHeader {
        flags: 0,
        command,
        cookie: 0xfeed,
        offset,
        len,
    }
}

#[test]
fn requests_round_trip_and_write_payload_is_borrowed() {
    let mut buf = Vec::new();
    let h = header(1, 4096, 5);
    encode_request(&h, b"hello", &mut buf);
    encode_request(&header(0, 0, 512), &[], &mut buf);
    let d = decode_request(&buf, 1 << 20, false).unwrap().unwrap();
    assert_eq!(d.header, h);
    assert_eq!(d.payload, b"hello");
    assert_eq!(d.consumed, REQUEST_HEADER_LEN + 5);
    assert_eq!(d.request.unwrap().command, Command::Write);
    let d2 = decode_request(&buf[d.consumed..], 1 << 20, false)
        .unwrap()
        .unwrap();
    assert_eq!(d2.request.unwrap().command, Command::Read);
    // Every prefix is "need more", never an error.
    for cut in 0..d.consumed {
        assert_eq!(decode_request(&buf[..cut], 1 << 20, false), Ok(None));
    }
}

#[test]
fn bad_requests_are_refused_with_errno() {
    let refusal = |h: RequestHeader, ro: bool| {
        let mut buf = Vec::new();
        let payload = vec![0; if h.command == 1 { h.len as usize } else { 0 }];
        encode_request(&h, &payload, &mut buf);
        let d = decode_request(&buf, 1 << 20, ro).unwrap().unwrap();
        assert_eq!(d.consumed, buf.len());
        d.request.unwrap_err()
    };
    let r = refusal(header(9, 0, 0), false);
    assert_eq!((r.errno, r.cookie), (EINVAL, 0xfeed));
    assert!(r.reason.contains("unknown NBD command 9"));
    assert_eq!(refusal(header(0, (1 << 20) - 1, 2), false).errno, EINVAL);
    assert_eq!(refusal(header(0, u64::MAX, 2), false).errno, EINVAL);
    assert_eq!(refusal(header(1, 1 << 20, 1), false).errno, ENOSPC);
    assert_eq!(
        refusal(header(0, 0, MAX_PAYLOAD + 1), false).errno,
        EOVERFLOW
    );
    assert_eq!(refusal(header(1, 0, 1), true).errno, EPERM);
    assert_eq!(refusal(header(6, 0, 1), true).errno, EPERM);
    // Flush and disconnect ignore offset and length.
    let mut buf = Vec::new();
    encode_request(&header(3, u64::MAX, u32::MAX), &[], &mut buf);
    assert!(decode_request(&buf, 0, true)
        .unwrap()
        .unwrap()
        .request
        .is_ok());
}

#[test]
fn fatal_request_errors() {
    let mut buf = Vec::new();
    encode_request(&header(0, 0, 1), &[], &mut buf);
    buf[3] ^= 0xff;
    assert!(matches!(
        decode_request(&buf, 1 << 20, false),
        Err(NbdError::BadRequestMagic(_))
    ));
    let mut buf = Vec::new();
    encode_request(&header(1, 0, MAX_PAYLOAD + 1), &[], &mut buf);
    assert_eq!(
        decode_request(&buf, u64::MAX, false),
        Err(NbdError::WriteTooLarge {
            len: MAX_PAYLOAD + 1
        })
    );
    assert!(NbdError::WriteTooLarge { len: 1 }
        .to_string()
        .contains("at most"));
}

#[test]
fn simple_reply_round_trips() {
    let mut out = Vec::new();
    encode_simple_reply(42, EIO, &[], &mut out);
    assert_eq!(out.len(), SIMPLE_REPLY_LEN);
    assert_eq!(decode_simple_reply(&out), Some((EIO, 42)));
    assert_eq!(decode_simple_reply(&out[..15]), None);
}
