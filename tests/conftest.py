"""Shared fixtures: a tiny random Llama (fast) and the real SmolLM2 (slow, loaded once)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir():
    from pdd.model.loader import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir):
    from pdd.model.loader import prepare_default_model

    return prepare_default_model(cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """A 2-layer random Llama with SmolLM2's tokenizer (so it can serve text)."""
    from pdd.model.loader import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0, tokenizer_from=smollm2_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from pdd.model.loader import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from pdd.model.loader import load_model

    return load_model(smollm2_dir)
