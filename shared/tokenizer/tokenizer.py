"""The model's tokenizer and chat template, read from a Hugging Face layout directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
    pass


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # {"content": "...", ...} as some tokenizer configs store it
        return v.get("content")
    return v


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: not found")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises bare Exceptions
            raise TokenizerError(f"{tok_file}: cannot be loaded ({e})") from None
        cfg_file = d / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        except ValueError as e:
            raise TokenizerError(f"{cfg_file}: not valid JSON ({e})") from None
        self.config: dict[str, Any] = cfg if isinstance(cfg, dict) else {}  # tokenizer_config.json, as read
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # What Hugging Face's template environment adds: templates are written against it.
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise
        self._compiled = self._env.from_string(template) if template else None
        self.vocab_size = self._tok.get_vocab_size()
        self._byte_level = _decoder_type(tok_file) == "ByteLevel"
        self._pieces: dict[bool, list[bytes] | None] = {}
        self.max_length = int(cfg.get("model_max_length", 1 << 30)) if isinstance(cfg.get("model_max_length"), int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call that skips character offsets: a third less work than encode(), same ids.
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """The bytes each token id decodes to, for a byte-level BPE decoder: decoding is
        then a table lookup and an incremental UTF-8 decode. None for other decoders.

        Checked against decode() token by token when built, so a table that would ever
        disagree with the library is never used."""
        if skip_special_tokens not in self._pieces:
            self._pieces[skip_special_tokens] = self._build_pieces(skip_special_tokens) if self._byte_level else None
        return self._pieces[skip_special_tokens]

    def _build_pieces(self, skip: bool) -> list[bytes] | None:
        to_byte = _unicode_to_byte()
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        n = max(self.vocab_size, max(special, default=-1) + 1)
        pieces = []
        for i in range(n):
            t = self._tok.id_to_token(i)
            if t is None or (skip and i in special):
                pieces.append(b"")
            elif all(c in to_byte for c in t):
                pieces.append(bytes(to_byte[c] for c in t))
            else:  # as the byte-level decoder does: a token with a character outside its alphabet is taken as is
                pieces.append(t.encode())
        for i, b in enumerate(pieces):
            if b.decode("utf-8", "replace") != self._tok.decode([i], skip_special_tokens=skip):
                return None
        return pieces

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """tools: OpenAI's `tools` array; the template writes them (and the call format)
        where the model expects them, as Hugging Face's apply_chat_template does."""
        if self._compiled is None:
            raise TokenizerError("this model has no chat template")
        try:
            return self._compiled.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as e:  # a template's own raise_exception, or a field it needs and lacks
            raise TokenizerError(f"the chat template cannot render these messages: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template writes the BOS itself, so the tokenizer must not add another.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's tojson: keys in their order and no HTML escaping (Jinja's own sorts
    the keys and escapes <, > and &, so a tool's schema would read differently from the
    text the model was trained on)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise TokenizerError(message)


def _decoder_type(tok_file: Path) -> str | None:
    try:
        dec = json.loads(tok_file.read_text()).get("decoder") or {}
    except ValueError:
        return None
    return dec.get("type") if isinstance(dec, dict) else None


def _unicode_to_byte() -> dict[str, int]:
    """The byte-level BPE alphabet, inverted: printable bytes stand for themselves, the
    others for the code points from 256 up, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out
