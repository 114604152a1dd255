"""The router's PDD driver sends extends, pauses and background aborts in
order per instance, without holding up the facts that follow (RLD's tokens
must reach the user while MD answers an extend between two of its steps)."""

import asyncio

from pdd.policy import lifecycle_io as io
from pdd.server.pdd_flow import PddRun


def _run_with_slow_calls(cmds, delays):
    """apply(cmds) with carry_out taking `delays[instance]` seconds; returns
    (seconds apply took, [(instance, what, start, end)] of the calls)."""
    calls = []

    async def main():
        run = PddRun(None, None, None)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def carry_out(cmd):
            start = loop.time() - t0
            await asyncio.sleep(delays.get(getattr(cmd, "instance_id", ""), 0.0))
            calls.append((getattr(cmd, "instance_id", None), type(cmd).__name__, start, loop.time() - t0))

        run.carry_out = carry_out
        await run.apply(cmds)
        took = loop.time() - t0
        for _ in range(100):
            if not run.background:
                break
            await asyncio.sleep(0.02)
        assert not run.background
        return took

    took = asyncio.run(main())
    return took, calls


def test_extends_go_out_in_order_per_instance_without_blocking_the_next_fact():
    cmds = [io.ExtendMd("md0", (1, 2), False), io.ExtendMd("md0", (3,), True), io.PauseRld("rld0"),
            io.Abort(io.Leg.RLD, "rld0")]
    took, calls = _run_with_slow_calls(cmds, {"md0": 0.2, "rld0": 0.1})
    assert took < 0.05                                   # nothing waited for an answer
    md = [c for c in calls if c[0] == "md0"]
    rld = [c for c in calls if c[0] == "rld0"]
    assert [c[1] for c in md] == ["ExtendMd", "ExtendMd"]
    assert md[1][2] >= md[0][3] - 1e-3                   # the final batch after the first one's answer
    assert [c[1] for c in rld] == ["PauseRld", "Abort"]
    assert rld[1][2] >= rld[0][3] - 1e-3                 # the abort after the pause
    assert rld[0][2] < md[0][3]                          # RLD's pause did not wait for MD


def test_foreground_commands_are_still_carried_out_in_place():
    cmds = [io.Note("x", {}), io.Abort(io.Leg.MD, "md0", keep_kv=True, background=False)]
    took, calls = _run_with_slow_calls(cmds, {"md0": 0.15})
    assert took >= 0.14                                  # a keep_kv abort is awaited
    assert [c[1] for c in calls] == ["Note", "Abort"]


def test_p_release_and_a_copy_cancel_do_not_hold_the_next_fact():
    """A call to P can be slow to come back: awaited in the fact loop, P's
    release held MD's first tokens until it was answered (up to 1.4 s, when
    P's prefill handler held the connection it went out on until P's step
    ended). They go in P's lane, in order: the cancel, then the release."""
    class P:
        class spec:
            name = "p0"

    cmds = [io.CancelTransfer("md0", "filter"), io.ReleaseP("p0")]
    calls = []

    async def main():
        run = PddRun(None, None, None)
        run.members[io.Leg.P] = P
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def carry_out(cmd):
            start = loop.time() - t0
            await asyncio.sleep(0.2)                      # P busy with a prompt step
            calls.append((type(cmd).__name__, start, loop.time() - t0))

        run.carry_out = carry_out
        await run.apply(cmds)
        took = loop.time() - t0
        while run.background:
            await asyncio.sleep(0.02)
        return took, set(run.lanes)

    took, lanes = asyncio.run(main())
    assert took < 0.05
    assert lanes == {"p0"}                                # P's lane, not the copy's receiver's
    assert [c[0] for c in calls] == ["CancelTransfer", "ReleaseP"]
    assert calls[1][1] >= calls[0][2] - 1e-3
