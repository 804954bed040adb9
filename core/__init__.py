"""The core Ray job: rollout, reward stream, sample buffer, trainer (see docs/DESIGN.md)."""
