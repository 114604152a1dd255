"""KV transfers of the simulated cluster: flows on shared links, landing, cancel.

A mixin of `pdd.sim.cluster.Cluster` (it uses the cluster's instances, links,
estimators and event loop). A flow joins its link after one handshake RTT
(BEGIN out, HAVE back; with `import_wait` "batch" or "block", a busy
receiver answers HAVE only at its next step boundary, as the server did
when it looked its prefix cache up on its engine thread). What crosses is
what the receiver lacks when it answers HAVE, as the real receiver decides:
blocks that landed for another request since the routing decision are not
sent again. When it lands the receiver holds the whole KV (with
`import_wait` "batch" or "block", only after the receiver's next step
boundary, as a busy server imported blocks between steps before the pool
lock), the link's estimator is fed the transfer as the router's is fed the
real ones, and P frees the prompt's blocks once every transfer out of it
has ended (the lifecycle's `ReleaseP`). A cancelled copy ends as the real
P reports it: a failed transfer.

Each step of a flow's life that takes time is an event record
(`pdd.sim.events`) naming the flow by id (`<request>/<kind>/<receiver>`):
BEGIN reaches the receiver (`BeginArrives`), HAVE the sender
(`HaveArrives`), the bytes end on the link (`TransferDone`), a streamed
flow's tail after the prefill (`FlowTailArrives`); a failed start
(`CopyFailed`), a cancel (`CancelTaken`), a cut line (`LinkCut`,
`LinkRestored`).
"""

from __future__ import annotations

from pdd.policy import Role, wait_for_siblings
from pdd.policy.lifecycle_io import TransferEnded
from pdd.sim.events import (
    BeginArrives, CancelTaken, CopyFailed, FlowTailArrives, HaveArrives, LinkCut, LinkRestored,
    TransferDone,
)
from pdd.sim.instance import SimInstance
from pdd.sim.loop import Event
from pdd.sim.request import SimRequest


