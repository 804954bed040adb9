"""Text FrozenLake: walk from S to G over a frozen lake without falling into a hole.

The map is generated from the reset seed (gymnasium's ``generate_random_map`` rule: each
tile is frozen with probability ``p_frozen``, redrawn until the goal is reachable), or fixed
with ``desc=[...]``. On a slippery lake a move goes the intended way with probability 1/3
and to either side otherwise, drawn from the same seeded generator, so a seed and a list of
actions always replay the same episode.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult

MOVES: dict[str, tuple[int, int]] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
#: Perpendicular moves a slippery lake may substitute for the intended one.
_SIDEWAYS = {
    "left": ("up", "down"),
    "right": ("up", "down"),
    "up": ("left", "right"),
    "down": ("left", "right"),
}
_LEGEND = "Legend: @ you, S start, F frozen (safe), H hole, G goal. Row 0 is the top row."
VALID = "left, right, up, down"


def generate_map(size: int, rng: random.Random, p_frozen: float = 0.8) -> list[str]:
    """A ``size`` x ``size`` map with S top-left, G bottom-right and a safe path between them."""
    while True:
        rows = [["F" if rng.random() < p_frozen else "H" for _ in range(size)] for _ in range(size)]
        rows[0][0], rows[-1][-1] = "S", "G"
        if _reachable(rows):
            return ["".join(r) for r in rows]


def _reachable(rows: list[list[str]] | list[str]) -> bool:
    n, m = len(rows), len(rows[0])
    seen, todo = {(0, 0)}, [(0, 0)]
    while todo:
        r, c = todo.pop()
        if rows[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < m and (nr, nc) not in seen and rows[nr][nc] != "H":
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


class FrozenLakeEnv(Env):
    """Actions: ``left``, ``right``, ``up``, ``down`` (any case). Reward 1 on the goal."""

    example_actions: ClassVar[tuple[str, ...]] = ("right", "Down", " left ", "up", "jump")

    def __init__(
        self,
        size: int = 4,
        slippery: bool = False,
        p_frozen: float = 0.8,
        desc: list[str] | None = None,
        neighbours: bool = False,
    ):
        if desc is not None:
            if not desc or any(len(row) != len(desc[0]) for row in desc) or set("".join(desc)) - set("SFHG"):
                raise ValueError("desc must be equal-length rows of S, F, H, G")
            if desc[0][0] != "S" or "G" not in "".join(desc):
                raise ValueError("desc must start with S at the top-left and contain a G")
        elif not 2 <= size <= 16:
            raise ValueError(f"size must be 2..16, got {size}")
        if not 0.0 < p_frozen <= 1.0:
            raise ValueError(f"p_frozen must be in (0, 1], got {p_frozen}")
        self.size = size
        self.slippery = slippery
        self.p_frozen = p_frozen
        self.desc = list(desc) if desc is not None else None
        # a local view: small policies learn "avoid the hole next to me" from one line long
        # before they learn to read it off the 2-D map
        self.neighbours = neighbours
        self._rng: random.Random | None = None
        self.map: list[str] = []
        self.pos = (0, 0)

    # -- helpers
    def render(self) -> str:
        lines = []
        for r, row in enumerate(self.map):
            lines.append(" ".join("@" if (r, c) == self.pos else t for c, t in enumerate(row)))
        r, c = self.pos
        lines.append(f"You are at row {r}, column {c}.")
        if self.neighbours:
            lines.append(f"Next to you: {self._around()}.")
        return "\n".join([*lines, _LEGEND])

    def _around(self) -> str:
        """``left F, right H, up edge, down F``: the tile each move would reach."""
        r, c = self.pos
        out = []
        for name in ("left", "right", "up", "down"):
            dr, dc = MOVES[name]
            nr, nc = r + dr, c + dc
            inside = 0 <= nr < len(self.map) and 0 <= nc < len(self.map[0])
            out.append(f"{name} {self.map[nr][nc] if inside else 'edge'}")
        return ", ".join(out)

    def _obs(self, message: str) -> Observation:
        return Observation(text=f"{message}\n{self.render()}")

    # -- contract
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        # a seed restarts the generator; without one the previous episode's stream goes on
        if seed is not None or self._rng is None:
            self._rng = random.Random(seed)
        self.map = self.desc or generate_map(self.size, self._rng, self.p_frozen)
        self.pos = (0, 0)
        intro = (
            f"FrozenLake {len(self.map)}x{len(self.map[0])}: walk from S to G without falling into "
            f"a hole (H). {'The ice is slippery: you may slide sideways. ' if self.slippery else ''}"
            f"Reply with one action: {VALID}."
        )
        info = {"map": list(self.map), "slippery": self.slippery, "position": list(self.pos)}
        return self._obs(intro), info

    def step(self, action: str) -> StepResult:
        assert self._rng is not None  # GuardedEnv enforces reset first
        move = action.strip().lower()
        if move not in MOVES:
            shown = action.strip()[:40]
            return StepResult(
                obs=self._obs(f"Invalid action {shown!r}. Valid actions: {VALID}."),
                info={"valid": False, "position": list(self.pos)},
            )
        actual = move
        if self.slippery:
            actual = [move, *_SIDEWAYS[move]][int(self._rng.random() * 3)]
        dr, dc = MOVES[actual]
        r, c = self.pos
        nr, nc = r + dr, c + dc
        moved = 0 <= nr < len(self.map) and 0 <= nc < len(self.map[0])
        if moved:
            self.pos = (nr, nc)
        tile = self.map[self.pos[0]][self.pos[1]]
        slip = f"You tried to move {move} but slipped {actual}. " if actual != move else ""
        where = (
            f"You moved {actual}." if moved else f"You bumped into the edge moving {actual} and stayed put."
        )
        reward, terminated = 0.0, False
        if tile == "H":
            where += " You fell into a hole. Episode over."
            terminated = True
        elif tile == "G":
            where += " You reached the goal! Episode over."
            reward, terminated = 1.0, True
        info = {"valid": True, "moved": actual, "slipped": actual != move, "position": list(self.pos)}
        return StepResult(obs=self._obs(slip + where), reward=reward, terminated=terminated, info=info)
