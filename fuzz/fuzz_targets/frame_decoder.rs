//! Arbitrary record plaintexts through the frame decoder (`docs/PROTOCOL.md` §5).
//!
//! Property: decoding never panics, and every frame it yields survives a
//! round trip: `decode(encode(f)) == f`, consuming exactly the encoding.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_proto::codec::Reader;
use roam_proto::frame::{for_each_frame, Frame};

fuzz_target!(|data: &[u8]| {
    let mut buf = Vec::new();
    let _ = for_each_frame(data, |frame| {
        buf.clear();
        frame.encode(&mut buf);
        let mut r = Reader::new(&buf);
        let back = Frame::decode(&mut r).expect("re-encoded frame must decode");
        assert_eq!(back, frame, "round trip changed the frame");
        assert_eq!(r.remaining(), 0, "re-encoded frame left trailing bytes");
        assert_eq!(back.is_reliable(), frame.is_reliable());
        Ok(())
    });
});
