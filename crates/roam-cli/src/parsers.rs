//! Every decoder of untrusted or user-written text in the `roam` command, as
//! plain functions over bytes, for the fuzz targets (`fuzz/`) and tests. Each
//! returns an error message, never panics, and re-encodes what it decoded where
//! the format has an encoder, so a fuzz target can check the round trip.

/// Parses a configuration file (TOML); `Ok` carries a canonical re-encoding
/// (parsing that again must give the same configuration).
pub fn config_file(text: &str) -> Result<String, String> {
    crate::config::FileConfig::parse(text, "<input>").map(|c| format!("{c:?}"))
}

/// Parses an authorized-keys file; `Ok` carries the keys in hex, one per entry.
pub fn authorized_keys(text: &str) -> Result<Vec<String>, String> {
    crate::keys::parse_authorized(text, "<input>")
        .map(|keys| keys.iter().map(ToString::to_string).collect())
}

/// Parses a known-servers file; `Ok` carries `(name, hex key)` per entry in file order.
pub fn known_servers(text: &str) -> Result<Vec<(String, String)>, String> {
    crate::keys::parse_known(text, "<input>")
        .map(|v| v.into_iter().map(|(n, k)| (n, k.to_string())).collect())
}

/// Formats known-servers entries as the file stores them (the encoder
/// [`known_servers`] decodes).
pub fn format_known_servers(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(n, k)| crate::keys::known_line(n, k))
        .collect()
}

/// Parses one allow-list rule (`HOST:PORT`, `*` wildcards); `Ok` carries its canonical text.
pub fn allow_rule(text: &str) -> Result<String, String> {
    crate::target::AllowRule::parse(text).map(|r| r.to_string())
}

/// Parses a duration such as `3d` or `500ms`; `Ok` carries milliseconds.
pub fn duration(text: &str) -> Result<u128, String> {
    crate::config::parse_duration(text).map(|d| d.as_millis())
}

/// Parses `roam resume --trickle`'s rate (`off`, `10M`, `500kbit`, `2Mbps`);
/// `Ok` carries bytes per second, `None` for `off`.
pub fn trickle_rate(text: &str) -> Result<Option<u64>, String> {
    crate::store::trickle::parse_rate(text)
}

/// Parses a request sent to a control socket; `Ok` carries its canonical encoding.
pub fn control_request(bytes: &[u8]) -> Result<Vec<u8>, String> {
    crate::control::Request::decode(bytes).map(|r| r.encode())
}

/// Parses a control socket's reply (a process status document); `Ok` carries
/// its canonical encoding.
pub fn control_reply(bytes: &[u8]) -> Result<Vec<u8>, String> {
    crate::control::decode_reply(bytes).and_then(|p| crate::control::encode_reply(&p))
}

/// The relay-takeover stream (`roam serve --takeover`, `docs/ARCHITECTURE.md`)
/// with stand-in descriptors: decodes, re-encodes and decodes again.
/// `Ok(Ok(description))` or `Ok(Err(why malformed))`; `Err` only if the
/// round trip changed what was decoded (a bug).
pub fn takeover(bytes: &[u8]) -> Result<Result<String, String>, String> {
    crate::takeover::decode_bytes(bytes)
}

/// Decodes the record a detached named session leaves (`roam pipe --name`);
/// `Ok` carries its canonical re-encoding (decoding that gives it again).
pub fn detached_record(bytes: &[u8]) -> Result<Vec<u8>, String> {
    crate::named::Record::decode(bytes).map(|r| r.encode())
}

/// Decodes a named session's journal slot file (`roam pipe --name`); `Ok`
/// carries its canonical re-encoding (decoding that gives it again), `None`
/// for an empty slot.
pub fn journal_slot(bytes: &[u8]) -> Result<Option<Vec<u8>>, String> {
    crate::named::parse_slot(bytes).map(|s| s.map(|(seq, r)| crate::named::encode_slot(seq, &r)))
}

