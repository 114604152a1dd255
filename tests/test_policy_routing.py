import pytest

from pdd.policy import InstanceView, PolicyConfig, Role, pick_instance, score_instance

CFG = PolicyConfig()


def inst(iid, running=0, waiting=0, free=100, total=100, role=Role.PREFILL):
    return InstanceView(iid, role, "dc-a", running, waiting, 8, free, total)


def test_longest_prefix_wins_when_loads_are_equal():
    cands = [inst("p0"), inst("p1"), inst("p2")]
    assert pick_instance(cands, {"p1": 40_000, "p2": 10_000}, 50_000, 0.0, CFG) == "p1"


def test_load_outweighs_a_small_prefix():
    cands = [inst("p0", running=4, waiting=3), inst("p1")]
    # p0 saves 1,000 tokens but holds 3 queued prefills; p1 is idle.
    assert pick_instance(cands, {"p0": 1_000}, 50_000, 0.0, CFG) == "p1"


def test_a_large_prefix_outweighs_some_load():
    cands = [inst("p0", running=4, waiting=1), inst("p1")]
    assert pick_instance(cands, {"p0": 45_000}, 50_000, 0.0, CFG) == "p0"


def test_saved_tokens_capped_at_prompt_length():
    a = score_instance(inst("p0"), 10**9, 100, CFG)
    b = score_instance(inst("p0"), 100, 100, CFG)
    assert a == b


def test_tie_breaks_on_smallest_id_regardless_of_order():
    cands = [inst("p2"), inst("p10"), inst("p1")]
    assert pick_instance(cands, {}, 10, 0.0, CFG) == "p1"
    assert pick_instance(list(reversed(cands)), {}, 10, 0.0, CFG) == "p1"


def test_kv_pressure_is_penalised():
    cands = [inst("p0", free=5), inst("p1", free=90)]
    assert pick_instance(cands, {}, 10, 0.0, CFG) == "p1"


def test_empty_pool_is_an_error():
    with pytest.raises(ValueError):
        pick_instance([], {}, 10, 0.0, CFG)


def test_instance_view_validates():
    with pytest.raises(ValueError):
        InstanceView("x", Role.MAIN, "dc", -1, 0, 8, 1, 1)
    with pytest.raises(ValueError):
        InstanceView("x", Role.MAIN, "dc", 0, 0, 8, 2, 1)
