"""The deployment file: `moemesh up --config` takes its pools from it (flags win), passes
it to every service, and every service reads its own tables and ignores [pools]."""

from __future__ import annotations

from pathlib import Path

import pytest

from moemesh.tools.cli.main import build_parser
from moemesh.tools.cli.cmd_up import config_from_args
from moemesh.shared.config.loader import ConfigFileError, load
from moemesh.tools.launch.up import launch_plan, up_config

REPO = Path(__file__).resolve().parents[2]

DEPLOYMENT = """
[common]
nats_url = "nats://10.0.0.5:4222"
model = "/models/v3"

[pools]
prefill = 1
decode = 2
prefill_dep = 1
decode_dep = 2
redundant = 1

[gateway]
nats_user = "gateway"
host = "0.0.0.0"
port = 8080

[decode]
nats_user = "decode"
max_num_seqs = 32
"""


@pytest.fixture
def deployment(tmp_path) -> Path:
    p = tmp_path / "moemesh.toml"
    p.write_text(DEPLOYMENT)
    return p


def _by_role(plan):
    out = {}
    for launch in plan:
        out.setdefault(launch.argv[0], []).append(launch)
    return out


def test_pools_come_from_the_file(deployment):
    cfg = up_config(str(deployment))
    assert (cfg.num_prefill, cfg.num_decode, cfg.prefill_dp, cfg.decode_dp, cfg.eplb_redundant) == (1, 2, 1, 2, 1)
    assert (cfg.nats_url, cfg.model, cfg.host, cfg.port) == ("nats://10.0.0.5:4222", "/models/v3", "0.0.0.0", 8080)
    plan = launch_plan(cfg, cfg.model, cfg.nats_url, cfg.port)
    roles = _by_role(plan)
    assert len(roles["moemesh.services.prefill"]) == 1
    assert len(roles["moemesh.services.decode"]) == 4  # two DEP2 instances, one process per rank
    assert len(roles["moemesh.services.balancer"]) == 1  # redundant slots need one
    assert "moemesh.services.kv_store" not in roles
    assert plan[-1].argv[0] == "moemesh.services.gateway"  # opens its port last
    for launch in plan:
        i = launch.argv.index("--config")
        assert launch.argv[i + 1] == str(deployment.resolve())
    ranks = sorted(a for launch in roles["moemesh.services.decode"] for a in launch.argv if a.startswith("dp_rank="))
    assert ranks == ["dp_rank=0", "dp_rank=0", "dp_rank=1", "dp_rank=1"]
    instances = {a for launch in roles["moemesh.services.decode"] for a in launch.argv if a.startswith("instance_id=")}
    assert len(instances) == 2
    assert all("eplb_redundant=1" in launch.argv for launch in roles["moemesh.services.decode"])


def test_flags_override_the_file(deployment):
    args = build_parser().parse_args(["up", "--config", str(deployment), "--decode", "1", "--dep", "1",
                                      "--redundant", "0", "--no-balancer", "--port", "9000"])
    cfg = config_from_args(args)
    assert (cfg.num_decode, cfg.decode_dp, cfg.eplb_redundant, cfg.balancer, cfg.port) == (1, 1, 0, False, 9000)
    assert cfg.num_prefill == 1 and cfg.nats_url == "nats://10.0.0.5:4222"  # not given: the file's
    roles = _by_role(launch_plan(cfg, cfg.model, cfg.nats_url, cfg.port))
    assert len(roles["moemesh.services.decode"]) == 1 and "moemesh.services.balancer" not in roles


def test_without_a_file_the_defaults_stand():
    cfg = config_from_args(build_parser().parse_args(["up"]))
    assert (cfg.num_prefill, cfg.num_decode, cfg.decode_dp, cfg.port, cfg.nats_url, cfg.config_file, cfg.kv_store) == \
        (1, 1, 1, 8000, "", "", False)
    plan = launch_plan(cfg, "/m", "nats://127.0.0.1:4222", 8000)
    assert [launch.name for launch in plan] == ["prefill-0", "decode-0", "gateway"]
    assert all("--config" not in launch.argv for launch in plan)


