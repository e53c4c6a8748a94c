//! Client: the rate-based move policy (Service Continuations §7.1.3). The
//! inbound data rate is estimated over fixed windows; when it falls by the
//! configured fraction below the best rate seen from the current server,
//! the client asks to be moved (`MOVE_ASK` to any host, PROTOCOL.md §9.4).

use tokio::time::Instant;

use crate::config::MovePolicy;

/// The policy's running state for one session.
pub(super) struct Slowdown {
    policy: MovePolicy,
    /// Start of the current window and the byte count then.
    window_start: Instant,
    bytes_at_start: u64,
    /// The best window rate (bytes per second) from the current server.
    best: f64,
    /// No new request before this (a move takes time to show).
    quiet_until: Option<Instant>,
    /// The server changed: start over at the next check.
    restart: bool,
}

impl Slowdown {
    pub(super) fn new(policy: MovePolicy, now: Instant) -> Self {
        Self {
            policy,
            window_start: now,
            bytes_at_start: 0,
            best: 0.0,
            quiet_until: None,
            restart: false,
        }
    }

    /// The session is moving to another server: rates start over there.
    pub(super) fn restart(&mut self) {
        self.restart = true;
    }

    /// Called every loop: `received` is the session's inbound payload
    /// count, `connected` whether a transport carries it. Returns whether to
    /// ask for a move now, and when the current window ends (a deadline).
    pub(super) fn check(
        &mut self,
        now: Instant,
        received: u64,
        connected: bool,
    ) -> (bool, Instant) {
        if std::mem::take(&mut self.restart) {
            self.window_start = now;
            self.bytes_at_start = received;
            self.best = 0.0;
            return (false, now + self.policy.window);
        }
        let end = self.window_start + self.policy.window;
        if now < end {
            return (false, end);
        }
        let secs = (now - self.window_start).as_secs_f64().max(1e-3);
        let rate = received.saturating_sub(self.bytes_at_start) as f64 / secs;
        self.window_start = now;
        self.bytes_at_start = received;
        let next = now + self.policy.window;
        if !connected {
            // A suspension is the transport's business, not the server's.
            return (false, next);
        }
        if rate > self.best {
            self.best = rate;
        }
        let quiet = self.quiet_until.is_some_and(|t| now < t);
        let slow =
            self.best >= self.policy.min_rate as f64 && rate < self.best * (1.0 - self.policy.drop);
        if slow && !quiet {
            tracing::info!(
                "inbound rate {:.0} B/s is {:.0} % below the best {:.0} B/s from this server; asking to move",
                rate,
                100.0 * (1.0 - rate / self.best),
                self.best
            );
            self.quiet_until = Some(now + self.policy.window * 5);
            return (true, next);
        }
        (false, next)
    }
}
