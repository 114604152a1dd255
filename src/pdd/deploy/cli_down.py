"""`pdd down -c deploy.toml`: stop what `pdd up` started for this file, nothing else."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True)


def run(args: argparse.Namespace) -> int:
    from pdd.deploy.launcher import default_run_dir, stop_recorded
    from pdd.model.loader import default_cache_dir

    names = stop_recorded(default_run_dir(Path(args.config), default_cache_dir()))
    print(f"stopped {len(names)} processes: {', '.join(names)}" if names else "nothing running for this file")
    return 0
