"""The deployment file: one TOML describing model, instances, links, policy.

Validated once at the entry point into frozen dataclasses; every error names
the offending field (e.g. `instances[2].role`). The same file works when the
instances run on different hosts: each instance has its own host and ports,
and `pdd serve -c FILE --name X` starts just that one.
"""

from __future__ import annotations

import enum
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdd.engine.config import EngineConfig


class SpecError(ValueError):
    pass


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    RELAY = "relay"      # RelayDecode: datacenter A, beside P
    MAIN = "main"        # MainDecode: datacenter B, behind the WAN

    @property
    def decodes(self) -> bool:
        return self in (Role.DECODE, Role.RELAY, Role.MAIN)


class Backend(str, enum.Enum):
    """The engine behind an instance. Chosen as `backend` in the `[engine]`
    table (or an instance's `engine = { ... }`): that table already holds the
    engine's settings (block size, pool size, batch limits, threads, dtype),
    which both backends read, so the choice sits beside them; a top-level
    `engine = "vllm"` would clash with the `[engine]` table in TOML."""
    PDD = "pdd"      # our embedded engine (pdd.engine): the default
    VLLM = "vllm"    # vLLM as a library, KV moved by the PDD connector (pdd.vllm)


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: Role
    datacenter: str
    host: str
    port: int
    kv_port: int
    cost_per_hour: float = 1.0
    cpu: int | None = None            # pin the process to this core
    # Its CPU priority below the others' (Linux nice, 0-19): an instance that
    # shares a core with a latency-critical one gives way to it.
    nice: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: Backend = Backend.PDD


@dataclass(frozen=True)
class LinkSpec:
    a: str                            # client side datacenter
    b: str                            # server side datacenter (its instances are reached via the relay)
    bandwidth_mbps: float = 400.0
    latency_ms: float = 20.0          # one way
    jitter_ms: float = 5.0
    cost_per_hour: float = 0.0
    relay_host: str = "127.0.0.1"
    relay_port_base: int = 8400
    control_port: int = 8399
    # The instances' HTTP calls (control calls, token streams) cross in a
    # priority class ahead of queued bulk bytes (KV copies), as a managed WAN
    # marks its control traffic; false: one FIFO queue for everything.
    priority_control: bool = True


class TlsMode(str, enum.Enum):
    OFF = "off"      # no TLS anywhere (a trusted network, or a test of the plaintext path)
    WAN = "wan"      # mutual TLS on every port that a client reaches across datacenters
    ALL = "all"      # mutual TLS on every instance port, inside a datacenter too


@dataclass(frozen=True)
class TlsSpec:
    mode: TlsMode = TlsMode.WAN
    # The operator's own certificates: ca.crt plus NAME.crt / NAME.key for every
    # instance and `router`. None: `pdd up` creates a CA and them in the run dir.
    dir: Path | None = None


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: str = "default"
    router_host: str = "127.0.0.1"
    router_port: int = 8100
    router_datacenter: str = "A"
    # Client API keys of the router. The file (one key a line, # comments)
    # and the variable are only named here; `pdd serve --router` reads them
    # at start-up, so a key never sits in the deployment file itself.
    router_api_keys_file: Path | None = None
    router_api_key_env: str | None = None
    router_max_traces: int = 10_000
    instances: tuple[InstanceSpec, ...] = ()
    links: tuple[LinkSpec, ...] = ()
    policy: dict = field(default_factory=dict)
    request_timeout_s: float = 300.0
    # How long KV nobody waits on may take to land: a warm push after the
    # answer, a decode call's wait without a deadline of its own. A request's
    # own copies have the request's deadline (`server.flows.target`).
    kv_deadline_s: float = 60.0
    tls: TlsSpec = field(default_factory=TlsSpec)
    # A decoding instance silent this long while it should stream counts as
    # gone for that request (RLD -> MD takes over; MD -> RLD carries on).
    stream_stall_s: float = 30.0
    # A KV transfer's peer silent this long (no frame, not even the WAIT a
    # live but queued or busy side sends every kv_keepalive_s) is dead, or
    # its line cut: the transfer fails.
    kv_stall_s: float = 30.0
    # How KV moves between two instances of one datacenter on the same host
    # (`[kv] same_host`): "shm", through a shared-memory file, the socket
    # carrying only the frames that say where (`transport.shm`); "socket":
    # every byte over the loopback connection, sealed, as across the WAN.
    kv_same_host: str = "shm"
    source: Path | None = None

    @property
    def kv_keepalive_s(self) -> float:
        from pdd.transport.stream import DEFAULT_KEEPALIVE_S

        return min(DEFAULT_KEEPALIVE_S, self.kv_stall_s / 4)

    @property
    def mode(self) -> str:
        roles = {i.role for i in self.instances}
        if Role.COLOCATED in roles:
            return "colocated"
        if Role.MAIN in roles:
            return "pdd"
        p_dcs = {i.datacenter for i in self.instances if i.role == Role.PREFILL}
        d_dcs = {i.datacenter for i in self.instances if i.role == Role.DECODE}
        return "pd-local" if d_dcs <= p_dcs else "pd-wan"

    @property
    def backend(self) -> Backend:
        """The one engine backend every instance runs (checked at load)."""
        return self.instances[0].backend if self.instances else Backend.PDD

    @property
    def cost_per_hour(self) -> float:
        return sum(i.cost_per_hour for i in self.instances) + sum(l.cost_per_hour for l in self.links)

    def instance(self, name: str) -> InstanceSpec:
        for i in self.instances:
            if i.name == name:
                return i
        raise SpecError(f"no instance named {name!r} in {self.source or self.name}")

    def by_role(self, *roles: Role) -> list[InstanceSpec]:
        return [i for i in self.instances if i.role in roles]

    def link_between(self, a: str, b: str) -> LinkSpec | None:
        return next((l for l in self.links if {l.a, l.b} == {a, b}), None)


