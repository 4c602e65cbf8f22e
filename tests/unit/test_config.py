import re
from pathlib import Path

import pytest

from p2p_diloco.cli import build_parser, load_join_config
from p2p_diloco.config import Config, ConfigError, load_config, parse_set

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _args(argv):
    return build_parser().parse_args(["join", *argv])


def test_precedence_defaults_file_set_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("P2P_DILOCO_INITIAL_PEERS", raising=False)
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[train]\ninner_steps = 7\nlr = 0.5\n[run]\nrun_id = "from-file"\n[data]\nbatch_size = 3\n')
    # defaults only
    assert load_join_config(_args([])).train.inner_steps == Config().train.inner_steps
    # file beats defaults
    cfg = load_join_config(_args(["--config", str(cfg_file)]))
    assert (cfg.train.inner_steps, cfg.train.lr, cfg.run.run_id, cfg.data.batch_size) == (7, 0.5, "from-file", 3)
    # --set beats file
    cfg = load_join_config(_args(["--config", str(cfg_file), "--set", "train.inner_steps=9", "--set",
                                  "run.run_id=from-set"]))
    assert (cfg.train.inner_steps, cfg.run.run_id, cfg.train.lr) == (9, "from-set", 0.5)
    # flags beat --set
    cfg = load_join_config(_args(["--config", str(cfg_file), "--set", "train.inner_steps=9", "--inner-steps", "11",
                                  "--set", "run.run_id=from-set", "--run-id", "from-flag", "--max-rounds", "4",
                                  "--set", "run.max_rounds=2", "--data-seed", "5"]))
    assert (cfg.train.inner_steps, cfg.run.run_id, cfg.run.max_rounds, cfg.data.seed) == (11, "from-flag", 4, 5)


def test_set_parses_toml_else_string():
    assert parse_set("train.lr=3e-4") == ("train", "lr", 3e-4)
    assert parse_set("swarm.host_maddrs=['/ip4/0.0.0.0/tcp/0']")[2] == ["/ip4/0.0.0.0/tcp/0"]
    assert parse_set("data.path=/some/dir/*.txt") == ("data", "path", "/some/dir/*.txt")
    assert parse_set("outer.nesterov=false")[2] is False


@pytest.mark.parametrize("item, message", [
    ("train.nope=1", "unknown config key train.nope"),
    ("bogus.lr=1", "unknown config section"),
    ("train.inner_steps=abc", "must be an integer"),
    ("train.inner_steps=0", "must be > 0"),
    ("outer.momentum=1.5", "outer.momentum"),
    ("noequals", "section.key=value"),
])
def test_bad_values_are_config_errors(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [item])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/x.toml")


def test_every_shipped_config_loads():
    files = sorted((ROOT / "configs").glob("*.toml"))
    assert len(files) >= 3
    for f in files:
        cfg = load_config(f)
        assert cfg.model.num_layers > 0 and cfg.fingerprint()
    paper = load_config(ROOT / "configs" / "llama-150m-c4.toml")
    assert (paper.train.lr, paper.train.warmup_steps, paper.train.inner_steps) == (4e-4, 1000, 500)
    assert (paper.outer.lr, paper.outer.momentum, paper.model.num_layers) == (0.7, 0.9, 12)


def test_every_peer_profile_references_loadable_configs():
    import re
    import subprocess

    profiles = sorted((ROOT / "peers").iterdir())
    assert profiles
    for f in profiles:
        subprocess.run(["bash", "-n", str(f)], check=True)
        for command in re.findall(r"exec p2p-diloco (\w+)", f.read_text()):
            assert command in ("join", "bootstrap"), (f, command)
        for ref in re.findall(r"configs/[\w.-]+\.toml", f.read_text()):
            load_config(ROOT / ref)


def test_fingerprint_changes_with_model_and_outer_only():
    a = Config()
    b = load_config(None, ["train.lr=0.5", "data.batch_size=2"])
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != load_config(None, ["model.num_layers=3"]).fingerprint()
    assert a.fingerprint() != load_config(None, ["outer.lr=0.5"]).fingerprint()


def test_security_settings_keep_old_fingerprints_at_their_defaults():
    # the default fingerprint before outer.aggregation / norm_bound / trim existed (commit 44022bd): old runs and
    # checkpoints keep it, while peers that set them differently cannot average together
    assert Config().fingerprint() == "54f7714b4f25631b"
    assert load_config(None, ["outer.sharding=sharded"]).fingerprint() == "ed4e40a7837ef605"
    for item in ("outer.aggregation=centered_clip", "outer.norm_bound=5", "outer.trim=0.1"):
        assert load_config(None, [item]).fingerprint() != Config().fingerprint(), item
    assert load_config(None, ["swarm.allowed_peers=['x']"]).fingerprint() == Config().fingerprint()


@pytest.mark.parametrize("item, needle", [
    ("outer.aggregation=median", "outer.aggregation must be one of mean, trimmed_mean, centered_clip"),
    ("outer.norm_bound=0.5", "outer.norm_bound must be 0 (off) or > 1"),
    ("outer.norm_bound=-1", "outer.norm_bound must be 0 (off) or > 1"),
    ("outer.trim=0.5", "outer.trim must be in [0, 0.5)"),
    ("debug.corrupt_pseudo_gradient='scale:x'", "debug.corrupt_pseudo_gradient: bad corruption mode"),
])
def test_security_settings_are_checked(item, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, [item])
