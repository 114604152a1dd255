import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_fixtures import default_model_path, our_logits

from pdd.model.loader import (
    MARKER,
    ModelNotFoundError,
    build_folder_atomically,
    compute_model_id,
    default_cache_dir,
    find_embedded_gguf,
    load_model,
    make_tiny_model,
    prepare_default_model,
    resolve_model_path,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PDD_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDD_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "pdd"


def test_find_embedded_gguf():
    p = find_embedded_gguf()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.stat().st_size > 50_000_000


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_path(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path)
    tiny = make_tiny_model(tmp_path / "tiny")
    assert resolve_model_path(str(tiny), tmp_path) == tiny


def test_default_model_prepared_idempotent_and_stale_tmp_harmless():
    path = default_model_path()  # converted by `make model` (or here, once)
    assert (path / MARKER).is_file() and (path / "chat_template.jinja").is_file()
    stale = path.parent / f".{path.name}.tmp-stale-test"
    stale.mkdir(exist_ok=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    try:
        t0 = time.perf_counter()
        assert prepare_default_model(path.parent.parent) == path
        for spec in (None, "default", "smollm2", "SmolLM2"):
            assert resolve_model_path(spec, path.parent.parent) == path
        assert time.perf_counter() - t0 < 1.0
    finally:
        import shutil

        shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------------- atomic build
def _slow_build(tmp: Path, counter: str) -> dict:
    with open(counter, "a") as f:
        f.write("x")
    time.sleep(0.5)
    (tmp / "data").write_text("ok")
    return {"n": 1}


def _worker(target: str, counter: str) -> None:
    build_folder_atomically(Path(target), lambda tmp: _slow_build(tmp, counter))


def test_build_folder_atomically_stale_failure_and_concurrency(tmp_path):
    target = tmp_path / "models" / "m"
    target.parent.mkdir()
    stale = target.parent / ".m.tmp-dead"
    stale.mkdir()
    (stale / "junk").write_text("interrupted")

    def boom(tmp):
        (tmp / "partial").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_folder_atomically(target, boom)
    assert not target.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock"]  # stale and failed tmp gone

    counter = tmp_path / "counter"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(str(target), str(counter))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert counter.read_text() == "x"  # built exactly once
    assert (target / "data").read_text() == "ok"
    assert json.loads((target / MARKER).read_text())["n"] == 1
    t0 = time.perf_counter()
    assert build_folder_atomically(target, lambda tmp: pytest.fail("rebuilt")) == target
    assert time.perf_counter() - t0 < 0.1


# ---------------------------------------------------------------------- model id, shards, cli
def test_model_id_sidecar_and_change(tmp_path):
    p = make_tiny_model(tmp_path / "t", seed=1)
    mid = compute_model_id(p)
    side = json.loads((p / ".pdd-model-id").read_text())
    assert side["model_id"] == mid and mid.startswith("sha256-")
    assert compute_model_id(p) == mid
    make_tiny_model(tmp_path / "t", seed=2)  # overwrite the weights
    assert compute_model_id(p) != mid


def test_sharded_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    p = make_tiny_model(tmp_path / "one", seed=4, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    m1, _ = load_model(p)
    m2, _ = load_model(sharded)
    ids = list(range(1, 30))
    assert torch.equal(our_logits(m1, ids), our_logits(m2, ids))


def test_cli_info_on_local_folder(tmp_path):
    p = make_tiny_model(tmp_path / "t")
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "model", "info", "--model", str(p)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["num_layers"] == 2 and info["kv_bytes_per_token_fp32"] == 2 * 2 * 2 * 16 * 4
    bad = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "model", "info", "--model", str(tmp_path / "missing")],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert bad.returncode == 1 and "never downloads" in bad.stderr


# ---------------------------------------------------------------------- the real conversion
_PREPARE = (
    "import sys; from pathlib import Path; from pdd.model.loader import prepare_default_model; "
    "print(prepare_default_model(Path(sys.argv[1])))"
)


@pytest.mark.slow
def test_real_conversion_concurrent_with_stale_tmp(tmp_path):
    """Two processes convert the GGUF into a fresh cache holding a stale temp dir: one converts
    (~30 s), the other waits on the lock and reuses the result."""
    models = tmp_path / "models"
    models.mkdir()
    stale = models / ".smollm2-135m-instruct.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _PREPARE, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    target = models / "smollm2-135m-instruct"
    assert [o.strip() for o, _ in outs] == [str(target)] * 2
    assert not stale.exists()
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", MARKER} <= names
    assert sorted(p.name for p in models.iterdir()) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]
    # identical to the default cache's conversion (deterministic dequantisation)
    ref = default_model_path()
    assert compute_model_id(target) == compute_model_id(ref)


def test_tiny_model_with_smollm2_tokenizer(tmp_path):
    from pdd.model.reference import generate_greedy
    from pdd.model.tokenizer import Tokenizer

    src = default_model_path()
    p = make_tiny_model(tmp_path / "t", tokenizer_from=src)
    model, cfg = load_model(p)
    assert cfg.vocab_size == 49152 and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    tok = Tokenizer(p)
    assert tok.chat_template and tok.eos_token_ids == (2,)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    out = generate_greedy(model, ids, 8, eos_token_ids=cfg.eos_token_ids)
    assert 1 <= len(out) <= 8 and isinstance(tok.decode(out), str)