# -- parsing -------------------------------------------------------------------
def _take(d: dict, key: str, typ, where: str, default: Any = ...):
    if key not in d:
        if default is ...:
            raise SpecError(f"{where}.{key} is required")
        return default
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        raise SpecError(f"{where}.{key} must be {typ.__name__}, got {v!r}")
    return v


def _unknown(d: dict, allowed: set[str], where: str) -> None:
    extra = set(d) - allowed
    if extra:
        raise SpecError(f"{where}: unknown field(s) {sorted(extra)}; allowed: {sorted(allowed)}")


def _engine(d: dict, base: tuple[EngineConfig, Backend], where: str) -> tuple[EngineConfig, Backend]:
    """An engine table over `base`: (settings, backend)."""
    if not isinstance(d, dict):
        raise SpecError(f"{where} must be a table of engine settings")
    d = dict(d)
    backend = base[1]
    if "backend" in d:
        b = d.pop("backend")
        try:
            backend = Backend(b)
        except ValueError:
            raise SpecError(f"{where}.backend must be one of {[x.value for x in Backend]}, got {b!r}") from None
    names = {f.name for f in fields(EngineConfig)}
    _unknown(d, names | {"backend"}, where)
    try:
        return replace(base[0], **d), backend
    except (TypeError, ValueError) as e:
        raise SpecError(f"{where}: {e}") from None


def _port(d: dict, key: str, where: str, default: Any = ...) -> int:
    v = _take(d, key, int, where, default)
    if not 0 < v < 65536:
        raise SpecError(f"{where}.{key} must be a TCP port, got {v}")
    return v


