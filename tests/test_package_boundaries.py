"""The simulator and the benchmark share `pdd.measure`, not each other.

Each check imports every module of one package in a fresh interpreter and
looks at what came along with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_with(package: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True,
                         check=True, timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package, kept_out", [
    ("pdd.sim", ("pdd.bench",)),
    ("pdd.measure", ("pdd.bench", "pdd.sim", "pdd.server", "aiohttp", "torch")),
])
def test_package_does_not_pull_in(package, kept_out):
    mods = loaded_with(package)
    assert package + ".metrics" in mods or package + ".cluster" in mods     # the walk ran
    leaked = sorted(m for m in mods if m in kept_out or m.startswith(tuple(k + "." for k in kept_out)))
    assert not leaked, f"{package} imports {leaked[:5]}"
