//! Fuzzing-only hooks, compiled only under `cfg(fuzzing)` (cargo-fuzz).
//!
//! The session fuzz targets play a hostile peer that holds the transport keys:
//! they seal arbitrary frames into records with a session's own send keys, so
//! the other session receives them through its real record path.

use super::transport::Phase;
use super::Session;
use crate::event::TransportId;
use crate::record::{RecordCipher, MAX_PLAINTEXT};

impl Session {
    /// Fuzzing only: seals `plaintext` (frames) as one record on the active
    /// transport with this session's send keys, as if this session had sent
    /// it, and appends it to `out`. The session's own state is not otherwise
    /// touched. `None` if there is no open transport or the plaintext is too big.
    #[doc(hidden)]
    pub fn fuzz_seal_record(&mut self, plaintext: &[u8], out: &mut Vec<u8>) -> Option<TransportId> {
        if plaintext.len() > MAX_PLAINTEXT {
            return None;
        }
        let t = self.active.as_mut()?;
        let Phase::Open(keys) = &mut t.phase else {
            return None;
        };
        let start = RecordCipher::begin(out);
        out.extend_from_slice(plaintext);
        if keys.tx.seal(out, start).is_err() {
            out.truncate(start);
            return None;
        }
        Some(t.id)
    }
}
