"""Restart dead processes of a deployment, with bounded exponential backoff.

Lifecycle of one supervised process (a `Watch`):
    UP --(found dead)--> WAITING --(backoff elapsed)--> UP (respawned, same
    command, same ports, log appended)
    UP for `stable_s` resets its failure count; `max_failures` deaths in a
    row without a stable run -> GAVE_UP (left dead, logged).
The decision is pure (`Watch.on_poll(alive, now)` returns whether to spawn
now); `Supervisor` is the thin driver: a thread that polls pids every
`interval_s`, respawns, and rewrites pids.json so `pdd down` stops the new
process. The router needs no telling: it polls every instance and routes
to it again once /internal/stats answers.
"""

from __future__ import annotations

import enum
import logging
import subprocess
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 0.5          # first restart after this long
    max_delay_s: float = 30.0    # the backoff doubles up to this bound
    stable_s: float = 30.0       # up this long: the next death counts as the first
    max_failures: int = 8        # deaths in a row before giving up

    def delay_s(self, failures: int) -> float:
        """failures >= 1: deaths in a row so far."""
        return min(self.max_delay_s, self.base_s * 2 ** (failures - 1))


class WatchState(enum.Enum):
    UP = "up"
    WAITING = "waiting"
    GAVE_UP = "gave_up"


@dataclass
class Watch:
    name: str
    policy: RestartPolicy
    up_since_s: float
    state: WatchState = WatchState.UP
    failures: int = 0
    restart_at_s: float = 0.0
    restarts: int = 0

    def on_poll(self, alive: bool, now: float) -> bool:
        """Fold one observation in; True: spawn the process now."""
        if self.state == WatchState.UP:
            if alive:
                if now - self.up_since_s >= self.policy.stable_s:
                    self.failures = 0
                return False
            self.failures += 1
            if self.failures > self.policy.max_failures:
                self.state = WatchState.GAVE_UP
                return False
            self.state = WatchState.WAITING
            self.restart_at_s = now + self.policy.delay_s(self.failures)
        if self.state == WatchState.WAITING and now >= self.restart_at_s:
            self.state, self.up_since_s = WatchState.UP, now
            self.restarts += 1
            return True
        return False


class Supervisor:
    def __init__(self, dep, policy: RestartPolicy = RestartPolicy(), interval_s: float = 0.25):
        from pdd.deploy.launcher import _alive

        self.dep, self.policy, self.interval_s, self._alive = dep, policy, interval_s, _alive
        now = time.monotonic()
        self.watches = {p.name: Watch(p.name, policy, now) for p in dep.procs if p.name in dep.recipes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdd-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll(time.monotonic())
            except Exception:   # keep supervising the others
                log.exception("supervisor poll failed")

    def poll(self, now: float) -> list[str]:
        """One round; returns the names respawned."""
        out = []
        for p in self.dep.procs:
            w = self.watches.get(p.name)
            if w is None or self._stop.is_set():
                continue
            before = w.state
            if w.on_poll(self._alive(p.pid), now):
                self._respawn(p)
                out.append(p.name)
            elif w.state != before and w.state == WatchState.WAITING:
                log.warning("%s (pid %d) died; restart %d in %.1f s", p.name, p.pid, w.failures,
                            w.restart_at_s - now)
            elif w.state != before and w.state == WatchState.GAVE_UP:
                log.error("%s died %d times in a row; not restarting it", p.name, w.failures)
        return out

    def _respawn(self, p) -> None:
        cmd, env = self.dep.recipes[p.name]
        with open(p.log, "ab") as f:
            f.write(f"\n--- restarted by pdd up at {time.strftime('%H:%M:%S')} ---\n".encode())
            f.flush()
            child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        p.pid = child.pid
        self.dep._record()
        log.warning("%s restarted as pid %d", p.name, child.pid)
