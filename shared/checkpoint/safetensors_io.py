"""A small reader for the safetensors format that reads tensors straight into place.

The format: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data. Reading with pread into the destination tensor's own memory means no
memory map and no second copy, so loading never holds the model twice. Every
structural problem is reported as a SafetensorsFormatError naming the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
# e8m0 (the power-of-two block scales of FP8/FP4 checkpoints) arrived in torch 2.7; older
# torch still reads every other file, and reports an F8_E8M0 tensor as malformed metadata.
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_MAX_HEADER = 100 << 20


class SafetensorsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    nbytes: int


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors = self._parse()
        except Exception:
            os.close(self._fd)
            raise

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def keys(self) -> list[str]:
        return list(self.tensors)

    def _bad(self, msg: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"{self.path.name}: {msg}")

    def _parse(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("file is shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise self._bad(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        data_start = 8 + n
        out: dict[str, TensorInfo] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[meta["dtype"]]
                shape = tuple(int(d) for d in meta["shape"])
                begin, end = (int(x) for x in meta["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has malformed metadata {meta!r}") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise self._bad(f"tensor {name!r}: offsets {begin}..{end} do not match shape {shape} {meta['dtype']}")
            if data_start + end > size:
                raise self._bad(f"tensor {name!r} extends past the end of the file (truncated?)")
            out[name] = TensorInfo(dtype, shape, data_start + begin, nbytes)
        return out

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Copy tensor `name` into dest (same shape; any dtype or device)."""
        info = self.tensors[name]
        if dest.dtype == info.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            self._pread_into(info, dest)
        else:
            tmp = torch.empty(info.shape, dtype=info.dtype)
            self._pread_into(info, tmp)
            dest.copy_(tmp)

    def read_row_into(self, name: str, row: int, dest: torch.Tensor) -> None:
        """Copy row `row` of tensor `name` (a slice along dim 0) into dest, reading only it."""
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0]
        part = TensorInfo(info.dtype, info.shape[1:], info.begin + row * row_bytes, row_bytes)
        if dest.dtype == info.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            self._pread_into(part, dest)
        else:
            tmp = torch.empty(part.shape, dtype=info.dtype)
            self._pread_into(part, tmp)
            dest.copy_(tmp)

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        t = torch.empty(info.shape, dtype=info.dtype)
        self._pread_into(info, t)
        return t

    def _pread_into(self, info: TensorInfo, dest: torch.Tensor) -> None:
        if info.nbytes == 0:
            return
        buf = memoryview(dest.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < info.nbytes:
            got = os.preadv(self._fd, [buf[done:]], info.begin + done)
            if got <= 0:
                raise self._bad(f"unexpected end of file while reading {info}")
            done += got
