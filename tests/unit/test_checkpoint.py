import os
import pathlib
import random
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from p2p_diloco import checkpoint
from p2p_diloco.checkpoint import CheckpointError, CheckpointStore, PeerState, capture_rng, restore_rng
from p2p_diloco.errors import UsageError
from p2p_diloco.outer.optimizer import digest, legacy_digest

pytestmark = pytest.mark.unit

FP = "0123456789abcdef"


def make_state(round_=1, fingerprint=FP, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    momentum = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    model = torch.nn.Linear(4, 3)
    return PeerState(round=round_, fingerprint=fingerprint, global_digest=digest(theta + momentum), theta=theta,
                     momentum=momentum, model=model.state_dict(), inner_optimizer={}, data={"shard": 3, "pos": 17},
                     rng=capture_rng(), extra={"tokens_trained": 1234, "rounds_participated": round_})


def tiny_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    return model, opt, x, y


def train_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def assert_one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for needle in needles:
        assert str(needle) in msg, msg


def test_round_trip_every_field_and_resumed_adamw_is_bit_identical(tmp_path):
    model, opt, x, y = tiny_training()
    train_step(model, opt, x, y)
    state = make_state(round_=7)
    state.model, state.inner_optimizer = model.state_dict(), opt.state_dict()
    store = CheckpointStore(tmp_path / "ckpt")
    path = store.save(state)
    assert path == tmp_path / "ckpt" / "round-00000007.pt"

    loaded = store.load(fingerprint=FP)
    assert (loaded.round, loaded.fingerprint, loaded.global_digest) == (7, FP, state.global_digest)
    assert (loaded.data, loaded.extra) == (state.data, state.extra)
    for a, b in zip(loaded.theta + loaded.momentum, state.theta + state.momentum, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert loaded.model.keys() == state.model.keys()
    assert all(torch.equal(loaded.model[k], state.model[k]) for k in state.model)
    assert loaded.model._metadata == state.model._metadata  # module versions used by load_state_dict
    assert torch.equal(loaded.rng["torch"], state.rng["torch"]) and loaded.rng["python"] == state.rng["python"]

    # Resume into fresh objects; the next step must match the uninterrupted run bit for bit.
    resumed_model, resumed_opt, _, _ = tiny_training(seed=1)
    resumed_model.load_state_dict(loaded.model)
    resumed_opt.load_state_dict(loaded.inner_optimizer)
    for _ in range(2):
        train_step(model, opt, x, y)
        train_step(resumed_model, resumed_opt, x, y)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_saved_tensors_are_compact_clones(tmp_path):
    big = torch.zeros(1_000_000)
    state = make_state()
    state.theta[1] = big[:5]  # a view into a 4 MB storage
    state.momentum[1] = torch.zeros(5, requires_grad=True)
    state.global_digest = digest(state.theta + state.momentum)
    path = CheckpointStore(tmp_path).save(state)
    assert path.stat().st_size < 100_000  # a non-cloned view would drag the whole storage into the file
    big.fill_(1.0)  # live in-place update after saving
    assert torch.equal(CheckpointStore(tmp_path).load(path).theta[1], torch.zeros(5))


def test_keep_prunes_oldest_and_ignores_stray_files(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / ".tmp-abc.pt").write_bytes(b"partial")
    (tmp_path / "round-1.pt").write_bytes(b"wrong name pattern")
    for r in (3, 1, 10, 2):
        store.save(make_state(round_=r))
        # The file just written survives even when its round is older than those on disk.
        assert (tmp_path / f"round-{r:08d}.pt").exists()
    assert [p.name for p in store.paths()] == ["round-00000002.pt", "round-00000010.pt"]
    assert store.latest() == tmp_path / "round-00000010.pt"
    assert {"notes.txt", ".tmp-abc.pt", "round-1.pt"} <= {p.name for p in tmp_path.iterdir()}


def test_saving_the_same_round_twice_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(make_state(round_=5, seed=0))
    second = make_state(round_=5, seed=1)
    store.save(second)
    assert len(store.paths()) == 1
    assert store.load().global_digest == second.global_digest


def test_keep_below_one_is_rejected_and_directory_is_created_lazily(tmp_path):
    for keep in (0, -1):
        with pytest.raises(ValueError):
            CheckpointStore(tmp_path, keep=keep)
    store = CheckpointStore(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists() and store.paths() == [] and store.latest() is None
    with pytest.raises(CheckpointError) as excinfo:
        store.load()
    assert_one_line_error(excinfo, "no checkpoint in", tmp_path / "a" / "b")
    assert store.save(make_state()).exists()


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("target", ["torch.save", "os.replace"])
@pytest.mark.parametrize("new_round", [1, 2])
def test_failed_save_leaves_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch, error, target, new_round):
    store = CheckpointStore(tmp_path, keep=1)
    first = make_state(round_=1, seed=0)
    store.save(first)

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise error

    def failing_replace(*args, **kwargs):
        raise error

    if target == "torch.save":
        monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    else:
        monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(type(error)):
        store.save(make_state(round_=new_round, seed=1))
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-00000001.pt"]
    assert store.load().global_digest == first.global_digest


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_latest_names_file_and_points_to_older_good_one(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    good = store.save(make_state(round_=1))
    bad = store.save(make_state(round_=2))
    data = bad.read_bytes()
    bad.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[damage])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError) as excinfo:
        store.load()
    assert_one_line_error(excinfo, bad, f"an older checkpoint is at {good}", "remove the bad file")
    assert isinstance(excinfo.value, UsageError)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # load never modifies or deletes
    assert store.load(good).round == 1


def test_no_hint_when_every_older_checkpoint_is_bad_too(tmp_path):
    store = CheckpointStore(tmp_path)
    old, new = store.save(make_state(round_=1)), store.save(make_state(round_=2))
    old.write_bytes(b"junk")
    new.write_bytes(b"junk")
    with pytest.raises(CheckpointError) as excinfo:
        store.load()
    assert_one_line_error(excinfo, new)
    assert "older checkpoint" not in str(excinfo.value)


def rewrite_payload(path, change):
    payload = torch.load(path, weights_only=False)
    change(payload)
    torch.save(payload, path)


def flip_one_bit(payload):
    payload["theta"][0].view(torch.int32)[1, 2] ^= 1


@pytest.mark.parametrize("change, needle", [
    (flip_one_bit, "digest"),
    (lambda p: p["momentum"].pop(), "momentum"),
    (lambda p: p["momentum"].__setitem__(0, torch.zeros(4, 3)), "momentum"),
    (lambda p: p.update(format=99), "format"),
    (lambda p: p.pop("rng"), "rng"),
    (lambda p: p.update(round="3"), "round"),
])
def test_tampered_payload_is_rejected(tmp_path, change, needle):
    store = CheckpointStore(tmp_path)
    good = store.save(make_state(round_=1))
    bad = store.save(make_state(round_=2))
    rewrite_payload(bad, change)
    with pytest.raises(CheckpointError) as excinfo:
        store.load(bad)
    assert_one_line_error(excinfo, bad, needle, f"an older checkpoint is at {good}")


def test_a_format_1_checkpoint_loads_with_the_digest_of_theta_and_momentum(tmp_path):
    # Format 1 recorded digest(theta) only; it is still verified that way, and resumes with today's digest.
    path = CheckpointStore(tmp_path).save(make_state())
    rewrite_payload(path, lambda p: p.update(format=1, global_digest=legacy_digest(p["theta"])))
    loaded = CheckpointStore(tmp_path).load(path)
    assert loaded.global_digest == digest(loaded.theta + loaded.momentum) and loaded.certificate is None
    rewrite_payload(path, lambda p: flip_one_bit(p))
    with pytest.raises(CheckpointError, match="digest"):
        CheckpointStore(tmp_path).load(path)


def test_untampered_rewrite_still_loads(tmp_path):
    # Guards the tampering test: rewriting the payload unchanged must not by itself trip the checks.
    path = CheckpointStore(tmp_path).save(make_state())
    rewrite_payload(path, lambda p: None)
    assert CheckpointStore(tmp_path).load(path).round == 1


def test_fingerprint_mismatch_names_both_configs(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(make_state(fingerprint=FP))
    assert store.load(fingerprint=FP).fingerprint == FP
    assert store.load().fingerprint == FP  # no fingerprint given: not checked
    with pytest.raises(CheckpointError) as excinfo:
        store.load(fingerprint="fedcba9876543210")
    assert_one_line_error(excinfo, path, "another config", FP, "fedcba9876543210")


def draw():
    return torch.rand(4), random.random(), np.random.rand(3)


def assert_same_draws(a, b):
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


def test_rng_capture_restore_reproduces_sequences(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    draw()
    state = capture_rng()
    first = draw()
    draw()  # advance further so that a no-op restore cannot pass
    restore_rng(state)
    assert_same_draws(draw(), first)

    # Through a checkpoint file, after the generators have been reseeded.
    saved = make_state()
    saved.rng = state
    CheckpointStore(tmp_path).save(saved)
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    restore_rng(CheckpointStore(tmp_path).load().rng)
    assert_same_draws(draw(), first)


def test_save_fsyncs_file_before_rename_and_directory_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(*args):
        calls.append("replace")
        real_replace(*args)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    CheckpointStore(tmp_path).save(make_state())
    assert calls == ["fsync file", "replace", "fsync dir"]


class Payload:
    """A pickle that runs code when loaded the unsafe way: it creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_crafted_pickle_is_refused_and_nothing_runs(tmp_path):
    """Issue 18, point 5: checkpoints are handed around (``eval``, ``export``); one that names any code is refused
    with one line, before anything of it runs. Before, torch.load(weights_only=False) ran it, then refused it."""
    marker = tmp_path / "ran"
    path = CheckpointStore(tmp_path).save(make_state())
    rewrite_payload(path, lambda p: p["extra"].update(x=Payload(marker)))
    with pytest.raises(CheckpointError) as excinfo:
        CheckpointStore(tmp_path).load(path)
    assert_one_line_error(excinfo, path, "cannot read checkpoint")
    assert not marker.exists()
    for command in (["eval", "--checkpoint", str(path)], ["export", "--checkpoint", str(path), "--out",
                                                          str(tmp_path / "out")]):
        r = subprocess.run([sys.executable, "-m", "p2p_diloco", *command], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "cannot read checkpoint" in r.stderr and not marker.exists()


def test_a_format_2_checkpoint_with_a_numpy_rng_state_still_loads(tmp_path):
    np.random.seed(5)
    np.random.rand(2)
    state = np.random.get_state()
    after = np.random.rand(3)
    path = CheckpointStore(tmp_path).save(make_state())
    rewrite_payload(path, lambda p: (p.update(format=2), p["rng"].update(numpy=state)))
    loaded = CheckpointStore(tmp_path).load(path)
    np.random.seed(6)
    restore_rng(loaded.rng)
    assert np.array_equal(np.random.rand(3), after)
