"""`p2p-diloco eval` and `export` on the checkpoints of a real (one-peer) run, through the CLI."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.export import load_trained
from tests.conftest import survivors
from tests.swarm.helpers import FAST, LONE, Proc, eval_by_round, events_of, load_json

# light: one process at a time (a lone peer, then the commands)
pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.light, pytest.mark.timeout(300)]


def _cli(args, tag):
    proc = Proc(args, tag)
    rc = proc.wait(120)
    return rc, "".join(proc.lines), proc.stderr_tail()


def test_eval_and_export_of_a_trained_checkpoint(tmp_path, reap):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run = Proc(["join", "--run-id", "t-export", "--data-seed", "3", "--max-rounds", "2", "--inner-steps", "10",
                "--checkpoint-dir", str(ckpt), "--log-dir", str(tmp_path / "logs"),
                "--summary-json", str(tmp_path / "run.json"), *FAST, *LONE], reap)
    assert run.wait(240) == 0, run.stderr_tail()
    summary = load_json(tmp_path / "run.json")
    peer_eval = eval_by_round(events_of(tmp_path / "logs", run))

    # eval: the newest checkpoint's global weights, on the run's own held-out batches (its config is in the
    # checkpoint), give exactly the loss the peer logged for that round.
    rc, stdout, stderr = _cli(["eval", "--checkpoint", str(ckpt), "--json"], reap)
    assert rc == 0, stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["round"] == 2 and result["global_digest"] == summary["global_digest"]
    assert result["eval_loss"] == pytest.approx(peer_eval[2], abs=1e-5)
    assert result["perplexity"] == pytest.approx(torch.tensor(result["eval_loss"]).exp().item(), rel=1e-6)
    # Another dataset, given with --set, changes the number (and the text line says which data it used).
    other = tmp_path / "other.txt"
    other.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(4000)))
    rc, stdout, stderr = _cli(["eval", "--checkpoint", str(ckpt), "--set", f"data.path={other}",
                               "--set", "data.eval_fraction=0.5"], reap)
    assert rc == 0, stderr
    assert "eval_loss=" in stdout and "perplexity=" in stdout and str(other) in stdout
    assert f"eval_loss={peer_eval[2]:.4f}" not in stdout
    # A small personal dataset (a few KB, new to the datasets cache): the eval set shrinks to what is held out, with
    # one warning, and no progress bar of datasets ("Generating train split") reaches stderr.
    small = tmp_path / "notes"
    small.mkdir()
    (small / "notes.txt").write_text("\n\n".join(f"note {i}: " + "the swarm trains a small model " * (1 + i % 7)
                                                 for i in range(40)))
    rc, stdout, stderr = _cli(["eval", "--checkpoint", str(ckpt), "--set", f"data.path={small}",
                               "--set", "data.eval_fraction=0.3"], reap)
    assert rc == 0, stderr
    assert "on 1024 held-out tokens" in stdout, stdout  # 1,431 held out: one batch of 8 x 128
    assert len(stderr.strip().splitlines()) == 1 and "WARN" in stderr and "tokens of eval text in" in stderr, stderr

    # export: a save_pretrained directory that transformers loads on its own and that generates.
    rc, stdout, stderr = _cli(["export", "--checkpoint", str(ckpt), "--out", str(out)], reap)
    assert rc == 0, stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("def main():", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 8)
    assert isinstance(tok.decode(generated[0]), str)
    reference = load_trained(ckpt).model  # the global weights, straight from the checkpoint
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # Bad input: one line, exit 2, nothing overwritten.
    before = sorted(p.name for p in out.iterdir())
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, expected in [
        (["export", "--checkpoint", str(ckpt), "--out", str(out)], "already exists"),
        (["eval", "--checkpoint", str(tmp_path / "missing")], "checkpoint not found"),
        (["eval", "--checkpoint", str(ckpt), "--set", "model.hidden_size=96"], "model.hidden_size=96 (the run's: 128)"),
        (["eval", "--checkpoint", str(ckpt), "--set", f"data.path={empty}"], f"data file {empty} is empty: it has no"),
    ]:
        rc, stdout, stderr = _cli(args, reap)
        assert rc == 2 and expected in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not list(tmp_path.glob(".tmp-*"))
    assert not survivors(reap)
