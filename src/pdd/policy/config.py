"""Every threshold of the policy in one frozen dataclass, checked once.

Built at the entry point (router config, simulator TOML) and passed down;
nothing below reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum


class HandoffOverride(Enum):
    AUTO = "auto"            # choose per handoff from RLD's live load
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"
    OVERLAP = "overlap"      # RLD not paused; MD takes over once its tokens pass RLD's
    PACED = "paced"          # RLD not paused; its tokens slowed until MD's catch them up


@dataclass(frozen=True)
class PolicyConfig:
    # --- pipeline choice -------------------------------------------------
    # DIRECT (P->MD) when MD is estimated to hold the prompt KV within this
    # many seconds of prefill: a relay would emit at most a handful of tokens.
    direct_max_wan_s: float = 0.5
    # ... and also when RLD would not have the whole prompt KV at least this
    # much sooner than MD has what it lacks (needs the local link estimate):
    # a high-hit follow-up's few new blocks cross the WAN about as fast as the
    # whole prompt reaches RLD, and a relay would only add RLD's work.
    relay_min_gain_s: float = 0.25
    # A DIRECT request's first token goes to the user as soon as P has it
    # (P sits beside the router) when MD is expected to hold the KV within
    # this many seconds of it (a relay's, when RLD is: its local copy,
    # `PipelineDecision.rld_wait_s`): the user then waits that long for the second
    # token instead of for the first, as after an RLD's eager token. Longer
    # expected waits keep the first token for MD, so that TTFT still shows
    # them. 0 (default): always MD's, as the PD baselines (SGLang's and
    # vLLM's disaggregated serving stream from the decoder only) and the
    # simulator's PD modes, which share this policy, do.
    first_token_max_stall_s: float = 0.0
    enable_drc: bool = True           # MD keeps a prefix cache (decode-side RadixCache)
    md_reachable: bool = True         # operator switch: False forces RELAY_ONLY ("wan down")

    # A KV receiver answers HAVE only after a sibling transfer that is
    # bringing it at least this fraction of the blocks it lacks has ended, so
    # that two turns of one conversation do not send the same context over a
    # slow WAN twice (0 disables the wait).
    sibling_wait_min_fraction: float = 0.5
    # A copy that yields the line (`copy_yields_line`) goes ahead of every
    # younger yielding copy once it has waited this long since it started
    # (`line_order`; TOML `inf`: never, fewest bytes left first always).
    # Off by default: on a line offered about what it carries every copy
    # ages and the order turns first-come-first-served; in the simulator
    # (results/cal-bf16-12 profile) 20 s moved PDD's TTFT p90 from 4.9 to
    # 53 s at 30 Mbit/s (p99 84 -> 80 s) and from 114 to 147 s at twice P's
    # capacity (docs/DESIGN.md, known limits).
    copy_max_yield_s: float = math.inf
    # P's senders pace the copies that yield the line at this fraction of
    # its rate (`line_order.copy_pace_bytes_s`; 0: as fast as TCP takes
    # them). Unpaced, a yielding copy keeps the buffers ahead of the line
    # full (the line's and the sockets': ~1-2 MB, 0.13-0.27 s at 60 Mbit/s
    # with the relay's buffer per connection before session 27), and a warm turn's HAVE handshake and its few blocks wait
    # behind them (`results/wan-bound-22`: handshakes 0.17 s median, up to
    # 0.32, on a shared line against 0.046 alone). Session 23: still 0.17 s
    # at 0.95 on the agentic shape while three cold turns' copies crossed,
    # 0.05 s at 0.8 (README, "What session 23 found"): the emulated line
    # carries 97% of its nominal rate, so a burst ahead of a 0.95 pace drains
    # slowly; 0.8 makes those copies 16% slower: on the WAN-bound preset
    # (results/wan-bound-43p) the p99 of the cold turns waiting for them rose
    # from 22.6 to 28.6 s, where the handshakes were not inflated at 0.95.
    copy_pace: float = 0.95
    # P's copy of a relayed prompt to RLD streams while P computes it (True)
    # or leaves once the prefill has ended (False). Where RLD shares P's CPU
    # core (examples/pdd.toml) a streamed copy's sending and RLD's import
    # ran beside every chunk of the prompt: relayed cold prompts took 1.41x
    # pd-local's prefill time for the same requests (median of 7,
    # results/wan-bound-43p), 1.01x with the copy after the prefill
    # (results/s23-exp-local-after), whose ~0.1 s on the local link then
    # delays RLD's first token less than a slower prefill did (its first gap
    # 0.085 s median against 0.22). Where RLD has a machine of its own,
    # streaming lets it start sooner.
    stream_relay_copy: bool = False

    # --- routing score: saved prefill tokens - load penalty (in tokens) ---
    # One running request costs roughly a decode slot; a queued one delays
    # this request by a whole prefill, so it weighs far more.
    penalty_tokens_per_running: float = 256.0
    penalty_tokens_per_waiting: float = 4096.0
    penalty_tokens_kv_full: float = 2048.0   # scaled by the instance's KV used fraction

    # --- abnormal-traffic filter ----------------------------------------
    enable_filter: bool = True
    # Abnormal when RLD's whole output, stretched by this factor, still ends
    # before the WAN copy lands (>= 1: only clear cases skip the WAN).
    filter_margin: float = 1.25
    # ... and only for the report's class of abnormal traffic: an input at
    # least this many times longer than the output bound (agentic turns read
    # thousands of tokens and answer tens to hundreds: ratios of 10-100; a
    # classify-this-document call answers a handful of tokens) ...
    filter_min_io_ratio: float = 100.0
    # ... whose input is mostly new to P: a request P holds more than this
    # fraction of continues a conversation, and MD must learn what P knows
    # (DRC) or every later turn of it lacks more and is filtered again.
    filter_max_prefix_hit: float = 0.5
    # ... while RLD-only requests (filtered or cancelled) stay at most this
    # share of recent requests: the small relay pool is sized to hide
    # latency, not to decode a class of traffic to the end.
    relay_only_max_share: float = 0.05
    relay_only_window: int = 200      # recent requests the shares are counted over
    # Relays (and RLD-only requests) stop while RLD's expected share of the
    # recent output tokens would pass this: the pool is sized to hide
    # transfers, a small part of the decoding (the report's RLD emits 6.2%);
    # past it, low-hit requests wait for their WAN copy on MD (DIRECT).
    relay_max_token_share: float = 0.1
    # ... except at the start: an empty history proves no overuse, and a run
    # opens with sessions that are all cold, the requests relays exist for.
    # The token budget lends this many requests' worth of output to RLD,
    # repaid over the next loan / relay_max_token_share decisions. None: the
    # relay pool's batch slots (what it can serve at once: a burst of cold
    # turns that size is what the pool is there to absorb).
    relay_startup_loan: float | None = None
    rld_tpot_prior_s: float = 0.05    # RLD step time before it has reported one
    # A cancelled/skipped transfer's shared prefix is warmed on MD later only
    # when P has seen it reused by at least this many other requests.
    warm_min_prefix_reuses: int = 2

    # --- handoff ---------------------------------------------------------
    handoff_mode: HandoffOverride = HandoffOverride.AUTO
    catchup_threshold_tokens: int = 64
    catchup_final_max_tokens: int = 8
    # Send the final batch just after RLD's next token reaches the router, not
    # whenever MD gets ready: RLD then pauses with a whole inter-token gap
    # ahead, and the user's stall is MD's extend alone, not also the part of
    # RLD's gap that had already passed (on average half an ITL).
    handoff_on_rld_token: bool = True
    catchup_max_batches: int = 4      # non-final batches before forcing the final one
    rld_busy_fraction: float = 0.75
    # Overlap handoff (`pdd.policy.handoff`, HandoffMode.OVERLAP): when MD's
    # decode step is at most this fraction of RLD's pace (the gap between the
    # request's own last tokens from RLD; its reported step before there are any),
    # the final batch goes with no pause: RLD keeps streaming while MD
    # extends, and the user's stream moves to MD once MD's tokens overtake
    # RLD's. 0 turns it off (the paused handoff only).
    overlap_max_step_ratio: float = 0.67
    # MD's first token of its own waits for RLD's token of the same index (so
    # the switch lands just after one of RLD's tokens, not a round trip and
    # an extend after one), unless MD is this many tokens ahead: RLD is late.
    overlap_max_ahead: int = 3
    # MD still behind after RLD made this many tokens past the final batch:
    # RLD pauses and MD's own tokens catch up (the paused handoff's stall).
    overlap_max_lag: int = 8
    # The paced handoff (`HandoffMode.PACED`, and catch-up's final batch):
    # where MD is not clearly faster than RLD, the final batch still leaves
    # RLD streaming, and RLD's tokens reach the user at least this many of
    # MD's decode steps apart until MD's own tokens (a round trip and an
    # extend behind RLD's) catch the user's stream up. The switch then costs
    # no stall: the user's gaps grow to at most this ratio of MD's step for
    # a few tokens, instead of one gap of a round trip and two MD steps
    # (2.5-4x MD's gap at a 45 ms round trip, `wan-bound-59-96`). Above 1
    # (MD gains ratio - 1 of its step a token); 0: the final batch pauses RLD.
    # Since session 35 the most the gap is stretched: it is MD's pace plus
    # MD's lag spread over what is left of overlap_max_lag tokens, at least
    # a quarter of the ratio's stretch (docs/DESIGN.md, "The paced handoff").
    handoff_pace_ratio: float = 1.5
    # RLD's tokens go to MD as they come while the prompt's KV crosses
    # (`ExtendAhead`): MD computes them with the prompt's tail in its first
    # step after the landing and races RLD from there at once, where the
    # handoff's first batch waited for MD's kv_ready to reach the router and
    # the batch to come back, then for a step of its own after the tail's
    # (`results/wan-bound-66`, s0000-t00: MD's first token 0.33 s after its
    # KV landed). Applies with handoff_mode "auto", "overlap" or "paced".
    extend_ahead: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.handoff_mode, str):
            object.__setattr__(self, "handoff_mode", HandoffOverride(self.handoff_mode))
        if self.direct_max_wan_s < 0:
            raise ValueError("direct_max_wan_s must be >= 0")
        if not 0.0 <= self.sibling_wait_min_fraction <= 1.0:
            raise ValueError("sibling_wait_min_fraction must be in [0, 1]")
        if self.relay_min_gain_s < 0:
            raise ValueError("relay_min_gain_s must be >= 0")
        if self.first_token_max_stall_s < 0:
            raise ValueError("first_token_max_stall_s must be >= 0")
        if not self.copy_max_yield_s > 0:
            raise ValueError("copy_max_yield_s must be > 0")
        if not 0.0 <= self.copy_pace <= 1.0:
            raise ValueError("copy_pace must be in [0, 1]")
        if not isinstance(self.stream_relay_copy, bool):
            raise ValueError("stream_relay_copy must be true or false")
        for name in ("penalty_tokens_per_running", "penalty_tokens_per_waiting",
                     "penalty_tokens_kv_full"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.filter_margin < 1.0:
            raise ValueError("filter_margin must be >= 1.0 (RLD must clearly finish first)")
        if self.filter_min_io_ratio < 0:
            raise ValueError("filter_min_io_ratio must be >= 0")
        if not 0.0 <= self.filter_max_prefix_hit <= 1.0:
            raise ValueError("filter_max_prefix_hit must be in [0, 1]")
        if not 0.0 <= self.relay_only_max_share <= 1.0:
            raise ValueError("relay_only_max_share must be in [0, 1]")
        if not 0.0 <= self.relay_max_token_share <= 1.0:
            raise ValueError("relay_max_token_share must be in [0, 1]")
        if self.relay_startup_loan is not None and self.relay_startup_loan < 0:
            raise ValueError("relay_startup_loan must be >= 0")
        if self.relay_only_window < 1:
            raise ValueError("relay_only_window must be >= 1")
        if self.rld_tpot_prior_s <= 0:
            raise ValueError("rld_tpot_prior_s must be > 0")
        if self.warm_min_prefix_reuses < 0:
            raise ValueError("warm_min_prefix_reuses must be >= 0")
        if self.catchup_final_max_tokens < 0:
            raise ValueError("catchup_final_max_tokens must be >= 0")
        if self.catchup_threshold_tokens < self.catchup_final_max_tokens:
            raise ValueError("catchup_threshold_tokens must be >= catchup_final_max_tokens")
        if self.catchup_max_batches < 1:
            raise ValueError("catchup_max_batches must be >= 1")
        if not 0.0 < self.rld_busy_fraction <= 1.0:
            raise ValueError("rld_busy_fraction must be in (0, 1]")
        if not 0.0 <= self.overlap_max_step_ratio <= 1.0:
            raise ValueError("overlap_max_step_ratio must be in [0, 1]")
        if self.overlap_max_ahead < 1 or self.overlap_max_lag < 1:
            raise ValueError("overlap_max_ahead and overlap_max_lag must be >= 1")
        if self.handoff_pace_ratio != 0 and not self.handoff_pace_ratio > 1:
            raise ValueError("handoff_pace_ratio must be 0 (off) or > 1")

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyConfig":
        """From a TOML table; unknown keys are an error, not a silent no-op."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown policy keys: {sorted(unknown)}")
        return cls(**d)
