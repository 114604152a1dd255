"""The model layer: config, our Llama forward, loading, tokenizer, reference attention.

Names are imported lazily so that `import pdd.model` (and `pdd.model.config`)
does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "config",
    "LlamaModel": "llama",
    "AttentionFn": "llama",
    "WeightLoadError": "llama",
    "ContiguousAttention": "reference",
    "generate_greedy": "reference",
    "ModelNotFoundError": "loader",
    "default_cache_dir": "loader",
    "find_embedded_gguf": "loader",
    "prepare_default_model": "loader",
    "resolve_model_path": "loader",
    "load_model": "loader",
    "read_model_config": "loader",
    "compute_model_id": "loader",
    "make_tiny_model": "loader",
    "Tokenizer": "tokenizer",
    "IncrementalDetokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'pdd.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
