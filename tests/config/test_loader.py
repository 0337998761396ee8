import pytest

from moemesh.services.decode.config import DecodeConfig
from moemesh.services.gateway.config import GatewayConfig
from moemesh.shared.config.loader import ConfigFileError, load, parse_overrides


def test_precedence_file_then_env_then_cli(tmp_path):
    f = tmp_path / "mesh.toml"
    f.write_text('[common]\nmodel = "/m"\nnats_url = "nats://a:1"\nport = 9\n'
                 '[decode]\nmax_num_seqs = 8\nstaging_mb = 32\n[decode.extra]\nignored = 1\n')
    cfg = load(DecodeConfig, "decode", f, parse_overrides(["staging_mb=64"]),
               {"MOEMESH_DECODE_MAX_NUM_SEQS": "16", "MOEMESH_NATS_URL": "nats://b:2"})
    assert (cfg.model, cfg.nats_url, cfg.max_num_seqs, cfg.staging_mb) == ("/m", "nats://b:2", 16, 64)
    gw = load(GatewayConfig, "gateway", f, {}, {})
    assert gw.port == 9 and gw.model == "/m"


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    f = tmp_path / "mesh.toml"
    f.write_text('[decode]\nmodel = "/m"\nmax_num_seq = 8\n')
    with pytest.raises(ConfigFileError, match=r"\[decode\] has unknown key 'max_num_seq'"):
        load(DecodeConfig, "decode", f, {}, {})
    with pytest.raises(ConfigFileError, match="cannot use 'lots' as int"):
        load(DecodeConfig, "decode", None, {"model": "/m", "max_num_seqs": "lots"}, {})
    with pytest.raises(ConfigFileError, match="on_transfer_failure must be"):
        load(DecodeConfig, "decode", None, {"model": "/m", "on_transfer_failure": "pray"}, {})
    with pytest.raises(ConfigFileError, match="expert_placement must be one of linear, round_robin"):
        load(DecodeConfig, "decode", None, {"model": "/m", "expert_placement": "striped"}, {})
    with pytest.raises(ConfigFileError, match="model is required"):
        load(DecodeConfig, "decode", None, {}, {})
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        (tmp_path / "bad.toml").write_text("[x\n")
        load(DecodeConfig, "decode", tmp_path / "bad.toml", {}, {})
    with pytest.raises(ConfigFileError, match="--set expects field=value"):
        parse_overrides(["oops"])


def test_bool_and_optional_coercion():
    cfg = load(GatewayConfig, "gateway", None, {"model": "/m", "port": "0"}, {"MOEMESH_LOG_LEVEL": "debug"})
    assert cfg.port == 0 and cfg.log_level == "debug"
