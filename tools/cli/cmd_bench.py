"""`moemesh bench ...`: benchmarks that print a table and save JSON.

Each benchmark registers itself from its own module in BENCHES."""

from __future__ import annotations

from moemesh.tools.cli import (
    bench_chaos, bench_eplb, bench_forward, bench_gateway_start, bench_grammar, bench_idle, bench_kv, bench_kv_bytes,
    bench_kv_reuse, bench_launches, bench_phases, bench_plan_check, bench_rack, bench_serve, bench_stream,
)

BENCHES = [bench_forward, bench_kv, bench_serve, bench_eplb, bench_phases, bench_stream, bench_idle, bench_kv_reuse,
           bench_kv_bytes, bench_gateway_start, bench_grammar, bench_chaos, bench_rack, bench_plan_check, bench_launches]


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    for mod in BENCHES:
        mod.register(bsub)

