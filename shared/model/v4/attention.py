"""DeepSeek-V4 attention over the hybrid paged cache.

Shapes: T = rows, H = heads, d = head_dim, W = sliding window, E = compressed entries.
One KV head (MQA), and its key is also its value. A query at position t attends to:
- the window: positions t-W+1 .. t;
- CSA layers: the indexer's top-k among entries 0 .. (t+1)//m - 1;
- HCA layers: all of entries 0 .. (t+1)//m - 1;
plus a learned per-head sink logit that takes probability mass and gives nothing. The
output's rotary part is rotated back by the query's angle (values carry their keys'
rotation), then heads go through the grouped low-rank output projection.

Order within a layer matters: the pre positions are read from the ring before this
batch's rows are written there (a long chunk wraps the ring), and the entries that
complete in this batch are written before anyone gathers entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moemesh.shared.kernels.dispatch import use_triton
from moemesh.shared.kernels.v4_attention import attend_ref, v4_decode_attention
from moemesh.shared.model.layers import FusedLinears, RMSNorm
from moemesh.shared.model.v4.batch import Entries, HybridMeta
from moemesh.shared.model.v4.compressor import Compressor, Indexer
from moemesh.shared.model.v4.config import CSA, HCA, SLIDING, V4Config
from moemesh.shared.model.v4.layout import LayerRegions
from moemesh.shared.model.v4.rope import Rope, rotate


@dataclass
class V4Step:
    """Per-forward state shared by the layers: the cache rows and each rope's angles."""

    main: torch.Tensor  # [num_blocks, main_width]
    rings: torch.Tensor  # [num_rings, ring_width]
    meta: HybridMeta
    angles: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin [T, R/2]
    ropes: dict[str, Rope]


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int):
        super().__init__()
        self.layer_type = cfg.layer_type(layer_id)
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        H, D, d = cfg.num_attention_heads, cfg.hidden_size, cfg.head_dim
        self.H, self.d, self.W, self.eps = H, d, cfg.sliding_window, cfg.rms_norm_eps
        self.groups = cfg.o_groups
        self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, fp32_weight=True)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * d, bias=False)
        self.kv_proj = nn.Linear(D, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, fp32_weight=True)
        # Grouped output projection: [groups * o_lora_rank, H*d / groups], one block per group.
        self.o_a_proj = nn.Linear(H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if self.layer_type != SLIDING:
            m = cfg.compress_rate(layer_id)
            self.compressor = Compressor(D, d, m, overlap=self.layer_type == CSA, eps=cfg.rms_norm_eps)
            if self.layer_type == CSA:
                self.compressor.indexer = Indexer(D, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, m,
                                                  cfg.index_topk, cfg.rms_norm_eps)
        self.scale = d**-0.5
        self.x_proj: FusedLinears | None = None  # fuse(): every projection of x in one GEMM

    def fuse(self) -> None:
        """The projections that read the layer's input x (the query's and the key's
        down-projections, the compressors' kv and gate, the indexer's head weights) as
        one GEMM: one launch where a CSA layer had seven and two cats."""
        parts = [self.q_a_proj, self.kv_proj]
        comp = self.compressor
        if comp is not None:
            parts += [comp.kv_proj, comp.gate_proj]
            if self.layer_type == CSA:
                ix = comp.indexer
                parts += [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
        self.x_proj = FusedLinears(*parts)

    def _project(self, x: torch.Tensor) -> tuple:
        """(q_a, kv, compressor [kv | gate], indexer [kv | gate], indexer head weights) of
        x's rows; those a layer lacks are None. Fused: column slices of one GEMM's output."""
        comp = self.compressor
        if self.x_proj is not None:
            p = self.x_proj(x)
            r, d = self.q_a_proj.out_features, self.d
            if comp is None:
                return p[:, :r], p[:, r:], None, None, None
            cw = comp.proj_width
            if self.layer_type != CSA:
                return p[:, :r], p[:, r : r + d], p[:, r + d :], None, None
            ix = comp.indexer
            a, b = r + d + cw, r + d + cw + ix.proj_width
            return p[:, :r], p[:, r : r + d], p[:, r + d : a], p[:, a:b], p[:, b:]
        if comp is None:
            return self.q_a_proj(x), self.kv_proj(x), None, None, None
        if self.layer_type != CSA:
            return self.q_a_proj(x), self.kv_proj(x), comp.project(x), None, None
        ix = comp.indexer
        return self.q_a_proj(x), self.kv_proj(x), comp.project(x), ix.project(x), ix.scorer.weights_proj(x)

    def forward(self, x: torch.Tensor, st: V4Step, reg: LayerRegions) -> torch.Tensor:
        T, H, d = x.shape[0], self.H, self.d
        meta = st.meta
        cos, sin = st.angles[self.rope_kind]
        q_a, kv_a, proj, iproj, wts = self._project(x)
        q_res = self.q_a_norm(q_a)
        q = rotate(self.q_b_proj(q_res).view(T, H, d), cos, sin, rms_eps=self.eps)
        kv = rotate(self.kv_norm(kv_a), cos, sin)

        ctx_kv = torch.cat([kv, _read(reg.window_kv, st).to(kv.dtype)])
        writes = [(reg.window_kv, kv)]
        comp = self.compressor
        entries = index_keys = None
        if comp is not None:
            entries = reg.entries.view(st.main)
            self._compress(comp, proj, reg.proj, entries, st)
            writes.append((reg.proj, proj))
            if self.layer_type == CSA:
                index_keys = reg.index_keys.view(st.main)
                self._compress(comp.indexer, iproj, reg.index_proj, index_keys, st)
                writes.append((reg.index_proj, iproj))
        for region, rows in writes:
            _write(region, st, rows)

        ccos, csin = st.angles["compress"]
        nd = meta.num_decode
        w_nd = None if wts is None else wts[:nd]
        # A decode step's rows are all attended one by one: their output is the layer's.
        out = None if nd == T and nd else x.new_empty(T, H, d)
        if nd and use_triton(q):  # one kernel reads every key where it lies (shared/kernels/v4_attention.py)
            dec = self._decode_kernel(q[:nd], ctx_kv, meta, entries, index_keys, q_res[:nd], w_nd, ccos[:nd],
                                      csin[:nd])
        elif nd:
            keys = ctx_kv[meta.dec_keys.clamp(min=0)]  # [Bd, W, d]
            mask = meta.dec_keys >= 0
            if comp is not None:
                ent = meta.dec_entries[self.layer_type]
                rows = slice(0, nd)
                ck, cmask = self._entries_per_row(ent, entries, index_keys, q_res[rows], w_nd, ccos[rows],
                                                  csin[rows], ent.visible)
                keys, mask = torch.cat([keys, ck.to(keys.dtype)], dim=1), torch.cat([mask, cmask], dim=1)
            dec = attend_ref(q[:nd], keys, mask, self.sinks, self.scale)
        if out is None:
            out = dec
        elif nd:
            out[:nd] = dec
        for ext in meta.extends:
            rows = slice(ext.q_start, ext.q_start + ext.q_len)
            n, L = ext.q_len, ext.key_idx.shape[0]
            keys = ctx_kv[ext.key_idx.clamp(min=0)]  # [n + W - 1, d], shared by the chunk's rows
            i = torch.arange(n, device=x.device)[:, None]
            j = torch.arange(L, device=x.device)[None, :]
            mask = (j >= i) & (j < i + self.W) & (ext.key_idx >= 0)[None, :]
            if comp is not None:
                ent = ext.entries[self.layer_type]
                ck, cmask = self._entries_shared(ent, entries, index_keys, q_res[rows],
                                                 None if wts is None else wts[rows], ccos[rows], csin[rows])
                keys, mask = torch.cat([keys, ck.to(keys.dtype)]), torch.cat([mask, cmask], dim=1)
            out[rows] = attend_ref(q[rows], keys, mask, self.sinks, self.scale)

        out = rotate(out, cos, sin, inverse=True)
        return self.o_b_proj(self._grouped_out(out.reshape(T, H * d)))

    def _decode_kernel(self, q, ctx_kv, meta: HybridMeta, entries, index_keys, q_res, wts, cos, sin) -> torch.Tensor:
        kw = {}
        if self.compressor is not None:
            ent = meta.dec_entries[self.layer_type]
            kw = dict(entries=entries, table=ent.table, visible=ent.visible, count=ent.count)
            if self.layer_type == CSA:
                kw["sel"] = self.compressor.indexer.pick(q_res, None, cos, sin, index_keys, ent, wts)
        return v4_decode_attention(q, ctx_kv, meta.dec_keys, self.sinks, self.scale, **kw)

    def _compress(self, comp: Compressor, proj: torch.Tensor, proj_region, store: torch.Tensor, st: V4Step) -> None:
        """Pool the groups completing now into `store`, from the rows' projections `proj`
        and the ring's."""
        groups = st.meta.groups.get(self.layer_type)
        if groups is not None and groups.idx.shape[0]:
            m = st.meta
            comp.compress(proj, proj_region.view(st.rings), m.pre_ring, m.pre_slot[proj_region.count], groups,
                          st.ropes["compress"], store)

    def _entries_per_row(self, ent: Entries, entries, index_keys, q_res, wts, cos, sin, visible):
        """Decode rows, one sequence each: [Bd, E', d] keys and their mask."""
        per_block = entries.shape[1]
        if self.layer_type == HCA:
            blk, slot = ent.addresses(per_block)
            return entries[blk, slot], torch.arange(ent.count, device=q_res.device)[None, :] < visible[:, None]
        indexer = self.compressor.indexer
        blk, slot = ent.addresses(per_block)
        scores = indexer.scores(q_res, None, cos, sin, index_keys[blk, slot], wts)
        top, valid = indexer.select(scores, visible)
        return entries[ent.table.gather(1, top // per_block), top % per_block], valid

    def _entries_shared(self, ent: Entries, entries, index_keys, q_res, wts, cos, sin):
        """An extend chunk's rows share one sequence's entries: [E, d] and a [n, E] mask."""
        blk, slot = ent.addresses(entries.shape[1])
        blk, slot, visible, E = blk[0], slot[0], ent.visible, ent.count
        keys = entries[blk, slot]
        if self.layer_type == HCA:
            return keys, torch.arange(E, device=q_res.device)[None, :] < visible[:, None]
        indexer = self.compressor.indexer
        top, valid = indexer.select(indexer.scores(q_res, None, cos, sin, index_keys[blk, slot], wts), visible)
        mask = torch.zeros(q_res.shape[0], E + 1, dtype=torch.bool, device=q_res.device)
        mask.scatter_(1, torch.where(valid, top, E), True)  # invalid picks land in a spare column
        return keys, mask[:, :E]

    def _grouped_out(self, o: torch.Tensor) -> torch.Tensor:
        """[T, H*d] -> [T, groups * o_lora_rank]: group g's slice through its own block."""
        T, G = o.shape[0], self.groups
        w = self.o_a_proj.weight.view(G, -1, o.shape[1] // G)  # [G, o_lora, H*d/G]
        y = torch.bmm(o.view(T, G, o.shape[1] // G).transpose(0, 1), w.transpose(1, 2))  # [G, T, o_lora]
        return y.transpose(0, 1).flatten(1)


def _read(region, st: V4Step) -> torch.Tensor:
    """The pre positions' rows of a ring region (stale beyond its look-back: never used)."""
    m = st.meta
    return region.view(st.rings)[m.pre_ring, m.pre_slot[region.count]]


def _write(region, st: V4Step, rows: torch.Tensor) -> None:
    """Store the batch's rows in a ring region: of each chunk, the last `span` positions
    (listed, with their ring and slot, by the batcher: asking the device would wait on it)."""
    m, s = st.meta, region.count
    region.view(st.rings)[m.keep_ring[s], m.keep_slot[s]] = rows[m.keep[s]].to(st.rings.dtype)
