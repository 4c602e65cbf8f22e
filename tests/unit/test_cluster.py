"""The cluster (torchrun) layer without processes: config checks, the batch split, the fingerprint."""

import pytest
import torch

from p2p_diloco.local.cluster import Cluster, check
from p2p_diloco.config import Config, ConfigError, load_config
from p2p_diloco.config.checks import validate

pytestmark = pytest.mark.unit


def test_not_under_torchrun_is_a_plain_peer(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Cluster.from_env(Config()) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert Cluster.from_env(Config()) is None


def test_ranks_split_each_batch_into_contiguous_equal_rows():
    batch = torch.arange(8 * 3).view(8, 3)
    parts = [Cluster(r, 4, r, torch.device("cpu")).shard(batch) for r in range(4)]
    assert all(p.shape == (2, 3) for p in parts)
    assert torch.equal(torch.cat(parts), batch)  # together the ranks train exactly the peer's batch


@pytest.mark.parametrize("sets, message", [
    (["data.batch_size=6"], "data.batch_size (6) must be a multiple of the number of local ranks (4)"),
    (["outer.sharding=sharded", "outer.shards=3"], "outer.shards (3) must be at least the number of local ranks (4)"),
    (["outer.fragments=2"], "outer.fragments > 1 does not work under torchrun with several ranks yet"),
    (["train.compile=true"], "train.compile does not work under torchrun with several ranks yet"),
])
def test_settings_that_cannot_work_with_this_many_ranks(sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(load_config(sets=sets), 4)
    check(load_config(sets=["data.batch_size=8"]), 4)
    check(load_config(sets=["data.batch_size=8", "outer.overlap=true"]), 4)  # the sync runs behind rank 0's steps


@pytest.mark.parametrize("sets, message", [
    (["train.parallelism=zero3"], "train.parallelism must be ddp or fsdp"),
    (["outer.sharding=zero"], "outer.sharding must be rank0 or sharded"),
    (["outer.sharding=sharded", "outer.shards=0"], "outer.shards must be >= 1"),
    (["outer.sharding=sharded", "outer.overlap=true"], "outer.sharding = sharded does not work with outer.overlap"),
])
def test_unknown_or_unimplemented_modes_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(sets=sets))


def test_rank_layout_is_not_part_of_the_fingerprint():
    """A 1-rank and an 8-rank peer must be able to average: how a peer lays out its ranks is its own business.
    The sharding mode and shard count are fingerprinted in sharded mode only (rank0 fingerprints are unchanged)."""
    fields = Config().fingerprint_fields()
    assert "outer.sharding" not in fields and "outer.shards" not in fields
    assert not any(k.startswith("train.") for k in fields) and "outer.lr" in fields
    sharded = load_config(sets=["outer.sharding=sharded"])
    assert sharded.fingerprint_fields()["outer.shards"] == 8 and sharded.fingerprint() != Config().fingerprint()
    assert load_config(sets=["outer.sharding=sharded", "outer.shards=4"]).fingerprint() != sharded.fingerprint()


def test_peer_profiles_parse_and_the_8_gpu_config_fits_8_ranks():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in sorted((root / "peers").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)
    text = (root / "peers" / "8xh100.sh").read_text()
    assert "torchrun" in text and "-m p2p_diloco join" in text
    cfg = load_config(root / "configs" / "llama-1b-c4.toml")  # the profile's default config
    validate(cfg)
    check(cfg, 8)
