"""The embedded-default policy: a word-level tokenizer and a tiny causal LM (torch)."""
