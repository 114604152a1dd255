"""A runtime deployment file (`pdd.deploy.spec`) as a simulator mode.

What the file says is taken as is: every instance with its role, datacenter,
engine settings (block size, KV blocks, batch slots, token budget, threads),
core pinning and price; the links' bandwidth, latency, jitter and price; the
[policy] table. What the file leaves to the machine is filled in:

* hardware: this CPU (`cpu` profile, one chip per engine thread), its
  roofline coefficients fitted to measured engine steps when a calibration
  is given (`pdd.sim.calibration`; the instance role's own fit where it has
  one), else the profile's prior; with a calibration, each step's time is
  drawn about the fit with the scatter measured steps showed (`step_jitter`,
  seeded by `seed`): on a closed-loop workload one request more or less
  caught behind a cold prefill moves the median, so the simulator's answer
  is a spread over seeds, as a real run is one draw;
* model: the embedded SmolLM2-135M (or the local HF folder the file names,
  read from its config.json), KV in the engine's dtype;
* links inside a datacenter: the same-host path or loopback TCP (~500 MB/s, ~0.1 ms each way);
  the WAN: the emulated line, with jitter folded into its latency (a long
  transfer's packets are delivered in order, so it waits on the later ones);
  optionally (`measured_wan_rate`, off by default) one WAN transfer is
  capped at the KV rate P measured in the bench run (metrics/*.prom): the
  sender, receiver and relay share the two cores with the engines, and a
  200 Mbit/s line carried ~10-13 MB/s per transfer in our runs;
  the server's KV receiver answers HAVE and puts arriving blocks into its
  pool under the engine's pool lock, during a step, so the KV is usable when
  its last byte lands; only the decode call's submit waits for the step
  under way (`import_wait="submit"`; "batch": one import command per step
  boundary, as the server did before the pool lock; "block": one block per
  step; "none"); P streams each block as soon as its chunk is computed
  (`stream_kv`; off: it sends after the prefill, as the server did before;
  `manifest_after_step`: only after its next step, as it did before that);
* serving overheads around the engines (`ServingOverheads`): the router's
  own latency, each streamed token's trip to the user, prefix-match round
  trips in PDD, and instances pinned to one core sharing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdd.deploy.spec import DeploymentSpec, Role as DeployRole
from pdd.engine.config import DTYPE_BYTES
from pdd.policy import PolicyConfig, Role
from pdd.sim.model_shape import ModelShape, get_model
from pdd.sim.scenario import LinkSpec, ModeSpec, PoolSpec, ServingOverheads
from pdd.wan.pipe import queue_limit_bytes

DEFAULT_MODELS = {"default", "smollm2", ""}


@dataclass(frozen=True)
class RuntimeOptions:
    """The machine-dependent constants of a runtime deployment (CLI-tunable)."""

    # A datacenter's local link, ~500 MB/s. Through the loopback socket a
    # relayed 40-57 MB prompt reached RLD in 0.16-0.65 s on the core P and RLD
    # share (the replay of `results/wan-bound-44` read PDD's TTFT p90 19% short
    # at this rate; 4% short at 1 Gbit/s); through the same-host path
    # (`transport.shm`, since session 24) in 0.025-0.10 s, and the replay of
    # `-46` reads the p90 2% short at this rate, 4% at 8 Gbit/s.
    loopback_gbps: float = 4.0
    loopback_one_way_ms: float = 0.1
    request_s: float = 0.010            # router: parse, tokenize, open the streams
    token_s: float = 0.003              # instance NDJSON -> router SSE -> client, per token
    manifest_after_step: bool = False   # P reads the KV manifest only after its next step (the server did until it read it at once)
    import_wait: str = "submit"         # none | submit (as the server: only the decode submit waits a step) | batch | block
    stream_kv: bool = True              # P streams blocks as it computes them (the server today; False: as before)
    stream_kv_layers: bool = True       # ... a chunk's KV layer by layer (the server today; False: block by block)
    measured_wan_rate: bool = False     # cap one WAN transfer at the KV rate P measured (tried, off: see docs/SIMULATOR.md)
    step_jitter: bool = True            # draw step times about the fit with the calibration's measured scatter
    line_buffer: bool = True            # bytes already handed to the line go before a new transfer (sim.link)
    # What a yielding copy's sender still has in its socket buffers when it
    # pauses (loopback autotunes them to megabytes): `python -m pdd.wan.probe
    # --wan-mbps 60 --latency-ms 20 --jitter-ms 5` (2026-12-06, the AMD EPYC,
    # the line's buffer shared) measured 1.46-2.49 MB of a copy crossing
    # ahead of a transfer that started behind it (median 1.98 MB over 12
    # trials), of which 3/4 of the line's 0.56 MB buffer: 1.56 MB. (With a
    # buffer per connection, 2026-12-05: median 2.05 MB, 1.00 MB beyond it.)
    sender_socket_bytes: float = 1.56e6
    seed: int = 0                       # of that jitter


def model_shape(spec: DeploymentSpec) -> ModelShape:
    """The model the deployment serves, in the engine's KV dtype."""
    dtype = DTYPE_BYTES[spec.instances[0].engine.dtype]
    if spec.model.strip().lower() in DEFAULT_MODELS:
        base = get_model("smollm2-135m")
        kv = base.kv_bytes_per_token * dtype // 4
        return get_model("smollm2-135m", weight_bytes_per_param=float(dtype), kv_bytes_per_token=kv)
    return shape_from_config(Path(spec.model) / "config.json", dtype)


