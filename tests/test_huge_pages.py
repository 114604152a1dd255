"""The packed weights on 2 MB pages (pdd.model.huge_pages): the chunk arithmetic
and the refusals with a fake system call, then the real thing on SmolLM2 where
the kernel offers it: the same numbers after, and the pages really huge."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pdd.model.huge_pages import HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, chunks_of, collapse, thp_mode

MB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pdd.toml"


class FakeMadvise:
    """Records calls; answers MADV_COLLAPSE with `errors[chunk]` (0 where absent)."""

    def __init__(self, errors: dict[int, int] | None = None):
        self.calls: list[tuple[int, int, int]] = []
        self.errors = errors or {}

    def __call__(self, addr: int, length: int, advice: int) -> int:
        self.calls.append((addr, length, advice))
        return self.errors.get(addr, 0) if advice == MADV_COLLAPSE else 0


def test_chunks_cover_every_byte_once():
    base = 100 * HUGE_PAGE
    # one span inside a chunk, one across two, one ending exactly on a boundary, and an empty one
    spans = [(base + 10, 100), (base + HUGE_PAGE - 5, 10), (base + 3 * HUGE_PAGE, HUGE_PAGE), (base + 9 * HUGE_PAGE, 0)]
    assert chunks_of(spans) == [base, base + HUGE_PAGE, base + 3 * HUGE_PAGE]


def test_collapse_marks_then_collapses_each_chunk_and_counts_the_weights_bytes():
    base = 7 * HUGE_PAGE
    spans = [(base + MB, 3 * MB), (base + 5 * MB, MB)]          # chunks 0, 1 and 2 of `base`
    fake = FakeMadvise()
    r = collapse(spans, madvise=fake)
    chunks = [base, base + HUGE_PAGE, base + 2 * HUGE_PAGE]
    assert fake.calls == [c for a in chunks for c in ((a, HUGE_PAGE, MADV_HUGEPAGE), (a, HUGE_PAGE, MADV_COLLAPSE))]
    assert (r.weight_bytes, r.huge_bytes, r.chunks, r.collapsed, r.reason) == (4 * MB, 4 * MB, 3, 3, "")
    assert "4 of 4 MB" in r.line()


def test_a_chunk_the_kernel_refuses_stays_and_is_not_counted():
    base = 3 * HUGE_PAGE
    spans = [(base, 2 * HUGE_PAGE)]
    r = collapse(spans, madvise=FakeMadvise({base + HUGE_PAGE: errno.ENOMEM}))
    assert (r.chunks, r.collapsed, r.huge_bytes, r.weight_bytes, r.reason) == (2, 1, HUGE_PAGE, 2 * HUGE_PAGE, "")


def test_a_kernel_without_the_advice_is_asked_once_and_named():
    base = 3 * HUGE_PAGE
    fake = FakeMadvise({base + i * HUGE_PAGE: errno.EINVAL for i in range(4)})
    r = collapse([(base, 4 * HUGE_PAGE)], madvise=fake)
    assert [c for c in fake.calls if c[2] == MADV_COLLAPSE] == [(base, HUGE_PAGE, MADV_COLLAPSE)]
    assert (r.collapsed, r.huge_bytes) == (0, 0)
    assert "EINVAL" in r.reason and "4 KB pages" in r.line()


def test_every_chunk_refused_for_want_of_memory_says_so():
    base = 3 * HUGE_PAGE
    r = collapse([(base, 2 * HUGE_PAGE)], madvise=FakeMadvise({base: errno.EAGAIN, base + HUGE_PAGE: errno.EAGAIN}))
    assert r.collapsed == 0 and "EAGAIN" in r.reason


def test_engine_config_takes_the_switch_as_a_bool_only():
    from pdd.engine.config import EngineConfig

    assert EngineConfig().huge_pages is True and EngineConfig(huge_pages=False).huge_pages is False
    with pytest.raises(ValueError, match="engine.huge_pages must be true or false"):
        EngineConfig(huge_pages="yes")


def test_a_deployment_file_sets_it_per_engine_and_refuses_a_non_bool(tmp_path):
    from pdd.deploy.spec import SpecError, load_spec

    text = EXAMPLE.read_text()
    (tmp_path / "off.toml").write_text(text.replace("[engine]\n", "[engine]\nhuge_pages = false\n", 1))
    assert all(not i.engine.huge_pages for i in load_spec(tmp_path / "off.toml").instances)
    assert all(i.engine.huge_pages for i in load_spec(EXAMPLE).instances)
    (tmp_path / "bad.toml").write_text(text.replace("[engine]\n", "[engine]\nhuge_pages = 1\n", 1))
    with pytest.raises(SpecError, match="huge_pages"):
        load_spec(tmp_path / "bad.toml")


def _anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_smollm2_packed_weights_on_huge_pages_compute_the_same_bits(smollm2_dir):
    """A fresh bf16 SmolLM2: logits and an engine's greedy tokens before and after the
    collapse are equal, and the process then holds the weights on 2 MB pages."""
    import torch

    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.engine.request import EngineRequest, SamplingParams
    from pdd.model.loader import load_model

    if thp_mode() in ("", "never"):
        pytest.skip(f"transparent huge pages unavailable here (mode {thp_mode()!r})")
    model, mcfg = load_model(smollm2_dir, torch.bfloat16)
    hidden = torch.randn(16, mcfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def greedy(huge: bool) -> list[list[int]]:
        cfg = EngineConfig(num_blocks=64, dtype="bfloat16", huge_pages=huge)
        eng = Engine(model, mcfg, cfg)
        for i in range(8):
            eng.submit(EngineRequest(f"r{i}", [1 + i, 500 + 7 * i, 42, 9000 + i], SamplingParams(max_tokens=6)))
        out = {}
        for _ in range(40):
            for e in eng.step():
                if e.token_id is not None:
                    out.setdefault(e.request_id, []).append(e.token_id)
            if not eng.has_work:
                break
        return [out[f"r{i}"] for i in range(8)]

    before_logits, before_tokens = model.compute_logits(hidden), greedy(False)
    assert model.huge_pages is None
    before_kb = _anon_huge_kb()
    report = model.weights_on_huge_pages()
    after_kb = _anon_huge_kb()
    if report.reason.startswith("MADV_COLLAPSE refused"):
        pytest.skip(f"this kernel does not collapse: {report.reason}")
    tokens = greedy(True)                    # the engine asks again: the same report, no second collapse
    assert model.huge_pages is report
    assert tokens == before_tokens
    assert torch.equal(model.compute_logits(hidden), before_logits)
    assert report.collapsed >= 0.9 * report.chunks and report.huge_bytes >= 0.9 * report.weight_bytes
    assert report.weight_bytes >= 250e6                 # SmolLM2's packed bf16 weights
    assert after_kb - before_kb >= 0.9 * report.huge_bytes / 1024
    model.pack()                                        # new copies: not on huge pages until asked again
    assert model.huge_pages is None
