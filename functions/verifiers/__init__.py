"""Code verification in isolated, pre-warmed sandboxes (see ``docs/code-verifier.md``).

Kept import-free: the sandbox zygote imports this package and must stay small.
"""
