"""The `pdd` command line.

Each subcommand lives in its own module, which exposes
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their command runs, so `pdd --help` stays fast and torch is loaded only
by the commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "model": ("pdd.model.cli", "prepare or inspect models (GGUF -> safetensors cache)"),
    "demo": ("pdd.demo", "run the local demo deployment and print its numbers"),
    "bench": ("pdd.bench.cli", "benchmarks: `bench engine`, or deployments side by side"),
    "up": ("pdd.deploy.cli_up", "start a deployment from a TOML file"),
    "down": ("pdd.deploy.cli_down", "stop a deployment started by `pdd up`"),
    "serve": ("pdd.server.cli", "run one instance (used by `pdd up`)"),
    "wan": ("pdd.wan.cli", "run the WAN emulator relay on its own"),
    "sim": ("pdd.sim.cli", "cluster simulator"),
    "plan": ("pdd.sim.plan_cli", "capacity planner"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
