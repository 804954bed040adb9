"""Built-in reward functions."""
