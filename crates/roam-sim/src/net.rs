//! Deterministic network simulator.
