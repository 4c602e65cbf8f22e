"""A joiner adopts the run's published config (config/sharing.py, config/adoption.py, cli/adopt.py), without a
network: the records a light client would read are given by the test."""

import msgpack
import pytest

from p2p_diloco.cli import build_parser, load_join_config
from p2p_diloco.cli.adopt import adopt_run_config
from p2p_diloco.config import Config, ConfigError, load_config
from p2p_diloco.config import sharing
from p2p_diloco.config.adoption import adopt, check_against_peers, conflicts, run_settings, trusted_configs
from p2p_diloco.config.sharing import CLASSES, FINGERPRINTED, LOCAL, PER_PEER, SHARED, config_of, published_settings
from p2p_diloco.errors import ConfigMismatch, SwarmError
from p2p_diloco.swarm.schema import MAX_VALUE_BYTES, check_config_record

pytestmark = pytest.mark.unit
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmVeKNQu4ihHqNoY3Vz5sPRVqxW7eSeSCm9NvD9E75MHeh"
# The operator's run: another H, outer lr and model size than the defaults, and its own batch size.
RUN = ["train.inner_steps=20", "outer.lr=0.5", "model.num_layers=1", "data.batch_size=4", "run.max_rounds=3",
       "swarm.peer_ttl=9.0", "data.seed=5", "swarm.min_peers=2"]


def _run_cfg(sets=RUN) -> Config:
    return load_config(None, sets)


