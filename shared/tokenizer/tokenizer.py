"""The model's tokenizer and chat template, read from a Hugging Face layout directory,
and the way back: incremental detokenization and stop strings (IncrementalDetokenizer).

The detokenizer releases text only once it can no longer change. A byte-level BPE
token may hold part of a multi-byte character: that character is withheld until a later
token completes it, so a character is never split across two stream chunks. Text that
could be the start of a stop string is withheld too, until the stop string is matched
(and cut off) or ruled out.

Two ways to the text, the same text either way:
- byte-level tokenizers (the DeepSeek family): each id's bytes from a table, through an
  incremental UTF-8 decoder. Constant work per token, no library call.
- any other tokenizer: decode a short window that starts a little before the new
  tokens, which gives the same characters as decoding everything.

`tokenizers`' own DecodeStream was measured against the byte table on the tiny model's
vocabulary: 1.0 µs per token, against 1.1 µs for add() one id at a time and 0.4 µs for
each() over a write's ids (the gateway's path), so the table stays.
"""

from __future__ import annotations

import codecs
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


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self._pieces = tokenizer.byte_pieces(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._pieces is not None else None
        self.ids: list[int] = []  # the window decode's tokens (the other way only)
        self._prefix = 0  # decode window start (token index)
        self._read = 0  # tokens before this are reflected in the released or held text
        self._held = ""  # final text withheld because a stop string may start in it
        self.stopped = False  # a stop string was found; nothing more is released

    def add(self, new_ids: list[int]) -> str:
        """Feed tokens; returns the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        if self._pieces is not None:
            pieces, n = self._pieces, len(self._pieces)
            return self._release(self._utf8.decode(b"".join([pieces[i] if 0 <= i < n else b"" for i in new_ids])))
        self.ids += new_ids
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        after = self.tok.decode(self.ids[self._prefix :], self.skip)
        new = ""
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(new)

    def each(self, new_ids: list[int]) -> list[str]:
        """add([i]) for each id in turn, as one call: a stream writes a chunk per token, and
        the common case (byte-level, no stop strings) is then one pass over the ids."""
        if self.stopped or self.stop or self._pieces is None:
            return [self.add([i]) for i in new_ids]
        pieces, n, dec = self._pieces, len(self._pieces), self._utf8.decode
        return [dec(pieces[i] if 0 <= i < n else b"") for i in new_ids]

    def flush(self) -> str:
        """At the end of a request: release whatever was held back, minus any stop string."""
        if self.stopped:
            return ""
        if self._pieces is not None:
            new = self._utf8.decode(b"", final=True)
        else:
            new = ""
            if self._read < len(self.ids):
                before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
                after = self.tok.decode(self.ids[self._prefix :], self.skip)
                new = after[len(before) :]
                self._prefix = self._read = len(self.ids)
        return self._release(new, final=True)

    def _release(self, new: str, final: bool = False) -> str:
        if not self.stop:
            return new
        text = self._held + new
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)]
        keep = 0 if final else max(_partial_suffix(text, s) for s in self.stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
