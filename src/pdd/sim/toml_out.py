"""A small TOML writer (tomllib only reads): enough for scenario and
deployment files — scalars, lists of scalars, tables, arrays of tables."""

from __future__ import annotations

import json
import math


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_scalar(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _is_table_list(v) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit(table: dict, prefix: str, out: list[str], inline: set[str]) -> None:
    for k, v in table.items():
        if v is None:
            continue
        if (isinstance(v, dict) and k not in inline) or _is_table_list(v):
            continue
        out.append(f"{k} = {_scalar(v)}")
    for k, v in table.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and k not in inline:
            out += ["", f"[{name}]"]
            _emit(v, name, out, inline)
        elif _is_table_list(v):
            for item in v:
                out += ["", f"[[{name}]]"]
                _emit(item, name, out, inline)


def dumps(doc: dict, header: str = "", inline: tuple[str, ...] = ()) -> str:
    """TOML text of `doc`; keys named in `inline` are written as inline tables."""
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    _emit(doc, "", out, set(inline))
    return "\n".join(out).lstrip("\n") + "\n"