def parse_spec(doc: dict, source: Path | None = None) -> DeploymentSpec:
    _unknown(doc, {"name", "model", "router", "engine", "instances", "links", "policy", "timeouts", "tls", "kv"},
             "deployment")
    name = _take(doc, "name", str, "deployment", source.stem if source else "deployment")
    model = doc.get("model", {})
    if not isinstance(model, dict):
        raise SpecError("model must be a table with a `path` field")
    _unknown(model, {"path"}, "model")
    base_engine = _engine(doc.get("engine", {}), (EngineConfig(), Backend.PDD), "engine")
    router = doc.get("router", {})
    _unknown(router, {"host", "port", "datacenter", "api_keys_file", "api_key_env", "max_traces"}, "router")
    keys_file = _take(router, "api_keys_file", str, "router", None)
    if keys_file is not None:
        keys_file = Path(keys_file).expanduser()
        if not keys_file.is_absolute() and source is not None:
            keys_file = source.parent / keys_file     # relative to the deployment file
    max_traces = _take(router, "max_traces", int, "router", 10_000)
    if max_traces < 1:
        raise SpecError(f"router.max_traces must be >= 1, got {max_traces}")
    instances = []
    raw = doc.get("instances")
    if not isinstance(raw, list) or not raw:
        raise SpecError("instances: at least one [[instances]] entry is required")
    for k, d in enumerate(raw):
        w = f"instances[{k}]"
        _unknown(d, {f.name for f in fields(InstanceSpec)} - {"backend"}, w)
        role_s = _take(d, "role", str, w)
        try:
            role = Role(role_s)
        except ValueError:
            raise SpecError(f"{w}.role must be one of {[r.value for r in Role]}, got {role_s!r}") from None
        cpu = d.get("cpu")
        if cpu is not None and (not isinstance(cpu, int) or cpu < 0):
            raise SpecError(f"{w}.cpu must be a core number >= 0, got {cpu!r}")
        nice = _take(d, "nice", int, w, 0)
        if not 0 <= nice <= 19:
            raise SpecError(f"{w}.nice must be 0-19 (a lower priority than the others'), got {nice}")
        cost = _take(d, "cost_per_hour", float, w, 1.0)
        if cost < 0:
            raise SpecError(f"{w}.cost_per_hour must be >= 0")
        engine, backend = _engine(d.get("engine", {}), base_engine, f"{w}.engine")
        instances.append(InstanceSpec(
            name=_take(d, "name", str, w), role=role, datacenter=_take(d, "datacenter", str, w, "A"),
            host=_take(d, "host", str, w, "127.0.0.1"), port=_port(d, "port", w),
            kv_port=_port(d, "kv_port", w), cost_per_hour=cost, cpu=cpu, nice=nice,
            engine=engine, backend=backend,
        ))
    links = []
    for k, d in enumerate(doc.get("links", [])):
        w = f"links[{k}]"
        _unknown(d, {f.name for f in fields(LinkSpec)}, w)
        link = LinkSpec(
            a=_take(d, "a", str, w), b=_take(d, "b", str, w),
            bandwidth_mbps=_take(d, "bandwidth_mbps", float, w, 400.0),
            latency_ms=_take(d, "latency_ms", float, w, 20.0), jitter_ms=_take(d, "jitter_ms", float, w, 5.0),
            cost_per_hour=_take(d, "cost_per_hour", float, w, 0.0),
            relay_host=_take(d, "relay_host", str, w, "127.0.0.1"),
            relay_port_base=_port(d, "relay_port_base", w, 8400), control_port=_port(d, "control_port", w, 8399),
            priority_control=_take(d, "priority_control", bool, w, True),
        )
        if link.bandwidth_mbps <= 0 or link.latency_ms < 0 or link.jitter_ms < 0:
            raise SpecError(f"{w}: bandwidth must be > 0, latency and jitter >= 0")
        links.append(link)
    timeouts = doc.get("timeouts", {})
    _unknown(timeouts, {"request_s", "kv_deadline_s", "stream_stall_s", "kv_stall_s"}, "timeouts")
    for key in ("stream_stall_s", "kv_stall_s"):
        if _take(timeouts, key, float, "timeouts", 30.0) <= 0:
            raise SpecError(f"timeouts.{key} must be > 0")
    kv = doc.get("kv", {})
    if not isinstance(kv, dict):
        raise SpecError("kv must be a table (same_host = \"shm\" or \"socket\")")
    _unknown(kv, {"same_host"}, "kv")
    same_host = _take(kv, "same_host", str, "kv", "shm")
    if same_host not in ("shm", "socket"):
        raise SpecError(f"kv.same_host must be \"shm\" or \"socket\", got {same_host!r}")
    spec = DeploymentSpec(
        name=name, model=_take(model, "path", str, "model", "default"),
        router_host=_take(router, "host", str, "router", "127.0.0.1"),
        router_port=_port(router, "port", "router", 8100),
        router_datacenter=_take(router, "datacenter", str, "router", "A"),
        router_api_keys_file=keys_file, router_api_key_env=_take(router, "api_key_env", str, "router", None),
        router_max_traces=max_traces,
        instances=tuple(instances), links=tuple(links), policy=dict(doc.get("policy", {})),
        request_timeout_s=_take(timeouts, "request_s", float, "timeouts", 300.0),
        kv_deadline_s=_take(timeouts, "kv_deadline_s", float, "timeouts", 60.0),
        stream_stall_s=_take(timeouts, "stream_stall_s", float, "timeouts", 30.0),
        kv_stall_s=_take(timeouts, "kv_stall_s", float, "timeouts", 30.0),
        tls=_tls(doc.get("tls", {}), source), kv_same_host=same_host, source=source,
    )
    _check_topology(spec)
    try:
        from pdd.policy.config import PolicyConfig

        PolicyConfig.from_dict(spec.policy)
    except (TypeError, ValueError) as e:
        raise SpecError(f"policy: {e}") from None
    return spec


def _tls(d: dict, source: Path | None) -> TlsSpec:
    if not isinstance(d, dict):
        raise SpecError("tls must be a table with `mode` and optionally `dir`")
    _unknown(d, {"mode", "dir"}, "tls")
    mode_s = _take(d, "mode", str, "tls", TlsMode.WAN.value)
    try:
        mode = TlsMode(mode_s)
    except ValueError:
        raise SpecError(f"tls.mode must be one of {[m.value for m in TlsMode]}, got {mode_s!r}") from None
    cert_dir = d.get("dir")
    if cert_dir is not None:
        cert_dir = Path(_take(d, "dir", str, "tls"))
        if not cert_dir.is_absolute() and source is not None:
            cert_dir = source.parent / cert_dir     # relative to the deployment file, as an operator expects
    return TlsSpec(mode, cert_dir)


