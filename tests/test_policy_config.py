import pytest

from pdd.policy import HandoffOverride, PolicyConfig


def test_defaults():
    cfg = PolicyConfig()
    assert cfg.catchup_threshold_tokens == 64
    assert cfg.catchup_final_max_tokens == 8
    assert cfg.rld_busy_fraction == 0.75
    assert cfg.handoff_mode is HandoffOverride.AUTO


def test_string_handoff_mode_is_coerced():
    assert PolicyConfig(handoff_mode="catch_up").handoff_mode is HandoffOverride.CATCH_UP
    with pytest.raises(ValueError):
        PolicyConfig(handoff_mode="sometimes")


@pytest.mark.parametrize("kw", [
    {"direct_max_wan_s": -1}, {"filter_margin": 0.9}, {"rld_busy_fraction": 0.0},
    {"rld_busy_fraction": 1.5}, {"catchup_final_max_tokens": 100},
    {"catchup_max_batches": 0}, {"penalty_tokens_per_waiting": -1}, {"rld_tpot_prior_s": 0},
])
def test_invalid_values_are_refused(kw):
    with pytest.raises(ValueError):
        PolicyConfig(**kw)


def test_from_dict_refuses_unknown_keys():
    assert PolicyConfig.from_dict({"enable_drc": False}).enable_drc is False
    with pytest.raises(ValueError, match="unknown"):
        PolicyConfig.from_dict({"enable_dcr": False})


def test_stream_relay_copy_is_a_bool_off_by_default():
    from pdd.policy import PolicyConfig

    assert PolicyConfig().stream_relay_copy is False
    assert PolicyConfig.from_dict({"stream_relay_copy": True}).stream_relay_copy is True
    with pytest.raises(ValueError, match="stream_relay_copy"):
        PolicyConfig.from_dict({"stream_relay_copy": "yes"})