def test_gateways_pool_numbers_them_on_consecutive_ports(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text("[pools]\ngateways = 3\n")
    plan = launch_plan(up_config(str(p)), "/m", "nats://h:4222", 8000)
    gateways = [(lc.name, lc.argv[lc.argv.index("--port") + 1], lc.argv[lc.argv.index("--worker-id") + 1])
                for lc in plan if lc.argv[0] == "moemesh.services.gateway"]
    assert gateways == [(f"gateway-{i}", str(8000 + i), f"gateway-{i}") for i in range(3)]


def test_kv_store_pool(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text("[pools]\nkv_store = true\n")
    plan = launch_plan(up_config(str(p)), "/m", "nats://h:4222", 8000)
    assert plan[0].argv[0] == "moemesh.services.kv_store"  # before the workers that will use it


@pytest.mark.parametrize("pools, match", [
    ("decodes = 2", "unknown key 'decodes'"),
    ('decode = "2"', "decode must be int"),
    ("balancer = 1", "balancer must be bool"),
    ("kv_store = 2", "kv_store must be bool"),
    ("gateways = 0", "gateways must be >= 1"),
    ("decode_dep = 0", "DEP widths"),
])
def test_bad_pools_are_errors(tmp_path, pools, match):
    p = tmp_path / "bad.toml"
    p.write_text(f"[pools]\n{pools}\n")
    with pytest.raises(ConfigFileError, match=match):
        up_config(str(p))


def test_services_read_their_tables_and_ignore_pools(deployment):
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.services.gateway.config import GatewayConfig

    gw = load(GatewayConfig, "gateway", deployment, environ={})
    assert (gw.port, gw.nats_user, gw.nats_url) == (8080, "gateway", "nats://10.0.0.5:4222")
    dec = load(DecodeConfig, "decode", deployment, environ={})
    assert (dec.max_num_seqs, dec.nats_user) == (32, "decode")


def _service_configs():
    from moemesh.services.balancer.config import BalancerConfig
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.services.gateway.config import GatewayConfig
    from moemesh.services.prefill.config import PrefillConfig

    out = [("gateway", GatewayConfig), ("prefill", PrefillConfig), ("decode", DecodeConfig),
           ("balancer", BalancerConfig)]
    try:  # being built alongside; checked once it exists, whatever its class is called
        import moemesh.services.kv_store.config as kv
    except ImportError:
        return out
    from moemesh.shared.config.common import ServiceConfig

    out += [("kv_store", c) for c in vars(kv).values()
            if isinstance(c, type) and issubclass(c, ServiceConfig) and c.__module__ == kv.__name__]
    return out


@pytest.mark.parametrize("section, cls", _service_configs())
def test_the_compose_deployment_file_is_valid_for_every_service(section, cls):
    cfg = load(cls, section, REPO / "compose" / "moemesh.toml", environ={})
    assert cfg.nats_user == ""  # each container's own, from docker-compose.yml (MOEMESH_NATS_USER)
    assert cfg.metrics_port == 9100 and cfg.otlp_endpoint.startswith("http://otel-collector:")
    assert cfg.nats_password == ""  # secrets come from the environment, never the file
    if hasattr(cfg, "ucx_net_devices"):  # moves KV bytes: other containers reach it on eth0, not loopback
        assert (cfg.ucx_net_devices, cfg.ucx_tls) == ("eth0", "tcp"), section


@pytest.mark.parametrize("section, cls", _service_configs())
def test_the_rack_file_leaves_each_process_its_own_nats_user(section, cls):
    """No per-role NATS user in the rack file: each process connects as its worker id,
    from its env file (compose/systemd/example.env), with a password of its own."""
    # A prefill instance's rendezvous is in its ranks' env files too.
    env = {"MOEMESH_PREFILL_DIST_INIT": "tcp://10.1.2.1:29500"}
    cfg = load(cls, section, REPO / "compose" / "rack" / "moemesh.toml", environ=env)
    assert cfg.nats_user == "" and cfg.nats_password == ""
    if section == "kv_store":  # serves KV across hosts: never loopback only (the workers name
        assert cfg.ucx_net_devices not in ("", "lo")  # the NIC nearest their GPU in their env files)


def test_the_rack_file_plans_a_dep32_decode_instance_and_dep4_prefills():
    rack = REPO / "compose" / "rack" / "moemesh.toml"
    cfg = up_config(str(rack))
    roles = _by_role(launch_plan(cfg, cfg.model, cfg.nats_url, cfg.port))
    assert len(roles["moemesh.services.decode"]) == 32 and len(roles["moemesh.services.prefill"]) == 16
    assert len({a for launch in roles["moemesh.services.prefill"] for a in launch.argv if a.startswith("instance_id=")}) == 4
    assert len(roles["moemesh.services.balancer"]) == 1 and len(roles["moemesh.services.kv_store"]) == 1
    assert [lc.name for lc in roles["moemesh.services.gateway"]] == ["gateway-0", "gateway-1"]
    from moemesh.services.balancer.config import BalancerConfig
    from moemesh.services.gateway.config import GatewayConfig

    assert load(BalancerConfig, "balancer", rack, environ={}).num_nodes == 4
    assert load(GatewayConfig, "gateway", rack, environ={}).api_keys_file


def test_the_compose_workers_settings_build_deepseek_v4_engines(tiny_v4_model):
    """compose/moemesh.toml with the model swapped for a DeepSeek-V4 folder (MOEMESH_MODEL,
    as the cpu profile's MOEMESH_CPU_PRESET=v4-tiny and the gpu profile set it) gives a
    prefill and a decode engine whose hand-off layouts match."""
    from moemesh.services.decode.config import DecodeConfig
    from moemesh.services.prefill.config import PrefillConfig
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import LLMEngine
    from moemesh.shared.kv.spec import compatible, describe

    engines = []
    for role, cls in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        cfg = load(cls, role, REPO / "compose" / "moemesh.toml",
                   environ={"MOEMESH_MODEL": tiny_v4_model, "MOEMESH_NUM_KV_BLOCKS": "64"})
        assert cfg.model == tiny_v4_model
        engines.append(LLMEngine(EngineConfig.for_worker(cfg, role)))
    pre, dec = engines
    assert pre.hybrid and dec.hybrid and dec.num_spec == 1
    assert compatible(describe(dec), describe(pre))
