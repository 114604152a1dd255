"""Capacity planning: candidate deployments, their simulation, the winner's file.

Two kinds of input, two kinds of winner:

* a simulator scenario (GPU profiles, report scale): candidates vary the
  instance count and hardware of each pool and the WAN line; the winner is
  written as a scenario TOML (`pdd sim -c winner.toml` reruns it);
* a runtime deployment file (this CPU): candidates vary how many instances
  of each role run (copies of the file's first instance of that role, on new
  ports, pinned to the same core) and the WAN line; the winner is written as
  a deployment TOML that `pdd.deploy.spec.load_spec` accepts (`pdd up`).

Ranking: highest BCR among the candidates whose SLA attainment reaches the
minimum; the rest follow by attainment.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, fields

from pdd.deploy.spec import DeploymentSpec, InstanceSpec
from pdd.engine.config import EngineConfig
from pdd.sim.model_shape import PRESETS
from pdd.sim.scenario import ModeSpec, Scenario
from pdd.sim.workload import AgenticWorkload, FixedHitWorkload, TraceWorkload

MAX_CANDIDATES = 400


def parse_range(spec: str) -> list[int]:
    parts = [int(x) for x in spec.split(":")]
    if len(parts) == 1:
        parts = [parts[0], parts[0]]
    lo, hi, step = parts[0], parts[1], parts[2] if len(parts) > 2 else 1
    if lo < 0 or hi < lo or step < 1:
        raise ValueError(f"{spec}: need 0 <= LO <= HI and STEP >= 1")
    return list(range(lo, hi + 1, step))


def parse_role_values(items: list[str], conv) -> dict[str, list]:
    """["prefill=1:3", ...] or ["main=gpu_a,gpu_b"] -> {role: [values]}."""
    out: dict[str, list] = {}
    for item in items:
        role, sep, spec = item.partition("=")
        if not sep or not spec:
            raise ValueError(f"{item!r}: expected ROLE=VALUES")
        out[role] = conv(spec)
    return out


def parse_wan(items: list[str]) -> list[tuple[float, float | None]]:
    """["50:2", "100"] -> [(gbps, price_per_hour or None)]."""
    out = []
    for item in items:
        g, _, price = item.partition(":")
        out.append((float(g), float(price) if price else None))
    return out


def _check_roles(have: set[str], grid: dict[str, list], what: str) -> None:
    for r in grid:
        if r not in have:
            raise ValueError(f"{what}: no {r!r} pool/instance (has {sorted(have)})")


# --- scenario candidates -----------------------------------------------------------
def scenario_candidates(mode: ModeSpec, counts: dict[str, list[int]],
                        hardware: dict[str, list[str]], wans: list[tuple[float, float | None]]):
    roles = {p.role.value for p in mode.pools}
    _check_roles(roles, counts, "--vary")
    _check_roles(roles, hardware, "--hardware")
    axes = [(("count", r), v) for r, v in sorted(counts.items())]
    axes += [(("hardware", r), v) for r, v in sorted(hardware.items())]
    wan_opts = wans or [None]
    for combo in itertools.product(*(v for _, v in axes)):
        choice = {k: c for (k, _), c in zip(axes, combo)}
        for wan in wan_opts:
            pools = tuple(dataclasses.replace(
                p, count=choice.get(("count", p.role.value), p.count),
                hardware=choice.get(("hardware", p.role.value), p.hardware)) for p in mode.pools)
            name = mode.name + "".join(
                f"-{r[0]}{c}" for (kind, r), c in choice.items() if kind == "count")
            name += "".join(f"-{r[0]}:{c}" for (kind, r), c in choice.items() if kind == "hardware")
            new_wan = mode.wan
            if wan is not None:
                if mode.wan is None:
                    raise ValueError(f"mode {mode.name} has no WAN to vary")
                g, price = wan
                new_wan = dataclasses.replace(mode.wan, gbps=g, price_per_hour=(
                    mode.wan.price_per_hour if price is None else price))
                name += f"-wan{g:g}"
            yield dataclasses.replace(mode, name=name, pools=pools, wan=new_wan)


def scenario_doc(sc: Scenario, mode: ModeSpec) -> dict:
    """A scenario file's tables for one mode (what `scenario.parse` reads back)."""
    m = sc.model
    preset = PRESETS.get(m.name)
    model = {"preset": m.name if preset else "report-moe"}
    base = preset or PRESETS["report-moe"]
    model.update({f.name: getattr(m, f.name) for f in fields(m)
                  if f.name != "name" and getattr(m, f.name) != getattr(base, f.name)})
    w = sc.workload
    kind = {AgenticWorkload: "agentic", FixedHitWorkload: "fixed_hit", TraceWorkload: "trace"}[type(w)]
    policy = {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(mode.policy).items()}
    mdoc = {"name": mode.name, "policy": policy, "rdma": asdict(mode.rdma)}
    if mode.wan is not None:
        mdoc["wan"] = asdict(mode.wan)
    mdoc["pool"] = [{k: (v.value if hasattr(v, "value") else v) for k, v in asdict(p).items()}
                    for p in mode.pools]
    return {"sim": asdict(sc.settings), "model": model, "workload": {"kind": kind, **asdict(w)},
            "sla": {"ttft_s": sc.sla.ttft_s, "tpot_s": sc.sla.tpot_s}, "mode": [mdoc]}


