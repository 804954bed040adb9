"""Checks of CLI help pages shared by the fabric and envpool CLI tests."""

from __future__ import annotations

import itertools
import re
from typing import Any


def early_breaks(page: str, columns: int) -> list[str]:
    """Lines of a help page's intro and command list that end before they had to: rich fills
    lines greedily, so one whose next line's first word would still have fit broke at a line
    break of the help text, mid-sentence."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    intro = [line.rstrip() for line in lines[start:end] if line.strip()]
    found = [a for a, b in itertools.pairwise(intro) if len(a) + 1 + len(b.split()[0]) < columns - 1]
    in_commands, col, prev = False, 0, ""
    for line in lines:
        if line.startswith("╭"):
            in_commands = "Commands" in line
            continue
        if not (in_commands and line.startswith("│")):
            continue
        row = line[1:-1]
        first = re.match(r" \S+ +", row)
        if first:  # a command's first line: its description starts after the name
            col = first.end()
        elif row.strip() and len(prev.rstrip()) + 1 + len(row[col:].split()[0]) < len(row):
            found.append(prev.strip())
        prev = row
    return found


def command_paths(command: Any) -> list[list[str]]:
    """[] for the command itself, then every subcommand's path, depth first."""
    subs = getattr(command, "commands", {})
    return [[], *([name, *path] for name, sub in subs.items() for path in command_paths(sub))]
