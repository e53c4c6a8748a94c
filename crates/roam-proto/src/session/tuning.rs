//! The session's own copy of its [`Config`], made compact.
//!
//! A session keeps its configuration for its whole life, suspended or not,
//! and [`Config`] spends 16 bytes on each `Duration`. Here a duration is a
//! count of nanoseconds in 8 bytes (saturating at about 584 years, which no
//! timer here comes near), and the resume timeout is not kept at all: the
//! session has its own, which a restore may shorten. 88 bytes instead of
//! 152, which with the other savings puts a client session's whole state
//! under the allocator's 1,024-byte class.

use std::time::Duration;

use crate::config::Config;
use crate::handshake::Params;

/// A duration as nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Nanos(u64);

impl Nanos {
    /// Means "none" in an optional duration.
    const NONE: Nanos = Nanos(u64::MAX);

    /// `d`, saturated just below [`Nanos::NONE`].
    fn of(d: Duration) -> Self {
        Nanos(u64::try_from(d.as_nanos()).map_or(u64::MAX - 1, |n| n.min(u64::MAX - 1)))
    }

    /// `d` or [`Nanos::NONE`].
    fn of_option(d: Option<Duration>) -> Self {
        d.map_or(Self::NONE, Self::of)
    }

    /// Back to a `Duration`.
    fn get(self) -> Duration {
        Duration::from_nanos(self.0)
    }

    /// Back to an optional `Duration`.
    fn get_option(self) -> Option<Duration> {
        (self != Self::NONE).then(|| self.get())
    }
}

/// What a [`Session`](super::Session) keeps of its [`Config`]: the same
/// values (see each accessor's namesake there), with the windows and the
/// stream limit already raised to what the handshake announces.
#[derive(Clone, Debug)]
pub(super) struct Tuning {
    /// [`Config::heartbeat_interval`].
    heartbeat_interval: Nanos,
    /// [`Config::suspend_after`].
    suspend_after: Nanos,
    /// [`Config::idle_resume_timeout`].
    idle_resume_timeout: Nanos,
    /// [`Config::handshake_timeout`].
    handshake_timeout: Nanos,
    /// [`Config::ack_delay`].
    ack_delay: Nanos,
    /// [`Config::refusal_grace`].
    refusal_grace: Nanos,
    /// [`Config::stream_window`], at least 1.
    pub(super) stream_window: u64,
    /// [`Config::session_window`], at least 1.
    pub(super) session_window: u64,
    /// [`Config::stream_send_buffer`].
    pub(super) stream_send_buffer: u64,
    /// [`Config::session_send_buffer`].
    pub(super) session_send_buffer: u64,
    /// [`Config::max_streams`], at least the protocol's minimum.
    max_streams: u64,
}

impl Tuning {
    /// The compact copy of `config`, windows and limit as announced.
    pub(super) fn new(config: &Config) -> Self {
        let p = config.params();
        Self {
            heartbeat_interval: Nanos::of(config.heartbeat_interval),
            suspend_after: Nanos::of(config.suspend_after),
            idle_resume_timeout: Nanos::of_option(config.idle_resume_timeout),
            handshake_timeout: Nanos::of(config.handshake_timeout),
            ack_delay: Nanos::of(config.ack_delay),
            refusal_grace: Nanos::of(config.refusal_grace),
            stream_window: p.stream_window,
            session_window: p.session_window,
            stream_send_buffer: config.stream_send_buffer,
            session_send_buffer: config.session_send_buffer,
            max_streams: p.max_streams,
        }
    }

    /// What the handshake announces (§8).
    pub(super) fn params(&self) -> Params {
        Params {
            stream_window: self.stream_window,
            session_window: self.session_window,
            max_streams: self.max_streams,
        }
    }

    /// [`Config::heartbeat_interval`].
    pub(super) fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval.get()
    }

    /// [`Config::suspend_after`].
    pub(super) fn suspend_after(&self) -> Duration {
        self.suspend_after.get()
    }

    /// [`Config::idle_resume_timeout`].
    pub(super) fn idle_resume_timeout(&self) -> Option<Duration> {
        self.idle_resume_timeout.get_option()
    }

    /// [`Config::handshake_timeout`].
    pub(super) fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout.get()
    }

    /// [`Config::ack_delay`].
    pub(super) fn ack_delay(&self) -> Duration {
        self.ack_delay.get()
    }

    /// [`Config::refusal_grace`].
    pub(super) fn refusal_grace(&self) -> Duration {
        self.refusal_grace.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_every_value_a_config_can_hold() {
        let config = Config {
            heartbeat_interval: Duration::new(1, 5),
            suspend_after: Duration::from_millis(5_500),
            resume_timeout: Duration::MAX,
            idle_resume_timeout: Some(Duration::from_secs(600)),
            handshake_timeout: Duration::from_nanos(1),
            ack_delay: Duration::ZERO,
            refusal_grace: Duration::MAX,
            stream_window: 0,
            session_window: 7,
            stream_send_buffer: 3,
            session_send_buffer: u64::MAX,
            max_streams: 0,
        };
        let t = Tuning::new(&config);
        assert_eq!(t.heartbeat_interval(), Duration::new(1, 5));
        assert_eq!(t.suspend_after(), Duration::from_millis(5_500));
        assert_eq!(t.idle_resume_timeout(), Some(Duration::from_secs(600)));
        assert_eq!(t.handshake_timeout(), Duration::from_nanos(1));
        assert_eq!(t.ack_delay(), Duration::ZERO);
        // Saturated, still "some" and longer than any session lives.
        assert!(t.refusal_grace() > Duration::from_secs(500 * 365 * 86_400));
        assert_eq!(t.params(), config.params());
        assert_eq!((t.stream_send_buffer, t.session_send_buffer), (3, u64::MAX));
        let none = Tuning::new(&Config {
            idle_resume_timeout: None,
            ..Config::default()
        });
        assert_eq!(none.idle_resume_timeout(), None);
        let huge = Tuning::new(&Config {
            idle_resume_timeout: Some(Duration::MAX),
            ..Config::default()
        });
        assert!(huge.idle_resume_timeout().is_some());
    }
}
