from pathlib import Path

import pytest

from pdd.sim.link import Link, cfs_weight


def drain(link, events):
    """Run a link's completion predictions to the end: flow id -> end time."""
    ends = {}
    nxt = events
    while nxt:
        t, v = nxt
        done, nxt = link.complete(t, v)
        for f in done:
            ends[f.flow_id] = t
    return ends


def test_two_equal_flows_share_fairly():
    link = Link("l", bandwidth_bytes_s=100.0, rtt_s=0.0)
    link.add(0.0, "a", 100)
    nxt = link.add(0.0, "b", 100)
    assert drain(link, nxt) == {"a": pytest.approx(2.0), "b": pytest.approx(2.0)}


def test_late_joiner_halves_the_rate_then_gets_it_all():
    link = Link("l", 100.0, 0.0)
    link.add(0.0, "a", 100)             # alone for 0.5 s: 50 bytes
    nxt = link.add(0.5, "b", 100)       # then 50 B/s each: a ends at 1.5, b has 50 left
    assert drain(link, nxt) == {"a": pytest.approx(1.5), "b": pytest.approx(2.0)}


def test_stale_prediction_is_ignored():
    link = Link("l", 100.0, 0.0)
    first = link.add(0.0, "a", 100)
    link.add(0.5, "b", 100)
    assert link.complete(*first) == ([], None)


def test_per_flow_cap():
    link = Link("l", 100.0, 0.0, max_flow_bytes_s=25.0)
    nxt = link.add(0.0, "a", 100)
    assert drain(link, nxt) == {"a": pytest.approx(4.0)}


def test_cancel_frees_the_share():
    link = Link("l", 100.0, 0.0)
    link.add(0.0, "a", 100)
    link.add(0.0, "b", 100)
    nxt = link.cancel(0.5, "b")         # a had 25 bytes done, 75 left at full rate
    assert drain(link, nxt) == {"a": pytest.approx(1.25)}
    assert link.bytes_delivered == 100


def test_remaining_estimate():
    link = Link("l", 100.0, 0.0)
    link.add(0.0, "a", 100)
    link.add(0.0, "b", 300)
    assert link.remaining_s("a", 0.0) == pytest.approx(2.0)


def test_shared_efficiency_costs_only_while_flows_share():
    """A CPU core time-sliced between two engines (seconds of work as bytes)
    keeps `shared_efficiency` of its capacity while both run, all of it alone."""
    core = Link("core1", 1.0, 0.0, shared_efficiency=0.8)
    assert drain(core, core.add(0.0, "alone", 1.0)) == {"alone": pytest.approx(1.0)}
    core.add(10.0, "a", 1.0)
    assert drain(core, core.add(10.0, "b", 1.0)) == {"a": pytest.approx(12.5), "b": pytest.approx(12.5)}
    # a alone for 0.5 s, then 0.4 each: a's last 0.5 takes 1.25 s; b then finishes alone.
    core.add(20.0, "a", 1.0)
    assert drain(core, core.add(20.5, "b", 1.0)) == {"a": pytest.approx(21.75), "b": pytest.approx(22.25)}
    with pytest.raises(ValueError, match="shared_efficiency"):
        Link("core2", 1.0, 0.0, shared_efficiency=0.0)


def test_a_niced_engine_gets_the_kernels_smaller_share_of_a_shared_core():
    """Weights split a shared core as CFS splits it by nice value: P (nice 0)
    and a relay decoder at nice 5 (weight 335 / 1024 in the kernel's table)."""
    assert cfs_weight(0) == 1.0 and cfs_weight(5) == pytest.approx(335 / 1024, rel=0.01)
    core = Link("core0", 1.0, 0.0)
    core.add(0.0, "p", 1.0)
    ends = drain(core, core.add(0.0, "rld", 1.0, weight=1 / 3))
    # p at 0.75 until it ends (1.333 s), rld at 0.25 meanwhile (0.333 done), then alone.
    assert ends == {"p": pytest.approx(4 / 3), "rld": pytest.approx(2.0)}
    # Equal weights: the even split, whatever the weight's scale.
    core.add(10.0, "a", 1.0, weight=3.0)
    assert drain(core, core.add(10.0, "b", 1.0, weight=3.0)) == {"a": pytest.approx(12.0), "b": pytest.approx(12.0)}
    # A capped flow keeps its cap; what it leaves goes to the others by weight.
    line = Link("l", 100.0, 0.0)
    line.add(0.0, "slow", 10, cap_bytes_s=10.0)
    line.add(0.0, "heavy", 90, weight=2.0)
    rates = line._rates()
    assert rates["slow"] == pytest.approx(10.0) and rates["heavy"] == pytest.approx(90.0)
    line.add(0.0, "light", 45, weight=1.0)
    rates = line._rates()
    assert rates["heavy"] == pytest.approx(60.0) and rates["light"] == pytest.approx(30.0)
    with pytest.raises(ValueError, match="weight"):
        core.add(20.0, "z", 1.0, weight=0.0)