class TransfersMixin:
    def _register_transfer_events(self) -> None:
        on = self.loop.on
        on(TransferDone, self._on_transfer_done)
        on(BeginArrives, self._on_begin_arrives)
        on(HaveArrives, self._on_have_arrives)
        on(FlowTailArrives, self._on_flow_tail_arrives)
        on(CopyFailed, self._on_copy_failed)
        on(CancelTaken, self._on_cancel_taken)
        on(LinkCut, self._on_link_cut)
        on(LinkRestored, self._on_link_restored)

    def _transfer(self, req: SimRequest, kind: str, src: SimInstance, dst: SimInstance,
                  now: float, blocks: int | None = None, background: bool = False) -> list[Event]:
        """Send the KV of the prompt's first `blocks` blocks (all by default)
        less what `dst` holds when it answers HAVE; a `background` copy (the
        lifecycle's `Transfer.background`) yields the line."""
        name = self._link_name(src.datacenter, dst.datacenter)
        link = self.links[name]
        if not link.up:         # the connection attempt fails after a round trip
            return [self._later(link.rtt_s, CopyFailed(name, req.spec.request_id, dst.instance_id,
                                                       f"{name} down"))]
        flow_id = f"{req.spec.request_id}/{kind}/{dst.instance_id}"
        # Its size is known at HAVE time (set in `_on_have_arrives`).
        self.flows[flow_id] = (req, kind, dst.instance_id, now, None, name)
        self.flow_steps[flow_id] = dst.num_steps
        # BEGIN crosses behind what the line's buffer holds (`Link.queue_s`).
        return [self._later(link.rtt_s / 2 + link.queue_s(now), BeginArrives(name, flow_id, now, blocks, background))]

    def _on_begin_arrives(self, ev: Event) -> list[Event]:
        """BEGIN reached the receiver: it answers HAVE, once the transfers
        bringing blocks this one lacks have ended and, with `import_wait`,
        at a busy engine's next step boundary."""
        msg, t = ev.record, ev.time
        flow_id = msg.flow_id
        if flow_id not in self.flows:
            return []       # cancelled meanwhile
        req, _, dst_id = self.flows[flow_id][:3]
        dst, link = self.instances[dst_id], self.links[msg.link]
        have = HaveArrives(msg.link, flow_id, msg.started_s, msg.blocks, msg.background)
        back = lambda _t: [self._later(link.rtt_s / 2, have)]
        siblings = self._siblings_bringing(flow_id, req, dst, msg.blocks)
        if siblings:
            promoted = []
            # A transfer waits on them: they stop yielding (the servers'
            # senders do the same for copies that bring its blocks).
            for sib in siblings:
                nxt = link.promote(t, sib) if sib in link.flows else None
                if nxt:
                    promoted.append(Event(nxt[0], TransferDone(msg.link, nxt[1])))
            # As the receiver: HAVE only once those transfers have ended, and
            # then look again, as the servers' receiver does (one that ended
            # early leaves its waiters lacking the same rest: the first to
            # look again brings it, the others wait on that one).
            left = [len(siblings)]

            def one_ended(t2: float) -> list[Event]:
                left[0] -= 1
                if left[0] or flow_id not in self.flows:
                    return []
                return self._on_begin_arrives(Event(t2, msg))
            for sib in siblings:
                self.flow_waiters.setdefault(sib, []).append(one_ended)
            return promoted
        self.flow_begun.add(flow_id)       # its blocks now count as on their way
        if self.import_wait not in ("batch", "block") or not dst.busy:
            return back(t)
        dst.wait_boundaries(1, back)
        return self._kick(dst, t)          # busy: a macro step ends at the next boundary

    def _on_have_arrives(self, ev: Event) -> list[Event]:
        """HAVE reached the sender: what the receiver lacked then joins the link."""
        msg, t = ev.record, ev.time
        flow_id = msg.flow_id
        if flow_id not in self.flows:
            return []       # cancelled during the handshake
        entry = self.flows[flow_id]
        req, dst = entry[0], self.instances[entry[2]]
        self.flow_handshake[flow_id] = t - msg.started_s
        span = self._flow_blocks(req, entry[1], msg.blocks)
        skipped = self._held_blocks(dst, span)              # the receiver's HAVE, as of now
        nb = self._missing_bytes(req, skipped, msg.blocks)
        self.flows[flow_id] = entry[:4] + (nb,) + entry[5:]
        # The blocks P already held (its cached prefix) go whole, first; a
        # prompt P still computes crosses layer by layer as P makes it, a
        # chunk's blocks side by side: they are whole only with the chunk's
        # last layer. After the prefill, block by block.
        p_held = max(req.cached_tokens // self.block_size, skipped)
        p = self.instances.get(req.p_id) if req.p_id else None
        unit = max(p.token_budget // self.block_size, 1) if req.prefill_done_s is None and p is not None else 1
        self.flow_span[flow_id] = (span, skipped, p_held, unit)
        cap = None
        if req.prefill_done_s is None and req.kv_made_by_s is not None and nb > 0:
            # Streamed layer by layer while P computes: paced by P, the
            # rest of the line left to the other transfers.
            cap = nb / max(req.kv_made_by_s - t, 1e-3)
            self.flow_paced_since[flow_id] = t
        nxt = self.links[msg.link].add(t, flow_id, nb, msg.background, cap_bytes_s=cap)
        return [Event(nxt[0], TransferDone(msg.link, nxt[1]))] if nxt else []

    def _flow_blocks(self, req: SimRequest, kind: str, blocks: int | None = None) -> list:
        ids = req.spec.block_ids
        if kind == "warm":
            return list(ids[: req.warm_blocks])
        return list(ids if blocks is None else ids[:blocks])

    def _siblings_bringing(self, flow_id: str, req: SimRequest, dst: SimInstance,
                           blocks: int | None) -> list[str]:
        """Flows into `dst` whose BEGIN it has taken that carry blocks this one
        lacks, when they carry enough of them to wait for
        (`pdd.policy.wait_for_siblings`)."""
        if dst.cache is None or not self.cfg.enable_drc:
            return []
        held = self._held_blocks(dst, req.spec.block_ids)
        wanted = set(self._flow_blocks(req, "md", blocks)[held:])
        lacking = len(wanted)
        coming, siblings = 0, []
        for fid, (other, kind, dst_id, _, _, _) in self.flows.items():
            if fid == flow_id or dst_id != dst.instance_id or fid not in self.flow_begun:
                continue
            mine = wanted & set(self._flow_blocks(other, kind))
            if mine:
                coming += len(mine)
                wanted -= mine
                siblings.append(fid)
        return siblings if wait_for_siblings(lacking, coming, self.cfg) else []

    def _flow_ended(self, flow_id: str, now: float) -> list[Event]:
        self.flow_begun.discard(flow_id)
        evs: list[Event] = []
        for fn in self.flow_waiters.pop(flow_id, []):
            evs += fn(now)
        return evs

    def _missing_bytes(self, req: SimRequest, held: int, blocks: int | None) -> int:
        """KV bytes of the prompt (or of its first `blocks` blocks) a receiver
        holding its first `held` blocks lacks."""
        if blocks is None:
            return self._facts(req).missing_kv_bytes(held * self.block_size)
        return (blocks - held) * self._block_bytes

    @property
    def _block_bytes(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token

    def _held_blocks(self, dst: SimInstance, ids) -> int:
        """How many of `ids` (a prompt's chained block ids) `dst` holds now, as
        its HAVE says: what its cache matches, and the blocks that transfers
        still crossing into it have landed so far (they travel in order and
        the receiver holds each block as it lands: a cold turn's system
        prompt, landed at the head of another's copy, is not sent again
        while that copy's tail still crosses)."""
        if dst.cache is None:
            return 0
        held = dst.cache.match(ids)
        for fid, entry in self.flows.items():
            span = self.flow_span.get(fid)
            if entry[2] != dst.instance_id or span is None:
                continue
            blocks, skipped, p_held, unit = span
            flow = self.links[entry[5]].flows.get(fid)
            if flow is None:          # all of it has crossed: landing
                end = len(blocks)
            else:
                crossed = int((flow.num_bytes - flow.remaining) // self._block_bytes + 1e-9)
                end = skipped + crossed
                paced = flow.background and self.links[entry[5]].paces_background
                if end > p_held and not paced:
                    # Past P's held prefix, streamed as P computed it: written as
                    # made, the slices queue layer by layer, so a chunk's blocks
                    # are whole together. A paced copy picks its next slice only
                    # when the line takes it, by then block by block.
                    end = p_held + (end - p_held) // unit * unit
            end = min(end, len(ids))
            k = held
            while k < end and blocks[k] == ids[k]:
                k += 1
            held = k
        return held

    def _on_transfer_done(self, ev: Event) -> list[Event]:
        name = ev.record.link
        done, nxt = self.links[name].complete(ev.time, ev.record.version)
        evs = [Event(nxt[0], TransferDone(name, nxt[1]))] if nxt else []
        for flow in done:
            self.flow_yielded[flow.flow_id] = flow.yielded_s
            if flow.shared:
                self.flow_shared.add(flow.flow_id)
            req = self.flows[flow.flow_id][0]
            if req.streamed and req.prefill_done_s is None:
                # Streamed ahead of P: the last chunk's blocks are not computed yet.
                self.after_prefill.setdefault(req.spec.request_id, []).append((flow, name))
                continue
            evs += self._arrive(flow.flow_id, flow.num_bytes, name, ev.time)
        return evs

    def _prefill_progress(self, req: SimRequest, job, left_s: float | None, now: float) -> list[Event]:
        """A step of P's prefill ended: the streamed copies may carry what it has
        made so far, and the rest at P's measured pace (`left_s`: P's estimate
        of the time its remaining tokens take)."""
        evs: list[Event] = []
        frac = min(job.done / max(job.num_tokens, 1), 1.0)
        for fid, entry in self.flows.items():
            if entry[0] is not req or fid not in self.links[entry[5]].flows:
                continue
            link = self.links[entry[5]]
            nb = link.flows[fid].num_bytes
            cap = nb * (1 - frac) / max(left_s, 1e-3) if left_s else None
            nxt = link.progress(now, fid, frac * nb, cap)
            if nxt:
                evs.append(Event(nxt[0], TransferDone(entry[5], nxt[1])))
        return evs

    def _tails_after_prefill(self, req: SimRequest, job, now: float) -> list[Event]:
        """The prefill is over: streamed transfers that kept pace land once the
        last chunk's last slice has crossed (its blocks, or, streamed layer by
        layer, their last layer)."""
        evs: list[Event] = []
        for fid, entry in self.flows.items():
            since = self.flow_paced_since.pop(fid, None) if entry[0] is req else None
            if since is not None:
                self.flow_paced[fid] = self.flow_paced.get(fid, 0.0) + now - since
            if entry[0] is req and fid in self.links[entry[5]].flows:
                nxt = self.links[entry[5]].uncap(now, fid)     # P has made all its KV
                if nxt:
                    evs.append(Event(nxt[0], TransferDone(entry[5], nxt[1])))
        for flow, name in self.after_prefill.pop(req.spec.request_id, []):
            if flow.flow_id not in self.flows:
                continue        # cancelled or cut meanwhile
            link = self.links[name]
            tail = min(flow.num_bytes, job.last_chunk * self.model.kv_bytes_per_token) / self.kv_layer_slices
            delay = tail / link.bandwidth_bytes_s + link.rtt_s / 2
            # waited for P (its last slices), not the line
            self.flow_paced[flow.flow_id] = self.flow_paced.get(flow.flow_id, 0.0) + now + delay - self.loop.now
            evs.append(self._later(delay, FlowTailArrives(name, flow.flow_id, flow.num_bytes)))
        return evs

    def _on_flow_tail_arrives(self, ev: Event) -> list[Event]:
        msg = ev.record
        return self._arrive(msg.flow_id, msg.num_bytes, msg.link, ev.time)

    def _arrive(self, flow_id: str, num_bytes: float, link_name: str, now: float) -> list[Event]:
        """A transfer's last byte is at its receiver."""
        evs: list[Event] = []
        if flow_id not in self.flows:
            return evs          # cancelled or cut while its tail was on its way
        dst = self.instances[self.flows[flow_id][2]]
        landed = self._landed(flow_id, link_name)
        started = self.flow_steps.get(flow_id, dst.num_steps)
        if self.import_wait in ("batch", "block") and dst.busy:
            if self.import_wait == "batch":
                # The last batch goes in at the end of the step under way.
                waits = 1
            else:
                # One import command per block (plus BEGIN), one per step of a
                # busy receiver; those that ran while bytes flowed are done.
                blocks = -(-num_bytes // self._block_bytes)
                waits = max(1, int(blocks) + 1 - (dst.num_steps - started))
            dst.wait_boundaries(waits, landed)
            evs += self._kick(dst, now)   # busy: a macro step ends at the next boundary
        else:
            evs += landed(now)
        return evs

    def _landed(self, flow_id: str, link_name: str):
        """The receiver holds the whole KV: the transfer's end, as the sender sees it."""
        def fn(now: float) -> list[Event]:
            if flow_id not in self.flows:
                return []       # cancelled while its blocks were being imported
            req, kind, dst_id, start, num_bytes, _ = self.flows.pop(flow_id)
            self.flow_span.pop(flow_id, None)
            self.flow_steps.pop(flow_id, None)
            # As the router: time spent yielding the line to foreground flows is
            # not its speed; one paced by P's prefill bounds the line's from below.
            self.flow_paced_since.pop(flow_id, None)
            self.estimators[link_name].observe_transfer(
                now, num_bytes, max(now - start, 1e-6), self.flow_handshake.pop(flow_id, 0.0),
                self.flow_yielded.pop(flow_id, 0.0), self.flow_paced.pop(flow_id, 0.0),
                flow_id in self.flow_shared)
            self.flow_shared.discard(flow_id)
            if link_name == "wan":
                req.wan_bytes += num_bytes
            dst = self.instances[dst_id]
            evs = self._flow_ended(flow_id, now)       # siblings waiting on it ask HAVE once the
                                                       # landing below has filled the cache
            if kind == "warm":          # a shared prefix for MD's cache, nothing waits on it
                if dst.cache is not None:
                    dst.cache.insert(req.spec.block_ids[: req.warm_blocks])
                return evs + self._feed(req, TransferEnded(now, dst_id, True))
            return evs + self._kv_landed(req, dst, now)
        return fn

    def _cancel_to(self, req: SimRequest, dst_id: str, now: float) -> list[Event]:
        """Cancel the KV copy to `dst_id`; P reports it failed (a fact, as the
        real P's transfer event) once the cancel has taken."""
        fid = f"{req.spec.request_id}/{'rld' if self.instances[dst_id].role is Role.RELAY else 'md'}/{dst_id}"
        evs: list[Event] = []
        if fid in self.flows:
            name = self.flows.pop(fid)[5]
            for table in (self.flow_handshake, self.flow_paced, self.flow_paced_since, self.flow_span):
                table.pop(fid, None)
            self.flow_steps.pop(fid, None)
            self.flow_shared.discard(fid)
            nxt = self.links[name].cancel(now, fid)
            evs += [Event(nxt[0], TransferDone(name, nxt[1]))] if nxt else []
            evs += self._flow_ended(fid, now)
        return evs + [self._later(0.0, CancelTaken(req.spec.request_id, dst_id))]

    def _on_cancel_taken(self, ev: Event) -> list[Event]:
        msg = ev.record
        return self._feed(self.by_id[msg.request_id], TransferEnded(ev.time, msg.dst_id, False, "cancelled"))

    def cut_link(self, name: str, at_s: float, restore_s: float) -> None:
        """Cut link `name` ("wan", "rdma-<dc>") from `at_s` to `restore_s`:
        every copy on it fails as P reports it (a failed transfer, with the
        live decoders for the lifecycle's failover), copies started meanwhile
        fail after one RTT, and routing sees the line down. Only KV copies
        are modelled: the router's streams to MD stay up."""
        self.loop.push(Event(at_s, LinkCut(name)))
        self.loop.push(Event(restore_s, LinkRestored(name)))

    def _on_link_cut(self, ev: Event) -> list[Event]:
        name, now = ev.record.link, ev.time
        link = self.links[name]
        link.up = False
        evs: list[Event] = []
        for fid in [f for f, entry in self.flows.items() if entry[5] == name]:
            req, _, dst_id = self.flows.pop(fid)[:3]
            for table in (self.flow_handshake, self.flow_steps, self.flow_yielded, self.flow_paced,
                          self.flow_paced_since, self.flow_span):
                table.pop(fid, None)
            self.flow_shared.discard(fid)
            nxt = link.cancel(now, fid)
            evs += [Event(nxt[0], TransferDone(name, nxt[1]))] if nxt else []
            evs += self._flow_ended(fid, now)
            evs += self._copy_failed(req, dst_id, now, f"{name} cut")
        return evs

    def _on_link_restored(self, ev: Event) -> list[Event]:
        self.links[ev.record.link].up = True
        return []

    def _on_copy_failed(self, ev: Event) -> list[Event]:
        msg = ev.record
        return self._copy_failed(self.by_id[msg.request_id], msg.dst_id, ev.time, msg.error)

    def _copy_failed(self, req: SimRequest, dst_id: str, now: float, error: str) -> list[Event]:
        healthy = tuple(i.view() for i in self.instances.values() if i.role in (Role.RELAY, Role.MAIN))
        return self._feed(req, TransferEnded(now, dst_id, False, error, healthy))

    def _release_p(self, req: SimRequest, now: float) -> list[Event]:
        """P frees the prompt's KV (the lifecycle's `ReleaseP`, or its stream
        closed by a failed request's end); once."""
        p = self.instances[req.p_id]
        p.release(req.p_blocks)
        p.unshare(req.p_shared)
        req.p_blocks, req.p_shared = 0, []
        return self._kick(p, now)
