"""The order in which copies that yield a line take it, one at a time.

A copy yields (`pipeline.copy_yields_line`) when nobody waits on it yet or
its user waits for its size anyway: a relayed request's copy, a warm push, a
big direct copy. Among themselves they go one at a time, fewest bytes (or
blocks) left first: shortest-remaining-first lands the most copies soonest
(four 90 MB copies one after the other land after one, two, three and four
copies' time instead of all after four).

Shortest-first alone starves: on a line that is busy most of the time, a
big copy waits while smaller ones keep arriving (on the servers at 30
Mbit/s a budget-denied cold turn's copy yielded for up to 108 s). With
`copy_max_yield_s` set, a copy that has waited that long since it started
goes ahead of every copy that has not (the oldest of them first): its
user's wait is bounded by that time plus the line time of the copies aged
before it. Off by default (inf): where the line is offered about what it
carries, every copy ages, the order turns first-come-first-served and the
p90 suffers far more than the worst case gains (docs/DESIGN.md, known
limits).

Pure: `now` is passed in. The servers' sender (`transport.priority.LineGate`)
and the simulator's link (`sim.link.Link`) order their copies by this key.

Yielding copies are also paced (`copy_pace_bytes_s`): a copy written as
fast as TCP takes it fills every buffer ahead of the line, and whatever
enters the line after it (a warm turn's BEGIN, its HAVE round trip, its one
block) queues behind those bytes even though the copy yields. Written a
little below the line's rate, a copy leaves those buffers empty, and a
transfer a user waits on meets a line that is free within one slice.
"""

from __future__ import annotations

import math


def yield_key(left: float, started_s: float, now: float, max_yield_s: float) -> tuple[int, float, float]:
    """Sort key among yielding copies (smallest goes next): `left` what the
    copy has still to send (bytes or blocks: only the order matters),
    `started_s` when it started."""
    if aged(started_s, now, max_yield_s):
        return (0, started_s, left)
    return (1, left, started_s)


def aged(started_s: float, now: float, max_yield_s: float) -> bool:
    """The copy has waited long enough to go before every younger one."""
    return now - started_s >= max_yield_s


def ages_at(started_s: float, max_yield_s: float) -> float:
    """When a copy started at `started_s` reaches the bound (inf: never)."""
    return started_s + max_yield_s if math.isfinite(max_yield_s) else math.inf


def copy_pace_bytes_s(line_bytes_s: float | None, num_senders: int, pace: float) -> float | None:
    """The rate at which one sender writes the copies that yield a line:
    `pace` (`PolicyConfig.copy_pace`) of the line's rate, split evenly among
    the senders that share it (each P sends its own copies, one at a time);
    None: unpaced (no pace, or a line of unknown rate)."""
    if pace <= 0 or not line_bytes_s or line_bytes_s <= 0 or not math.isfinite(line_bytes_s):
        return None
    return pace * line_bytes_s / max(num_senders, 1)
