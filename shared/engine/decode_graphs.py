"""Decode steps of fixed shapes, replayed as CUDA graphs on a GPU.

A decode step of B sequences issues one launch per op, every step, for the same shapes.
A CUDA graph records those launches once and replays them with one call; replay needs
inputs that never move and shapes that never change. So a pure decode batch (every row
one token: no prompt chunk, no draft to verify) is built padded to the smallest
*bucket* >= B (runner.Padding, runner.build_batch):

- rows B.. are padding: token 0 at position 0 of a sequence whose cache is a scratch
  block (and for DeepSeek-V4 a scratch ring) that no sequence owns, so a padding row
  never touches a sequence's cache;
- every size that could vary is at its most: block tables as wide as max_model_len
  needs; for V4 also as many compressed entries as max_model_len holds, a full
  look-back of earlier positions for every row, and a group slot for every row (a row
  that completes no group pools into the scratch block).

Each bucket has a *template*, a batch built the same way from padding alone. A step's
batch is copied into its bucket's template (one copy of the packed buffer on a GPU),
and the template's forward runs: captured once and replayed on a CUDA device, run as it
is in "eager" mode, which is how a CPU tests the path against the dynamic one.

Modes (EngineConfig.decode_graphs): "auto" captures on a CUDA device and is off
elsewhere; "on" insists on capture; "eager" runs the same path uncaptured; "off".
Batches with prompt chunks or drafts (the MTP path), and expert parallelism (its
all-to-alls take split sizes from the host), stay dynamic.
"""

from __future__ import annotations

from typing import Callable

import torch

from moemesh.shared.engine.runner import Padding, _get, index_tensors
from moemesh.shared.model.batch import ForwardBatch


def buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a graph is kept for: 1, 2, 4, 8, then every 16 up to max_batch (which
    is always one): padding wastes under 16 rows, at most 2x below 16."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return tuple(small + list(range(16, max_batch, 16)) + [max_batch])


class DecodeGraphs:
    """Owns the bucket templates and, when capturing, one graph per bucket. Call it as the
    model: a batch that was not built padded goes to model(batch, cache) unchanged."""

    def __init__(self, model, cache, build: Callable[[list, Padding], ForwardBatch], scratch_block: int,
                 scratch_ring: int, max_batch: int, max_model_len: int, capture: bool):
        """cache: what the model's forward takes; build(chunks, padding): the engine's
        build_batch onto its device."""
        self.model, self.cache, self.build, self.capture = model, cache, build, capture
        self.buckets = buckets(max_batch)
        self._block, self._ring, self._max_len = scratch_block, scratch_ring, max_model_len
        self._moes = list(model.moe_layers().values())
        self._templates: dict[int, ForwardBatch] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._routes: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> layer -> [rows, K] expert ids
        self._routed: list = []  # the MoE layers a decode forward runs (the target's, not the draft head's)

    def padding(self, chunks: list) -> Padding | None:
        """How to build the batch of these chunks; None: dynamically."""
        b = len(chunks)
        if not 0 < b <= self.buckets[-1] or any(len(c.token_ids) != 1 for c in chunks) \
                or any(m.runner is not None for m in self._moes):
            return None
        return Padding(next(x for x in self.buckets if x >= b), self._block, self._ring, self._max_len)

    def __call__(self, batch: ForwardBatch, cache) -> torch.Tensor:
        if not batch.static or cache is not self.cache:
            return self.model(batch, cache)
        size = batch.num_tokens
        template = self._template(size)
        _copy_into(template, batch)
        if self.capture:
            graph, hidden = self._graphs.get(size) or self._capture(size)
            graph.replay()
        else:
            hidden = self._forward(size)
        real = batch.num_decode  # the rows before the padding
        for m in self._routed:
            if m.on_route is not None:
                m.on_route(m.layer_id, self._routes[size][m.layer_id][:real])
        return hidden

    def capture_all(self) -> None:
        """Capture every bucket, largest first so that the smaller ones reuse its memory."""
        for size in reversed(self.buckets):
            if size not in self._graphs:
                self._capture(size)

    # ---- internals ---------------------------------------------------------------------
    def _template(self, size: int) -> ForwardBatch:
        t = self._templates.get(size)
        if t is None:
            t = self._templates[size] = self.build([], Padding(size, self._block, self._ring, self._max_len))
        return t

    def _forward(self, size: int) -> torch.Tensor:
        """The template's forward, each MoE layer's expert choices copied out for the load
        tracker (a hook inside a graph would count the padding too)."""
        template = self._template(size)
        hooks = [m.on_route for m in self._moes]
        routes = self._routes.setdefault(size, {})
        ran = []

        def record(lid: int, ids: torch.Tensor) -> None:
            ran.append(lid)
            if lid not in routes:
                routes[lid] = torch.empty_like(ids)
            routes[lid].copy_(ids)

        try:
            for m in self._moes:
                m.on_route = record
            return self.model(template, self.cache)
        finally:
            for m, h in zip(self._moes, hooks):
                m.on_route = h
            self._routed = [m for m in self._moes if m.layer_id in ran]

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, the allocator settles), as
        # capture may not compile or allocate outside the graph's pool. Whatever the
        # template holds, it writes only what its rows write again at replay.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._forward(size)
        self._pool = graph.pool()
        self._graphs[size] = (graph, hidden)
        return graph, hidden


def _copy_into(template: ForwardBatch, batch: ForwardBatch) -> None:
    """The batch's index tensors into the template's, which have the same shapes: one
    copy when both travelled packed (runner.pack), else one per tensor."""
    if template.packed is not None and batch.packed is not None:
        template.packed.copy_(batch.packed)
        pairs = [(d, s) for d, s in zip(index_tensors(template), index_tensors(batch))
                 if _get(*s).dtype != torch.long]  # what did not travel packed
    else:
        pairs = list(zip(index_tensors(template), index_tensors(batch)))
    for dst, src in pairs:
        _get(*dst).copy_(_get(*src))

