"""OpenAI-compatible request parsing and response shapes.

Parsing turns a client's JSON into (prompt ids, SamplingParams, stream
options) or raises ApiError with an OpenAI-style body and a 4xx status. Only
public fields are read: nothing a client sends can name an instance, a block
or a transfer parameter.
"""

from __future__ import annotations

import json
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
    return_token_ids: bool = False   # vLLM's extension: each choice lists its tokens' ids


# JSON deeper than this is refused before any field is read: no request of
# the API needs more than 4 levels (chat content parts), and json's C decoder
# recurses, so 1,000 levels would otherwise end in a RecursionError.
MAX_BODY_DEPTH = 32


def decode_body(raw: bytes) -> object:
    """Raw request bytes -> a JSON value, or ApiError (400) for anything the
    parser or tokenizer would choke on later: invalid UTF-8, NaN/Infinity,
    nesting past MAX_BODY_DEPTH, strings with lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(f"request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    except ValueError as e:   # JSONDecodeError, or a NaN / Infinity literal
        raise ApiError(f"request body is not valid JSON: {e}") from None
    _check_values(body)
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_values(body: object) -> None:
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_BODY_DEPTH:
            raise ApiError(f"request body nests deeper than {MAX_BODY_DEPTH} levels")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k)
                stack.append((x, depth + 1))
        else:
            stack.extend((x, depth + 1) for x in v)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:   # "\ud800": valid JSON, not text any tokenizer can take
        raise ApiError(f"request body holds a string that is not valid Unicode ({e.reason} "
                       f"at position {e.start})") from None


def _typed(body: dict, key: str, types, default, name: str | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(f"'{key}' must be {name or types}, got {v!r}", param=key)
    if not isinstance(v, types):
        raise ApiError(f"'{key}' must be {name or getattr(types, '__name__', types)}, got {_short(v)}", param=key)
    return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _number(body: dict, key: str, default: float) -> float:
    v = _typed(body, key, (int, float), default, "a number")
    try:
        return float(v)
    except OverflowError:   # an int of 400 digits
        raise ApiError(f"'{key}' is out of range", param=key) from None


def parse_request(body, chat: bool, tokenizer, served_model: str, max_model_len: int) -> ParsedRequest:
    """max_model_len: the most tokens (prompt + completion) one request may hold."""
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    model = _typed(body, "model", str, None, "a string")
    if model is None:
        raise ApiError("'model' is required", param="model")
    if model != served_model:
        raise ApiError(f"The model '{_short(model)[1:-1]}' does not exist; this server serves '{served_model}'",
                       status=404, param="model", code="model_not_found")
    if _typed(body, "n", int, 1) != 1:
        raise ApiError("only n=1 is supported", param="n")
    if body.get("echo") or body.get("logprobs") not in (None, False) or body.get("best_of") not in (None, 1):
        raise ApiError("echo, logprobs and best_of are not supported", param="logprobs")
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    if not prompt_ids:
        raise ApiError("the prompt is empty", param="messages" if chat else "prompt")
    n_in = len(prompt_ids)
    if n_in >= max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                       f"{n_in} input tokens. Please reduce the length of the input.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, key, int, None, "an integer")
    if max_tokens is None:   # unset: OpenAI's defaults, cut to what the context leaves
        max_tokens = max_model_len - n_in if chat else min(16, max_model_len - n_in)
    if max_tokens < 1:
        raise ApiError(f"'{key}' must be at least 1, got {max_tokens}", param=key)
    if n_in + max_tokens > max_model_len:   # vLLM's wording and numbers
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{n_in + max_tokens} tokens ({n_in} in the messages, {max_tokens} in the completion). "
                       f"Please reduce the length of the messages or completion.",
                       param=key, code="context_length_exceeded")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4):
        raise ApiError("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    seed = _typed(body, "seed", int, None, "an integer")
    stream = _typed(body, "stream", bool, False, "a boolean")
    opts = _typed(body, "stream_options", dict, {}, "an object")
    include_usage = _typed(opts, "include_usage", bool, False, "a boolean")
    ignore_eos = _typed(body, "ignore_eos", bool, False, "a boolean")
    return_token_ids = _typed(body, "return_token_ids", bool, False, "a boolean")
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                  stop=tuple(stop or ()), ignore_eos=ignore_eos)
    except ValueError as e:
        raise ApiError(str(e), param=str(e).split(" ", 1)[0]) from None
    return ParsedRequest(chat, prompt_ids, sampling, stream, include_usage, model, return_token_ids)


def _completion_prompt(body: dict, tokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ApiError(f"token id {_short(bad[0])} is outside the vocabulary", param="prompt")
        return list(p)
    raise ApiError("'prompt' must be a string, a list of token ids, or a one-element list of either",
                   param="prompt")


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    clean = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise ApiError(f"messages[{k}] needs a 'role', one of {list(CHAT_ROLES)}", param="messages")
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(_text_part(k, j, part) for j, part in enumerate(c))
        if not isinstance(c, str):
            raise ApiError(f"messages[{k}].content must be a string or a list of text parts", param="messages")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    return tokenizer.apply_chat_template(clean)


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _text_part(k: int, j: int, part) -> str:
    where = f"messages[{k}].content[{j}]"
    if not isinstance(part, dict):
        raise ApiError(f"{where} must be an object", param="messages")
    if part.get("type") != "text":
        raise ApiError(f"{where}: only parts of type 'text' are supported, got {_short(part.get('type'))}",
                       param="messages")
    if not isinstance(part.get("text"), str):
        raise ApiError(f"{where}.text must be a string, got {_short(part.get('text'))}", param="messages")
    return part["text"]


# -- responses -----------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def chunk(req_id: str, model: str, chat: bool, text: str | None, finish: str | None, first: bool = False,
          token_ids: list[int] | None = None) -> dict:
    """One SSE chunk; `token_ids` (asked for with `return_token_ids`) lists
    the ids of the tokens whose text it carries."""
    if chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", "content": text or ""}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": req_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def full(req_id: str, model: str, chat: bool, text: str, finish: str, use: dict,
         token_ids: list[int] | None = None) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
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
