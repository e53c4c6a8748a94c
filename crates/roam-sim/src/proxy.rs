//! Loopback TCP fault proxy (reset, black-hole, delay) for tests over real sockets.