def test_a_streamed_flow_that_yielded_catches_up_with_what_p_has_made():
    """P makes a 100-byte copy at 5 B/s (done at t=20) on a 10 B/s line; a
    50-byte foreground copy takes the line for the first 5 s. The real
    sender then sends every slice P has made meanwhile at the line's rate,
    levels with P at t=10 and ends with P at t=20 (held to 5 B/s after its
    yield, it would end at t=25)."""
    link = Link("wan", 10.0, 0.0)
    link.add(0.0, "fg", 50)
    nxt = link.add(0.0, "stream", 100, background=True, cap_bytes_s=5.0)
    ends = {}
    for _ in range(10):
        if nxt is None:
            break
        done, nxt = link.complete(nxt[0], nxt[1])
        for f in done:
            ends[f.flow_id] = f"{link._last_s:.6f}"
    assert ends == {"fg": "5.000000", "stream": "20.000000"}
    assert link.flows == {}


def test_p_s_reported_progress_moves_a_streamed_flow_s_envelope():
    """P was predicted to make 100 bytes at 5 B/s, but its first step made 60
    of them by t=4: the copy may carry them at once, not at the predicted pace."""
    link = Link("wan", 100.0, 0.0)
    link.add(0.0, "stream", 100, cap_bytes_s=5.0)
    nxt = link.progress(4.0, "stream", 60, cap_bytes_s=10.0)   # 20 crossed by now; 40 more made
    done, nxt = link.complete(*nxt)                            # levels with P at t=4 + 40/90
    assert not done
    assert link.flows["stream"].num_bytes - link.flows["stream"].remaining == pytest.approx(60 + 10 * 40 / 90)
    assert drain(link, nxt) == {"stream": pytest.approx(8.0)}  # then P's 10 B/s: the last 40 by t=8


def _run_background(link, adds):
    """Background flows added at their times (t, id, bytes), completions
    handled in time order: flow id -> end time."""
    ends, nxt, i = {}, None, 0
    while i < len(adds) or nxt:
        if i < len(adds) and (nxt is None or adds[i][0] <= nxt[0]):
            t, fid, size = adds[i]
            i += 1
            nxt = link.add(t, fid, size, background=True)
        else:
            done, nxt = link.complete(*nxt)
            ends.update({f.flow_id: link._last_s for f in done})
    return ends


def test_a_big_yielding_flow_is_not_starved_past_the_bound():
    # A 500-byte copy and a 100-byte one arriving every second: fewest bytes
    # left first alone keeps the big one waiting behind every small one.
    adds = [(0.0, "big", 500)] + [(float(k), f"s{k}", 100) for k in range(5)]
    srpt = _run_background(Link("l", 100.0, 0.0), adds)
    assert srpt["big"] == pytest.approx(10.0)
    assert [srpt[f"s{k}"] for k in range(5)] == pytest.approx([1, 2, 3, 4, 5])
    # With the bound (pdd.policy.line_order): at 2.5 s the big one has waited
    # long enough and goes first (s2 paused half-way); the small ones that
    # waited meanwhile follow, oldest first.
    bounded = _run_background(Link("l", 100.0, 0.0, max_yield_s=2.5), adds)
    assert bounded["big"] == pytest.approx(7.5)
    assert [bounded[f"s{k}"] for k in range(5)] == pytest.approx([1, 2, 8, 9, 10])


def test_a_new_transfer_waits_for_what_a_yielding_copy_has_on_the_line():
    # The relay's queue holds a copy's bytes that the sender's pause cannot
    # call back: a transfer a user waits on goes after them (buffer_bytes).
    def ends(buffer_bytes):
        link = Link("l", 100.0, 0.0, buffer_bytes=buffer_bytes)
        link.add(0.0, "copy", 200, background=True)
        done = {}
        nxt = link.add(1.0, "user", 50)              # the copy has 100 bytes left
        while nxt:
            flows, nxt2 = link.complete(*nxt)
            done.update({f.flow_id: nxt[0] for f in flows})
            nxt = nxt2
        return done
    assert ends(0.0) == {"user": pytest.approx(1.5), "copy": pytest.approx(2.5)}
    assert ends(30.0) == {"user": pytest.approx(1.8), "copy": pytest.approx(2.5)}
    # Never more than the copy has left.
    assert ends(1000.0) == {"copy": pytest.approx(2.0), "user": pytest.approx(2.5)}


