"""`moemesh bench stream`: the host overhead of the serving path (gateway, NATS, prefill,
decode) on the mock engine, measured the same way every time.

Run: one local mesh with `engine = "mock"` (a fixed step of `mock_step_ms`, one token per
sequence per step) -> a short warm-up -> for each stream count S, the load client
(`moemesh.tools.bench.sse_client`) in its own process: S streamed chat requests back to back for
`seconds` -> per point, tokens/s against the ideal S × G × 1000 / mock_step_ms (G = 1, or
with --spec-tokens K at --accept-rate A, 1 + A + ... + A^K), CPU µs per
output token of each mesh process and of the mesh as a whole (gateway + prefill + decode
+ nats; the client apart), and the decode worker's step figures over the load window.

Goals: at least 94% of the ideal at every stream count with a 20 ms step; with a 1 ms
step at 256 streams, at least 45,000 tokens/s and at most 25 µs of mesh CPU per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moemesh.tools.bench import overhead
from moemesh.tools.bench.env import environment
from moemesh.tools.launch.up import Mesh, UpConfig

GOALS = {"share_of_ideal_min": 0.94, "share_at_step_ms": 20.0,
         "fast_step_ms": 1.0, "fast_streams": 256, "fast_tokens_per_s_min": 45000.0,
         "fast_mesh_cpu_us_per_token_max": 25.0}
BLOCK_SIZE = 16
PROMPT_TOKENS_MAX = 64  # the client's chat prompt with its template stays under this


@dataclass(frozen=True)
class StreamBenchConfig:
    model: str = ""
    streams: tuple[int, ...] = (8, 64, 256)
    seconds: float = 20.0
    osl: int = 256
    mock_step_ms: float = 20.0
    warmup_s: float = 2.0
    spec_tokens: int = 0  # the mock's drafts a step (0: no draft head)
    accept_rate: float = 0.7  # each draft's chance, with spec_tokens

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ValueError("--streams needs one or more counts >= 1")
        if self.mock_step_ms <= 0 or self.osl < 1 or self.seconds < 0:
            raise ValueError("--mock-step-ms must be > 0, --osl >= 1, --seconds >= 0")
        overhead.draft_gain(self.spec_tokens, self.accept_rate)  # raises on draft flags out of range

    @property
    def tokens_per_step(self) -> float:
        return overhead.draft_gain(self.spec_tokens, self.accept_rate)


def worker_settings(max_streams: int, osl: int, step_ms: float, spec_tokens: int = 0,
                    accept_rate: float = 0.7) -> tuple[str, ...]:
    """Mock worker settings under which no admission or memory limit caps the run: every
    stream runs at once, and a whole wave of prompts is one prefill step. spec_tokens > 0:
    the mock drafts that many tokens a step, each accepted with accept_rate."""
    blocks_per_seq = -(-(PROMPT_TOKENS_MAX + osl + spec_tokens) // BLOCK_SIZE)
    drafts = (f"num_speculative_tokens={spec_tokens}", f"mock_accept_rate={accept_rate}") if spec_tokens else ()
    return ("engine=mock", f"mock_step_ms={step_ms}", f"block_size={BLOCK_SIZE}",
            f"max_num_seqs={max(max_streams, 64)}",
            f"max_num_batched_tokens={max(16384, max_streams * (64 + spec_tokens))}",
            f"num_kv_blocks={max(16384, 2 * max_streams * blocks_per_seq)}", *drafts)


def goal_check(row: dict, step_ms: float) -> str:
    """The goals that apply to this point: "met", "MISSED (...)", or "-" when none does."""
    missed, applies = [], False
    if step_ms == GOALS["share_at_step_ms"]:
        applies = True
        if row["share_of_ideal"] < GOALS["share_of_ideal_min"]:
            missed.append("share")
    if step_ms == GOALS["fast_step_ms"] and row["streams"] == GOALS["fast_streams"]:
        applies = True
        if row["tokens_per_s"] < GOALS["fast_tokens_per_s_min"]:
            missed.append("tok/s")
        mesh = row["cpu_us_per_token"]["mesh"]
        if mesh is None or mesh > GOALS["fast_mesh_cpu_us_per_token_max"]:
            missed.append("CPU/tok")
    if row["errors"]:
        missed.append("errors")
    if not missed:
        return "met" if applies else "-"
    return f"MISSED ({', '.join(missed)})"


def run(cfg: StreamBenchConfig) -> dict:
    top = max(cfg.streams)
    up = UpConfig(model=cfg.model, port=0,
                  service_args=worker_settings(top, cfg.osl, cfg.mock_step_ms, cfg.spec_tokens, cfg.accept_rate),
                  gateway_args=(f"max_inflight={top * 2}",), balancer=False)
    with Mesh(up) as mesh:
        model, pids = Path(mesh.model).name, overhead.mesh_pids(mesh)
        warmup = None
        if cfg.warmup_s > 0:
            warmup = overhead.run_client(mesh.url, model, min(8, top), cfg.warmup_s, min(cfg.osl, 32),
                                         cfg.mock_step_ms, chat=True)
        rows = []
        for streams in cfg.streams:
            res = overhead.run_client(mesh.url, model, streams, cfg.seconds, cfg.osl, cfg.mock_step_ms, chat=True,
                                      pids=pids)
            row = overhead.point_row(res, cfg.mock_step_ms, overhead.MESH_ROLES, overhead.decode_steps(mesh),
                                     cfg.tokens_per_step)
            row["goal"] = goal_check(row, cfg.mock_step_ms)
            rows.append(row)
    return {"bench": "stream", "config": asdict(cfg), "env": environment(), "goal": GOALS,
            "warmup": warmup, "points": rows}


def table(r: dict) -> str:
    c = r["config"]
    drafts = c.get("spec_tokens", 0)
    mtp = f", {drafts} drafts a step at accept rate {c['accept_rate']:g}" if drafts else ""
    head = (f"mock step {c['mock_step_ms']} ms{mtp}, osl {c['osl']}, {c['seconds']:g} s per point; "
            f"CPU us per output token of each process (gw+pre+dec+nats = mesh), client apart")
    return head + "\n" + overhead.table(r["points"], overhead.MESH_ROLES, "streams", extra="goal")
