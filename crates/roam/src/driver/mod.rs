//! The per-session driver task: owns the TCP connections, moves bytes between
//! them and the sans-IO session, runs its timers, dispatches its events and,
//! on a client, re-dials after a suspension.
//!
//! One loop iteration follows the order `roam_proto::Session` documents:
//! inputs (`handle_input` / `handle_transport_closed` / `handle_timeout`), then
//! `poll_transmit` into the named connection's buffer, then `poll_event`, then
//! wait for the next socket readiness, application call, timer, dial result or
//! network change. More records are polled only once the previous ones were
//! (almost) written, so a slow transport pushes back into the session's
//! bounded send buffers instead of into memory here.

//!
//! Parts: [`conn`] (one TCP connection: socket, buffers, write-out),
//! [`dialer`] (the client's re-dials), [`server_side`] (the server's resumes,
//! caps and routing seam); this module is the loop and the event dispatch.

mod conn;
mod dialer;
mod server_side;
mod slowdown;

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use roam_proto::{Event, Role, State};
use tokio::time::{sleep_until, Instant, Sleep};

use crate::handle::{Inner, SessionEvent, SessionHandle, Shared};
use conn::{poll_conns, Drained, Io, DRAIN_READS};

pub(crate) use conn::Conn;
use dialer::DialerWake;
pub(crate) use dialer::{dial, Dialer};
pub(crate) use server_side::{reject, Handoff, OnSession, Routing, ServerSide};

/// While output waits for the socket, how often the timers are looked at.
/// The deadlines that are overdue then (ACK, heartbeat) can only be met by
/// sending, which waits for writability; without this floor the driver slept
/// until an instant already past and spun.
const BACKED_UP_TICK: Duration = Duration::from_millis(50);
/// Most bytes a detach writes on its way out (see `flush_parting_words`).
const PARTING_WORDS: usize = 64 * 1024;
/// How long a closed transport may take to flush its last bytes.
const RETIRE_LINGER: Duration = Duration::from_secs(1);
/// How long a session whose handles were all dropped may take to close gracefully.
const ABANDON_LINGER: Duration = Duration::from_secs(10);

/// Which end of the session this driver runs.
pub(crate) enum Kind {
    Client(Box<Dialer>),
    /// Boxed like the client's side: inline, its ~170 bytes would size
    /// every driver task, the client's included (a 128-byte step of the
    /// task's allocation).
    Server(Box<ServerSide>),
}

pub(crate) enum Wake {
    Io(Io),
    Notified,
    Timer,
    Dialer(DialerWake),
    Handoff(Option<Box<Handoff>>),
    Shutdown,
}

/// How the driver of one side waits for its next wake-up: on its
/// connections, the application, its timer, and its side's own sources (a
/// client's dialer; a server's hand-offs and shutdown). The driver's task
/// is generic over it so that a client's task holds no state for the
/// server's branches (a `watch` wait alone is 144 bytes) nor the other way
/// round: the task lives as long as its session, suspended ones included.
pub(crate) trait Side {
    /// Waits for the next wake-up; `timer` is the driver's one timer, set
    /// to `deadline` (left alone, not polled, when there is none).
    fn wait<'a>(
        d: &'a mut Driver,
        deadline: Option<Instant>,
        timer: Pin<&'a mut Sleep>,
    ) -> impl std::future::Future<Output = Wake> + Send + 'a;
}

/// The client's side: its dialer (re-dials, network changes).
pub(crate) struct AsClient;

/// The server's side: resumes handed over and the server's shutdown.
pub(crate) struct AsServer;

/// Sets `timer` to `deadline` (if any) and polls it: the driver's timer
/// branch, as a poll rather than a future of its own (the task would hold
/// its state).
fn timer_branch(
    mut timer: Pin<&mut Sleep>,
    deadline: Option<Instant>,
) -> impl std::future::Future<Output = ()> + Send + '_ {
    if let Some(t) = deadline {
        if timer.deadline() != t {
            timer.as_mut().reset(t);
        }
    }
    poll_fn(move |cx| match deadline {
        Some(_) => timer.as_mut().poll(cx),
        None => Poll::Pending,
    })
}

