"""The demo's closing sentences follow its numbers."""

from pdd.demo import explain


def mode(p50, p90, share=0.0):
    return {"ttft_s": {"p50": p50, "p90": p90}, "rld_token_share": share}


def test_explain_names_the_gain_and_relay_share():
    text = explain({"modes": {"pd-local": mode(0.9, 9.0), "pd-wan-drc": mode(1.1, 16.0),
                              "pdd": mode(1.0, 10.0, 0.05)}})
    assert "38% lower than" in text and "(16.0 s)" in text and "9.0 s" in text and "5.0%" in text


def test_explain_says_when_pdd_does_not_help_or_a_mode_failed():
    same = explain({"modes": {"pd-local": mode(1, 9), "pd-wan-drc": mode(1, 10), "pdd": mode(1, 10.1)}})
    assert "about the same as" in same
    worse = explain({"modes": {"pd-local": mode(1, 9), "pd-wan-drc": mode(1, 10), "pdd": mode(1, 12)}})
    assert "20% higher than" in worse
    assert "no comparison" in explain({"modes": {"pd-local": mode(1, 9), "pdd": {"error": "x"}}})


def test_explain_names_first_tokens_sent_from_p_and_their_cost():
    pdd = mode(0.15, 1.7, 0.05) | {"num_first_from_p": 40, "first_gap_ratio_p50": 1.8}
    text = explain({"modes": {"pd-local": mode(0.14, 1.4), "pd-wan-drc": mode(0.24, 6.5), "pdd": pdd}})
    assert "40 first tokens from the prefill side" in text and "1.8x the usual gap" in text
    assert "first tokens from the prefill side" not in explain({"modes": {"pd-local": mode(1, 9), "pd-wan-drc": mode(1, 10),
                                                         "pdd": mode(1, 10)}})
