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


def _literal_fields():
    import dataclasses

    from p2p_diloco.config.schema import choices, field_types

    return [(f"{s.name}.{key}", choices(t)) for s in dataclasses.fields(Config)
            for key, t in field_types(s.default_factory).items() if choices(t)]


def test_enum_settings_are_literals_with_the_modules_choices():
    from p2p_diloco.outer.aggregation import METHODS
    from p2p_diloco.outer.codecs import CODECS

    fields = dict(_literal_fields())
    assert set(fields) == {"train.autocast", "train.device", "train.parallelism", "data.streaming",
                           "outer.compression", "outer.sharding", "outer.aggregation", "round.mode",
                           "swarm.transport", "swarm.deadlines"}
    assert fields["outer.compression"] == CODECS and fields["outer.aggregation"] == METHODS
    default = Config()
    for name, allowed in fields.items():  # every default is one of its choices
        section, key = name.split(".")
        assert getattr(getattr(default, section), key) in allowed, name


@pytest.mark.parametrize("name, allowed", _literal_fields())
def test_every_literal_setting_takes_its_choices_and_nothing_else(name, allowed):
    needs = {"outer.compression='topk'": ["outer.aggregation='mean'"]}  # the one choice that needs another
    for value in allowed:
        section, key = name.split(".")
        item = f"{name}='{value}'"
        assert getattr(getattr(load_config(None, [item, *needs.get(item, [])]), section), key) == value
    wording = " or ".join(allowed) if len(allowed) == 2 else "one of " + ", ".join(allowed)
    with pytest.raises(ConfigError, match=f"^{re.escape(f'{name} must be {wording}, got ' + repr('bogus'))}$"):
        load_config(None, [f"{name}=bogus"])


def test_choices_are_checked_on_a_config_built_in_code():
    from p2p_diloco.config.checks import validate

    cfg = Config()
    cfg.outer.compression = "zstd"
    with pytest.raises(ConfigError, match=re.escape("outer.compression must be one of none, fp16, bf16, int8, int4, "
                                                    "topk, got 'zstd'")):
        validate(cfg)


def test_reading_a_config_does_not_import_torch():
    # bad input must fail within a fraction of a second: torch alone takes over a second to import
    import subprocess
    import sys

    code = ("import sys; from p2p_diloco.config import load_config; import p2p_diloco.cli; "
            "load_config(None, ['train.lr=0.5']); print('torch' in sys.modules, 'hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_flag_table_names_real_flags_and_keys(monkeypatch):
    from p2p_diloco.cli.parser import FLAGS

    monkeypatch.delenv("P2P_DILOCO_INITIAL_PEERS", raising=False)
    dests = vars(_args([]))
    known = Config().to_dict()
    for dest, key in FLAGS:
        section, name = key.split(".")
        assert dest in dests and name in known[section], (dest, key)


def test_every_join_flag_reaches_its_config_key(monkeypatch, tmp_path):
    peer = "/ip4/127.0.0.1/tcp/5/p2p/12D3KooWAJ6LLP9vy8TfHi4hdDVvYT81fFM7YibrdRCRvaUyi1X8"
    monkeypatch.setenv("P2P_DILOCO_INITIAL_PEERS", peer)
    cfg = load_join_config(_args([
        "--run-id", "r1", "--max-rounds", "3", "--inner-steps", "5", "--data-seed", "4", "--checkpoint-dir", "/ck",
        "--resume", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--announce-maddrs", "/ip4/1.2.3.4/tcp/5",
        "--identity-path", "/id.key", "--client-mode", "--no-use-relay", "--use-auto-relay", "--startup-timeout", "3",
        "--debug-step-delay", "0.5", "--debug-corrupt-pseudo-gradient", "nan"]))
    assert (cfg.run.run_id, cfg.run.max_rounds, cfg.train.inner_steps, cfg.data.seed) == ("r1", 3, 5, 4)
    assert (cfg.checkpoint.dir, cfg.checkpoint.resume) == ("/ck", True)
    assert cfg.swarm.initial_peers == [peer]  # from the environment, when --initial-peers is not given
    assert (cfg.swarm.host_maddrs, cfg.swarm.announce_maddrs) == (["/ip4/127.0.0.1/tcp/0"], ["/ip4/1.2.3.4/tcp/5"])
    assert (cfg.swarm.identity_path, cfg.swarm.client_mode, cfg.swarm.use_relay, cfg.swarm.use_auto_relay,
            cfg.swarm.startup_timeout) == ("/id.key", True, False, True, 3.0)
    assert (cfg.debug.step_delay, cfg.debug.corrupt_pseudo_gradient) == (0.5, "nan")
    # flags not given leave the file's values alone: store_true's False is "not given", not "false"
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[checkpoint]\ndir = "/ck"\nresume = true\n[swarm]\nuse_relay = false\n')
    cfg = load_join_config(_args(["--config", str(cfg_file), "--initial-peers", peer]))
    assert cfg.checkpoint.resume is True and cfg.swarm.use_relay is False and cfg.swarm.initial_peers == [peer]


def test_swarm_per_peer_step_delays_stay_with_the_launcher(monkeypatch):
    import argparse

    monkeypatch.delenv("P2P_DILOCO_INITIAL_PEERS", raising=False)
    args = build_parser().parse_args(["swarm", "--peers", "2", "--debug-step-delay", "1", "2", "--data-seed", "3"])
    cfg = load_join_config(argparse.Namespace(**{**vars(args), "initial_peers": None}))
    assert cfg.debug.step_delay == 0.0 and cfg.data.seed == 3


def test_a_true_false_choice_takes_an_unquoted_bool():
    """``--set data.streaming=false`` as a user types it: TOML reads a bool, the setting's choices are strings."""
    assert load_config(sets=["data.streaming=false"]).data.streaming == "false"
    assert load_config(sets=["data.streaming=true"]).data.streaming == "true"
    with pytest.raises(ConfigError, match="train.autocast must be a string"):
        load_config(sets=["train.autocast=true"])  # not one of its choices: no silent conversion


@pytest.mark.parametrize("items, needle", [
    (["outer.compression='topk'"], "does not work with outer.aggregation = trimmed_mean"),
    (["outer.compression='topk'", "outer.aggregation='mean'", "outer.sharding='sharded'"], "needs outer.sharding"),
    (["outer.topk_bits=3"], "outer.topk_bits must be 2, 4 or 8"),
    (["outer.topk_density=0.9"], "outer.topk_density must be in (0, 0.5]"),
    (["outer.topk_error_decay=0"], "outer.topk_error_decay must be in (0, 1]"),
    (["outer.topk_error_decay=1.5"], "outer.topk_error_decay must be in (0, 1]"),
])
def test_topk_settings_are_checked(items, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, items)


def test_topk_settings_are_fingerprinted_only_when_set():
    base = load_config(None, ["outer.compression='topk'", "outer.aggregation='mean'"])
    assert load_config(None, ["outer.compression='topk'", "outer.aggregation='mean'",
                              "outer.topk_density=0.03"]).fingerprint() != base.fingerprint()
    assert Config().fingerprint() == load_config(None, ["outer.topk_bits=2"]).fingerprint()
    assert Config().fingerprint() == load_config(None, ["outer.topk_error_decay=1.0"]).fingerprint()
    assert load_config(None, ["outer.compression='topk'", "outer.aggregation='mean'",
                              "outer.topk_error_decay=0.95"]).fingerprint() != base.fingerprint()
