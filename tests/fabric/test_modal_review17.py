"""Review of the Modal backend and its deploy against the installed modal: the image's
Python is the deploying interpreter's (the functions are cloudpickled), and what Modal
refuses while the app is built is said as a deploy error."""

from __future__ import annotations

import sys

from sample_fns import REG

from fabric.deploy import plan_functions


def test_the_modal_image_runs_the_python_that_pickled_the_functions(monkeypatch):
    """The functions are deployed ``serialized=True``: cloudpickle sends their code by value,
    and a code object made by one Python minor version does not load in another (Modal:
    "Try changing the Python version in your Modal image to match your local Python
    version"). The image was always Python 3.11, so a deploy from 3.12 or 3.13 (which
    rl-fabric supports) made functions no container could load. It is the deploying
    interpreter's version now."""
    import modal
    from modal._image import _validate_python_version

    from fabric.deploy.modal_ import build_app

    asked: list[str | None] = []
    real = modal.Image.debian_slim

    def recording(*args, **kwargs):
        asked.append(kwargs.get("python_version"))
        return real(*args, **kwargs)

    monkeypatch.setattr(modal.Image, "debian_slim", recording)
    plan = plan_functions(REG, ["add"], prefix="rl-")
    monkeypatch.setattr(sys, "version_info", (3, 12, 9, "final", 0))
    try:
        build_app(REG, plan)
        # what Modal makes of it (None: the local version)
        series = [_validate_python_version(v, "2025.06") for v in asked]
    finally:
        monkeypatch.undo()
    assert series == ["3.12"], asked
