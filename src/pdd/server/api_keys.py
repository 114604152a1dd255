"""Client API keys of the router, as vLLM's `--api-key`.

Keys come from three places, all read once at the entry point (`pdd serve
--router`): repeated or comma-separated `--api-key` flags, the PDD_API_KEY
variable (comma-separated), and the deployment file's `[router]
api_keys_file` (one key a line) or `api_key_env` (a variable's name). With
no key configured the API is open, as before; with any, every path but
/health and /metrics wants `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Iterable, Mapping

from pdd.deploy.spec import DeploymentSpec, SpecError

ENV_VAR = "PDD_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})


def split_keys(values: Iterable[str]) -> list[str]:
    """Comma- or newline-separated keys; blanks and `#` comment lines dropped."""
    out = []
    for v in values:
        for line in v.replace(",", "\n").splitlines():
            k = line.strip()
            if k and not k.startswith("#"):
                out.append(k)
    return out


def collect_api_keys(spec: DeploymentSpec, flags: Iterable[str], environ: Mapping[str, str]) -> frozenset[str]:
    keys = split_keys(flags) + split_keys([environ.get(ENV_VAR, "")])
    if spec.router_api_key_env:
        keys += split_keys([environ.get(spec.router_api_key_env, "")])
    if spec.router_api_keys_file is not None:
        try:
            keys += split_keys([Path(spec.router_api_keys_file).read_text()])
        except OSError as e:
            raise SpecError(f"router.api_keys_file: cannot read {spec.router_api_keys_file}: {e}") from None
    bad = [k for k in keys if any(c.isspace() for c in k) or not k.isprintable()]
    if bad:
        raise SpecError("API keys must be printable and without spaces")
    return frozenset(keys)


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def allows(self, path: str, authorization: str | None) -> bool:
        if not self._keys or path in OPEN_PATHS:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = token.strip().encode("utf-8", "surrogateescape")
        # compare against every key, always: the time taken says nothing of which matched
        return sum(hmac.compare_digest(presented, k) for k in self._keys) > 0
