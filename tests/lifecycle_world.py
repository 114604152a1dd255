"""An in-memory PDD deployment that carries out a RequestLifecycle's commands.

Instances behave as the real ones do at the level the lifecycle sees: P
sends its first token, then one transfer per target (cancel reports a failed
transfer); a decoder streams tokens once its KV landed (MD: `kv_ready`
first, and only after a final extend when it holds the stream back); RLD
keeps going for a few tokens after a pause; a dead instance stops talking.
Every token is `ref(i)`: greedy decoding gives the same token at the same
index on every instance, so the user's stream must be ref(0), ref(1), ...

`choose` picks which enabled action happens next (a Hypothesis draw, or the
first one), so a test can explore event orders.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.policy import InstanceView, PipelineDecision, PolicyConfig, RequestFacts, Role
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.lifecycle_io import (
    Abort, CancelTransfer, ClientGone, CloseStream, DeadlinePassed, DecodeEnded, DecodeToken, DecodeTokens, Emit,
    EmitRun,
    EndReason, Extended, ExtendAhead, ExtendMd, Finish, KvReady, Leg, OpenDecode, PauseRld, PeerGone, Prefilled,
    PrefillEnded, ReleaseP, ResumeRld, StartPrefill, StartTransfer, TransferEnded, Wake,
)


def ref(i: int) -> int:
    return 1000 + i


@dataclass
class Stream:
    leg: Leg
    iid: str
    hold: bool
    pos: int = 0                    # next index it produces
    kv: bool = False
    kv_ready_sent: bool = False
    decoding: bool = False
    pause_limit: int | None = None  # stops producing at this index
    extends: list[int] = field(default_factory=list)     # `extended` uptos to report
    holds: int = 1                  # MD: tokens it holds (P's first, then extended)
    ahead: list = field(default_factory=list)    # MD: ExtendAhead calls on their way (start, ids)
    ended: bool = False
    dead_end: bool = False          # its instance died: one error event to report


class World:
    def __init__(self, decision: PipelineDecision, num_out: int, max_tokens: int,
                 cfg: PolicyConfig | None = None, instances=("p0", "r0", "r1", "m0", "m1"),
                 warm_blocks: int = 0) -> None:
        self.req = RequestFacts("req", 4096, max_tokens, 1000, 16)
        self.num_out = min(num_out, max_tokens)
        self.eos = num_out < max_tokens          # ends by a stop token, else by length
        self.lc = RequestLifecycle(self.req, decision, cfg or PolicyConfig(), warm_blocks=warm_blocks)
        self.alive = {i: True for i in instances}
        self.now = 0.0
        self.prefilled = False
        self.p_ended = False
        self.p_released = False
        self.transfers: dict[str, bool] = {}     # in flight -> landed-ok when done
        self.streams: dict[Leg, Stream] = {}
        self.user: list[int] = []
        self.finish: Finish | None = None
        self.log: list = []
        self.used_deadline = False
        self.apply(self.lc.start(self.now))

    # --- views ----------------------------------------------------------------
    def views(self) -> tuple[InstanceView, ...]:
        role = {"r": Role.RELAY, "m": Role.MAIN, "p": Role.PREFILL}
        return tuple(InstanceView(i, role[i[0]], "dc", 0, 0, 8, 1000, 1000, 0.05)
                     for i, up in self.alive.items() if up and i[0] in "rm")

    def rld_view(self) -> InstanceView:
        return InstanceView("r0", Role.RELAY, "dc", 0, 0, 8, 1000, 1000, 0.05)

    md_step_s = 0.05           # MD's decode step as its kv_ready reports it (below RLD's: an overlap handoff)
    md_wrong_from: int | None = None    # MD makes other tokens than the reference from this index on

    def md_view(self) -> InstanceView:
        return InstanceView("m0", Role.MAIN, "dc", 0, 0, 8, 1000, 1000, self.md_step_s)

    def tok(self, leg: Leg, i: int) -> int:
        wrong = leg is Leg.MD and self.md_wrong_from is not None and i >= self.md_wrong_from
        return ref(i) + 1 if wrong else ref(i)

    def end_reason(self) -> EndReason:
        return EndReason.STOP if self.eos else EndReason.LENGTH

    # --- commands -> world ----------------------------------------------------
    def apply(self, cmds) -> None:
        for c in cmds:
            self.log.append(c)
            if isinstance(c, StartPrefill):
                for t in c.targets:
                    self.transfers[t.instance_id] = True
            elif isinstance(c, OpenDecode):
                s = Stream(c.leg, c.instance_id, c.hold)
                s.dead_end = not self.alive[c.instance_id]
                self.streams[c.leg] = s
            elif isinstance(c, StartTransfer):
                self.transfers[c.instance_id] = not self.p_released and not self.p_ended and self.alive["p0"]
            elif isinstance(c, CancelTransfer):
                if c.instance_id in self.transfers:
                    self.transfers[c.instance_id] = False
            elif isinstance(c, CloseStream):
                self.streams.pop(c.leg, None)
            elif isinstance(c, ExtendMd):
                self._extend(c)
            elif isinstance(c, ExtendAhead):
                # The user's tokens from `start` on, as the user has them.
                assert list(c.token_ids) == self.user[c.start:c.start + len(c.token_ids)], (c, self.user)
                s = self.streams.get(Leg.MD)
                if s is not None and s.iid == c.instance_id:
                    s.ahead.append((c.start, len(c.token_ids)))
            elif isinstance(c, PauseRld):
                s = self.streams.get(Leg.RLD)
                if s is not None:
                    # Ahead (`at`): it makes tokens up to `at`, or stops as a
                    # pause at once would if it is there already.
                    s.pause_limit = s.pos + self.extra_after_pause if c.at is None \
                        else max(c.at, s.pos + self.extra_after_pause)
            elif isinstance(c, ResumeRld):
                s = self.streams.get(Leg.RLD)
                if s is not None:
                    s.pause_limit = None
            elif isinstance(c, ReleaseP):
                self.p_released = True
            elif isinstance(c, Emit):
                assert c.index == len(self.user), (c, self.user)
                self.user.append(c.token)
            elif isinstance(c, EmitRun):
                assert c.first_index == len(self.user), (c, self.user)
                self.user.extend(c.tokens)
            elif isinstance(c, Finish):
                assert self.finish is None
                self.finish = c
            elif isinstance(c, Abort):
                pass

    extra_after_pause = 1
    bulk = None      # n -> tokens in the next decode event (1..n): `DecodeTokens`; None: one `DecodeToken`

    def _extend(self, c: ExtendMd) -> None:
        s = self.streams.get(Leg.MD)
        if s is None or s.iid != c.instance_id or s.ended:
            return
        # What MD is given must be the user's tokens from where it stands.
        assert list(c.token_ids) == [ref(i) for i in range(s.holds, s.holds + len(c.token_ids))], c
        s.holds += len(c.token_ids)
        if c.final:
            s.decoding, s.pos = True, s.holds
        else:
            s.extends.append(s.holds)

    md_lands_after: int | None = None   # MD's copy lands only once RLD made this many tokens (or stopped)

    def _md_copy_waits(self, iid: str) -> bool:
        """MD's copy held back while RLD streams (`md_lands_after`): the orders
        in which RLD's tokens go to MD ahead of its KV."""
        s = self.streams.get(Leg.MD)
        r = self.streams.get(Leg.RLD)
        if self.md_lands_after is None or s is None or s.iid != iid or r is None or r.ended:
            return False
        stopped = not self.alive[r.iid] or (r.pause_limit is not None and r.pos >= r.pause_limit)
        return r.pos < min(self.md_lands_after, self.num_out) and not stopped

    # --- world -> facts -------------------------------------------------------
    def actions(self, faults: bool) -> list[tuple[str, object]]:
        acts: list[tuple[str, object]] = []
        p_up = self.alive["p0"]
        if not self.prefilled and p_up and not self.p_ended:
            acts.append(("prefill", None))
        if self.prefilled:
            acts += [("land", iid) for iid, ok in self.transfers.items()
                     if (p_up or not ok) and not self._md_copy_waits(iid)]
        if self.prefilled and not self.p_ended and not self.transfers and self.p_released:
            acts.append(("p_end", None))
        for leg, s in self.streams.items():
            if s.ended:
                continue
            if s.dead_end:
                acts.append(("dead", leg))
                continue
            if not self.alive[s.iid]:
                continue
            if s.ahead:
                acts.insert(0, ("ahead", leg))      # the next call sent ahead reaches MD (first: no lag)
            if leg is Leg.MD and s.kv and not s.kv_ready_sent:
                acts.append(("kv_ready", leg))
                continue
            if s.extends:
                acts.append(("extended", leg))
            producing = s.kv and (leg is Leg.RLD or s.decoding or (not s.hold and s.kv_ready_sent))
            if producing and (s.pause_limit is None or s.pos < s.pause_limit):
                acts.append(("token" if s.pos < self.num_out else "end", leg))
        if self.lc.wake_s() is not None:
            acts.append(("wake", None))      # a paced handoff's next token is due (the driver's timer)
        if faults:
            acts += [("kill", i) for i, up in self.alive.items() if up]
            acts += [("fail", iid) for iid in self.transfers]
            acts.append(("client_gone", None))
        return acts

    def step(self, act: tuple[str, object]) -> None:
        kind, arg = act
        self.now += 0.01
        t = self.now
        if kind == "prefill":
            self.prefilled = True
            self.fact(Prefilled(t, ref(0), stop=self.eos and self.num_out == 1))
        elif kind in ("land", "fail"):
            ok = self.transfers.pop(arg) and kind == "land" and self.alive[arg]
            for s in self.streams.values():
                if s.iid == arg and ok:
                    s.kv = True
            self.fact(TransferEnded(t, arg, ok, "" if ok else "failed", self.views()))
        elif kind == "p_end":
            self.p_ended = True
            self.fact(PrefillEnded(t))
        elif kind == "ahead":
            s = self.streams[arg]
            start, n = s.ahead.pop(0)
            if not s.kv and start <= s.holds:         # MD takes no more once its KV landed
                s.holds = max(s.holds, start + n)
        elif kind == "kv_ready":
            s = self.streams[arg]
            s.kv_ready_sent = True
            # As the decode server: RLD's tokens taken ahead are computed with
            # the prompt's tail and MD decodes on, unless they leave nothing to make.
            runs_on = s.hold and 1 < s.holds < self.req.max_tokens
            if runs_on:
                s.decoding, s.pos = True, s.holds
            else:
                s.holds = 1
            self.fact(KvReady(t, self.rld_view(), md=self.md_view(), md_have=s.holds if runs_on else None))
        elif kind == "extended":
            self.fact(Extended(t, self.streams[arg].extends.pop(0)))
        elif kind == "token" and self.bulk is not None:
            # A decode step of several tokens (the simulator's): fewer at a pause or the end.
            s = self.streams[arg]
            limit = self.num_out if s.pause_limit is None else min(self.num_out, s.pause_limit)
            first = s.pos
            s.pos = first + max(1, min(self.bulk(4), limit - first))
            self.fact(DecodeTokens(t, arg, first, tuple(self.tok(arg, i) for i in range(first, s.pos)),
                                   self.rld_view()))
        elif kind == "token":
            s = self.streams[arg]
            s.pos += 1
            self.fact(DecodeToken(t, arg, s.pos - 1, self.tok(arg, s.pos - 1), self.rld_view()))
        elif kind == "end":
            self.streams[arg].ended = True
            self.fact(DecodeEnded(t, arg, self.end_reason(), healthy=self.views()))
        elif kind == "dead":
            self.streams[arg].ended = True
            self.fact(DecodeEnded(t, arg, EndReason.ERROR, "unreachable", self.views()))
        elif kind == "kill":
            self.alive[arg] = False
            for s in self.streams.values():
                if s.iid == arg and not s.ended:
                    s.dead_end = True     # its connection drops: one error event
            if arg == "p0":
                # Its stream drops; copies in flight never land, so their
                # receivers' decodes end at their KV timeout.
                self.p_ended = True
                for iid in list(self.transfers):
                    del self.transfers[iid]
                    for s in self.streams.values():
                        if s.iid == iid and not s.kv:
                            s.dead_end = True
                self.fact(PrefillEnded(t, "P died"))
        elif kind == "client_gone":
            self.fact(ClientGone(t))
        elif kind == "wake":
            self.now = t = max(t, self.lc.wake_s())
            self.fact(Wake(t))

    def fact(self, f) -> None:
        self.log.append(f)
        self.apply(self.lc.handle(f))

    def idle(self) -> None:
        """Nothing can happen: a silent stream the lifecycle waits on is
        stalled (the driver's stall rule); otherwise only the deadline is left."""
        for leg, _ in self.lc.watched():
            s = self.streams.get(leg)
            if s is None or not self.alive[s.iid] or s.ended:
                self.fact(PeerGone(self.now + 10, leg, "silent", self.views()))
                return
        self.used_deadline = True
        self.fact(DeadlinePassed(self.now + 100))

    def run(self, choose, faults: int = 0, max_steps: int = 2000) -> None:
        """Until the user's stream is finished and P is settled."""
        num_faults = 0
        for _ in range(max_steps):
            if self.finish is not None:
                return
            acts = self.actions(faults=num_faults < faults)
            if not acts:
                self.idle()
                continue
            act = acts[choose(len(acts))]
            if act[0] in ("kill", "fail", "client_gone"):
                num_faults += 1
            self.step(act)
        raise AssertionError("request did not end")