# --- runtime candidates ------------------------------------------------------------
def runtime_candidates(spec: DeploymentSpec, counts: dict[str, list[int]],
                       wans: list[tuple[float, float | None]]):
    roles = {i.role.value for i in spec.instances}
    _check_roles(roles, counts, "--vary")
    order = sorted(counts)
    for combo in itertools.product(*(counts[r] for r in order)):
        by_role = dict(zip(order, combo))
        for wan in wans or [None]:
            s = resize(spec, by_role)
            name = spec.name + "".join(f"-{r[0]}{c}" for r, c in by_role.items())
            if wan is not None:
                if not s.links:
                    raise ValueError(f"{spec.name} has no WAN link to vary")
                g, price = wan
                link = dataclasses.replace(s.links[0], bandwidth_mbps=g * 1e3, cost_per_hour=(
                    s.links[0].cost_per_hour if price is None else price))
                s = dataclasses.replace(s, links=(link,) + s.links[1:])
                name += f"-wan{g:g}"
            if any(not s.by_role(r) for r in ("prefill",) if r in roles):
                continue
            yield name, dataclasses.replace(s, name=name)


def resize(spec: DeploymentSpec, by_role: dict[str, int]) -> DeploymentSpec:
    """`spec` with `by_role[role]` instances of each listed role.

    Extra instances copy the file's first instance of that role (same
    datacenter, engine, price and core) on fresh ports above every port the
    file uses, so they time-share that core unless edited.
    """
    used = [spec.router_port] + [p for i in spec.instances for p in (i.port, i.kv_port)]
    used += [p for link in spec.links for p in (link.control_port, link.relay_port_base + 63)]
    next_port = max(used) + 1
    out: list[InstanceSpec] = []
    for role in dict.fromkeys(i.role.value for i in spec.instances):
        have = [i for i in spec.instances if i.role.value == role]
        want = by_role.get(role, len(have))
        out += have[:want]
        stem = have[0].name.rstrip("0123456789") or have[0].name
        for k in range(len(have), want):
            out.append(dataclasses.replace(have[0], name=f"{stem}{k}", port=next_port,
                                           kv_port=next_port + 1))
            next_port += 2
    return dataclasses.replace(spec, instances=tuple(out))


def deployment_doc(spec: DeploymentSpec) -> dict:
    """A deployment file's tables (what `pdd.deploy.spec.parse_spec` reads back)."""
    default = EngineConfig()
    insts = []
    for i in spec.instances:
        d = {"name": i.name, "role": i.role.value, "datacenter": i.datacenter, "host": i.host,
             "port": i.port, "kv_port": i.kv_port, "cost_per_hour": i.cost_per_hour, "cpu": i.cpu}
        if i.nice:
            d["nice"] = i.nice
        eng = {f.name: getattr(i.engine, f.name) for f in fields(EngineConfig)
               if getattr(i.engine, f.name) != getattr(default, f.name)}
        if eng:
            d["engine"] = eng
        insts.append(d)
    doc = {"name": spec.name, "model": {"path": spec.model},
           "router": {"host": spec.router_host, "port": spec.router_port,
                      "datacenter": spec.router_datacenter},
           "instances": insts, "links": [asdict(link) for link in spec.links],
           "timeouts": {"request_s": spec.request_timeout_s, "kv_deadline_s": spec.kv_deadline_s}}
    if spec.policy:
        doc["policy"] = dict(spec.policy)
    return doc


# --- ranking -------------------------------------------------------------------------
def row(name: str, entry: dict, chips: dict | None = None) -> dict:
    return {"name": name, "chips": chips, "cost_per_hour": entry["cost_per_hour"],
            "bcr": entry["bcr"], "goodput_rps": entry["goodput_rps"],
            "sla_attainment": entry["sla_attainment"], "ttft_p50_s": entry["ttft_s"]["p50"],
            "ttft_p90_s": entry["ttft_s"]["p90"], "tpot_p90_s": entry["tpot_s"]["p90"],
            "rld_token_share": entry["rld_token_share"]}


def rank(rows: list[dict], min_sla: float) -> list[dict]:
    """SLA-meeting candidates by BCR (best first), then the others by attainment."""
    ok = sorted((r for r in rows if r["sla_attainment"] >= min_sla), key=lambda r: (-r["bcr"], r["name"]))
    rest = sorted((r for r in rows if r["sla_attainment"] < min_sla),
                  key=lambda r: (-r["sla_attainment"], -r["bcr"], r["name"]))
    return ok + rest