def _records(*cfgs: Config, left: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(live, configs) of peers p0, p1, ... publishing ``cfgs``, as the DHT would return them."""
    live = {f"p{i}": {"fp": c.fingerprint(), "round": 1, "phase": "left" if f"p{i}" in left else "train"}
            for i, c in enumerate(cfgs)}
    return live, {f"p{i}": published_settings(c) for i, c in enumerate(cfgs)}


# --------------------------------------------------------------------------------------------- classification
def test_every_setting_is_in_exactly_one_class():
    names = sharing.all_settings()
    assert set(CLASSES) == set(names) and len(names) == len(set(names))
    groups = [sharing._fingerprinted(), sharing.SHARED_SETTINGS, sharing.PER_PEER_SETTINGS, sharing.LOCAL_SETTINGS]
    assert all(sum(name in g for g in groups) == 1 for name in names)
    assert {CLASSES[n] for n in ("train.inner_steps", "swarm.peer_ttl", "round.target_tokens")} == {SHARED}
    assert CLASSES["model.num_layers"] == CLASSES["train.total_steps"] == FINGERPRINTED
    assert CLASSES["data.batch_size"] == CLASSES["train.grad_accum"] == PER_PEER
    assert CLASSES["train.threads"] == CLASSES["train.device"] == LOCAL  # this machine's, never adopted
    assert CLASSES["data.seed"] == CLASSES["swarm.initial_peers"] == CLASSES["debug.step_delay"] == LOCAL


def test_a_new_setting_must_be_classified(monkeypatch):
    monkeypatch.setattr(sharing, "all_settings", lambda: [*CLASSES, "train.new_knob"])
    with pytest.raises(ConfigError, match="train.new_knob is in 0 classes"):
        sharing.setting_classes()


def test_the_fingerprint_is_unchanged():
    assert Config().fingerprint() == "54f7714b4f25631b"  # existing runs and checkpoints depend on it
    assert {k for k, v in CLASSES.items() if v == FINGERPRINTED} >= set(Config().fingerprint_fields())


def test_published_config_round_trips_and_fits_the_record_limits():
    cfg = _run_cfg([*RUN, "outer.sharding=sharded", "data.path=" + "x" * 4000])
    published = check_config_record(published_settings(cfg))
    assert not any(CLASSES[name] == LOCAL for name in published) and "data.seed" not in published
    back = config_of(published)
    assert back.fingerprint() == cfg.fingerprint()
    assert back.train == cfg.train and back.data.batch_size == 4
    assert len(msgpack.dumps(published)) + 1024 < MAX_VALUE_BYTES["config"]


def test_a_strangers_config_record_stays_bounded():
    for bad in ({"A.b": 1}, {"a.b": "x" * 4097}, {"a.b": ["x"] * 65}, {"a": 1}, {"a.b": {"c": 1}}):
        with pytest.raises(SwarmError):
            check_config_record(bad)


# --------------------------------------------------------------------------------------------------- adoption
def test_a_bare_joiner_adopts_everything_but_local_settings():
    run = _run_cfg()
    local = load_config(None, ["data.seed=9"])
    merged, notices = adopt(local, set(), published_settings(run))
    assert (merged.train.inner_steps, merged.outer.lr, merged.model.num_layers) == (20, 0.5, 1)
    assert (merged.data.batch_size, merged.run.max_rounds, merged.swarm.peer_ttl, merged.swarm.min_peers) == (
        4, 3, 9.0, 2)
    assert merged.data.seed == 9 and merged.run.run_id == local.run.run_id  # local: never adopted
    assert merged.fingerprint() == run.fingerprint() and notices == []
    assert local.train.inner_steps == 50  # unchanged


@pytest.mark.parametrize("given, refused, noticed", [
    (["train.inner_steps=20"], None, None),  # equal to the run's: nothing to say
    (["train.inner_steps=50"], "train.inner_steps: ours 50, theirs 20", None),  # shared
    (["swarm.peer_ttl=6.0"], "swarm.peer_ttl: ours 6.0, theirs 9.0", None),  # shared
    (["model.num_layers=2"], "model.num_layers: ours 2, theirs 1", None),  # fingerprinted
    (["data.batch_size=16"], None, "data.batch_size=16 (run: 4)"),  # per-peer
    (["run.max_rounds=1", "data.batch_size=2"], None, "data.batch_size=2 (run: 4); run.max_rounds=1 (run: 3)"),
    (["outer.shards=4"], None, None),  # not in a rank0 run's fingerprint: no conflict
    (["data.seed=1", "swarm.startup_timeout=5"], None, None),  # local
])
def test_explicit_settings_against_the_run(given, refused, noticed):
    local = load_config(None, given)
    explicit = {item.split("=")[0] for item in given}
    if refused:
        with pytest.raises(ConfigMismatch) as e:
            adopt(local, explicit, published_settings(_run_cfg()), who="1 live peer")
        assert refused in str(e.value) and "\n" not in str(e.value)
        assert "already has 1 live peer with a different config" in str(e.value)
        return
    merged, notices = adopt(local, explicit, published_settings(_run_cfg()))
    assert merged.train.inner_steps == 20
    assert notices == ([f"run 'p2p-diloco-tiny': this peer's own per-peer settings: {noticed}"] if noticed else [])


def test_conflicts_name_every_differing_key_with_both_values():
    diffs = conflicts(load_config(None, ["train.lr=0.01", "model.hidden_size=64"]), Config())
    assert diffs == ["model.hidden_size: ours 64, theirs 128", "train.lr: ours 0.01, theirs 0.001"]
    # an older peer's record holds only the fingerprint's settings: its shared ones are not compared
    assert conflicts(load_config(None, ["train.lr=0.01"]), Config(), Config().fingerprint_fields()) == []


# ----------------------------------------------------------------------------------------------------- trust
def test_only_live_consistent_allowed_records_are_trusted():
    run = _run_cfg()
    live, configs = _records(run, run, run, run, run, left=("p1",))
    live.pop("p2")  # no live record: gone, or a stranger that never matchmakes
    live["p3"]["fp"] = Config().fingerprint()  # its live record matchmakes under another config than it publishes
    configs["p5"], live["p5"] = {"train.inner_steps": "many"}, {"fp": "0" * 16}  # garbage
    assert set(trusted_configs(configs, live)) == {"p0", "p4"}
    assert set(trusted_configs(configs, live, allowed={"p4"})) == {"p4"}
    assert set(trusted_configs(configs, live, me="p0")) == {"p4"}


def test_a_starting_peer_is_refused_by_a_trusted_peer_that_differs_in_a_shared_setting():
    run = _run_cfg()
    live, configs = _records(run)
    check_against_peers(_run_cfg([*RUN, "data.batch_size=16", "data.seed=1"]), configs, live)  # per-peer, local
    with pytest.raises(ConfigMismatch, match=r"already has peer p0 with a different config \(train.lr: ours 0.01, "
                                             r"theirs 0.001\)"):
        check_against_peers(_run_cfg([*RUN, "train.lr=0.01"]), configs, live)
    live["p0"]["phase"] = "left"  # only live, trusted peers count
    check_against_peers(_run_cfg([*RUN, "train.lr=0.01"]), configs, live)


def test_live_peers_that_disagree_are_not_guessed_between():
    a, b = _run_cfg(), _run_cfg([*RUN, "train.inner_steps=50"])
    live, configs = _records(a, a, b)
    with pytest.raises(ConfigMismatch) as e:
        run_settings(trusted_configs(configs, live), "r")
    text = str(e.value)
    assert "publish 2 different configs: train.inner_steps=20 (2 peers) | train.inner_steps=50 (1 peer)" in text
    assert "--config" in text and "\n" not in text


def test_per_peer_settings_are_adopted_only_where_the_peers_agree():
    a, b = _run_cfg(), _run_cfg([*RUN, "data.batch_size=8"])
    live, configs = _records(a, b)
    settings, disputed = run_settings(trusted_configs(configs, live), "r")
    assert settings["train.inner_steps"] == 20 and "data.batch_size" not in settings
    assert disputed == {"data.batch_size": [4, 8]}
    merged, notices = adopt(Config(), set(), settings, disputed)
    assert merged.data.batch_size == 8 and merged.train.inner_steps == 20  # its own (the default)
    assert notices == ["run 'p2p-diloco-tiny': this peer's own per-peer settings: data.batch_size=8 (peers differ: "
                       "4, 8)"]


# ------------------------------------------------------------------------------- the join command line (glue)
def _join(argv, monkeypatch, records):
    monkeypatch.delenv("P2P_DILOCO_INITIAL_PEERS", raising=False)
    args = build_parser().parse_args(["join", *argv])
    return adopt_run_config(args, load_join_config(args), read=lambda cfg: records)


def test_join_precedence_run_then_file_then_set_then_flags(tmp_path, monkeypatch):
    records = _records(_run_cfg())
    cfg, notices = _join(["--initial-peers", PEER], monkeypatch, records)
    assert (cfg.train.inner_steps, cfg.data.batch_size, cfg.run.max_rounds) == (20, 4, 3)
    assert notices[0].startswith("run 'p2p-diloco-tiny': adopted the config published by 1 live peer (fingerprint ")
    file = tmp_path / "c.toml"
    file.write_text("[data]\nbatch_size = 2\nseq_len = 64\n[run]\nmax_rounds = 1\n")
    cfg, notices = _join(["--initial-peers", PEER, "--config", str(file), "--set", "data.batch_size=6",
                          "--max-rounds", "2"], monkeypatch, records)
    assert (cfg.data.batch_size, cfg.data.seq_len, cfg.run.max_rounds, cfg.train.inner_steps) == (6, 64, 2, 20)
    assert "data.batch_size=6 (run: 4); data.seq_len=64 (run: 128); run.max_rounds=2 (run: 3)" in notices[1]
    with pytest.raises(ConfigMismatch, match="train.inner_steps: ours 30, theirs 20"):
        _join(["--initial-peers", PEER, "--inner-steps", "30"], monkeypatch, records)


def test_join_without_published_configs_keeps_its_own(monkeypatch):
    cfg, notices = _join(["--initial-peers", PEER, "--set", "train.inner_steps=7"], monkeypatch, ({}, {}))
    assert cfg.train.inner_steps == 7
    assert notices == ["run 'p2p-diloco-tiny': no live peer has published its config (yet): using this peer's own"]
    cfg, notices = _join([], monkeypatch, _records(_run_cfg()))  # a new swarm reads nothing
    assert cfg.train.inner_steps == 50 and notices == []


def test_join_with_a_config_file_goes_on_when_the_peers_disagree(tmp_path, monkeypatch):
    records = _records(_run_cfg(), _run_cfg([*RUN, "train.lr=0.01"]))
    with pytest.raises(ConfigMismatch, match="2 different configs"):
        _join(["--initial-peers", PEER], monkeypatch, records)
    file = tmp_path / "c.toml"
    file.write_text("[train]\ninner_steps = 20\n")
    cfg, notices = _join(["--initial-peers", PEER, "--config", str(file)], monkeypatch, records)
    assert cfg.train.inner_steps == 20 and cfg.model.num_layers == 2  # its own config, nothing adopted
    assert f"using --config {file}" in notices[0]
