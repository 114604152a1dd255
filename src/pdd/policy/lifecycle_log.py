"""A request's decisions as a short list of words, to compare two runs.

`entry(cmd)` names a `RequestLifecycle` command without the detail that
depends on timing alone (which token, how many ids a batch carries):
"open:rld", "extend", "extend_final", "pause:rld", "emit:md",
"note:md_ready:catch_up", "extend_ahead", "finish:relay:length". `decision_log` keeps, in
order, every word but the repeats of a stream (tokens, catch-up batches:
their number is the clock's, not a decision) and P's release (it follows
whichever transfer report comes last). Two drivers of the lifecycle (the
router, the simulator) that decide alike give the same log.

`trace_log` reads the same words back from the router's per-request trace
events (`Note`s are recorded there under their own names), for runs that
kept no command log: the lifecycle's notes, in order.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdd.policy import lifecycle_io as io

# Words kept once, at their first place: a stream's repeats.
_ONCE = ("emit:", "extend")
_DROPPED = ("release_p", "wan_failed")
# The lifecycle's `Note` events, and the one field that is a decision.
NOTE_EVENTS = {"kv_ready": None, "md_ready": "mode", "handoff_complete": None, "md_parked": None,
               "md_dropped": None, "filter_cancel": None, "failover": None, "rld_lost": None,
               "rld_lost_action": "action", "rld_lost_resend": None, "md_takeover": None,
               "overlap_pause": None, "overlap_diverged": None, "paced": None}


def note_word(event: str, fields: dict) -> str:
    key = NOTE_EVENTS.get(event)
    value = fields.get(key) if key else None
    return f"note:{event}" + (f":{value}" if value is not None else "")


def entry(cmd: io.Command) -> str:
    if isinstance(cmd, (io.Emit, io.EmitRun)):
        return f"emit:{cmd.source.value}"
    if isinstance(cmd, io.Note):
        return note_word(cmd.event, cmd.fields)
    if isinstance(cmd, io.ExtendMd):
        return "extend_final" if cmd.final else "extend"
    if isinstance(cmd, io.ExtendAhead):
        return "extend_ahead"
    if isinstance(cmd, io.Finish):
        return f"finish:{cmd.outcome.value}:{cmd.reason.value}"
    if isinstance(cmd, (io.OpenDecode, io.CloseStream)):
        return f"{type(cmd).__name__.lower()}:{cmd.leg.value}"
    if isinstance(cmd, io.Abort):
        return f"abort:{cmd.leg.value}" + (":keep_kv" if cmd.keep_kv else "")
    if isinstance(cmd, io.PauseRld):
        return "pause:rld" if cmd.at is None else "pause_at:rld"
    if isinstance(cmd, io.StartPrefill):
        return "start_prefill:" + "+".join("warm" if t.warm_blocks else "kv" for t in cmd.targets)
    return {io.StartTransfer: "start_transfer", io.CancelTransfer: "cancel_transfer",
            io.ResumeRld: "resume:rld", io.ReleaseP: "release_p",
            io.WanFailed: "wan_failed"}[type(cmd)]


class DecisionLog:
    """`decision_log` kept as the commands come (a word per decision, not per token)."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self._seen: set[str] = set()
        self._sources: set[io.Leg] = set()

    def add(self, cmd: io.Command) -> None:
        if isinstance(cmd, (io.Emit, io.EmitRun)) and cmd.source in self._sources:
            return                    # a stream's next token: no word (the common case, made cheap)
        if isinstance(cmd, (io.Emit, io.EmitRun)):
            self._sources.add(cmd.source)
        self.add_word(entry(cmd))

    def add_word(self, w: str) -> None:
        if w in _DROPPED or (w.startswith(_ONCE) and w in self._seen):
            return
        self._seen.add(w)
        self.words.append(w)


def decision_log(words: Iterable[str]) -> tuple[str, ...]:
    log = DecisionLog()
    for w in words:
        log.add_word(w)
    return tuple(log.words)


def notes_only(log: Iterable[str]) -> tuple[str, ...]:
    return tuple(w for w in log if w.startswith("note:"))


def trace_log(events: Iterable[dict]) -> tuple[str, ...]:
    """The lifecycle's notes from a router trace's events, as `entry` words."""
    return tuple(note_word(e["name"], e) for e in events if e.get("name") in NOTE_EVENTS)
