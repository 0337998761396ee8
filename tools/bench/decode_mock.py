"""`moemesh bench decode --mock-step-ms X`: the decode-only bench mesh on the mock engine.

The mesh is `bench decode`'s (decode workers with bench_dummy_kv, a gateway in
decode_only_bench mode, no prefill worker) with `engine = "mock"`: every step takes X ms
and gives each running sequence one token (with --spec-tokens K at --accept-rate A, the mock
drafts too: 1 + A + ... + A^K tokens a step), so with B streams the ideal is
B × that × 1000 / X tokens/s and anything short of it is host overhead. There is no forward-only run.
With --dep N the decode worker is a DEP-N instance of mock ranks (shared/engine/mock_model.py)
and --skew bends its routing; the ideal stays the balanced one, per instance, and each point
adds the instance's balance ratio and rank 0's rank wait.

Run: the mesh -> a short warm-up -> for each batch B, the load client
(`moemesh.tools.bench.sse_client`) in its own process with B streams of completions (a prompt
of `isl` token ids, `osl` output tokens) back to back for `seconds` -> per point,
tokens/s against the ideal, CPU µs per token of the gateway, decode and nats processes
and their sum over the load window, and the decode worker's step figures (step, host
and exposed host ms, the share of host hidden behind the forward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moemesh.tools.bench import overhead
from moemesh.tools.bench.env import environment
from moemesh.tools.launch.up import Mesh, UpConfig, default_home, ensure_tiny_model

ROLES = ("gateway", "decode", "nats")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class MockDecodeConfig:
    model: str = ""
    mock_step_ms: float = 20.0
    isl: int = 512
    osl: int = 64
    batches: tuple[int, ...] = (8, 32, 64, 128, 256)
    seconds: float = 10.0
    warmup_s: float = 2.0
    threads: int = 1
    spec_tokens: int = 0  # the mock's drafts a step (0: no draft head)
    accept_rate: float = 0.7  # each draft's chance, with spec_tokens
    dep: int = 1  # ranks of the decode instance
    skew: str = ""  # its routing skew (DEP only)

    def __post_init__(self) -> None:
        if self.dep < 1 or (self.skew and self.dep == 1):
            raise ValueError("--dep must be >= 1, and --skew needs --dep 2 or more")
        if self.mock_step_ms <= 0 or not self.batches or min(self.batches) < 1:
            raise ValueError("--mock-step-ms must be > 0 and --batch values >= 1")
        if self.isl < 1 or self.osl < 1 or self.seconds < 0:
            raise ValueError("--isl and --osl must be >= 1, --seconds >= 0")
        overhead.draft_gain(self.spec_tokens, self.accept_rate)  # raises on draft flags out of range

    @property
    def tokens_per_step(self) -> float:
        return overhead.draft_gain(self.spec_tokens, self.accept_rate)


def _mesh(cfg: MockDecodeConfig) -> Mesh:
    top = max(cfg.batches)
    blocks_per_seq = -(-(cfg.isl + cfg.osl + cfg.spec_tokens) // BLOCK_SIZE)
    worker = ("engine=mock", f"mock_step_ms={cfg.mock_step_ms}", f"num_threads={cfg.threads}",
              f"block_size={BLOCK_SIZE}", f"max_num_seqs={max(top, 64)}",
              f"max_num_batched_tokens={max(16384, top * (64 + cfg.spec_tokens))}",
              f"num_kv_blocks={max(16384, 2 * top * blocks_per_seq)}")
    drafts = (f"num_speculative_tokens={cfg.spec_tokens}",) + (
        (f"mock_accept_rate={cfg.accept_rate}",) if cfg.spec_tokens else ())
    if cfg.dep > 1:
        drafts += (f"skew={cfg.skew}", "load_window_steps=128", "load_publish_interval_s=0.5")
    model = cfg.model or str(ensure_tiny_model(default_home()))
    return Mesh(UpConfig(model=model, port=0, num_prefill=0, decode_dp=cfg.dep, service_args=worker,
                         decode_args=("bench_dummy_kv=true", *drafts),
                         gateway_args=("decode_only_bench=true", f"max_inflight={top * 2}"), balancer=False))


def run(cfg: MockDecodeConfig) -> dict:
    rows = []
    with _mesh(cfg) as mesh:
        model, pids = Path(mesh.model).name, overhead.mesh_pids(mesh)
        warmup = None
        if cfg.warmup_s > 0:
            warmup = overhead.run_client(mesh.url, model, min(8, max(cfg.batches)), cfg.warmup_s, min(cfg.osl, 32),
                                         cfg.mock_step_ms, prompt_tokens=cfg.isl)
        for b in cfg.batches:
            res = overhead.run_client(mesh.url, model, b, cfg.seconds, cfg.osl, cfg.mock_step_ms,
                                      prompt_tokens=cfg.isl, pids=pids)
            ratio, steps = overhead.decode_state(mesh, cfg.dep)
            row = overhead.point_row(res, cfg.mock_step_ms, ROLES, steps, cfg.tokens_per_step,
                                     ratio if cfg.dep > 1 else None)
            rows.append({"batch": b, **row})
    return {"bench": "decode", "mode": "mock", "config": asdict(cfg), "env": environment(), "warmup": warmup,
            "runs": [{"label": "mock" if cfg.dep == 1 else f"mock DEP{cfg.dep}", "skew": cfg.skew, "points": rows}]}


def table(r: dict) -> str:
    c = r["config"]
    drafts = c.get("spec_tokens", 0)
    mtp = f", {drafts} drafts a step at accept rate {c['accept_rate']:g}" if drafts else ""
    if c.get("dep", 1) > 1:
        mtp += f", DEP{c['dep']} (skew {c['skew'] or 'none'})"
    head = (f"decode only, mock step {c['mock_step_ms']} ms{mtp}, isl {c['isl']}, osl {c['osl']}, {c['seconds']:g} s per "
            f"point; CPU us per output token of each process (gw+dec+nats = mesh), client apart")
    return head + "\n" + overhead.table(r["runs"][0]["points"], ROLES, "batch")
