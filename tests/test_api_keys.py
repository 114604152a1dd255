"""Client API keys on the router, as vLLM's --api-key: with keys configured
(deployment file, PDD_API_KEY, a named variable, --api-key), /v1/* wants a
Bearer key and answers 401 OpenAI-style JSON without one; /health and
/metrics stay open. Checked with the official openai client over a real
deployment; with no key configured the API is open (every other test)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

import openai
import pytest

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment
from pdd.deploy.spec import SpecError, load_spec
from pdd.server.api_keys import ApiKeys, collect_api_keys


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "keys.txt").write_text("# client keys\nk-file-1\n\nk-file-2\n")
    path = d / "colocated.toml"
    path.write_text(deployment_toml("colocated", tiny_model_dir))
    saved = {k: os.environ.get(k) for k in ("PDD_API_KEY", "H1_TEST_KEYS")}
    os.environ["PDD_API_KEY"] = "k-env-a,k-env-b"     # the launcher hands its environment to the router
    os.environ["H1_TEST_KEYS"] = "k-named"
    try:
        dep = Deployment.start(path, overrides={"router": {"api_keys_file": "keys.txt", "api_key_env": "H1_TEST_KEYS"}},
                               run_dir=d / "run", timeout_s=180)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield dep
    dep.stop()


def _get(url: str, headers=None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if raw.startswith("{") else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_wrong_or_missing_key_is_refused_with_openai_401(keyed):
    for key in ("wrong", "k-file-1x", "unused"):
        client = openai.OpenAI(base_url=keyed.router_url, api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    for headers in ({}, {"Authorization": "Basic k-file-1"}, {"Authorization": "Bearer"},
                    {"Authorization": "k-file-1"}):
        code, body = _get(keyed.router_url + "/models", headers)
        assert code == 401 and body["error"]["type"] == "invalid_request_error", (headers, body)
    code, body = _get(keyed.router_url + "/requests/x/trace")
    assert code == 401
    code, body = _get(keyed.router_url.removesuffix("/v1") + "/elsewhere")    # unknown paths too
    assert code == 401


def test_every_configured_key_is_accepted(keyed):
    for key in ("k-file-1", "k-file-2", "k-env-a", "k-env-b", "k-named"):
        client = openai.OpenAI(base_url=keyed.router_url, api_key=key, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3, key


def test_health_and_metrics_stay_open(keyed):
    base = keyed.router_url.removesuffix("/v1")
    code, body = _get(base + "/health")
    assert code == 200 and body["status"] == "ok"
    code, text = _get(base + "/metrics")
    assert code == 200 and "pdd_router_requests_total" in text


def test_keys_from_every_source_and_flag_parsing(tmp_path):
    from pdd.server.cli import add_arguments

    (tmp_path / "k").write_text("f1\n# not a key\nf2, f3\n")
    (tmp_path / "d.toml").write_text(
        '[router]\napi_keys_file = "k"\napi_key_env = "MY_KEYS"\n'
        '[[instances]]\nname = "c0"\nrole = "colocated"\nport = 9001\nkv_port = 9002\n')
    spec = load_spec(tmp_path / "d.toml")
    assert spec.router_api_keys_file == tmp_path / "k"          # relative to the deployment file
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-c", "x", "--router", "--secret-file", "s", "--api-key", "a", "--api-key", "b,c"])
    keys = collect_api_keys(spec, args.api_key, {"PDD_API_KEY": "e1,e2", "MY_KEYS": "m"})
    assert keys == {"a", "b", "c", "e1", "e2", "m", "f1", "f2", "f3"}
    assert collect_api_keys(spec, [], {}) == {"f1", "f2", "f3"}         # the named variable unset: no keys from it
    with pytest.raises(SpecError, match="api_keys_file"):
        collect_api_keys(load_spec(tmp_path / "d.toml", {"router": {"api_keys_file": "missing"}}), [], {})
    with pytest.raises(SpecError, match="printable"):
        collect_api_keys(spec, ["bad\x00key"], {})
    open_api = ApiKeys()
    assert open_api.allows("/v1/completions", None)                 # no key configured: open
    k = ApiKeys({"s3cret"})
    assert k.allows("/health", None) and k.allows("/metrics", None)
    assert k.allows("/v1/models", "Bearer s3cret") and k.allows("/v1/models", "bearer  s3cret")
    assert not k.allows("/v1/models", "Bearer s3cre") and not k.allows("/v1/models", "Bearer \udcff")
