"""`moemesh bench rack`'s layout, without starting anything: who runs on which host, and
what each binds to and connects to."""

from __future__ import annotations

from moemesh.tools.bench.rack import SCENARIOS, RackConfig, goal_check, nats_nodes, plan, second_turns
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


def test_the_store_host_scenario_judges_its_second_turns():
    probes = [{"t_sent": 99.0, "error": None, "ttft_s": 0.1}, {"t_sent": 101.0, "error": None, "ttft_s": 3.2},
              {"t_sent": 102.0, "error": None, "ttft_s": 0.2}]
    before = {"kv_pulled_tokens": 48.0, "kv_pulls_failed": 0.0, "kv_pull_wait_max_s": 0.01}
    after = {"kv_pulled_tokens": 48.0, "kv_pulls_failed": 1.0, "kv_pull_wait_max_s": 3.05}
    t = second_turns({"probes": probes, "fault_at": 100.0}, before, after, transfer_timeout_s=3.0)
    assert (t["sent_before_fault"], t["sent_after_fault"], t["complete"]) == (1, 2, 3)
    assert t["ttft_max_after_s"] == 3.2 and t["fetches_given_up"] == 1 and t["pulled_tokens_after_fault"] == 0
    row = {"complete_of_counted": 100, "counted": 100, "hung": 0, "tokens_lost": 0, "wrong": 0, "max_stall_s": 3.0,
           "migrated": 40, "leftover": {"clean_after_s": 0.0}, "second_turns": t}
    sc = SCENARIOS["store-host"]
    assert goal_check(row, sc) == "met"
    slow = second_turns({"probes": probes, "fault_at": 100.0}, before, {**after, "kv_pull_wait_max_s": 6.1}, 3.0)
    assert goal_check({**row, "second_turns": slow}, sc) == "MISSED (a fetch waited 6.1 s)"
    failed = [*probes, {"t_sent": 103.0, "error": "http_500", "ttft_s": None}]
    lost = second_turns({"probes": failed, "fault_at": 100.0}, before, after, 3.0)
    assert goal_check({**row, "second_turns": lost}, sc) == "MISSED (second turns failed)"
    never = second_turns({"probes": probes, "fault_at": 100.0}, {**before, "kv_pulled_tokens": 0.0}, after, 3.0)
    assert goal_check({**row, "second_turns": never}, sc) == "MISSED (no prefix was fetched before the fault)"


def test_a_cut_move_moves_every_expert_and_a_balancer_joins_the_rack_only_for_it():
    import torch

    from moemesh.tools.bench.rack_moves import every_expert_moves, move_goal

    naive = torch.arange(8).repeat(3, 1)  # 3 layers, 2 ranks of 4 slots
    moved = every_expert_moves(naive, 2)
    assert torch.equal(moved[0], torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]))
    assert not torch.isin(moved[:, :4].contiguous(), naive[:, :4].contiguous()).any()  # none stays on its rank
    hosts = plan_hosts(3, "t")
    assert "balancer" not in {p.name for p in plan(RackConfig(), hosts, "/m")}
    bal = next(p for p in plan(RackConfig(), hosts, "/m", ["auto=false"]) if p.name == "balancer")
    assert bal.host == "h1" and _sets(bal.argv) == {"auto": "false"}
    ranks = ["r0", "r1"]
    assert move_goal({"ranks": ranks, "switched": [], "dropped": ranks, "must_drop": True}) == []
    assert move_goal({"ranks": ranks, "switched": [], "dropped": [], "must_drop": False}) == []
    assert move_goal({"ranks": ranks, "switched": [], "dropped": ["r0"], "must_drop": True}) == [
        "a rank kept the staged move"]
    assert move_goal({"ranks": ranks, "switched": ["r1"], "dropped": ranks, "must_drop": True}) == ["switched: r1"]
