"""A function's version hashes the whole file of the module that defines it (and of its
setup hook's): a helper or a constant the function uses is part of what it computes."""

from __future__ import annotations

from fabric.registry import load_entry_point, make_spec


def test_the_version_follows_the_whole_module(tmp_path):
    """A function's version changes with anything in its module file (a helper, a
    constant), and only with the text: the same text in another file is the same version."""
    texts = {
        "a": "K = 1\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
        "b": "K = 2\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
        "c": "K = 1\n\ndef helper():\n    return K + 0\n\ndef scorer(traj):\n    return helper()\n",
        "d": "K = 1\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
    }
    versions = {}
    for key, text in texts.items():
        (tmp_path / f"{key}.py").write_text(text)
        fn = load_entry_point(f"{tmp_path / f'{key}.py'}:scorer")
        versions[key] = make_spec(fn, kind="reward").version
    assert versions["a"] != versions["b"]  # a constant
    assert versions["a"] != versions["c"]  # a helper
    assert versions["a"] == versions["d"]  # the text, not the file it is in
