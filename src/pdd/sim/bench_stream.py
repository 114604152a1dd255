"""`pdd bench` workloads (real token ids) as a simulator request stream.

The simulator sees the very requests `pdd bench` sends: the same
`pdd.measure.agentic.generate` / `pdd.measure.trace.load` output, or a saved
`workload.json`. Token ids become chained block ids (equal prefixes -> equal
ids, as the engine's chained block hashes), so prefix caches hit exactly
where the real ones do. A closed-loop turn's next turn quotes its answer
(`WorkloadRequest.answer_at`; the bench client sends the ids the model
produced there): the workload's stand-in ids play the model's answer, so the
blocks a decoder completes with its output get the ids the next prompt's
blocks have, and its decode-side cache hits them as the real one does. Other
output blocks get ids of their own (they take room, nothing matches them).

Arrivals follow the bench client (its `run_workload`): a
request without `depends_on` is due at `arrival_s`; a closed-loop turn is
due `think_time_s` after the user saw its predecessor end (failed or not).

Replaying a recorded run (`pdd sim --validate`), `arrivals` gives each
request the time the bench client sent it: the run's own trace, so the
simulated requests meet the cluster in the phases the real ones met it.
A closed-loop turn is never sent before its predecessor has ended in the
simulation (its prompt quotes that answer): a turn the simulation holds
past its recorded time goes when its predecessor ends, and counts in
`held`. Without `arrivals`, the loop closes on the simulated times, and a
replay's timing error moves every later turn of the session with it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

from pdd.measure.workload import Workload, WorkloadRequest
from pdd.sim.request import RequestSpec


def chained_block_ids(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One id per full block, each a hash of the block and the id before it."""
    out, prev = [], 0
    for b in range(len(token_ids) // block_size):
        prev = hash((prev, tuple(token_ids[b * block_size:(b + 1) * block_size])))
        out.append(prev)
    return tuple(out)


def to_spec(req: WorkloadRequest, block_size: int, arrival_s: float | None = None,
            session: int = -1, quoted_by: WorkloadRequest | None = None) -> RequestSpec:
    """`quoted_by`: the next turn, whose prompt repeats this one's answer."""
    ids = chained_block_ids(req.prompt_token_ids, block_size)
    n, out = req.prompt_tokens, req.max_tokens
    # Blocks completed by the output (its last token is never computed): the
    # next turn's where it quotes the answer, else private ids after the prompt's.
    full = (n + out - 1) // block_size
    quoted = chained_block_ids(quoted_by.prompt_token_ids[:n + out - 1], block_size) if quoted_by else ()
    tail = ids[-1] if ids else zlib.crc32(req.request_id.encode())
    extra = quoted[len(ids):full] + tuple(hash((tail, -1, k)) for k in range(full - max(len(quoted), len(ids))))
    return RequestSpec(req.request_id, req.arrival_s if arrival_s is None else arrival_s, n, out,
                       out, ids, session=session, turn=req.turn, full_block_ids=ids + extra)


class BenchStream:
    """Open-loop and closed-loop (depends_on) requests of a bench Workload.

    Every request generates `max_tokens` tokens (the bench sets ignore_eos).
    """

    def __init__(self, workload: Workload, block_size: int,
                 arrivals: Mapping[str, float] | None = None) -> None:
        self.block_size = block_size
        self.arrivals = dict(arrivals) if arrivals is not None else None
        self.held = 0        # turns sent after their recorded time (their predecessor ended later)
        self._reqs = {r.request_id: r for r in workload.requests}
        self._children: dict[str, list[WorkloadRequest]] = {}
        self._quoted_by: dict[str, WorkloadRequest] = {}
        for r in workload.requests:
            if r.depends_on in self._reqs:
                self._children.setdefault(r.depends_on, []).append(r)
                if r.answer_at is not None:
                    self._quoted_by[r.depends_on] = r
        self._roots = [r for r in workload.requests if r.depends_on not in self._reqs]

    def initial(self) -> list[RequestSpec]:
        return [self._spec(r, self._recorded(r, r.arrival_s)) for r in self._roots]

    def _recorded(self, r: WorkloadRequest, default: float) -> float:
        if self.arrivals is None:
            return default
        return self.arrivals.get(r.request_id, default)

    def _spec(self, r: WorkloadRequest, arrival_s: float) -> RequestSpec:
        return to_spec(r, self.block_size, arrival_s, quoted_by=self._quoted_by.get(r.request_id))

    def next_after(self, spec: RequestSpec, done_s: float, failed: bool) -> list[RequestSpec]:
        out = []
        for c in self._children.get(spec.request_id, []):
            due = self._recorded(c, done_s + c.think_time_s)
            if due < done_s:
                self.held += 1
                due = done_s
            out.append(self._spec(c, due))
        return out
