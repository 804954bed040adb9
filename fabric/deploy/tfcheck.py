"""Check a tfvars dict against the variables a terraform directory declares.

terraform only warns about an undeclared variable and silently drops an undeclared object
attribute, so a typo in ``fabric.auto.tfvars.json`` would deploy without the setting.
No HCL library: a small scanner of HCL's ``variable`` blocks and ``object({...})``
type expressions, enough for the shapes ``terraform/variables.tf`` uses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fabric.deploy.plan import DeployError

_VARIABLE_BLOCK = re.compile(r'^[ \t]*variable[ \t]+"([A-Za-z_][A-Za-z0-9_-]*)"[ \t]*\{', re.M)
_ATTRIBUTE = re.compile(r'(?:^|(?<=[\n,{]))[ \t]*("[^"\n]*"|[A-Za-z_][A-Za-z0-9_-]*)[ \t]*=(?![=>])')


def _string_end(text: str, i: int) -> int:
    """Index just past the string that opens at text[i] (a '"'), templates included."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        elif text.startswith(("${", "%{"), i):
            i = _group_end(text, i + 1)
        else:
            i += 1
    raise ValueError("unterminated string")


def _group_end(text: str, i: int) -> int:
    """Index just past the bracket that closes the one at text[i] (strings and comments skipped)."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            continue
        if c == "#" or text.startswith("//", i):
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced brackets")


def _top_level(text: str) -> str:
    """``text`` with strings, comments and bracket contents blanked (same length): what is left
    is its top level, where a newline or a comma ends an expression."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = _string_end(text, i)
            out.append('"' + "_" * (j - i - 2) + '"')
        elif c == "#" or text.startswith("//", i):
            newline = text.find("\n", i)
            j = len(text) if newline < 0 else newline
            out.append(" " * (j - i))
        elif c in "([{":
            j = _group_end(text, i)
            out.append(c + " " * (j - i - 2) + text[j - 1])
        else:
            j = i + 1
            out.append(c)
        i = j
    return "".join(out)


def _attributes(body: str) -> dict[str, str]:
    """The top-level ``name = expression`` pairs of a block or object body."""
    top = _top_level(body)
    found: dict[str, str] = {}
    for m in _ATTRIBUTE.finditer(top):
        ends = [k for k in (top.find("\n", m.end()), top.find(",", m.end())) if k >= 0]
        # a quoted name is blanked in `top`: read it from `body`
        found[body[m.start(1) : m.end(1)].strip('"')] = body[m.end() : min(ends, default=len(body))].strip()
    return found


def declared_object_attributes(type_expr: str) -> set[str] | None:
    """The attribute names of the first object type in a type expression: ``object({...})``
    itself or the element of ``map(object({...}))`` and the like; None without one."""
    m = re.search(r"\bobject\s*\(\s*\{", type_expr)
    if m is None:
        return None
    brace = m.end() - 1
    return set(_attributes(type_expr[brace + 1 : _group_end(type_expr, brace) - 1]))


def _variable_types(terraform_dir: Path) -> dict[str, str | None]:
    """Variable name -> its type expression (None when it declares none) in terraform_dir/*.tf."""
    types: dict[str, str | None] = {}
    for tf in sorted(terraform_dir.glob("*.tf")):
        try:
            text = tf.read_text()
        except OSError as e:  # a directory named like one, no permission: was a traceback
            raise DeployError(f"cannot read {tf}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise DeployError(f"cannot read {tf}: not UTF-8 text (terraform reads UTF-8)") from None
        for m in _VARIABLE_BLOCK.finditer(text):
            brace = m.end() - 1
            body = text[brace + 1 : _group_end(text, brace) - 1]
            types[m.group(1)] = _attributes(body).get("type")
    return types


def check_tfvars(tfvars: dict[str, Any], terraform_dir: Path) -> list[str]:
    """What terraform would ignore in ``tfvars`` (it only warns about an undeclared variable and
    silently drops an undeclared object attribute): one line per problem, [] when none."""
    types = _variable_types(terraform_dir)
    problems: list[str] = []
    for key, value in tfvars.items():
        if key not in types:
            problems.append(f"{key}: not a declared variable")
            continue
        type_expr = types[key] or ""
        attributes = declared_object_attributes(type_expr)
        if attributes is None or not isinstance(value, dict):
            continue
        # map(object(...)): an object per entry; object(...): the value itself
        is_map = re.match(r"\s*map\s*\(", type_expr) is not None
        for where, obj in ((f"{key}[{k!r}]", v) for k, v in value.items()) if is_map else [(key, value)]:
            if isinstance(obj, dict):
                problems += [
                    f"{where}.{a}: not an attribute of its type" for a in sorted(set(obj) - attributes)
                ]
    return problems
