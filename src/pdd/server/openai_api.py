"""OpenAI-compatible request parsing and response shapes.

Parsing turns a client's JSON into (prompt ids, SamplingParams, stream
options) or raises ApiError with an OpenAI-style body and a 4xx status. Only
public fields are read: nothing a client sends can name an instance, a block
or a transfer parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdd.engine.request import SamplingParams


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    model: str


def _typed(body: dict, key: str, types, default, name: str | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(f"'{key}' must be {name or types}, got {v!r}", param=key)
    if not isinstance(v, types):
        raise ApiError(f"'{key}' must be {name or getattr(types, '__name__', types)}, got {v!r}", param=key)
    return v


def parse_request(body, chat: bool, tokenizer, served_model: str, max_model_len: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    model = _typed(body, "model", str, None, "a string")
    if model is None:
        raise ApiError("'model' is required", param="model")
    if model != served_model:
        raise ApiError(f"The model '{model}' does not exist; this server serves '{served_model}'",
                       status=404, param="model", code="model_not_found")
    if _typed(body, "n", int, 1) != 1:
        raise ApiError("only n=1 is supported", param="n")
    if body.get("echo") or body.get("logprobs") not in (None, False) or body.get("best_of") not in (None, 1):
        raise ApiError("echo, logprobs and best_of are not supported", param="logprobs")
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    if not prompt_ids:
        raise ApiError("the prompt is empty", param="messages" if chat else "prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, key, int, 16 if not chat else max(1, max_model_len - len(prompt_ids) - 1))
    if max_tokens < 1:
        raise ApiError(f"'{key}' must be at least 1, got {max_tokens}", param=key)
    if len(prompt_ids) >= max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(prompt_ids)} tokens", param="prompt", code="context_length_exceeded")
    max_tokens = min(max_tokens, max_model_len - len(prompt_ids) - 1) or 1
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4):
        raise ApiError("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    temperature = float(_typed(body, "temperature", (int, float), 1.0, "a number"))
    top_p = float(_typed(body, "top_p", (int, float), 1.0, "a number"))
    seed = _typed(body, "seed", int, None, "an integer")
    stream = _typed(body, "stream", bool, False, "a boolean")
    opts = _typed(body, "stream_options", dict, {}, "an object")
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                  stop=tuple(stop or ()), ignore_eos=bool(_typed(body, "ignore_eos", bool, False)))
    except ValueError as e:
        raise ApiError(str(e)) from None
    return ParsedRequest(chat, prompt_ids, sampling, stream, bool(opts.get("include_usage")), model)


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        return list(p)
    raise ApiError("'prompt' must be a string, a list of token ids, or a one-element list of either",
                   param="prompt")


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    clean = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise ApiError(f"messages[{k}] needs a valid 'role'", param="messages")
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(part.get("text", "") for part in c if isinstance(part, dict) and part.get("type") == "text")
        if not isinstance(c, str):
            raise ApiError(f"messages[{k}].content must be a string", param="messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return tokenizer.apply_chat_template(clean)


# -- responses -----------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(req_id: str, model: str, chat: bool, text: str | None, finish: str | None, first: bool = False) -> dict:
    if chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def full(req_id: str, model: str, chat: bool, text: str, finish: str, use: dict) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": use}


class StopTrimmer:
    """Streams text deltas, holding back just enough to cut at a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += delta
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.sent = self.text[self.sent:cut], cut
            return out
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out
