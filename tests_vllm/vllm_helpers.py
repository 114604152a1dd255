"""What the vLLM suite's deployment tests share: the engine table and a greedy completion."""

from __future__ import annotations

VLLM_ENGINE = {"backend": "vllm", "block_size": 32, "num_blocks": 512, "max_num_seqs": 16,
               "max_num_batched_tokens": 512}


def complete(client, model, prompt, n, stream=False):
    """A greedy completion with the official client (streamed: the chunks, usage included)."""
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw)
    return list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
