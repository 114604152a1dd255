"""The engine backend of a deployment: `[engine] backend`, one per deployment.

These tests never import vLLM: choosing it is a matter of the file only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdd.deploy.spec import Backend, SpecError, load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _pd(engine: dict | None = None, p_engine: dict | None = None, d_engine: dict | None = None) -> dict:
    doc = {"name": "t", "tls": {"mode": "off"}, "instances": [
        {"name": "p0", "role": "prefill", "port": 9201, "kv_port": 9301},
        {"name": "d0", "role": "decode", "port": 9202, "kv_port": 9302},
    ]}
    if engine is not None:
        doc["engine"] = engine
    if p_engine is not None:
        doc["instances"][0]["engine"] = p_engine
    if d_engine is not None:
        doc["instances"][1]["engine"] = d_engine
    return doc


def test_default_backend_is_ours():
    spec = parse_spec(_pd())
    assert spec.backend == Backend.PDD
    assert {i.backend for i in spec.instances} == {Backend.PDD}


def test_engine_table_chooses_vllm_for_every_instance_and_keeps_the_settings():
    spec = parse_spec(_pd({"backend": "vllm", "block_size": 64, "max_num_seqs": 8}, d_engine={"num_threads": 2}))
    assert spec.backend == Backend.VLLM
    assert [i.backend for i in spec.instances] == [Backend.VLLM, Backend.VLLM]
    assert [i.engine.block_size for i in spec.instances] == [64, 64]
    assert [i.engine.num_threads for i in spec.instances] == [1, 2]
    assert spec.instances[0].engine.max_num_seqs == 8


def test_every_instance_may_name_the_same_backend_itself():
    spec = parse_spec(_pd(p_engine={"backend": "vllm"}, d_engine={"backend": "vllm"}))
    assert spec.backend == Backend.VLLM


def test_a_deployment_that_mixes_backends_is_refused_naming_both():
    with pytest.raises(SpecError) as e:
        parse_spec(_pd({"backend": "vllm"}, p_engine={"backend": "pdd"}))
    msg = str(e.value)
    assert "one engine backend" in msg and "pdd: p0" in msg and "vllm: d0" in msg


def test_an_unknown_backend_names_the_field_and_the_choices():
    with pytest.raises(SpecError, match=r"instances\[1\]\.engine\.backend must be one of \['pdd', 'vllm'\]"):
        parse_spec(_pd(d_engine={"backend": "sglang"}))
    with pytest.raises(SpecError, match=r"^engine\.backend must be one of"):
        parse_spec(_pd({"backend": 3}))


def test_a_backend_outside_the_engine_table_is_an_unknown_field():
    doc = _pd()
    doc["instances"][0]["backend"] = "vllm"
    with pytest.raises(SpecError, match=r"instances\[0\]: unknown field"):
        parse_spec(doc)


def test_instances_must_share_one_block_size():
    with pytest.raises(SpecError, match="same engine.block_size"):
        parse_spec(_pd(p_engine={"block_size": 32}, d_engine={"block_size": 64}))


@pytest.mark.parametrize("name", ["colocated-cpu.toml", "pd-local-cpu.toml", "pdd-cpu.toml", "gpu-fleet.toml"])
def test_the_vllm_examples_load_without_vllm(name):
    spec = load_spec(EXAMPLES / "vllm" / name)
    assert spec.backend == Backend.VLLM
    assert all(i.engine.block_size % 16 == 0 for i in spec.instances)
    assert "vllm" not in sys.modules


def test_the_embedded_examples_keep_our_engine():
    for path in EXAMPLES.glob("*.toml"):
        assert load_spec(path).backend == Backend.PDD, path
