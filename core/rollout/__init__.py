"""Rollout: inference engines behind one ABC, the LLM proxy and the env managers."""
