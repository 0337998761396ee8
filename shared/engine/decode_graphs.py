"""Decode steps from static input buffers, replayed as CUDA graphs on a GPU.

A decode step of B sequences issues one launch per op, every step, for the same shapes.
A CUDA graph records those launches once and replays them with one call. Replay needs
inputs that never move, so a pure decode batch (every row one token: no prompt chunk,
no draft to verify) runs at the smallest *bucket* >= B, over buffers owned here:

- rows 0..B-1 are the batch's ids, positions, cache slots, block tables and context
  lengths, copied in;
- rows B.. are padding: token 0 at position 0, attending to one position and writing its
  latent into a scratch slot that no sequence owns (the cache's last block, KVCache), so
  a padding row never touches a sequence's cache;
- the block tables are as wide as max_model_len needs, so a bucket's shapes never change.

Modes (EngineConfig.decode_graphs): "auto" captures on a CUDA device and is off
elsewhere; "on" insists on capture; "eager" runs the same static path without capture,
which is how a CPU tests it against the dynamic path; "off" never takes it.

What stays on the dynamic path: batches with prompt chunks or drafts, DeepSeek-V4 (its
batch metadata has sizes that vary by step), and expert parallelism (its all-to-alls
take split sizes from the host).
"""

from __future__ import annotations

import logging

import torch

from moemesh.shared.model.batch import ForwardBatch

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a graph is kept for: 1, 2, 4, 8, then every 16 up to max_batch (which
    is always one): padding wastes under 16 rows, at most 2x below 16."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return tuple(small + list(range(16, max_batch, 16)) + [max_batch])


class DecodeGraphs:
    """Owns the static buffers and, when capturing, one graph per bucket. Call it as the
    model: a batch it cannot take goes to model(batch, kv_caches) unchanged."""

    def __init__(self, model, kv_caches: torch.Tensor, block_size: int, scratch_block: int,
                 max_batch: int, max_model_len: int, capture: bool):
        self.model = model
        self.kv_caches = kv_caches
        self.capture = capture
        self.buckets = buckets(max_batch)
        self._moes = list(model.moe_layers().values())
        n, dev = self.buckets[-1], kv_caches.device
        width = -(-max_model_len // block_size)
        self.scratch_slot = scratch_block * block_size
        self._ids = torch.zeros(n, dtype=torch.long, device=dev)
        self._pos = torch.zeros(n, dtype=torch.long, device=dev)
        self._slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self._tables = torch.zeros(n, width, dtype=torch.long, device=dev)
        self._tables[:, 0] = scratch_block
        self._lens = torch.ones(n, dtype=torch.long, device=dev)
        # Each MoE layer's expert choices land here, for the load tracker to count the
        # real rows only (a hook inside a graph would count the padding too).
        k = model.cfg.num_experts_per_tok
        self._routes = {m.layer_id: torch.zeros(n, k, dtype=torch.long, device=dev) for m in self._moes}
        self._routed: list = []  # the MoE layers a decode forward runs
        self._dirty = 0  # rows up to here may hold a real row's slot from an earlier step
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def width(self) -> int:
        return self._tables.shape[1]

    def fits(self, batch: ForwardBatch) -> bool:
        b = batch.num_tokens
        return (batch.hybrid is None and not batch.extends and batch.num_decode == batch.num_rowwise == b
                and 0 < b <= self.buckets[-1]
                and batch.decode_block_tables.shape[1] <= self.width
                and all(m.runner is None for m in self._moes))

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def __call__(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> torch.Tensor:
        if kv_caches is not self.kv_caches or not self.fits(batch):
            return self.model(batch, kv_caches)
        b = batch.num_tokens
        size = self.bucket(b)
        self._load(batch, b)
        if self.capture:
            graph, hidden = self._graphs.get(size) or self._capture(size)
            graph.replay()
        else:
            hidden = self._forward(size)
        for m in self._routed:
            if m.on_route is not None:
                m.on_route(m.layer_id, self._routes[m.layer_id][:b])
        return hidden[:b]

    def capture_all(self) -> None:
        """Capture every bucket, largest first so that the smaller ones reuse its memory."""
        for size in reversed(self.buckets):
            if size not in self._graphs:
                self._capture(size)

    # ---- internals ---------------------------------------------------------------------
    def _load(self, batch: ForwardBatch, b: int) -> None:
        self._ids[:b].copy_(batch.input_ids)
        self._pos[:b].copy_(batch.positions)
        self._slots[:b].copy_(batch.slot_mapping)
        w = batch.decode_block_tables.shape[1]
        # Columns past w keep what an earlier step left: the context length masks them.
        self._tables[:b, :w].copy_(batch.decode_block_tables)
        self._lens[:b].copy_(batch.decode_context_lens)
        if self._dirty > b:  # rows that were real before write to the scratch slot again
            self._slots[b : self._dirty].fill_(self.scratch_slot)
            self._lens[b : self._dirty].fill_(1)
        self._dirty = b

    def _static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(input_ids=self._ids[:size], positions=self._pos[:size], slot_mapping=self._slots[:size],
                            num_decode=size, num_rowwise=size, decode_block_tables=self._tables[:size],
                            decode_context_lens=self._lens[:size])

    def _forward(self, size: int) -> torch.Tensor:
        hooks = [m.on_route for m in self._moes]
        routes, ran = self._routes, set()

        def record(lid: int, ids: torch.Tensor) -> None:
            ran.add(lid)
            routes[lid][: ids.shape[0]].copy_(ids)

        try:
            for m in self._moes:
                m.on_route = record
            return self.model(self._static_batch(size), self.kv_caches)
        finally:
            for m, h in zip(self._moes, hooks):
                m.on_route = h
            self._routed = [m for m in self._moes if m.layer_id in ran]  # the target's, not the draft head's

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (Triton compiles, the allocator settles), as
        # capture may not compile or allocate outside the graph's pool. The inputs hold
        # whatever rows were loaded; padding writes only the scratch slot, and a real row
        # rewrites its own slot with what it will write again at replay.
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
