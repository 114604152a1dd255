"""A calibration's per-step factors (`pdd.sim.calibration`): how a step's
measured time compares with its role's fitted one, pooled into an
instance's speed, a factor per row class (a role's, and a prefill
instance's own over its role's), and a decoder's lone-chunk factor.

Every function takes the steps `calibration._alone_speeds` marks as having
had their core alone, each with "fitted_s" by its role's model."""

from __future__ import annotations

from pdd.sim.cost_model import row_bucket


def _weight(r: dict, fitted_s: float) -> float:
    """What a step's measured / fitted ratio weighs in a speed factor.

    A decoder's step weighs the tokens it makes (TPOT is a per-token mean);
    a prefill step its fitted seconds, so the factor is total measured over
    total fitted time, the long chunks that make the cold TTFTs counting for
    what they take. Equal weights had let the many short warm-turn chunks,
    which run 0-40% over the fit while a prompt's KV is sent on the same
    core, set P's speed for its 512-token chunks, which ran 5-25% under it:
    the replay's cold turns came out 9-16% slow.
    """
    if r["group"] == "prefill":
        return fitted_s
    return float(max(r["num_decode_tokens"], 1))


def _rows(r: dict) -> int:
    return int(r["num_prefill_tokens"]) + int(r["num_decode_tokens"])


def _row_factor(r: dict, rows: dict[tuple[str, int], tuple[float, ...]]) -> float:
    """The row factor of a step's row class under its role fit (1.0 without one)."""
    return _class_factor(rows.get((r["group"], r["threads"]), ()), r)


def _class_factor(rf: tuple[float, ...], r: dict) -> float:
    """The factor of a step's row class in `rf` (1.0 past its end)."""
    k = row_bucket(_rows(r))
    return rf[k - 1] if k <= len(rf) else 1.0


def _instance_speeds(alone: list[dict], rows: dict) -> dict[str, float]:
    """Per instance: measured / (fitted x row factor) over its own steps."""
    own: dict[str, list[tuple[float, float]]] = {}
    for r in alone:
        own.setdefault(r["instance"], []).append(
            (r["wall_s"] / (r["fitted_s"] * _row_factor(r, rows)), _weight(r, r["fitted_s"])))
    return {i: _speed_factor(v) for i, v in sorted(own.items()) if len(v) >= 10}


# A row class needs this many steps for a factor of its own; the factor
# is pulled towards 1 as if ROW_PRIOR more steps had measured 1.
MIN_ROW_STEPS = 20
ROW_PRIOR = 10


def _row_factors(alone: list[dict], speeds: dict[str, float]) -> dict[tuple[str, int], tuple[float, ...]]:
    """Per (role group, threads): mean measured / (fitted x instance speed)
    of its steps, by row class (`row_bucket` of the step's tokens).

    The roofline's time is smooth in the rows a step multiplies; the
    engine's is not. Its linear layers take W @ x^T up to 5 rows and x @ W^T
    above, and MKL's kernels differ by shape: measured here, batch-2 decode
    steps run 8-17% under the smooth fit and batch-5 ones 7-20% over it,
    in every run; a decoder that sits at one batch size for a while (MD at
    7-8) was off by as much. Chunks differ too: on the colocated engine a
    warm turn's ~80-token chunk with six decodes ran 4-10% over the fit,
    a 512-token chunk 2-8% under it.
    """
    by: dict[tuple[str, int], dict[int, list[tuple[float, float]]]] = {}
    for r in alone:
        speed = speeds.get(r["instance"], 1.0)
        by.setdefault((r["group"], r["threads"]), {}).setdefault(row_bucket(_rows(r)), []).append(
            (r["wall_s"] / (r["fitted_s"] * speed), 1.0))
    return {key: row for key, classes in by.items() if (row := _class_factors(classes))}


def _class_factors(classes: dict[int, list[tuple[float, float]]]) -> tuple[float, ...]:
    """Factors by row class from each class's measured / fitted pairs: 1.0 for
    a class of fewer than MIN_ROW_STEPS steps, else its speed factor pulled
    towards 1 as if ROW_PRIOR more steps had measured 1; () with none."""
    enough = [k for k, v in classes.items() if len(v) >= MIN_ROW_STEPS]
    if not enough:
        return ()
    row = []
    for k in range(1, max(enough) + 1):
        v = classes.get(k, [])
        if len(v) < MIN_ROW_STEPS:
            row.append(1.0)
            continue
        row.append(round((len(v) * _speed_factor(v) + ROW_PRIOR) / (len(v) + ROW_PRIOR), 4))
    return tuple(row)


