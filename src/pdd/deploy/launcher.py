"""Start and stop a whole deployment on this machine.

`Deployment.start(path)` prepares the model once, writes a fresh shared
secret (mode 0600; every process derives its per-purpose keys from it,
`pdd.keys`, and none sends it anywhere) and (TLS on) a fresh deployment CA
with a certificate per instance and the router (pdd.transport.tls), starts
the WAN relays, every instance and the router (each its own process group,
logs under the run directory), waits until all answer /health, and records
their pids. `stop()` (and `pdd down`) ends exactly those process groups:
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdd.deploy.spec import DeploymentSpec, load_spec
from pdd.deploy.topology import control_ports, relay_mappings
from pdd.keys import DeploymentKeys

if TYPE_CHECKING:
    from pdd.deploy.supervisor import RestartPolicy, Supervisor


class DeploymentError(RuntimeError):
    pass


def default_run_dir(config_path: Path, cache_dir: Path) -> Path:
    digest = hashlib.sha256(str(config_path.resolve()).encode()).hexdigest()[:10]
    return cache_dir / "run" / f"{config_path.stem}-{digest}"


@dataclass
class Proc:
    name: str
    pid: int
    url: str                 # health URL
    log: Path
    signer: tuple[bytes, str] | None = None   # (key, name): the relay's /health must be signed
    ca: Path | None = None      # an https health URL: verify the server against this CA


@dataclass
class Deployment:
    spec: DeploymentSpec
    run_dir: Path
    procs: list[Proc] = field(default_factory=list)
    tls_dir: Path | None = None     # certificates (None: TLS off)
    # name -> (command, environment): how to start a process again (supervisor.py)
    recipes: dict[str, tuple[list[str], dict]] = field(default_factory=dict)
    supervisor: "Supervisor | None" = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def router_url(self) -> str:
        return f"http://{self.spec.router_host}:{self.spec.router_port}/v1"

    @property
    def cost_per_hour(self) -> float:
        return self.spec.cost_per_hour

    def wan_control(self, k: int = 0):
        """A client of link k's relay control API (cut / restore / set / stats)."""
        from pdd.wan.control import WanControlClient

        link = self.spec.links[k]
        return WanControlClient(link.relay_host, link.control_port, self.keys.wan_control, name=f"wan{k}")

    def instance_url(self, name: str) -> tuple[str, ssl.SSLContext | None]:
        """Base URL of an instance's HTTP API from this host, and the SSL context
        for it (None: plain http): verified against the deployment CA and
        presenting the router's certificate, so tools may make /internal/ calls."""
        from pdd.deploy.spec import ROUTER_CERT_NAME
        from pdd.transport.tls import TlsFiles, client_context, http_tls

        inst = self.spec.instance(name)
        if self.tls_dir is None or not http_tls(self.spec, inst):
            return f"http://{inst.host}:{inst.port}", None
        ctx = client_context(TlsFiles(self.tls_dir, ROUTER_CERT_NAME))
        ctx.check_hostname = False     # reached by address (urllib cannot pass the name); the CA still vouches
        return f"https://{inst.host}:{inst.port}", ctx

    @property
    def secret(self) -> bytes:
        return (self.run_dir / "secret").read_bytes().strip()

    @property
    def keys(self) -> DeploymentKeys:
        return DeploymentKeys.derive(self.secret)

    # -- start ----------------------------------------------------------------
    @classmethod
    def start(cls, config_path: str | Path, overrides: dict | None = None, run_dir: Path | None = None,
              cache_dir: Path | None = None, timeout_s: float = 300.0,
              supervise: "RestartPolicy | None" = None) -> "Deployment":
        """supervise: restart any process that dies, with this backoff (`pdd up` does)."""
        from pdd.model.loader import default_cache_dir, resolve_model_path

        config_path = Path(config_path)
        spec = load_spec(config_path, overrides)
        cache_dir = cache_dir or default_cache_dir()
        resolve_model_path(spec.model, cache_dir)      # convert once, before any process needs it
        run_dir = Path(run_dir) if run_dir else default_run_dir(config_path, cache_dir)
        if (run_dir / "pids.json").exists():
            stop_recorded(run_dir)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        secret_file = run_dir / "secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        _check_ports_free(spec)
        from pdd.transport.tls import TlsError, ensure_certs, http_tls

        try:
            tls_dir = ensure_certs(spec, run_dir)
        except TlsError as e:
            raise DeploymentError(str(e)) from None
        dep = cls(spec, run_dir, tls_dir=tls_dir)
        tls_args = ["--tls-dir", str(tls_dir)] if tls_dir is not None else []
        base = [sys.executable, "-m", "pdd.cli"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PDD_CACHE": str(cache_dir)}
        try:
            for k, link in enumerate(spec.links):
                cmd = base + ["wan", "--host", link.relay_host, "--rate-mbps", str(link.bandwidth_mbps),
                              "--latency-ms", str(link.latency_ms), "--jitter-ms", str(link.jitter_ms),
                              "--control-port", str(link.control_port), "--secret-file", str(secret_file),
                              "--name", f"wan{k}"]
                control_lps = control_ports(spec, link) if link.priority_control else set()
                for lp, host, tp in relay_mappings(spec, link):
                    control = lp in control_lps
                    cmd += ["--listen-control" if control else "--listen", f"{lp}:{host}:{tp}"]
                dep._spawn(f"wan{k}", cmd, f"http://{link.relay_host}:{link.control_port}/health", env,
                           signer=(dep.keys.wan_control, f"wan{k}"))
            extra = ["--override", json.dumps(overrides)] if overrides else []
            for inst in spec.instances:
                cmd = base + ["serve", "-c", str(config_path), "--name", inst.name,
                              "--secret-file", str(secret_file), "--cache", str(cache_dir)] + tls_args + extra
                if http_tls(spec, inst):
                    dep._spawn(inst.name, cmd, f"https://{inst.host}:{inst.port}/health", env, ca=tls_dir / "ca.crt")
                else:
                    dep._spawn(inst.name, cmd, f"http://{inst.host}:{inst.port}/health", env)
            dep._wait_healthy(timeout_s, [p for p in dep.procs])
            cmd = base + ["serve", "-c", str(config_path), "--router", "--secret-file", str(secret_file),
                          "--cache", str(cache_dir)] + tls_args + extra
            dep._spawn("router", cmd, f"http://{spec.router_host}:{spec.router_port}/health", env)
            dep._wait_healthy(timeout_s, dep.procs[-1:])
        except BaseException:
            dep.stop()
            raise
        if supervise is not None:
            from pdd.deploy.supervisor import Supervisor

            dep.supervisor = Supervisor(dep, supervise).start()
        return dep

    def _spawn(self, name: str, cmd: list[str], url: str, env: dict, signer: tuple[bytes, str] | None = None,
               ca: Path | None = None) -> None:
        log = self.run_dir / "logs" / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
        self.procs.append(Proc(name, p.pid, url, log, signer, ca))
        self.recipes[name] = (cmd, env)
        self._record()

    def _record(self) -> None:
        data = [{"name": p.name, "pid": p.pid, "log": str(p.log)} for p in self.procs]
        (self.run_dir / "pids.json").write_text(json.dumps({"config": str(self.spec.source), "procs": data}))

    def _wait_healthy(self, timeout_s: float, procs: list[Proc]) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            for p in list(pending):
                if not _alive(p.pid):
                    raise DeploymentError(f"{p.name} exited during start-up; log {p.log}:\n{_tail(p.log)}")
                if _healthy(p.url, p.signer, p.ca):
                    pending.remove(p)
            if time.monotonic() > deadline:
                raise DeploymentError(f"not healthy within {timeout_s:.0f} s: {[p.name for p in pending]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.supervisor is not None:     # first, or it would restart what we stop
            self.supervisor.stop()
        stop_recorded(self.run_dir)
        self.procs.clear()


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _healthy(url: str, signer: tuple[bytes, str] | None = None, ca: Path | None = None) -> bool:
    headers = {}
    if signer is not None:
        from pdd.server.http_auth import sign

        headers = sign(signer[0], "GET", urllib.parse.urlsplit(url).path, signer[1])
    req = urllib.request.Request(url, headers=headers)
    context = None
    if ca is not None:
        # A liveness probe: the CA must vouch for the server, but it is reached by
        # address, not by its certificate's name (no client certificate needed).
        context = ssl.create_default_context(cafile=str(ca))
        context.check_hostname = False
    try:
        with urllib.request.urlopen(req, timeout=1.0, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _check_ports_free(spec: DeploymentSpec) -> None:
    wanted = [(spec.router_host, spec.router_port)]
    for i in spec.instances:
        wanted += [(i.host, i.port), (i.host, i.kv_port)]
    for link in spec.links:
        wanted.append((link.relay_host, link.control_port))
        wanted += [(link.relay_host, lp) for lp, _, _ in relay_mappings(spec, link)]
    for host, port in wanted:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                raise DeploymentError(f"port {host}:{port} is already in use (another deployment up?)") from None


def stop_recorded(run_dir: Path, grace_s: float = 10.0) -> list[str]:
    """Stop the process groups recorded in run_dir/pids.json; return their names."""
    f = run_dir / "pids.json"
    if not f.exists():
        return []
    procs = json.loads(f.read_text())["procs"]
    live = [p for p in procs if _is_ours(p["pid"])]
    for p in reversed(live):                       # router first, relays last
        _signal_group(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p["pid"]) for p in live):
        time.sleep(0.1)
    for p in live:
        if _alive(p["pid"]):
            _signal_group(p["pid"], signal.SIGKILL)
    for p in live:
        for _ in range(50):
            if not _alive(p["pid"]):
                break
            time.sleep(0.05)
    f.unlink(missing_ok=True)
    return [p["name"] for p in live]


def _is_ours(pid: int) -> bool:
    """Guards against a recycled pid: the process must be one of ours."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pdd.cli" in cmd


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
