"""`moemesh bench rack`'s layout, without starting anything: who runs on which host, and
what each binds to and connects to."""

from __future__ import annotations

from moemesh.tools.bench.rack import RackConfig, goal_check, nats_nodes, plan, SCENARIOS
from moemesh.tools.launch.rack_net import plan_hosts


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _sets(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def test_every_service_is_on_its_host_and_prefers_its_own_nats_node():
    hosts = plan_hosts(3, "t")
    procs = {p.name: p for p in plan(RackConfig(), hosts, "/m")}
    assert {n: p.host for n, p in procs.items()} == {
        "kv_store": "h3", "prefill-0": "h1", "decode-i0-r0": "h2", "decode-i0-r1": "h2", "decode-1": "h3",
        "gateway": "h1"}
    for p in procs.values():
        own = next(h for h in hosts if h.name == p.host)
        urls = _arg(p.argv, "--nats-url").split(",")
        assert len(urls) == 3 and urls[0] == f"nats://{own.ctl_addr}:4222"
    gw = procs["gateway"].argv
    assert _arg(gw, "--host") == hosts[0].ctl_addr
    r1 = _sets(procs["decode-i0-r1"].argv)
    assert r1["ucx_net_devices"] == "data0" and r1["ucx_tls"] == "tcp"
    assert r1["dist_init"].startswith(f"tcp://{hosts[1].ctl_addr}:") and r1["dp_rank"] == "1"
    assert procs["decode-i0-r1"].env == {"GLOO_SOCKET_IFNAME": "ctl0"}
    wide = {p.name for p in plan(RackConfig(second_dep=2), hosts, "/m")}
    assert {"decode-i1-r0", "decode-i1-r1"} <= wide and "decode-1" not in wide


def test_the_nats_nodes_are_one_per_host():
    hosts = plan_hosts(3, "t")
    assert [(n.name, n.host) for n in nats_nodes(hosts)] == [(f"nats-{i}", h.ctl_addr) for i, h in enumerate(hosts, 1)]


def test_a_slow_rank_whose_streams_moved_misses_the_straggler_goal():
    row = {"complete_of_counted": 100, "counted": 100, "hung": 0, "tokens_lost": 0, "wrong": 0, "max_stall_s": 3.0,
           "migrated": 0, "leftover": {"clean_after_s": 0.0}}
    assert goal_check(row, SCENARIOS["straggler"]) == "met"
    assert goal_check({**row, "migrated": 33}, SCENARIOS["straggler"]).startswith("MISSED")
    assert goal_check({**row, "leftover": {"clean_after_s": None}}, SCENARIOS["kill-rank"]) == "MISSED (leftover)"