impl Side for AsClient {
    async fn wait(d: &mut Driver, deadline: Option<Instant>, timer: Pin<&mut Sleep>) -> Wake {
        let Driver {
            inner, conns, kind, ..
        } = d;
        let sleep = timer_branch(timer, deadline);
        let io = poll_fn(|cx| poll_conns(conns, cx));
        debug_assert!(
            matches!(kind, Kind::Client(_)),
            "a server driven as a client"
        );
        let mut dialer = match kind {
            Kind::Client(dialer) => Some(dialer),
            Kind::Server(_) => None,
        };
        let dialer = poll_fn(|cx| match dialer.as_mut() {
            Some(dialer) => dialer.poll_wake(cx),
            None => Poll::Pending,
        });
        tokio::select! {
            io = io => Wake::Io(io),
            _ = inner.notify.notified() => Wake::Notified,
            _ = sleep => Wake::Timer,
            w = dialer => Wake::Dialer(w),
        }
    }
}

impl Side for AsServer {
    async fn wait(d: &mut Driver, deadline: Option<Instant>, timer: Pin<&mut Sleep>) -> Wake {
        let Driver {
            inner,
            conns,
            kind,
            shutting_down,
            handoffs_open,
            ..
        } = d;
        let sleep = timer_branch(timer, deadline);
        let io = poll_fn(|cx| poll_conns(conns, cx));
        debug_assert!(
            matches!(kind, Kind::Server(_)),
            "a client driven as a server"
        );
        let Kind::Server(s) = kind else {
            return tokio::select! {
                io = io => Wake::Io(io),
                _ = inner.notify.notified() => Wake::Notified,
                _ = sleep => Wake::Timer,
            };
        };
        let shutdown = &mut s.shutdown;
        let watch_shutdown = !*shutting_down;
        tokio::select! {
            io = io => Wake::Io(io),
            _ = inner.notify.notified() => Wake::Notified,
            _ = sleep => Wake::Timer,
            h = s.handoffs.recv(), if *handoffs_open => Wake::Handoff(h),
            _ = shutdown.wait_for(|stop| *stop), if watch_shutdown => Wake::Shutdown,
        }
    }
}

