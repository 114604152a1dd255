import dataclasses
from pathlib import Path

import pytest

from pdd.sim.loop import Event, EventKind, EventLoop
from pdd.sim.runner import run_mode
from pdd.sim.scenario import load

TINY = Path(__file__).resolve().parents[1] / "examples" / "sim" / "tiny.toml"


@dataclasses.dataclass(frozen=True)
class Tick:
    """A test record: its kind and key are given per instance."""
    KIND: EventKind
    key: str
    n: int = 0


def test_ties_break_on_time_kind_key_then_creation():
    loop = EventLoop()
    seen = []
    loop.on(Tick, lambda ev: seen.append(ev.record.n))
    loop.push(Event(1.0, Tick(EventKind.ARRIVAL, "b", 1)))
    loop.push(Event(1.0, Tick(EventKind.ARRIVAL, "a", 2)))
    loop.push(Event(1.0, Tick(EventKind.STEP_END, "z", 3)))
    loop.push(Event(0.5, Tick(EventKind.ARRIVAL, "z", 4)))
    loop.push(Event(1.0, Tick(EventKind.ARRIVAL, "a", 5)))
    loop.push(Event(1.0, Tick(EventKind.TRANSFER_DONE, "y", 6)))
    assert loop.run() == 6
    assert seen == [4, 6, 3, 2, 5, 1]


def test_handlers_return_next_events_and_until_stops():
    loop = EventLoop()
    times = []

    def tick(ev):
        times.append(ev.time)
        return [Event(ev.time + 1.0, Tick(EventKind.STEP_END, "i"))]
    loop.on(Tick, tick)
    loop.push(Event(0.0, Tick(EventKind.STEP_END, "i")))
    loop.run(until_s=3.5)
    assert times == [0.0, 1.0, 2.0, 3.0]
    assert loop.peek_time() == 4.0


def test_past_events_are_refused():
    loop = EventLoop()
    loop.on(Tick, lambda ev: [Event(ev.time - 1, Tick(EventKind.ARRIVAL, "x"))])
    loop.push(Event(5.0, Tick(EventKind.ARRIVAL, "x")))
    with pytest.raises(ValueError, match="past"):
        loop.run()


def test_a_record_without_a_handler_is_an_error():
    loop = EventLoop()
    loop.push(Event(0.0, Tick(EventKind.ARRIVAL, "x")))
    with pytest.raises(RuntimeError, match="no handler for Tick"):
        loop.run()


def test_same_scenario_replays_identically():
    sc = load([TINY])
    sc = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, duration_s=30.0))
    mode = sc.modes[0]
    a = run_mode(sc, mode)
    b = run_mode(sc, mode)
    assert [r.to_dict() for r in a[1]] == [r.to_dict() for r in b[1]]
    assert a[2] == b[2]
    assert len(a[1]) > 10
