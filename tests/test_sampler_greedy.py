"""The greedy pick (`sampler.greedy`: numpy's argmax over fp32, bf16 and fp16 upcast) against torch.max's indices."""

import torch

from pdd.engine.sampler import greedy


def test_greedy_matches_torch_max_on_ties_nans_and_infinities():
    torch.manual_seed(0)
    x = torch.randn(16, 4096)
    x[1, 10] = x[1, 20] = x[1].max() + 1        # a tie: the first wins
    x[2, 5] = float("nan")                       # NaN counts as the maximum, the first one
    x[2, 9] = float("nan")
    x[3] = float("-inf")
    x[4, 7] = float("inf")
    x[5, :] = 0.0
    x[5, 3] = -0.0
    assert greedy(x) == x.max(dim=-1).indices.tolist()
    assert greedy(x)[1:3] == [10, 5]
    for low in (torch.bfloat16, torch.float16):   # upcast to fp32 first: exact, so the same picks
        assert greedy(x.to(low)) == x.to(low).max(dim=-1).indices.tolist()
    assert greedy(x[:, ::2]) == x[:, ::2].max(dim=-1).indices.tolist()   # strided rows
