"""Tokenizer wrapper: HF fast tokenizer files, chat template, incremental detokenizer.

Reads the folder's `tokenizer.json` with the `tokenizers` library and renders
the chat template with jinja2 the way transformers does, so serving processes
do not pay for importing transformers (~3 s). Results equal HF
`AutoTokenizer` (checked by tests/test_model_tokenizer.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence


class TokenizerNotFoundError(FileNotFoundError):
    pass


def _token_str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):  # old AddedToken serialisation
        return v.get("content")
    return str(v)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """Tokenizer of an HF model folder (tokenizer.json + tokenizer_config.json + chat template)."""

    def __init__(self, folder: Path | str) -> None:
        from tokenizers import Tokenizer as _Tok

        self.folder = Path(folder)
        tj = self.folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerNotFoundError(f"{self.folder} has no tokenizer.json (a fast tokenizer is required)")
        self._tok = _Tok.from_file(str(tj))
        cfg_path = self.folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        stm = self.folder / "special_tokens_map.json"
        special_map: dict[str, Any] = json.loads(stm.read_text()) if stm.is_file() else {}

        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            val = _token_str(self.config.get(key)) or _token_str(special_map.get(key))
            if val is not None:
                self.special_tokens[key] = val
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self._add_bos = bool(self.config.get("add_bos_token", False))

        # eos: the tokenizer's own, plus the model's (config / generation_config)
        eos: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        for name in ("generation_config.json", "config.json"):
            p = self.folder / name
            if p.is_file():
                e = json.loads(p.read_text()).get("eos_token_id")
                for x in (e if isinstance(e, list) else [] if e is None else [e]):
                    if int(x) not in eos:
                        eos.append(int(x))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

        self.chat_template: str | None = None
        if (self.folder / "chat_template.jinja").is_file():
            self.chat_template = (self.folder / "chat_template.jinja").read_text()
        elif (self.folder / "chat_template.json").is_file():
            self.chat_template = json.loads((self.folder / "chat_template.json").read_text()).get("chat_template")
        elif isinstance(self.config.get("chat_template"), str):
            self.chat_template = self.config["chat_template"]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Like HF `tokenizer(text).input_ids`: special tokens only if the tokenizer's
        post-processor (or `add_bos_token`) says so. SmolLM2 adds none."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError(f"tokenizer in {self.folder} has no chat template")
        tmpl = _compile_template(self.chat_template)
        return tmpl.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation (no extra special tokens, as HF)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    A delta is emitted only once it does not end in an incomplete UTF-8
    sequence (U+FFFD), so multi-byte characters split over tokens never show up
    broken. `finish()` flushes whatever is held back; the concatenation of all
    deltas equals `tokenizer.decode(all_ids)`.

    Decodes only a short window (from `prefix_offset`), so each step costs
    O(window), not O(length).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # ids[:read_offset] have been emitted as text
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def feed(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly "")."""
        self.ids.append(int(token_id))
        return self._delta(final=False)

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def finish(self) -> str:
        """Flush held-back text (e.g. a trailing incomplete character as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        return self._delta(final=True)