thread_local! {
    /// Where a driver's records are built before a connection takes them
    /// (by swapping buffers when its own is empty, else by copying): one
    /// per worker thread, not one per session, so a session holds one
    /// output buffer per connection and nothing between transmits. Only
    /// [`Driver::transmit`] uses it, and never across an await.
    static RECORDS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Largest record buffer a worker thread keeps between transmits (bytes).
const RECORDS_KEEP: usize = 1 << 20;

/// Drives one session until it is over. Spawn it: it does nothing unless polled.
#[must_use = "a session driver does nothing unless spawned"]
pub(crate) struct Driver {
    inner: Arc<Inner>,
    conns: Vec<Conn>,
    kind: Kind,
    /// Give up waiting for a graceful close at this time.
    give_up_at: Option<Instant>,
    shutting_down: bool,
    handoffs_open: bool,
    /// Announced `Closed` to the application already.
    closed_sent: bool,
    /// Taken out by `SessionHandle::detach`: already out of the routing map.
    detached: bool,
}

impl Driver {
    pub(crate) fn new(inner: Arc<Inner>, conn: Conn, kind: Kind) -> Self {
        Self {
            conns: vec![conn],
            ..Self::restored(inner, kind)
        }
    }

    /// Takes a new connection. Room for exactly one more: a session has
    /// one connection but for the moments of a hand-over, and `push` into
    /// an empty vector would make room for four (~680 bytes, kept by
    /// every session that ever re-dialed).
    fn adopt(&mut self, conn: Conn) {
        self.conns.reserve_exact(1);
        self.conns.push(conn);
    }

    /// A driver for a restored session that has no connection yet (its
    /// resume arrives as a handoff).
    pub(crate) fn restored(inner: Arc<Inner>, kind: Kind) -> Self {
        Self {
            inner,
            conns: Vec::new(),
            kind,
            give_up_at: None,
            shutting_down: false,
            handoffs_open: true,
            closed_sent: false,
            detached: false,
        }
    }

    /// Exports the session for `SessionHandle::detach` and shuts this driver
    /// down without closing the session: connections dropped, out of the
    /// routing map (before the caller learns the result, so a resume that
    /// arrives meanwhile goes to the caller's lookup, not to this driver).
    fn detach(
        &mut self,
        sh: &mut Shared,
        now: std::time::Instant,
        live: bool,
    ) -> Result<(crate::Detached, Option<crate::LiveTransport>), roam_proto::ExportError> {
        if sh.closed.is_some() {
            return Err(roam_proto::ExportError::Closed);
        }
        // Before the export, so the snapshot counts these bytes as sent
        // (and keeps them for retransmission until acknowledged).
        self.flush_parting_words(sh, now);
        let blob = sh.session.export(now)?;
        // After the export and the last records polled: the transport state
        // and the continuation describe the same instant.
        let live = if live { self.take_live(sh) } else { None };
        let detached = crate::Detached {
            blob,
            unaccepted: sh
                .rare_if_any()
                .map(|r| r.incoming.drain(..).collect())
                .unwrap_or_default(),
            orphans: sh
                .rare_if_any()
                .map(|r| r.orphans.iter().copied().collect())
                .unwrap_or_default(),
        };
        sh.closed = Some(Box::new(roam_proto::CloseReason::Local {
            code: roam_proto::code::NO_ERROR,
        }));
        sh.detached = true;
        sh.wake_all();
        self.closed_sent = true;
        self.detached = true;
        self.conns.clear();
        if let Kind::Server(s) = &self.kind {
            s.unroute();
        }
        tracing::debug!(
            "session {} detached{}",
            id_text(sh),
            if live.is_some() {
                " with its connection"
            } else {
                ""
            }
        );
        self.inner.events.send(SessionEvent::Detached);
        Ok((detached, live))
    }

    /// Takes the active connection out for [`SessionHandle::detach_live`]:
    /// its socket, its transport state and what it has not written yet.
    /// `None` (the connection is then dropped with the others) when the
    /// transport is not at rest or the socket cannot be taken out of the
    /// runtime.
    fn take_live(&mut self, sh: &Shared) -> Option<crate::LiveTransport> {
        let tid = sh.session.active_transport()?;
        let state = sh.session.export_transport()?;
        let i = self.conns.iter().position(|c| c.tid == tid)?;
        let c = self.conns.swap_remove(i);
        let unsent = c.out[c.pos..].to_vec();
        let peer = c.peer;
        match c.sock.into_fd() {
            Ok(fd) => Some(crate::LiveTransport::new(fd, peer, state, unsent)),
            Err(e) => {
                tracing::warn!(
                    "session {}: its connection could not be taken out ({e}); the client resumes",
                    id_text(sh)
                );
                None
            }
        }
    }

    /// Before a detach drops the sockets: writes, without waiting, what the
    /// active transport already has queued and what the session still has
    /// to say on it (up to [`PARTING_WORDS`] bytes) — above all a `MOVE_TO`
    /// queued just before, so the peer resumes where the session goes
    /// instead of finding out by a failed resume here. Called before the
    /// export, which then holds all of it: nothing depends on these bytes
    /// arriving.
    fn flush_parting_words(&mut self, sh: &mut Shared, now: std::time::Instant) {
        let Some(tid) = sh.session.active_transport() else {
            return;
        };
        let Some(c) = self.conns.iter_mut().find(|c| c.tid == tid) else {
            return;
        };
        let mut out = Vec::new();
        while out.len() < PARTING_WORDS {
            let before = out.len();
            match sh.session.poll_transmit(now, &mut out) {
                Some(t) if t == tid && out.len() > before => {}
                _ => {
                    out.truncate(before);
                    break;
                }
            }
        }
        c.queue(&mut out);
        // What is written is written: a connection that moves on
        // (`detach_live`) takes only the rest along.
        if let Ok(n) = c.sock.try_write(&c.out[c.pos..]) {
            c.pos += n;
        }
    }

    /// Feeds bytes that arrived with the hello (server) before the loop starts.
    pub(crate) fn initial_input(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now().into_std();
        let tid = self.conns[0].tid;
        let inner = self.inner.clone();
        let mut sh = inner.lock();
        if let Err(e) = sh.session.handle_input(now, tid, data) {
            tracing::debug!("transport {tid:?}: {e}");
        }
    }

    /// The driver's task. A plain function returning an `async move`
    /// block rather than an `async fn`: an `async fn` keeps its argument
    /// twice in its state (the argument and the body's copy), and this
    /// future lives, inside its task, for as long as the session does,
    /// suspended ones included.
    ///
    /// `S` is the side the driver serves ([`AsClient`] or [`AsServer`]),
    /// whose sources it waits on.
    pub(crate) fn run<S: Side>(self) -> impl std::future::Future<Output = ()> + Send {
        let mut me = self;
        async move {
            // One timer for the driver's whole life, moved rather than replaced:
            // a new `Sleep` per iteration registered afresh each time, and
            // registering one earlier than the runtime's next wake-up writes to
            // its eventfd (two extra syscalls per ping-pong round trip, as the
            // ACK deadline comes and goes). Moving a timer later costs nothing.
            let timer = sleep_until(Instant::now());
            tokio::pin!(timer);
            loop {
                let now = Instant::now();
                let (deadline, done, new_session) = me.step(now);
                if let (Some(handle), Kind::Server(s)) = (new_session, &me.kind) {
                    (s.on_session)(handle);
                }
                if done {
                    break;
                }
                let wake = S::wait(&mut me, deadline, timer.as_mut()).await;
                me.on_wake(wake);
            }
            me.exit();
        }
    }

    /// Timers, transmit, events, re-dial scheduling. Returns the next deadline,
    /// whether the driver is finished, and a new server session to announce.
    fn step(&mut self, now: Instant) -> (Option<Instant>, bool, Option<SessionHandle>) {
        let std_now = now.into_std();
        let inner = self.inner.clone();
        let mut sh = inner.lock();
        sh.driver_wakeups += 1;
        let (reading, advice) = crate::tcpmem::current(std_now);
        for c in &mut self.conns {
            c.fit_memory(reading, advice);
        }
        if let Some(req) = sh.rare_if_any().and_then(|r| r.detach.take()) {
            // The export carries no event queue: what the last input left
            // there is dispatched first. Above all a stream the peer has
            // just opened: not yet in `incoming`, it would be in neither
            // `Detached::unaccepted` nor, restored, any accept queue — a
            // stream nobody ever accepts (a shell client's re-attach lost
            // in a relay takeover). No session handle comes of it: a
            // server's `Connected` precedes any handle, hence any detach.
            while let Some(ev) = sh.session.poll_event() {
                let _ = self.on_event(&mut sh, ev, now);
            }
            let result = self.detach(&mut sh, std_now, req.live);
            let done = result.is_ok();
            let _ = req.reply.send(result);
            if done {
                return (None, true, None);
            }
        }
        if sh.session.poll_timeout().is_some_and(|t| t <= std_now) {
            // Input that arrived while this task was busy or descheduled
            // counts as life: take it before the silence timer can fire.
            self.drain_ready_input(&mut sh, std_now);
            sh.session.handle_timeout(std_now);
        }
        if sh.abandoned && self.give_up_at.is_none() {
            self.give_up_at = Some(now + ABANDON_LINGER);
        }
        // A server session whose first handshake failed can never be resumed
        // (the client never learned its secret): end it instead of keeping it
        // for the whole resume timeout.
        if sh.session.role() == Role::Server
            && sh.session.state() == State::Handshaking
            && sh.session.active_transport().is_none()
        {
            sh.session
                .close(roam_proto::code::NO_ERROR, "handshake not completed");
        }
        let backed_up = self.transmit(&mut sh, std_now);
        self.keep_journal(&mut sh, std_now);
        let mut new_session = None;
        while let Some(ev) = sh.session.poll_event() {
            if let Some(h) = self.on_event(&mut sh, ev, now) {
                new_session = Some(h);
            }
        }
        sh.tidy();

        let redial_at = match &mut self.kind {
            Kind::Client(d) => d.schedule(&mut sh, &inner.events, now),
            Kind::Server(_) => None,
        };

        if sh.closed.is_some() {
            for c in &mut self.conns {
                c.retire_by.get_or_insert(now + RETIRE_LINGER);
            }
        }
        self.conns
            .retain(|c| !c.retire_by.is_some_and(|t| c.unwritten() == 0 || t <= now));
        if self.conns.is_empty() {
            // Suspended: no room for connections is needed until a
            // transport is back (a `Conn` is ~170 bytes, and `retain` keeps
            // the capacity).
            if self.conns.capacity() > 0 {
                self.conns = Vec::new();
            }
            // Nor the tables of the waker maps once nothing waits in them
            // (a map keeps its table when emptied: ~120 bytes each).
            if sh.read_wakers.is_empty() {
                sh.read_wakers.shrink_to_fit();
            }
            if sh.write_wakers.is_empty() {
                sh.write_wakers.shrink_to_fit();
            }
        }

        let give_up = self.give_up_at.is_some_and(|t| t <= now);
        let done = (sh.closed.is_some() && self.conns.is_empty()) || give_up;

        let mut deadline = sh.session.poll_timeout().map(Instant::from_std);
        if backed_up {
            // Overdue send deadlines wait for writability (a socket wake-up),
            // not for the timer.
            deadline = deadline.map(|t| t.max(now + BACKED_UP_TICK));
        }
        let mut at = |t: Instant| deadline = Some(deadline.map_or(t, |d| d.min(t)));
        for c in &self.conns {
            if let Some(t) = c.retire_by {
                at(t);
            }
        }
        if let Some(t) = self.give_up_at {
            at(t);
        }
        if let Some(t) = redial_at {
            at(t);
        }
        (deadline, done, new_session)
    }

    /// Feeds whatever the sockets hold right now, without waiting.
    fn drain_ready_input(&mut self, sh: &mut Shared, now: std::time::Instant) {
        let mut i = 0;
        while i < self.conns.len() {
            if let Drained::Open = self.conns[i].drain_ready(&mut sh.session, now, DRAIN_READS) {
                i += 1;
            } else {
                let c = self.conns.remove(i);
                self.note_lost(sh, c.tid);
                sh.session.handle_transport_closed(now, c.tid);
            }
        }
    }

    /// A connection is gone. If it was the client's resume attempt and the
    /// resume never completed on it, the address is not serving us: the next
    /// re-dial tries the next address the server announced.
    fn note_lost(&mut self, sh: &Shared, tid: roam_proto::TransportId) {
        if let Kind::Client(d) = &mut self.kind {
            if d.resuming.take_if(|t| *t == tid).is_some()
                && sh.session.active_transport() != Some(tid)
            {
                d.rotate(sh.addresses(), "closed the connection before the resume");
            }
        }
    }

    /// Moves records from the session into the connections' buffers until
    /// the session has none or a connection is backed up; returns whether
    /// one is (output then waits for the socket to take some).
    fn transmit(&mut self, sh: &mut Shared, now: std::time::Instant) -> bool {
        RECORDS.with_borrow_mut(|records| {
            let backed_up = loop {
                // A retiring (dead or replaced) connection must not hold back
                // the others: its unwritten bytes may never drain.
                if self.conns.iter().any(Conn::backed_up) {
                    break true;
                }
                records.clear();
                let Some(tid) = sh.session.poll_transmit(now, records) else {
                    break false;
                };
                match self.conns.iter_mut().find(|c| c.tid == tid) {
                    Some(c) => c.queue(records),
                    None => tracing::trace!("dropping output for unknown transport {tid:?}"),
                }
            };
            if records.capacity() > RECORDS_KEEP {
                // A buffer a bulk transfer grew: not kept for the thread.
                *records = Vec::new();
            }
            backed_up
        })
    }

    /// Journals the session ([`SessionHandle::set_journal`]) after a
    /// transmit, while what it queued is still in the connections' buffers:
    /// nothing it covers has reached a socket yet.
    fn keep_journal(&mut self, sh: &mut Shared, now: std::time::Instant) {
        let Some(journal) = sh.rare.as_deref_mut().and_then(|r| r.journal.as_mut()) else {
            return;
        };
        let kept = journal.keep(&sh.session, now);
        if let Err(e) = &kept {
            tracing::warn!(
                "session {}: journal stopped ({e}); the session no longer survives this process being killed",
                id_text(sh)
            );
        }
        if !matches!(kept, Ok(true)) {
            sh.rare().journal = None;
        }
    }

    /// Handles one session event; returns a handle for a server session that just connected.
    fn on_event(&mut self, sh: &mut Shared, ev: Event, now: Instant) -> Option<SessionHandle> {
        let events = &self.inner.events;
        let role = sh.session.role();
        match ev {
            Event::Connected {
                session_id,
                peer_key,
            } => {
                if let Kind::Server(s) = &mut self.kind {
                    if !s.admit_key(sh, session_id, peer_key) {
                        return None;
                    }
                }
                sh.connected = true;
                for w in sh.closed_wakers.drain(..) {
                    w.wake();
                }
                tracing::debug!("session {session_id} connected, peer key {peer_key}");
                events.send(SessionEvent::Connected {
                    session_id,
                    peer_key,
                });
                if role == Role::Server {
                    return Some(SessionHandle::new(self.inner.clone()));
                }
            }
            Event::Suspended { reason, .. } => {
                tracing::info!("session {} suspended: {reason:?}", id_text(sh));
                events.send(SessionEvent::Suspended { reason });
            }
            Event::ResumeAbandoned => {
                tracing::info!(
                    "session {}: a resume ended before it completed; still suspended",
                    id_text(sh)
                );
                events.send(SessionEvent::ResumeAbandoned);
            }
            Event::Resumed {
                suspended_for,
                frames_replayed,
                bytes_replayed,
            } => {
                tracing::info!(
                    "session {} resumed after {suspended_for:?}, replaying {bytes_replayed} bytes",
                    id_text(sh)
                );
                if let Kind::Client(d) = &mut self.kind {
                    d.attempt = 0;
                    d.moves = 0;
                    d.fallback = None;
                }
                events.send(SessionEvent::Resumed {
                    suspended_for,
                    bytes_replayed,
                    frames_replayed,
                });
            }
            Event::PeerAddressChanged { from, to } => {
                tracing::info!(
                    "session {}: peer moved from {from:?} to {to:?}",
                    id_text(sh)
                );
                events.send(SessionEvent::PeerAddressChanged { from, to });
            }
            Event::TransportClosed { transport, error } => {
                if let Some(e) = error {
                    tracing::debug!("transport {transport:?} closed: {e}");
                    if role == Role::Client
                        && matches!(
                            e,
                            roam_proto::Error::UnknownSession | roam_proto::Error::ResumeRejected
                        )
                    {
                        events.send(SessionEvent::ResumeRefused { error: e });
                        // The session may live on at another address the
                        // server announced (a cluster whose host we were
                        // sent to, or fell back to, does not hold it).
                        if let Kind::Client(d) = &mut self.kind {
                            d.rotate(sh.addresses(), "does not know the session");
                        }
                    }
                }
                if let Some(c) = self.conns.iter_mut().find(|c| c.tid == transport) {
                    c.retire_by.get_or_insert(now + RETIRE_LINGER);
                }
            }
            Event::StreamOpened { stream } => {
                let rare = sh.rare();
                rare.incoming.push_back(stream);
                for w in rare.accept_wakers.drain(..) {
                    w.wake();
                }
            }
            Event::StreamReadable { stream } => {
                if sh.is_orphan(stream) {
                    let mut scratch = [0u8; 4096];
                    loop {
                        match sh.session.read(stream, &mut scratch) {
                            Ok(Some(n)) if n > 0 => {}
                            Ok(None) => break,
                            _ => {
                                sh.unorphan(stream);
                                break;
                            }
                        }
                    }
                } else if let Some(w) = sh.read_wakers.remove(&stream) {
                    w.wake();
                }
            }
            // Only the stream concerned: waking every writer on each event made
            // a session with 1,000 blocked streams spin (bench scenario 6).
            Event::StreamWritable { stream } => {
                if let Some(w) = sh.write_wakers.remove(&stream) {
                    w.wake();
                }
            }
            Event::StreamSendComplete { stream } => {
                if sh.unorphan(stream) {
                    // Dropped unread, and our direction is now delivered:
                    // tell the peer nobody reads what it still sends.
                    let _ = sh.session.reset_stream(stream, roam_proto::code::NO_ERROR);
                } else if let Some(w) = sh.write_wakers.remove(&stream) {
                    w.wake();
                }
            }
            Event::StreamReset { stream, code } => {
                tracing::debug!("stream {stream} reset by peer (code {code})");
                if !sh.unorphan(stream) {
                    sh.rare().resets.insert(stream, code);
                }
                if let Some(w) = sh.read_wakers.remove(&stream) {
                    w.wake();
                }
                if let Some(w) = sh.write_wakers.remove(&stream) {
                    w.wake();
                }
            }
            // Only a non-empty list makes the seldom-used parts.
            Event::AddressesUpdated { addrs } => match sh.rare_if_any() {
                Some(r) => r.addresses = addrs,
                None if addrs.is_empty() => {}
                None => sh.rare().addresses = addrs,
            },
            Event::MoveAsked { host } => {
                events.send(SessionEvent::MoveAsked { host });
            }
            Event::MoveRequested { addr } => {
                if let Kind::Client(d) = &mut self.kind {
                    d.move_to(addr);
                }
            }
            Event::Closed { reason } => {
                if role == Role::Server
                    && matches!(
                        reason,
                        roam_proto::CloseReason::Error(roam_proto::Error::Unauthorized)
                    )
                {
                    server_side::warn_unauthorized(sh);
                    if let Kind::Server(s) = &self.kind {
                        s.note_unauthorized();
                    }
                }
                tracing::info!(
                    "session {} closed: {}",
                    id_text(sh),
                    crate::error::describe_close(&reason)
                );
                sh.closed = Some(Box::new(reason.clone()));
                sh.wake_all();
                self.closed_sent = true;
                events.send(SessionEvent::Closed { reason });
            }
            other => tracing::trace!("unhandled event {other:?}"),
        }
        None
    }

    fn on_wake(&mut self, wake: Wake) {
        let now = Instant::now();
        let std_now = now.into_std();
        let inner = self.inner.clone();
        match wake {
            Wake::Io(Io::Readable(i)) => {
                let mut sh = inner.lock();
                // One read per wake, as a socket read used to be: the loop
                // then transmits and dispatches before reading more.
                let gone = match self.conns[i].drain_ready(&mut sh.session, std_now, 1) {
                    Drained::Open => return,
                    Drained::Eof => "closed by peer".to_string(),
                    Drained::Failed(e) => e.to_string(),
                };
                let c = self.conns.remove(i);
                tracing::debug!("transport {:?} from {}: {gone}", c.tid, c.peer);
                self.note_lost(&sh, c.tid);
                sh.session.handle_transport_closed(std_now, c.tid);
            }
            Wake::Io(Io::Failed(i, e)) => {
                let c = self.conns.remove(i);
                tracing::debug!("transport {:?} from {}: {e}", c.tid, c.peer);
                let mut sh = inner.lock();
                self.note_lost(&sh, c.tid);
                sh.session.handle_transport_closed(std_now, c.tid);
            }
            Wake::Io(Io::Wrote) | Wake::Notified | Wake::Timer => {}
            Wake::Dialer(w) => {
                let Kind::Client(d) = &mut self.kind else {
                    return;
                };
                let mut sh = inner.lock();
                match w {
                    DialerWake::Dialed(result) => {
                        if let Some(conn) = d.on_dialed(&mut sh, result, std_now) {
                            self.adopt(conn);
                        }
                    }
                    DialerWake::NetChange(alive) => d.on_net_change(&sh, &self.conns, alive),
                }
            }
            Wake::Handoff(None) => self.handoffs_open = false,
            Wake::Handoff(Some(h)) => {
                let Kind::Server(s) = &mut self.kind else {
                    return;
                };
                let mut sh = inner.lock();
                if let Some(conn) = s.on_handoff(&mut sh, *h, std_now) {
                    self.adopt(conn);
                }
            }
            Wake::Shutdown => {
                self.shutting_down = true;
                let Kind::Server(s) = &self.kind else { return };
                inner
                    .lock()
                    .session
                    .close(roam_proto::code::NO_ERROR, "server shutting down");
                self.give_up_at = Some(now + s.shutdown_grace);
            }
        }
    }

    fn exit(mut self) {
        let mut sh = self.inner.lock();
        if sh.closed.is_none() {
            sh.closed = Some(Box::new(roam_proto::CloseReason::Local {
                code: roam_proto::code::NO_ERROR,
            }));
        }
        sh.wake_all();
        if !self.closed_sent {
            if let Some(reason) = sh.closed.as_deref().cloned() {
                self.inner.events.send(SessionEvent::Closed { reason });
            }
        }
        drop(sh);
        self.conns.clear();
        if let Kind::Server(s) = &self.kind {
            if !self.detached {
                s.unroute();
            }
        }
    }
}

pub(super) fn id_text(sh: &Shared) -> String {
    sh.session
        .id()
        .map_or_else(|| "(new)".to_string(), |id| id.to_string())
}
