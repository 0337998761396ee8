"""The training text: the Python standard library's own sources, which every machine
that runs moemesh has installed, so nothing is downloaded.

The files are the top-level modules of the running interpreter's standard library in
name order, each closed by the end-of-sentence token. Another Python version ships
other sources, so the corpus is identified by its version and a digest of its bytes.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    files: int
    sha256: str
    python: str

    @property
    def bytes(self) -> int:
        return sum(len(t.encode()) for t in self.texts)

    def describe(self) -> dict:
        return {"source": f"python {self.python} standard library, top-level modules", "files": self.files,
                "bytes": self.bytes, "sha256": self.sha256}


def stdlib(max_bytes: int) -> Corpus:
    """Top-level standard library modules in name order, until max_bytes of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    digest = hashlib.sha256()
    size = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable or non-UTF-8 file: the others suffice
        texts.append(text)
        digest.update(path.name.encode() + b"\0" + text.encode())
        size += len(text.encode())
        if size >= max_bytes:
            break
    if not texts:
        raise ValueError(f"no standard library sources under {root} to train on")
    return Corpus(texts, len(texts), digest.hexdigest(), f"{sys.version_info.major}.{sys.version_info.minor}")


def encode(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """One stream of token ids [N]: the texts in order, each followed by eos_id."""
    out: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        out += enc.ids
        out.append(eos_id)
    return torch.tensor(out, dtype=torch.long)


def split(ids: torch.Tensor, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out): the held-out part is the stream's tail, text the model never trains on."""
    n = int(len(ids) * (1.0 - held_out))
    return ids[:n], ids[n:]


def windows(ids: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] windows at seeded random offsets."""
    if len(ids) <= length:
        raise ValueError(f"the corpus holds {len(ids)} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, len(ids) - length, (batch,), generator=gen)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])