# Certificates name instances by a DNS name (their SAN), which TLS checks on
# both ends; `router` is the router's own certificate.
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
ROUTER_CERT_NAME = "router"


def _check_topology(spec: DeploymentSpec) -> None:
    names = [i.name for i in spec.instances]
    if len(set(names)) != len(names):
        raise SpecError(f"instances: names must be unique, got {names}")
    if spec.tls.mode != TlsMode.OFF:
        for k, n in enumerate(names):
            if not _DNS_LABEL.fullmatch(n) or n == ROUTER_CERT_NAME:
                raise SpecError(f"instances[{k}].name {n!r}: with TLS on, names are certificate names: letters, "
                                f"digits and inner '-' (at most 63), and not {ROUTER_CERT_NAME!r}")
    dtypes = {i.engine.dtype for i in spec.instances}
    if len(dtypes) > 1:   # KV moves between instances as raw blocks: one dtype for all
        raise SpecError(f"instances: every engine must use one dtype (KV crosses between them), got {sorted(dtypes)}")
    ports = [(i.host, p) for i in spec.instances for p in (i.port, i.kv_port)] + [(spec.router_host, spec.router_port)]
    if len(set(ports)) != len(ports):
        raise SpecError("instances: every port (port, kv_port, router.port) must be distinct")
    _check_backends(spec)
    roles = {i.role for i in spec.instances}
    if Role.COLOCATED in roles and roles != {Role.COLOCATED}:
        raise SpecError("instances: colocated instances cannot be mixed with other roles")
    if roles & {Role.DECODE, Role.RELAY, Role.MAIN} and Role.PREFILL not in roles:
        raise SpecError("instances: decode/relay/main instances need at least one prefill instance")
    if Role.PREFILL in roles and not roles & {Role.DECODE, Role.RELAY, Role.MAIN}:
        raise SpecError("instances: prefill instances need a decode, relay or main instance")
    if Role.DECODE in roles and roles & {Role.RELAY, Role.MAIN}:
        raise SpecError("instances: use either decode (PD baselines) or relay+main (PDD), not both")
    if Role.RELAY in roles and Role.MAIN not in roles:
        raise SpecError("instances: relay instances need a main instance")
    dcs = {i.datacenter for i in spec.instances}
    for i in spec.instances:
        if i.datacenter != spec.router_datacenter and spec.link_between(spec.router_datacenter, i.datacenter) is None:
            raise SpecError(f"instance {i.name!r} is in datacenter {i.datacenter!r} but no [[links]] joins it to "
                            f"{spec.router_datacenter!r}")
    for k, l in enumerate(spec.links):
        if l.a not in dcs | {spec.router_datacenter} or l.b not in dcs:
            raise SpecError(f"links[{k}] joins unknown datacenters {l.a!r}-{l.b!r}")


def _check_backends(spec: DeploymentSpec) -> None:
    """One backend per deployment: KV moves between instances as whole blocks
    of the engine's own layout (ours: token-major pages of `block_size`;
    vLLM's CPU cache: per head, K rows then V rows, in blocks of a multiple
    of 32), and the block hashes that DRC and the HAVE handshake compare are
    taken at one block size. Two backends could exchange neither."""
    by_backend: dict[Backend, list[str]] = {}
    for i in spec.instances:
        by_backend.setdefault(i.backend, []).append(i.name)
    if len(by_backend) > 1:
        said = "; ".join(f"{b.value}: {', '.join(names)}" for b, names in by_backend.items())
        raise SpecError(f"instances: a deployment runs one engine backend for every instance, got {said}. "
                        f"Set `backend` once in [engine] (KV layouts and block sizes differ between engines, "
                        f"so KV cannot move between them)")
    sizes = {i.engine.block_size for i in spec.instances}
    if len(sizes) > 1:
        raise SpecError(f"instances: every instance needs the same engine.block_size (block hashes and KV "
                        f"transfers are per block), got {sorted(sizes)}")


def link_overrides(wan_mbps: float | None) -> dict | None:
    """`--wan-mbps`: every line of a deployment at this rate (None: as in its file)."""
    if wan_mbps is None:
        return None
    if wan_mbps <= 0:
        raise SpecError("--wan-mbps must be > 0")
    return {"links": {"bandwidth_mbps": float(wan_mbps)}}


def load_spec(path: str | Path, overrides: dict | None = None) -> DeploymentSpec:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"deployment file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: invalid TOML: {e}") from None
    for key, val in (overrides or {}).items():
        if key == "links" and isinstance(val, dict):
            # One table for every line (`pdd bench --wan-mbps`, sweeps).
            doc["links"] = [{**link, **val} for link in doc.get("links", [])]
        elif isinstance(val, dict):
            doc[key] = {**doc.get(key, {}), **val}
        else:
            doc[key] = val
    return parse_spec(doc, path)
