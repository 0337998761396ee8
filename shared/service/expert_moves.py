"""Live expert moves on one rank of a DEP instance.

Lifecycle of a move: planned (MovePlan arrives) -> staging (the weights of every slot
that changes are copied into staging memory: from a local slot, or over UCX from the
rank that holds the expert now, while decode steps go on) -> staged (reported to the
balancer) -> ready (MoveCommit arrived) -> switched, at the first step boundary where
every rank is ready: staged weights are copied into their slots and the new
placement's routing tables take effect on all ranks at once. Aborted (MoveAbort, a
failure anywhere, or no commit in time): staging is dropped and the old placement,
which was never touched, stays whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from moemesh.shared.model.expert_parallel import ExpertParallel
from moemesh.shared.transport.base import TransferError
from moemesh.shared.transport.staging import StagingPool, StagingSlot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    row: int  # index of the MoE layer in the placement
    dst: int  # global slot that gets a new expert
    expert: int
    src: int  # global slot that holds that expert now


def plan_changes(old: torch.Tensor, new: torch.Tensor, slots_per_rank: int) -> list[Change]:
    """Every slot whose expert changes, with where to copy the weights from: a slot of the
    same rank when there is one (a local copy), else the lowest slot holding it."""
    out = []
    for row in range(new.shape[0]):
        for dst in (old[row] != new[row]).nonzero().flatten().tolist():
            e = int(new[row, dst])
            holders = (old[row] == e).nonzero().flatten().tolist()
            if not holders:
                raise ValueError(f"layer row {row}: expert {e} is held nowhere now, so it cannot be copied")
            same = [q for q in holders if q // slots_per_rank == dst // slots_per_rank]
            out.append(Change(row, dst, e, (same or holders)[0]))
    return out


def move_tag(move_id: int, row: int, dst: int) -> int:
    return ((move_id & 0xFFFFF) << 42) | ((row & 0x3FF) << 32) | (dst & 0xFFFFFFFF) | (1 << 62)


@dataclass
class Move:
    move_id: int
    new: torch.Tensor  # [layers, P]
    incoming: dict[Change, StagingSlot] = field(default_factory=dict)
    transfers: list = field(default_factory=list)  # (receive, its staging slot) still owned by UCX until done
    error: str = ""
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    bytes_received: int = 0
    bytes_sent: int = 0


class MoveAgent:
    def __init__(self, ep: ExpertParallel, transport, staging: StagingPool, peer_address, timeout_s: float = 30.0,
                 fail_for_test: bool = False):
        """peer_address(rank) -> UCX address of that rank of this instance, or None."""
        self.ep, self.transport, self.staging = ep, transport, staging
        self.peer_address = peer_address
        self.timeout_s = timeout_s
        self.fail_for_test = fail_for_test
        self.version = 0
        self.move: Move | None = None

    @property
    def ready_move_id(self) -> int:
        return self.move.move_id if self.move is not None and self.move.ready else 0

    def _expert_bytes(self, layer_id: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.ep.layers[layer_id].experts
        return ex.gate_up_proj[local], ex.down_proj[local]

    async def stage(self, move_id: int, new: torch.Tensor) -> Move:
        """Copy in every weight this rank needs for the new placement. Raises on failure."""
        if self.move is not None:
            raise RuntimeError(f"move {self.move.move_id} is still in progress")
        old = self.ep.phy2log()
        if new.shape != old.shape:
            raise ValueError(f"plan placement has shape {tuple(new.shape)}, this instance {tuple(old.shape)}")
        S, me = old.shape[1] // self.ep.world, self.ep.rank
        move = self.move = Move(move_id, new.clone())
        changes = plan_changes(old, new, S)
        lids = self.ep.layer_ids
        recvs, sends = [], []
        for ch in changes:
            lid = lids[ch.row]
            if ch.dst // S == me:
                w13, w2 = self._expert_bytes(lid, ch.dst % S)
                slot = self.staging.alloc(w13.numel() * w13.element_size() + w2.numel() * w2.element_size())
                if slot is None:
                    raise RuntimeError("staging memory is full; raise staging_mb")
                move.incoming[ch] = slot
                if ch.src // S == me:  # local: stage a copy now, since the source may change too
                    a, b = self._expert_bytes(lid, ch.src % S)
                    _pack(slot, a, b)
                else:
                    tr = self.transport.post_recv(slot.buffer(), move_tag(move_id, ch.row, ch.dst))
                    move.transfers.append((tr, slot))
                    recvs.append(tr)
                    move.bytes_received += slot.nbytes
            elif ch.src // S == me:
                sends.append((ch, lid))
        if self.fail_for_test:
            raise RuntimeError("injected move failure")
        out = self.staging.alloc(max((self._packed_size(lid) for _, lid in sends), default=1))
        try:
            for ch, lid in sends:  # one at a time through one staging range
                a, b = self._expert_bytes(lid, ch.src % S)
                _pack(out, a, b)
                peer = await self._peer(ch.dst // S)
                n = a.numel() * a.element_size() + b.numel() * b.element_size()
                await self.transport.send(peer, out.buffer()[:n], move_tag(move_id, ch.row, ch.dst), self.timeout_s)
                move.bytes_sent += n
            for r in recvs:
                await r.wait(self.timeout_s)
        finally:
            if out is not None:
                self.staging.free(out)
        move.transfers = []
        return move

    async def _peer(self, rank: int, wait_s: float = 3.0) -> bytes:
        """The rank's UCX address; a rank that started a moment ago may not have beaten yet."""
        deadline = time.monotonic() + wait_s
        while (peer := self.peer_address(rank)) is None:
            if time.monotonic() > deadline:
                raise TransferError(f"no address for rank {rank}")
            await asyncio.sleep(0.05)
        return peer

    def _packed_size(self, lid: int) -> int:
        a, b = self._expert_bytes(lid, 0)
        return a.numel() * a.element_size() + b.numel() * b.element_size()

    def mark_ready(self, move_id: int) -> bool:
        if self.move is None or self.move.move_id != move_id:
            return False
        self.move.ready = True
        return True

    def switch(self) -> int:
        """At a step boundary every rank agreed on: staged weights into their slots, then
        the new routing tables. Returns the new placement version."""
        move, self.move = self.move, None
        S = move.new.shape[1] // self.ep.world
        lids = self.ep.layer_ids
        with torch.no_grad():
            for ch, slot in move.incoming.items():
                a, b = self._expert_bytes(lids[ch.row], ch.dst % S)
                _unpack(slot, a, b)
                self.staging.free(slot)
        for row, lid in enumerate(lids):
            if not torch.equal(self.ep.layers[lid].phy2log, move.new[row]):
                self.ep.layers[lid].set_placement(move.new[row])
        self.version += 1
        return self.version

    async def abort(self, move_id: int | None = None) -> None:
        move = self.move
        if move is None or (move_id is not None and move.move_id != move_id):
            return
        self.move = None
        pending = {id(slot) for _, slot in move.transfers}
        for tr, slot in move.transfers:
            if await tr.abandon(1.0):
                self.staging.free(slot)
            else:  # bytes still landing: free the range once the receive ends
                tr.add_done_callback(lambda _t, s=slot: self.staging.free(s))
        for slot in move.incoming.values():
            if id(slot) not in pending:
                self.staging.free(slot)


def _pack(slot: StagingSlot, a: torch.Tensor, b: torch.Tensor) -> None:
    na = a.numel() * a.element_size()
    slot.tensor[:na].copy_(a.reshape(-1).view(torch.uint8))
    slot.tensor[na : na + b.numel() * b.element_size()].copy_(b.reshape(-1).view(torch.uint8))


def _unpack(slot: StagingSlot, a: torch.Tensor, b: torch.Tensor) -> None:
    na = a.numel() * a.element_size()
    a.copy_(slot.tensor[:na].view(a.dtype).view(a.shape))
    b.copy_(slot.tensor[na : na + b.numel() * b.element_size()].view(b.dtype).view(b.shape))
