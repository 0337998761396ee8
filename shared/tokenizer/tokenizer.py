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
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._compiled = self._env.from_string(template) if template else None
        self.vocab_size = self._tok.get_vocab_size()
        self.max_length = int(cfg.get("model_max_length", 1 << 30)) if isinstance(cfg.get("model_max_length"), int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            raise TokenizerError("this model has no chat template")
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes the BOS itself, so the tokenizer must not add another.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
