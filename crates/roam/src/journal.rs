//! A session's journal: a copy of its continuation kept current enough that
//! the session survives its process being killed (`kill -9`, a crash).
//!
//! The rule is write-ahead. The peer can resume only a copy at least as new
//! as what it saw (`docs/PROTOCOL.md` §13.2): every reliable frame it may
//! have received and every acknowledgement it may have been given. So after
//! each `poll_transmit` that grew either ([`Session::peer_exposure`]) the
//! driver exports the session and hands the continuation to the
//! application's writer *before* the bytes go to the socket. Steps that send
//! nothing new (most of an idle session's life) write nothing.
//!
//! The writer decides where the copy goes and how (a file replaced
//! atomically, say). If it fails, the driver stops journaling: output
//! already taken from the session cannot be held back, so the copy would be
//! stale from then on; the writer is expected to remove it and say so.

use roam_proto::{Session, StreamId, StreamProgress};

/// What the driver hands the journal's writer.
pub struct JournalEntry<'a> {
    /// The continuation (as in [`Detached::blob`](crate::Detached::blob));
    /// it holds the resume secret.
    pub blob: &'a [u8],
    session: &'a Session,
}

impl JournalEntry<'_> {
    /// A stream's progress at the instant of the copy (what the application
    /// had written and read), `None` for a stream the session no longer
    /// knows.
    pub fn stream_progress(&self, id: StreamId) -> Option<StreamProgress> {
        self.session.stream_progress(id)
    }
}

/// Writes one journal copy; an error stops the journal.
pub type JournalWriter = Box<dyn FnMut(&JournalEntry<'_>) -> std::io::Result<()> + Send>;

/// A journal as the driver keeps it.
pub(crate) struct Journal {
    write: JournalWriter,
    /// The exposure the last copy covered; `None` before the first copy.
    covered: Option<(u64, u64)>,
}

impl Journal {
    pub(crate) fn new(write: JournalWriter) -> Self {
        Self {
            write,
            covered: None,
        }
    }

    /// Writes a copy if the peer may have seen more than the last one
    /// covers. `Ok(false)`: the session is over, the journal ends with it;
    /// `Err` ends the journal (the message says why).
    pub(crate) fn keep(
        &mut self,
        session: &Session,
        now: std::time::Instant,
    ) -> Result<bool, String> {
        let exposure = session.peer_exposure();
        if self.covered == Some(exposure) {
            return Ok(true);
        }
        let blob = match session.export(now) {
            Ok(b) => b,
            // Before the session is established there is nothing a peer
            // could resume; the first copy follows once there is.
            Err(roam_proto::ExportError::NotEstablished) => return Ok(true),
            Err(roam_proto::ExportError::Closed) => return Ok(false),
            Err(e) => return Err(format!("the session cannot be copied: {e}")),
        };
        (self.write)(&JournalEntry {
            blob: &blob,
            session,
        })
        .map_err(|e| format!("writing the journal: {e}"))?;
        self.covered = Some(exposure);
        Ok(true)
    }
}
