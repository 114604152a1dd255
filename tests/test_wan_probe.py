"""The probe measures what a yielding copy still sends after it yields, on
the real sender, receiver and relay (`pdd.wan.probe`): the simulator's line
model takes its `sender_socket_bytes` from it."""

import asyncio

from pdd.wan.pipe import queue_limit_bytes
from pdd.wan.probe import trial
from pdd.wan.shaper import MBIT_BYTES_S


def test_a_yielding_copy_still_sends_what_it_had_handed_over():
    rate = 60 * MBIT_BYTES_S
    t = asyncio.run(asyncio.wait_for(trial(rate, 0.02, 0.0, fg_blocks=1, bg_blocks=40, head_start_s=0.8), 60))
    # The foreground transfer waits behind at least the relay's queue of the
    # copy (its sender writes as fast as the gate lets it: the queue is full),
    # and not behind the whole rest of the copy (the gate does act).
    assert t.elapsed_s > t.alone_s >= 0.04 + t.foreground_bytes / rate
    assert 0.5 * queue_limit_bytes(rate, 0.02, 0.0) < t.lead_bytes < 0.5 * (40 * 368_640 - 0.8 * rate)
