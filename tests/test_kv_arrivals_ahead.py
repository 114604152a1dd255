"""The decode side keeps a relay's tokens sent ahead of the request's KV
(`KVArrivals.add_ahead`) only while its decode call waits for that KV: in
order, a resend from an earlier index replacing what follows it, a gap
taking nothing, and nothing once the call has taken the KV (the real
server's whole path, on the real model: tests/test_pdd.py)."""

from __future__ import annotations

import asyncio

from pdd.policy import PolicyConfig
from pdd.server.instance_metrics import InstanceMetrics
from pdd.server.kv_arrivals import KVArrivals
from test_engine import make_engine
from test_kv_arrivals_reserve import SPEC


def test_tokens_sent_ahead_are_kept_in_order_while_the_decode_call_waits(tiny_model):
    async def go():
        arrivals = KVArrivals(SPEC, make_engine(tiny_model), PolicyConfig(), InstanceMetrics("md0", "main"))
        assert arrivals.add_ahead("r", 1, [5, 6]) is None          # no decode call yet: nothing taken
        arrivals.get("r")                                          # the transfer came first
        assert arrivals.add_ahead("r", 1, [5, 6]) is None          # ... still no call waiting
        arrivals.get("r").claimed = True                           # the decode call waits
        assert arrivals.add_ahead("r", 1, [5, 6]) == 3             # P's first + two
        assert arrivals.add_ahead("r", 3, [7]) == 4
        assert arrivals.add_ahead("r", 2, [9, 10]) == 4            # a resend from index 2 replaces 2-3
        assert arrivals.by_id["r"].ahead == [5, 9, 10]
        assert arrivals.add_ahead("r", 6, [11]) == 4               # a gap (index 4-5 missing): nothing
        assert arrivals.by_id["r"].ahead == [5, 9, 10]
        arrivals.consumed("r")                                     # the KV landed and the call took it
        assert arrivals.add_ahead("r", 4, [11]) is None

    asyncio.run(go())
