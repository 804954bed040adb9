"""Stateful environments in session-affine container pools (see docs/DESIGN.md)."""
