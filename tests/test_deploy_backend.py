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


@pytest.mark.parametrize("name", ["colocated-cpu.toml", "pd-local-cpu.toml", "pd-wan-cpu.toml", "pd-wan-drc-cpu.toml",
                                  "pdd-cpu.toml", "gpu-fleet.toml"])
def test_the_vllm_examples_load_without_vllm(name):
    spec = load_spec(EXAMPLES / "vllm" / name)
    assert spec.backend == Backend.VLLM
    assert all(i.engine.block_size % 16 == 0 for i in spec.instances)
    assert "vllm" not in sys.modules


def test_the_vllm_cross_dc_baselines_differ_only_in_drc():
    naive, drc = (load_spec(EXAMPLES / "vllm" / n) for n in ("pd-wan-cpu.toml", "pd-wan-drc-cpu.toml"))
    assert (naive.policy["enable_drc"], drc.policy["enable_drc"]) == (False, True)
    assert [(i.name, i.role, i.datacenter) for i in naive.instances] == \
        [(i.name, i.role, i.datacenter) for i in drc.instances]


def test_the_embedded_examples_keep_our_engine():
    for path in EXAMPLES.glob("*.toml"):
        assert load_spec(path).backend == Backend.PDD, path


def test_vllm_arguments_size_the_pool_from_the_engine_table_without_vllm(tmp_path):
    from pdd.engine.config import EngineConfig
    from pdd.model.config import ModelConfig
    from pdd.vllm.args import engine_kwargs

    mc = ModelConfig(model_id="m", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0,
                     eos_token_ids=(1,))
    kw = engine_kwargs(tmp_path, EngineConfig(block_size=32, num_blocks=64, num_threads=1), mc)
    # one more block than asked: vLLM keeps block 0 as its null block
    assert kw["num_gpu_blocks_override"] == 65
    assert kw["kv_cache_memory_bytes"] == 65 * 32 * mc.kv_bytes_per_token(4)
    assert kw["max_model_len"] == 64 * 32          # the pool, not the model's 4096, bounds a request
    assert kw["block_size"] == 32 and kw["enforce_eager"] and kw["enable_prefix_caching"]
    assert "vllm" not in sys.modules
