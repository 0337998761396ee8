"""One rank of a DEP instance, run in a spawned process by the DEP tests, and the pool of
such processes the tests share: a rank process imports torch and the engine once and then
runs one instance after another, each in a process group of its own."""

from __future__ import annotations

import time
import traceback


class RankPool:
    """`size` spawned rank processes, each taking instances from its own queue. An instance
    of `world` ranks runs on the first `world` of them; each gets run_rank's arguments
    after (rank, world, init_method), and answers what run_rank puts on its queue."""

    def __init__(self, size: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(size)]
        self._procs = [ctx.Process(target=_serve, args=(q, self._out), daemon=True) for q in self._jobs]
        self._job = 0
        for p in self._procs:
            p.start()

    def run(self, world: int, *args, timeout_s: float = 240, **kwargs) -> list[tuple]:
        """Each rank's result, by rank. A rank that raised fails the call with its traceback;
        one that never answers (a peer stuck in a collective) fails it after timeout_s."""
        from moemesh.tools.launch.procs import free_port

        assert world <= len(self._procs), f"an instance of {world} ranks on a pool of {len(self._procs)}"
        self._job += 1
        init = f"tcp://127.0.0.1:{free_port()}"
        for r in range(world):
            self._jobs[r].put((self._job, r, world, init, args, kwargs))
        deadline = time.monotonic() + timeout_s
        results = []
        while len(results) < world:
            job, result = self._out.get(timeout=max(0.0, deadline - time.monotonic()))
            if job == self._job:  # not a late answer of an instance that timed out before
                results.append(result)
        errors = [r[1] for r in results if r[0] == "error"]
        assert not errors, "\n".join(errors)
        return sorted(results, key=lambda r: r[0])

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _serve(jobs, out) -> None:
    while (item := jobs.get()) is not None:
        job, rank, world, init, args, kwargs = item
        answer = _Answer(out, job)
        try:
            run_rank(rank, world, init, *args, out_q=answer, **kwargs)
        except BaseException:  # its peers then fail too, by their collectives' timeout
            answer.put(("error", f"rank {rank}: {traceback.format_exc()}"))


class _Answer:
    """run_rank's queue, its answers marked with the instance they belong to."""

    def __init__(self, out, job: int):
        self._out, self._job = out, job

    def put(self, result: tuple) -> None:
        self._out.put((self._job, result))


def run_rank(rank: int, world: int, init_method: str, model_dir: str, prompts: list[list[int]], redundant: int,
             max_tokens: int, num_spec: int, out_q, phy2log=None, placement: str = "linear") -> None:
    """phy2log: [MoE layers, P] placement to switch to once loaded (default: the naive one,
    by the `placement` strategy)."""
    import torch

    torch.set_num_threads(1)
    from moemesh.shared.checkpoint.loader import load_model
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.dp import DPGroup
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.model.config import ModelConfig
    from moemesh.shared.model.expert_parallel import ExpertParallel
    from moemesh.shared.protocol.messages import SamplingParams

    dp = DPGroup(rank, world, init_method)
    try:
        # The instance's start-up sizing, as DepRuntime.build_engine does it.
        cfg = ModelConfig.from_dir(model_dir)
        slots, S = ExpertParallel.naive_slot_map(cfg.n_routed_experts, rank, world, redundant, placement)
        if phy2log is not None:  # a checkpoint with its MTP layer: target layers, then MTP
            layer_ids = cfg.moe_layer_ids + [cfg.num_hidden_layers]
            slots = ExpertParallel.local_slot_map(phy2log, layer_ids, rank, world)
        model = load_model(model_dir, expert_slots=slots, num_slots=S)
        ep = ExpertParallel.naive(model, rank, world, redundant, strategy=placement) if phy2log is None else \
            ExpertParallel(model, rank, world, phy2log)
        eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=256, num_speculative_tokens=num_spec),
                        model=model, lockstep=True)
        mine = {i: p for i, p in enumerate(prompts) if i % world == rank}  # attention is data-parallel
        for i, p in mine.items():
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        outs = {f"r{i}": [] for i in mine}
        steps = 0
        while any(v[0] for v in dp.exchange([int(eng.has_unfinished())])):
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
            steps += 1
        out_q.put((rank, outs, steps, eng.blocks.num_free_blocks == eng.blocks.num_blocks,
                   {"num_moe_layers": len(ep.layer_ids), "has_mtp": model.cfg.has_mtp,
                    "slot_tokens": {lid: layer.slot_tokens.tolist() for lid, layer in ep.layers.items()}}))
    finally:
        dp.close()