/// Decodes `roam shell` stream frames; `Ok` carries their re-encoding
/// (decoding that gives the same frames again).
pub fn shell_frames(bytes: &[u8]) -> Result<Vec<u8>, String> {
    crate::shell::wire::reencode(bytes)
}

/// Decodes the control frames between the relay and a shell's worker
/// process (`roam shell-worker`); `Ok` carries their re-encoding.
pub fn shell_control(bytes: &[u8]) -> Result<Vec<u8>, String> {
    crate::shell::worker::reencode(bytes)
}

/// Parses a shell request from stream metadata; `Ok(None)`: not one.
pub fn shell_open(meta: &[u8]) -> Result<Option<Vec<u8>>, String> {
    crate::shell::wire::Open::parse(meta)
        .transpose()
        .map(|o| o.map(|o| o.meta()))
}

/// Decodes the page requests a destination's lazy-pages daemon sends
/// (`roam migrate-process --lazy-pages`: CRIU's 24-byte `page_server_iov`
/// headers, as many whole ones as `bytes` holds); `Ok` carries each request
/// re-encoded and decoded again, which must equal the first decoding.
pub fn migrate_page_requests(bytes: &[u8]) -> Result<Vec<bool>, String> {
    use crate::migrate::pages::Request;
    bytes
        .chunks_exact(24)
        .map(|h| {
            let h: &[u8; 24] = h.try_into().map_err(|_| "a short header".to_string())?;
            let request = Request::decode(h)?;
            Ok(Request::decode(&request.encode()) == Ok(request))
        })
        .collect()
}

/// Decodes the whole frames at the start of a process migration's stream
/// (`roam migrate-process`); `Ok` carries the bytes they were decoded from
/// and their re-encoding (the encoding is canonical: the two are equal).
pub fn migrate_frames(bytes: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let frames = crate::migrate::wire::decode_all(bytes).map_err(|e| e.to_string())?;
    let mut read = Vec::new();
    let mut again = Vec::new();
    for (frame, raw) in frames {
        read.extend_from_slice(raw);
        again.extend_from_slice(&crate::migrate::wire::encode(&frame));
    }
    Ok((read, again))
}

/// Decodes `bytes` as one request frame of the remote store protocol
/// (`roam store serve`, docs/STORE-REMOTE.md), then as one response frame;
/// each `Ok` carries the re-encoding of what decoded (the encoding is
/// canonical: it equals `bytes`).
pub fn store_frames(bytes: &[u8]) -> (Result<Vec<u8>, String>, Result<Vec<u8>, String>) {
    use crate::store_remote::{Request, Response};
    (
        Request::decode(bytes)
            .map(|r| r.encode())
            .map_err(|e| e.to_string()),
        Response::decode(bytes)
            .map(|r| r.encode())
            .map_err(|e| e.to_string()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_requests_round_trip_and_refuse_garbage() {
        let enc = control_request(b"{\"op\":\"status\"}\n").unwrap();
        assert_eq!(control_request(&enc).unwrap(), enc);
        assert!(control_request(b"{\"op\":\"shutdown\"}").is_err());
        assert!(control_request(b"{\"op\":\"status\"}\n{}").is_err());
        assert!(control_request(&[b' '; 5000]).is_err());
    }

    #[test]
    fn known_servers_round_trip() {
        let key = roam_proto::Keypair::generate()
            .unwrap()
            .public()
            .to_string();
        let entries = vec![("relay:7447".to_string(), key)];
        let text = format_known_servers(&entries);
        assert_eq!(known_servers(&text).unwrap(), entries);
        assert!(known_servers("relay:7447 nothex\n").is_err());
    }

    #[test]
    fn allow_rules_print_canonically() {
        assert_eq!(allow_rule("[::1]:*").unwrap(), "[::1]:*");
        assert_eq!(allow_rule("127.0.0.1:22").unwrap(), "127.0.0.1:22");
    }
}