def calibration_model(preset: str, steps_paths: list[Path]) -> ModelShape:
    """The model a calibration fits: the preset, and for the embedded model in
    the dtype its runs served (the deploy.toml saved beside each steps.jsonl),
    so a bf16 run is fitted with half the weight and KV bytes."""
    base = get_model(preset)
    if preset != "smollm2-135m":
        return base
    from pdd.deploy.spec import load_spec

    dtypes = set()
    for p in steps_paths:
        files = sorted(p.rglob("deploy.toml")) if p.is_dir() else [p.parent / "deploy.toml"]
        dtypes |= {load_spec(f).instances[0].engine.dtype for f in files if f.is_file()}
    if len(dtypes) > 1:
        raise ValueError(f"runs of different engine dtypes cannot share one calibration: {sorted(dtypes)}")
    n = DTYPE_BYTES[dtypes.pop()] if dtypes else 4
    return get_model(preset, weight_bytes_per_param=float(n), kv_bytes_per_token=base.kv_bytes_per_token * n // 4)


def shape_from_config(path: Path, dtype_bytes: int = 4) -> ModelShape:
    """ModelShape of a dense Llama-style HF config.json."""
    c = json.loads(Path(path).read_text())
    h, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads", heads))
    hd = int(c.get("head_dim") or h // heads)
    inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    per_layer = h * heads * hd * 2 + h * kv_heads * hd * 2 + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
    params = float(layers * per_layer + embed + h)
    return ModelShape(Path(path).parent.name or "hf-model", layers, heads, hd, h, params, params,
                      float(dtype_bytes), 2 * layers * kv_heads * hd * dtype_bytes)


def mode_from_spec(spec: DeploymentSpec, name: str | None = None,
                   calibration=None, opts: RuntimeOptions = RuntimeOptions(),
                   run: str | None = None) -> ModeSpec:
    """One ModeSpec: a pool of one per instance.

    `calibration` (a `pdd.sim.calibration.CpuCalibration` or None) gives the
    roofline coefficients per engine thread count and, for a replayed bench
    mode (`run`), how much that run's machine was slowed by other processes.
    """
    pools = []
    for inst in spec.instances:
        e = inst.engine
        coef = {}
        if calibration is not None:
            coef = dict(calibration.coefficients(e.num_threads, inst.role.value),
                        time_scale=calibration.time_scale(run, inst.name))
            f = calibration.fit_for(e.num_threads, inst.role.value)
            if f is not None:
                coef["row_factors"] = calibration.row_factors(e.num_threads, inst.role.value, run, inst.name)
                coef["lone_chunk_factor"] = f.lone_chunk
                if opts.step_jitter:
                    coef["step_jitter"] = f.jitter
        pools.append(PoolSpec(
            role=Role(inst.role.value), hardware="cpu", chips=e.num_threads, count=1,
            datacenter=inst.datacenter, max_batch=e.max_num_seqs,
            token_budget=e.max_num_batched_tokens, prefix_cache=e.enable_prefix_cache,
            name=inst.name, kv_blocks=e.num_blocks, price_per_hour=inst.cost_per_hour,
            core=inst.cpu, nice=inst.nice, chunk_packing="short_first",
            step_overhead_tokens=e.step_overhead_tokens, **coef))
    block_sizes = {i.engine.block_size for i in spec.instances}
    if len(block_sizes) != 1:
        raise ValueError(f"{spec.name}: instances disagree on engine.block_size {sorted(block_sizes)}")
    rdma = LinkSpec(gbps=opts.loopback_gbps, rtt_ms=2 * opts.loopback_one_way_ms)
    wan = None
    if spec.links:
        if len(spec.links) > 1:
            raise ValueError(f"{spec.name}: the simulator models one WAN line, the file has "
                             f"{len(spec.links)}")
        link = spec.links[0]
        line = link.bandwidth_mbps / 1e3
        measured = calibration.transfer_bytes_s("wan", run) if calibration is not None else None
        cap = None
        if measured is not None and opts.measured_wan_rate:
            cap = min(measured * 8 / 1e9, line)
        # The line's buffer (the relay's, one per direction, shared by every
        # connection) holds between half and all of its limit while senders
        # outrun the line: on average 3/4 of it is ahead of a transfer that
        # starts meanwhile (`LinkSpec.buffer_bytes`). A copy that yields
        # unpaced still has what its sockets hold ahead (`sender_socket_bytes`).
        limit = queue_limit_bytes(line * 1e9 / 8, link.latency_ms / 1e3, link.jitter_ms / 1e3)
        on = opts.line_buffer
        wan = LinkSpec(gbps=line, rtt_ms=line_rtt_ms(link), max_flow_gbps=cap,
                       price_per_hour=link.cost_per_hour, buffer_bytes=0.75 * limit if on else 0.0,
                       yield_leak_bytes=opts.sender_socket_bytes if on else 0.0,
                       tail_release_bytes=opts.sender_socket_bytes if on else 0.0,
                       handshake_queue_bytes=calibration.handshake_queue_bytes("wan", run)
                       if calibration is not None and on else 0.0)
    roles = {i.role for i in spec.instances}
    match = DeployRole.MAIN in roles or (DeployRole.COLOCATED in roles and len(spec.instances) > 1)
    serving = ServingOverheads(spec.router_datacenter, opts.request_s, opts.token_s, match,
                               manifest_after_step=opts.manifest_after_step,
                               import_wait=opts.import_wait, stream_kv=opts.stream_kv,
                               stream_kv_layers=opts.stream_kv_layers)
    return ModeSpec(name or spec.name, tuple(pools), PolicyConfig.from_dict(spec.policy), rdma,
                    wan, serving, seed=opts.seed,
                    core_sharing=calibration.core_sharing if calibration is not None else 1.0)


def line_rtt_ms(link) -> float:
    """The simulated round trip of a deployment's `[[links]]` line: both ways'
    latency and one jitter (the relay delays each way by latency +- jitter)."""
    return 2 * link.latency_ms + link.jitter_ms


def block_size(spec: DeploymentSpec) -> int:
    return spec.instances[0].engine.block_size