def test_the_line_s_buffer_is_ahead_once_however_many_flows_fill_it():
    # The line's buffer is one (the relay's, as a router's), not one per
    # flow: two busy flows hold it together, so a new transfer waits behind
    # 30 bytes of it, not 60, then shares the line three ways.
    link = Link("l", 100.0, 0.0, buffer_bytes=30.0)
    link.add(0.0, "a", 1000)
    link.add(0.0, "b", 1000)
    nxt = link.add(1.0, "user", 30)                  # a and b have 950 bytes left each
    assert link.flows["a"].lead == pytest.approx(15.0) and link.flows["b"].lead == pytest.approx(15.0)
    done = drain(link, nxt)
    assert done["user"] == pytest.approx(1.0 + 30 / 100 + 30 / (100 / 3))
    # a yielding copy unpaced has its sockets' bytes ahead as well
    link = Link("l", 100.0, 0.0, buffer_bytes=30.0, yield_leak_bytes=20.0)
    link.add(0.0, "copy", 1000, background=True)
    link.add(1.0, "user", 30)
    assert link.flows["copy"].lead == pytest.approx(50.0)


def test_a_transfer_lets_the_copies_go_once_its_last_bytes_are_in_its_socket():
    # P's sender lets the yielding copies go again when a transfer's last
    # block is written (`LineShare.let_go`), not when it has crossed: the
    # bytes its socket still holds then share the line with the copy.
    def ends(release):
        link = Link("l", 100.0, 0.0, tail_release_bytes=release)
        link.add(0.0, "copy", 1000, background=True)
        return drain(link, link.add(1.0, "user", 200))     # the copy has 900 bytes left
    assert ends(0.0) == {"user": pytest.approx(3.0), "copy": pytest.approx(12.0)}
    # 150 alone (1.5 s), then the last 50 at half the line beside the copy (1 s)
    assert ends(50.0) == {"user": pytest.approx(3.5), "copy": pytest.approx(12.0)}
    # a paced copy resumes at its pace at most
    link = Link("l", 100.0, 0.0, tail_release_bytes=50.0, background_pace_bytes_s=20.0)
    link.add(0.0, "copy", 1000, background=True)
    done = drain(link, link.add(1.0, "user", 200))
    assert done["user"] == pytest.approx(1.0 + 1.5 + 50 / 80)
    with pytest.raises(ValueError):
        Link("l", 100.0, 0.0, tail_release_bytes=-1.0)


def test_a_paced_copy_goes_at_its_pace_and_leaves_nothing_ahead_of_a_new_transfer():
    # P's sender paces the copies that yield the line (`copy_pace`): alone,
    # a copy goes at the pace, not the line's rate; and since the line drains
    # faster than it is fed, a transfer a user waits on finds no buffered
    # bytes of it ahead (against test_a_new_transfer_waits_for_...: 1.8 s).
    link = Link("l", 100.0, 0.0, buffer_bytes=30.0, background_pace_bytes_s=80.0)
    link.add(0.0, "copy", 200, background=True)
    done = drain(link, link.add(1.0, "user", 50))    # the copy has 120 bytes left
    assert done == {"user": pytest.approx(1.5), "copy": pytest.approx(3.0)}
    # two paced copies together still go at the pace (one at a time)
    link = Link("l", 100.0, 0.0, background_pace_bytes_s=80.0)
    link.add(0.0, "a", 80, background=True)
    nxt = link.add(0.0, "b", 160, background=True)
    assert link.remaining_s("b", 0.0) == pytest.approx(3.0)      # behind a, both at the pace
    assert drain(link, nxt) == {"a": pytest.approx(1.0), "b": pytest.approx(3.0)}
    with pytest.raises(ValueError):
        Link("l", 100.0, 0.0, background_pace_bytes_s=0.0)


def test_a_flow_knows_whether_it_shared_the_line():
    link = Link("wan", 1e6, 0.0)
    link.add(0.0, "a", 1e6)
    done, _ = link.complete(1.0 + 1e-6, link.version)
    assert [f.flow_id for f in done] == ["a"] and not done[0].shared
    link.add(2.0, "b", 1e6)
    link.add(2.5, "c", 1e5)
    assert link.flows["b"].shared and link.flows["c"].shared


def test_the_copy_pace_is_the_lines_rate_shared_by_its_senders():
    from pdd.deploy.spec import load_spec
    from pdd.deploy.topology import copy_pace
    from pdd.policy.config import PolicyConfig
    from pdd.policy.line_order import copy_pace_bytes_s

    assert copy_pace_bytes_s(7.5e6, 1, 0.95) == pytest.approx(7.125e6)
    assert copy_pace_bytes_s(7.5e6, 2, 0.95) == pytest.approx(3.5625e6)
    assert copy_pace_bytes_s(7.5e6, 1, 0.0) is None          # off
    assert copy_pace_bytes_s(None, 1, 0.95) is None          # a line of unknown rate
    with pytest.raises(ValueError):
        PolicyConfig(copy_pace=1.5)
    # the servers' senders and the simulator read it off the deployment: 24 Mbit/s, one P
    examples = Path(__file__).resolve().parents[1] / "examples"
    assert copy_pace(load_spec(examples / "pdd.toml")) == {"wan": pytest.approx(0.95 * 3.0e6)}
    assert copy_pace(load_spec(examples / "pd-local.toml")) == {}
