"""The files a run leaves and a later reader (or the simulator) reads back.

    workload.json     the workload as run: settings and every request, prompt ids included
    records.jsonl     one `RequestRecord` per line
    summary.json ...  any summary dict, NaN / inf written as null

Written by `pdd bench` (measured) and `pdd sim` (simulated) alike, read by
`pdd sim --validate`, `--calibrate` and `sweep`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdd.measure.records import RequestRecord
from pdd.measure.workload import RequestKind, Workload, WorkloadRequest


def finite(x):
    """`x` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write_json(path: Path, obj: dict) -> None:
    """Indented JSON through a temporary file, so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(finite(obj), indent=2) + "\n")
    tmp.replace(path)


def write_records(path: Path, records: list[RequestRecord]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def save_workload(workload: Workload, path: Path) -> None:
    """The workload as run: settings plus every request, prompt ids included."""
    reqs = [{"request_id": r.request_id, "arrival_s": r.arrival_s,
             "num_prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens,
             "session_id": r.session_id, "turn": r.turn, "depends_on": r.depends_on,
             "think_time_s": r.think_time_s, "kind": r.kind.value, "answer_at": r.answer_at,
             "prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
    doc = {"name": workload.name, "settings": workload.settings,
           "block_size": workload.block_size, "requests": reqs}
    write_json(path, doc)


def load_workload(path: Path) -> Workload:
    """Inverse of `save_workload`."""
    doc = json.loads(Path(path).read_text())
    reqs = [WorkloadRequest(d["request_id"], float(d["arrival_s"]), list(d["prompt_token_ids"]),
                            int(d["max_tokens"]), d.get("session_id"), int(d.get("turn", 0)),
                            d.get("depends_on"), float(d.get("think_time_s", 0.0)),
                            RequestKind(d.get("kind", "turn")), d.get("answer_at")) for d in doc["requests"]]
    return Workload(doc.get("name", "workload"), reqs, doc.get("settings", {}),
                    int(doc.get("block_size", 16)))
