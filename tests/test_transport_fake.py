"""FakeLink: the same handler contract and state machine, driven by a passed-in clock."""

import pytest

from pdd.transport.fake_link import BLOCK_OVERHEAD_BYTES, FakeLink
from pdd.transport.state import TransferState


class Recorder:
    def __init__(self, held=()):
        self.held = set(held)
        self.calls = []
        self.blocks = {}

    def on_begin(self, request_id, meta, block_hashes):
        self.calls.append(("begin", request_id))
        return self.held

    def on_block(self, request_id, index, block_hash, payload):
        self.calls.append(("block", index))
        self.blocks[index] = payload

    def on_end(self, request_id, status):
        self.calls.append(("end", status.state, status.error))


HASHES = [bytes([i]) * 16 for i in range(4)]
BLOCKS = [bytes([i]) * 1000 for i in range(4)]


def test_instant_link_delivers_everything_at_once():
    rec = Recorder(held={1})
    link = FakeLink(rec)
    t = link.send(0.0, "r", {}, HASHES, BLOCKS)
    assert t.poll().state == TransferState.BOOTSTRAPPING
    link.advance(0.0)
    st = t.poll()
    assert st.state == TransferState.SUCCESS and st.num_blocks_skipped == 1 and st.num_blocks_sent == 3
    assert rec.calls == [("begin", "r"), ("block", 0), ("block", 2), ("block", 3), ("end", TransferState.SUCCESS, "")]
    assert st.bytes_sent == 3 * (1000 + BLOCK_OVERHEAD_BYTES) == link.num_bytes_sent


def test_bandwidth_and_latency_follow_the_clock():
    rec = Recorder()
    wire = 1000 + BLOCK_OVERHEAD_BYTES
    link = FakeLink(rec, rate_bytes_s=wire * 10, latency_s=0.05)  # 0.1 s per block
    t = link.send(0.0, "r", {}, HASHES, BLOCKS)
    link.advance(0.049)
    assert t.poll().state == TransferState.BOOTSTRAPPING
    link.advance(0.05)
    assert t.poll().state == TransferState.WAITING and rec.calls == [("begin", "r")]
    link.advance(0.1)
    assert t.poll().state == TransferState.TRANSFERRING
    link.advance(0.1 + 0.1 + 0.05 - 1e-9)
    assert len(rec.blocks) == 0
    link.advance(0.25)
    assert len(rec.blocks) == 1
    link.advance(0.55 + 1e-9)  # 4 blocks serialized by 0.5, landed by 0.55: receiver done
    assert len(rec.blocks) == 4 and rec.calls[-1][:2] == ("end", TransferState.SUCCESS)
    assert t.poll().state == TransferState.TRANSFERRING  # END ack still in flight
    link.advance(0.6 + 1e-9)
    assert t.poll().state == TransferState.SUCCESS and t.poll().finished_s == pytest.approx(0.6)


def test_shared_line_serializes_transfers():
    wire = 1000 + BLOCK_OVERHEAD_BYTES
    link = FakeLink(Recorder(), rate_bytes_s=wire * 10)
    a = link.send(0.0, "a", {}, HASHES, BLOCKS)
    b = link.send(0.0, "b", {}, HASHES, BLOCKS)
    link.advance(10.0)
    assert a.poll().finished_s == pytest.approx(0.4) and b.poll().finished_s == pytest.approx(0.8)


def test_deadline_cancel_and_cut_fail_with_on_end():
    rec = Recorder()
    link = FakeLink(rec, rate_bytes_s=1000, latency_s=0.01)
    slow = link.send(0.0, "slow", {}, HASHES, BLOCKS, deadline_s=1.0)
    link.advance(5.0)
    st = slow.poll()
    assert st.state == TransferState.FAILED and "deadline" in st.error and st.finished_s == 1.0
    assert rec.calls[-1][:2] == ("end", TransferState.FAILED)
    c = link.send(5.0, "c", {}, HASHES, BLOCKS)
    link.advance(5.02)
    link.cancel(c, 5.03, "abnormal")
    assert c.poll().cancelled and "abnormal" in c.poll().error and "abnormal" in rec.calls[-1][2]
    d = link.send(6.0, "d", {}, HASHES, BLOCKS)
    link.cut(6.001)  # before BEGIN landed: no on_end, since on_begin never ran
    assert d.poll().state == TransferState.FAILED and rec.calls[-1][2] != "connection lost: link cut"
