"""Drives one Engine on its own thread and bridges it to asyncio.

The engine is single-threaded; everything that touches it (submit, extend,
abort, KV import, stats) runs as a command on the engine thread between two
steps. Token events go back to the asyncio loop, into one queue per request.

KV import is the exception: its calls touch only the block pool and free
blocks of the KV tensor, under the engine's `pool_lock`, which a step holds
only while it schedules and books (not while the model runs). `call_now`
runs them at once on the caller's thread, so an arriving transfer does not
wait for the step under way (up to a whole prefill chunk).

Lifecycle of a request's queue: created by `submit`, fed StepEvents, closed
(None) after the finishing event, dropped by the caller when read.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

from pdd.engine.engine import Engine, StepEvent
from pdd.engine.request import EngineRequest

log = logging.getLogger(__name__)


class EngineMoved:
    """Wakes the coroutines waiting for the engine to move (a layer's KV
    written, a step or a command done), so that a streamed transfer or a job
    waiting for its prompt to be scheduled does not poll: under overload P
    holds dozens of queued jobs, and polling each every 10 ms cost P's core
    thousands of wake-ups a second.

    The engine thread calls `notify_threadsafe`: it counts the move and, only
    if a coroutine waits, queues one wake-up on the loop (a decode instance,
    which nothing streams from, pays a counter per layer). A waiter notes
    `version` before it looks at the engine's state and passes it to `wait`,
    which returns at once if the engine has moved since, so a move while the
    waiter was busy is not lost; every wait is also bounded by a timeout.
    Ordering under the GIL: the engine counts, then looks for a waiter; the
    waiter registers, then looks at the count; so one of the two sees the
    other."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.version = 0            # moves so far (written by the engine thread)
        self._fut: asyncio.Future | None = None
        self._queued = False

    def notify_threadsafe(self) -> None:
        self.version += 1
        if self._fut is None or self._queued:
            return
        self._queued = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:        # the loop has closed: nobody is waiting
            pass

    def _wake(self) -> None:
        self._queued = False
        fut, self._fut = self._fut, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self, seen: int, timeout_s: float) -> None:
        """Until the engine has moved since `version` was `seen`, or `timeout_s`."""
        if self.version != seen:
            return
        if self._fut is None:
            self._fut = self.loop.create_future()
        fut = self._fut
        if self.version != seen:      # it moved before it could see us waiting
            return
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            pass


class EngineLoop:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, idle_wait_s: float = 1.0,
                 stuck_wait_s: float = 0.01):
        self.engine = engine
        self.loop = loop
        # `moved`: a layer's KV written, a step started or done, commands
        # run; `stepped`: the same less the layers (what a job waiting for
        # its prompt to be scheduled needs: a fraction of the wake-ups).
        self.moved = EngineMoved(loop)
        self.stepped = EngineMoved(loop)
        runner = getattr(engine, "runner", None)
        if runner is not None and hasattr(runner, "on_progress"):
            runner.on_progress = self.moved.notify_threadsafe
            runner.on_step_start = self._notify
        # With no work, only a command can bring some (submit, extend; a
        # KV import through `call_now` fills blocks but schedules nothing),
        # and every command wakes the thread: it sleeps on the queue, the
        # timeout only bounds how late it sees `_stop` without one. Measured
        # (`pdd up -c examples/pdd.toml`, 60 s of each idle process, session
        # 36): polling every 10 ms, P / RLD / MD took 3.4 / 3.3 / 3.6% of a
        # core (the router's status polls included), 3.1 / 2.5 / 2.4% without
        # it; on a core P shares with RLD, that is P's time. With
        # work it cannot schedule (no free blocks), a step plans nothing:
        # it waits `stuck_wait_s` before trying again instead of spinning.
        self.idle_wait_s = idle_wait_s
        self.stuck_wait_s = stuck_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.busy_s = 0.0
        self.started_s = time.monotonic()
        self.on_step: Callable[[list[StepEvent]], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        runner = getattr(self.engine, "runner", None)
        if runner is not None and getattr(runner, "on_progress", None) == self.moved.notify_threadsafe:
            runner.on_progress = runner.on_step_start = None

    # -- called from asyncio ------------------------------------------------
    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread; return its result (or raise its error)."""
        fut = self.loop.create_future()
        self._commands.put((fn, fut))
        return await fut

    def call_now(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the calling thread under the pool lock: only for
        work that touches nothing but the block pool (KV import)."""
        with self.engine.pool_lock:
            return fn(self.engine)

    async def submit(self, req: EngineRequest) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        try:
            await self.call(lambda e: e.submit(req))
        except Exception:
            self._queues.pop(req.request_id, None)
            raise
        return q

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort(request_id))
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(StepEvent(request_id, finished=True, finish_reason="abort"))
            q.put_nowait(None)

    # -- engine thread ----------------------------------------------------------
    def _run(self) -> None:
        stuck = False
        while not self._stop.is_set():
            has_work = self.engine.has_work
            self._drain_commands(wait_s=self.idle_wait_s if not has_work else self.stuck_wait_s if stuck else None)
            if self._stop.is_set() or not self.engine.has_work:
                stuck = False
                continue
            before = self.engine.num_steps
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as e:
                # Engine.step already fails a request whose own computation
                # raises, alone; reaching here means the engine's bookkeeping
                # itself broke, and then no request's state can be trusted.
                # Still, none may hang.
                log.exception("engine step failed")
                events = self._fail_all(f"engine step failed: {e!r}")
            self.busy_s += time.perf_counter() - t0
            stuck = not events and self.engine.num_steps == before
            if events:
                self.loop.call_soon_threadsafe(self._deliver, events)
            self._notify()

    def _drain_commands(self, wait_s: float | None) -> None:
        """Run every queued command; first wait up to `wait_s` for one (None: do not wait)."""
        try:
            item = self._commands.get(timeout=wait_s) if wait_s is not None else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut = item
            try:
                with self.engine.pool_lock:
                    res, err = fn(self.engine), None
            except Exception as e:
                res, err = None, e
            self.loop.call_soon_threadsafe(_settle, fut, res, err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                self._notify()
                return

    def _notify(self) -> None:
        self.moved.notify_threadsafe()
        self.stepped.notify_threadsafe()

    def _fail_all(self, msg: str) -> list[StepEvent]:
        out = []
        with self.engine.pool_lock:
            for rid, req in list(self.engine.requests.items()):
                if not req.status.finished:
                    self.engine.abort(rid)
                    out.append(StepEvent(rid, finished=True, finish_reason="error", error=msg))
        return out

    def _deliver(self, events: list[StepEvent]) -> None:
        if self.on_step:
            self.on_step(events)
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is None:
                continue
            q.put_nowait(ev)
            if ev.finished:
                q.put_nowait(None)
                del self._queues[ev.request_id]


def _settle(fut: asyncio.Future, res: Any, err: Exception | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