def _instance_row_factors(alone: list[dict], speeds: dict[str, float],
                          rows: dict[tuple[str, int], tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
    """Per prefill instance: mean measured / (fitted x its speed x its role's
    row factor) of its own steps, by row class (classes of fewer than
    MIN_ROW_STEPS steps, and the pull towards 1, as `_row_factors`).

    The role's factors pool its instances; one instance's small steps can
    run slower than the pool's for reasons of its deployment, not of the
    shapes: P's 17-64-token warm-turn chunks in `wan-bound-59` took 108 ms
    (median) in PDD against 98 ms in pd-local, with the same CPU time
    (97 / 94 ms): P's core also carries RLD's process (and P's sender's
    copies), and a step's wall lost 14 ms to them against 6 ms. Its speed
    factor, weighted by fitted time, is the 512-token chunks'; replayed
    with it alone, those short chunks, the median request's first token
    in PDD, came out ~10 ms short.
    """
    by: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in alone:
        if r["group"] != "prefill":
            continue        # a decoder's classes are its batch sizes, where its role's factors held (TPOT within 5%)
        speed = speeds.get(r["instance"], 1.0)
        by.setdefault(r["instance"], {}).setdefault(row_bucket(_rows(r)), []).append(
            (r["wall_s"] / (r["fitted_s"] * speed * _row_factor(r, rows)), 1.0))
    return {inst: row for inst, classes in sorted(by.items()) if (row := _class_factors(classes))}


def _own_row_factor(r: dict, own: dict[str, tuple[float, ...]]) -> float:
    """A step's factor of its row class on its own instance (1.0 without one)."""
    return _class_factor(own.get(r["instance"], ()), r)


# The lone-chunk factor needs this many such steps (pooled over a role
# group's instances); it is pulled towards 1 as the row factors are.
MIN_LONE_STEPS = 5


def _lone_chunk(r: dict) -> bool:
    """A decoder's step that decodes nothing."""
    return r["group"] == "decode" and not int(r["num_decode_tokens"]) and int(r["num_prefill_tokens"]) > 0


def _lone_chunk_factors(alone: list[dict], speeds: dict[str, float],
                        rows: dict[tuple[str, int], tuple[float, ...]]) -> dict[tuple[str, int], float]:
    """Per decoder group and threads: measured / (fitted x instance speed x
    row factor) of its steps that decode nothing (prefill tokens only).

    Such a step is a sequence's first on the decoder (the partial block it
    recomputes with its first token, after an idle spell) or an extend with
    nothing else to run. Its row class holds mostly decode steps of as many
    rows, so the row factors miss it: measured here 1.3-1.5x the fit on every
    decoder (MD, D and RLD, `results/wan-bound-42`, `heldout-agentic-29s1`),
    against 1.00-1.01 for the same chunks beside decodes. On RLD it is the
    relayed user's first gap after P's token.
    """
    by: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in alone:
        if not _lone_chunk(r):
            continue
        speed = speeds.get(r["instance"], 1.0)
        by.setdefault((r["group"], r["threads"]), []).append(
            (r["wall_s"] / (r["fitted_s"] * speed * _row_factor(r, rows)), 1.0))
    return {key: round((len(v) * _speed_factor(v) + ROW_PRIOR) / (len(v) + ROW_PRIOR), 4)
            for key, v in by.items() if len(v) >= MIN_LONE_STEPS}


def _speed_factor(pairs: list[tuple[float, float]]) -> float:
    """Weighted mean of measured / fitted, steps over 3x the median left out.

    The mean, not the median: TPOT is a mean over tokens, and the simulator
    draws each step from a mean-1 jitter. On this machine a decoder's mean
    ratio is 1-4% above its median (a slow step is slower by more than a
    fast one is faster), which a median factor had left out of every TPOT.
    Steps over 3x the median (a first step, a foreign process's burst) are
    not what the instance's speed is.
    """
    med = _weighted_median(pairs)
    kept = [(r, w) for r, w in pairs if r <= 3 * med]
    return sum(r * w for r, w in kept) / sum(w for _, w in kept)


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    pairs = sorted(pairs)
    half, acc = sum(w for _, w in pairs) / 2, 0.0
    for value, w in pairs:
        acc += w
        if acc >= half:
            return value
    return pairs[-1][0]
