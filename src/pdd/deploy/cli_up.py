"""`pdd up -c deploy.toml [--detach]`: start a deployment and wait until healthy."""

from __future__ import annotations

import argparse
import signal
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--detach", action="store_true", help="return once healthy; stop later with `pdd down`")
    p.add_argument("--timeout", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    from pdd.deploy.launcher import Deployment, DeploymentError
    from pdd.deploy.spec import SpecError

    try:
        from pdd.deploy.supervisor import RestartPolicy

        # In the foreground `pdd up` also restarts dead processes; --detach returns, so nothing supervises.
        dep = Deployment.start(args.config, timeout_s=args.timeout, supervise=None if args.detach else RestartPolicy())
    except (SpecError, DeploymentError) as e:
        print(f"pdd up: {e}")
        return 1
    print(f"{dep.name}: {dep.spec.mode}, {len(dep.spec.instances)} instances, logs in {dep.run_dir / 'logs'}")
    print(f"router: {dep.router_url}", flush=True)
    if args.detach:
        return 0
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    dep.stop()
    print("stopped")
    return 0
