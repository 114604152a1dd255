"""KV transport: a framed binary protocol over asyncio TCP, plus an in-memory fake.

    sender                                receiver
      HELLO(client nonce)          ->
                                   <-     CHALLENGE(server nonce, server proof)
      AUTH(client proof)           ->
      BEGIN(id, meta, hashes)      ->     handler.on_begin -> indices held
                                   <-     HAVE(bitmap)
      BLOCK(i, hash, payload) ...  ->     handler.on_block (as each lands)
      END(count)                   ->     handler.on_end(SUCCESS)
                                   <-     END(count)   (the ack: only now SUCCESS)

Modules: `state` (poll enum + status), `frames` (sans-I/O codec), `auth`
(challenge-response), `stream` (frames over asyncio streams, WAIT
keepalives), `kv_receiver`, `kv_sender` (one transfer's protocol and its
failures), `transfer` (what a caller gives, the blocks' forms, and gets back,
`TransferHandle`), `line_share` (how one sender's transfers share a named
line: turns, pacing, a copy that others wait on), `connections` (the sender's
pooled connections), `priority` (who may write to a shared line),
`fake_link` (same contract in memory, clock passed in).
"""

from pdd.transport.fake_link import FakeLink, FakeTransfer
from pdd.transport.kv_receiver import KVReceiver, ReceiverHandler
from pdd.transport.kv_sender import KVSender, TransferHandle, send_kv
from pdd.transport.state import TransferState, TransferStatus

__all__ = [
    "FakeLink", "FakeTransfer", "KVReceiver", "KVSender", "ReceiverHandler", "TransferHandle",
    "TransferState", "TransferStatus", "send_kv",
]
