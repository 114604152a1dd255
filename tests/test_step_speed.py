"""The bench's per-mode engine speed against the baseline's, shape for shape
(`pdd.measure.step_speed`): the same work compared, whatever else differs."""

from __future__ import annotations

import math

import pytest

from pdd.measure.metrics import Sla, summarize_mode
from pdd.measure.records import RequestRecord
from pdd.measure.report import render_markdown
from pdd.measure.step_speed import compare, shape_key, speed_rows, step_shapes


def step(role, cpu, wall, batch=1, ctx=(2000,), pre=0):
    return {"role": role, "cpu_s": cpu, "wall_s": wall, "batch_size": batch,
            "context_lens": list(ctx), "num_prefill_tokens": pre}


def test_shapes_group_the_same_work_and_leave_out_rld_and_mixed_decoder_steps():
    assert shape_key(step("decode", 1, 1, batch=2, ctx=(1000, 1100))) == ("decode", "b2c2")
    assert shape_key(step("main", 1, 1)) == ("decode", "b1c1")
    assert shape_key(step("relay", 1, 1)) is None                  # RLD: P's core, not the decoder's
    assert shape_key(step("main", 1, 1, pre=5)) is None            # an extend: not a plain decode
    assert shape_key(step("prefill", 1, 1, pre=55, ctx=(2455,))) == ("prefill", "b1t1c2")
    assert shape_key(step("prefill", 1, 1, pre=512, ctx=(1024,))) == ("prefill", "b1t16c1")
    shapes = step_shapes([step("decode", c, 2 * c) for c in (0.05, 0.07, 0.06)] + [step("decode", 0, 1)])
    assert shapes["decode"] == {"b1c1": [3, 0.06, 0.12]}           # medians; a zero CPU record dropped


def test_a_mode_whose_steps_all_ran_slower_reads_that_ratio_whatever_its_mix():
    base = step_shapes([step("main", 0.05, 0.05)] * 10 + [step("main", 0.10, 0.10, batch=4)] * 4)
    # 20% more CPU, 50% more wall for the same shapes, in another mix, and a shape base never ran
    other = step_shapes([step("main", 0.06, 0.075)] * 3 + [step("main", 0.12, 0.15, batch=4)] * 30
                        + [step("main", 9.0, 9.0, batch=7)] * 10)
    c = compare(base["decode"], other["decode"])
    assert math.isclose(c["cpu"], 1.2) and math.isclose(c["wall"], 1.5)
    assert c["shapes"] == 2 and c["steps"] == 33
    # too few steps of any common shape: no figure rather than a noisy one
    assert compare(base["decode"], step_shapes([step("main", 1, 1)] * 2)["decode"]) is None


def test_weights_favour_the_shapes_both_ran_often():
    base = step_shapes([step("decode", 1.0, 1.0)] * 100 + [step("decode", 1.0, 1.0, batch=2)] * 3)
    other = step_shapes([step("decode", 1.1, 1.1)] * 100 + [step("decode", 2.0, 2.0, batch=2)] * 3)
    c = compare(base["decode"], other["decode"])
    assert 1.1 < c["cpu"] < 1.13


def test_the_report_shows_each_mode_against_the_baseline():
    base = step_shapes([step("decode", 0.05, 0.05)] * 5 + [step("prefill", 0.2, 0.2, pre=55)] * 5)
    pdd = step_shapes([step("main", 0.055, 0.055)] * 5 + [step("prefill", 0.22, 0.264, pre=55)] * 5)
    summary = {"baseline": "pd-local", "modes": {
        "pd-local": {"step_shapes": base}, "pdd": {"step_shapes": pdd}, "broken": {"error": "x"}}}
    assert speed_rows(summary) == [["pdd", "+10% (5)", "+10% (5)", "+32% (5)"]]
    assert speed_rows({"baseline": "gone", "modes": summary["modes"]}) == []


@pytest.mark.parametrize("with_shapes", [True, False])
def test_the_markdown_report_has_the_section_only_with_step_records(with_shapes):
    shapes = step_shapes([step("decode", 0.05, 0.05)] * 5)
    recs = [RequestRecord(request_id="r", arrival_s=0.0, prompt_tokens=10, output_tokens=3, cached_tokens=0,
                          ttft_s=0.2, token_times_s=[0.2, 0.3, 0.4], e2e_s=0.4)]
    modes = {name: summarize_mode(recs, Sla(3.0, 0.25), 1.0, 1.0) for name in ("pd-local", "pdd")}
    if with_shapes:
        for v in modes.values():
            v["step_shapes"] = shapes
    text = render_markdown({"baseline": "pd-local", "modes": modes, "workload": {}, "sla": {}})
    assert ("## Engine steps against the baseline's" in text) == with_shapes
    if with_shapes:
        assert "| pdd | +0% (5) | - | - |" in text
