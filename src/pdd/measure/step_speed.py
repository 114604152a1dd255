"""How fast each mode's engine steps ran, shape for shape, against the baseline's.

A bench runs its modes one after another on a machine shared with others,
and two things move a mode's step times that are not the mode's design:
the host's own speed over the minutes between two modes' windows, and what
shares a core with an engine in that mode (RLD beside P in PDD, the WAN
emulator, the router). Neither shows in a TTFT ratio, which is a ratio of
such steps. This module puts a number on both, from the engines' own step
records (`<mode>/steps.jsonl`):

- steps are grouped by shape, the work they did: a decoder's by batch size
  and total context (1K-token buckets), P's by batch size, prompt tokens
  (32-token buckets) and total context;
- for each shape both modes ran at least `MIN_STEPS` times, the ratio of the
  medians (CPU time of the engine's thread, and wall time); a mode's figure
  is their geometric mean, each shape weighted by the fewer of its two step
  counts.

The decoder's core carries the same kind of work in every mode, so its CPU
ratio reads mostly the machine's drift between the two windows; P's CPU
ratio beyond it is what P's core shares (other processes' cache traffic),
and P's wall ratio beyond its CPU ratio is time P waited for its core.
Measured, not corrected: a TTFT ratio is reported as it was, beside these.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Iterable

MIN_STEPS = 3
DECODE_ROLES = ("decode", "main")      # RLD ("relay") shares P's core: not the decoder's figure


def shape_key(step: dict) -> tuple[str, str] | None:
    """(kind, shape) of one engine step record; None for steps not compared."""
    role = step.get("role")
    batch = int(step.get("batch_size") or 0)
    ctx = sum(int(c) for c in step.get("context_lens") or ())
    n_pre = int(step.get("num_prefill_tokens") or 0)
    if batch <= 0:
        return None
    if role in DECODE_ROLES and n_pre == 0:
        return "decode", f"b{batch}c{ctx // 1024}"
    if role == "prefill" and n_pre > 0:
        return "prefill", f"b{batch}t{n_pre // 32}c{ctx // 1024}"
    return None


def step_shapes(steps: Iterable[dict]) -> dict[str, dict[str, list]]:
    """{kind: {shape: [count, median CPU s, median wall s]}} of a mode's steps."""
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in steps:
        key = shape_key(s)
        cpu, wall = s.get("cpu_s"), s.get("wall_s")
        if key is None or cpu is None or wall is None or cpu <= 0 or wall <= 0:
            continue
        groups.setdefault(key, []).append((float(cpu), float(wall)))
    out: dict[str, dict[str, list]] = {"decode": {}, "prefill": {}}
    for (kind, shape), xs in groups.items():
        out[kind][shape] = [len(xs), statistics.median(c for c, _ in xs), statistics.median(w for _, w in xs)]
    return out


def read_step_shapes(path: Path) -> dict[str, dict[str, list]] | None:
    """`step_shapes` of a steps.jsonl file; None where there is none."""
    if not path.is_file():
        return None
    with open(path) as f:
        return step_shapes(json.loads(line) for line in f if line.strip())


def compare(base: dict[str, list], other: dict[str, list], min_steps: int = MIN_STEPS) -> dict | None:
    """`other`'s steps over `base`'s, shape for shape (one kind's dicts from
    `step_shapes`): {"cpu": ratio, "wall": ratio, "steps": steps compared,
    "shapes": shapes compared}; None where no shape has enough steps in both."""
    num = {"cpu": 0.0, "wall": 0.0}
    weight = 0
    steps = shapes = 0
    for shape, (n_b, cpu_b, wall_b) in base.items():
        if shape not in other:
            continue
        n_o, cpu_o, wall_o = other[shape]
        if min(n_b, n_o) < min_steps:
            continue
        w = min(n_b, n_o)
        num["cpu"] += w * math.log(cpu_o / cpu_b)
        num["wall"] += w * math.log(wall_o / wall_b)
        weight += w
        steps += n_o
        shapes += 1
    if not weight:
        return None
    return {"cpu": math.exp(num["cpu"] / weight), "wall": math.exp(num["wall"] / weight),
            "steps": steps, "shapes": shapes}


def speed_rows(summary: dict) -> list[list[str]]:
    """Report rows: each mode's decoder and P steps against the baseline's."""
    modes = {n: m for n, m in summary.get("modes", {}).items() if "error" not in m and m.get("step_shapes")}
    base = summary.get("baseline")
    if base not in modes:
        return []
    b = modes[base]["step_shapes"]
    rows = []
    for name, m in modes.items():
        if name == base:
            continue
        cells = [name]
        for kind, fields in (("decode", ("cpu",)), ("prefill", ("cpu", "wall"))):
            c = compare(b.get(kind, {}), m["step_shapes"].get(kind, {}))
            for f in fields:
                cells.append(f"{c[f] - 1.0:+.0%} ({c['steps']})" if c else "-")
        rows.append(cells)
    return rows
