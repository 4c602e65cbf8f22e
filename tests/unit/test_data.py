import json
import logging
import os
import subprocess
import sys
import sysconfig
import time

import datasets
import pandas as pd
import pytest
import torch
from datasets import IterableDataset

from p2p_diloco.config import Config, ConfigError, DataConfig, TokenizerConfig
from p2p_diloco.training import data as data_module
from p2p_diloco.training.data import (
    PackedStream,
    eval_batches,
    eval_documents,
    load_documents,
    resolve_data_files,
    train_documents,
)
from p2p_diloco.training.part import Training
from p2p_diloco.training.tokenizer import build_tokenizer

pytestmark = pytest.mark.unit

EOS = 256


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TokenizerConfig("byte"))


def _docs(n=60):
    """Distinct documents of varied length (no blank lines, so .txt paragraphs are whole documents)."""
    return [f"doc {i}: " + " ".join(f"w{i}x{j}" for j in range(i % 9 + 1)) for i in range(n)]


@pytest.fixture
def jsonl_dir(tmp_path):
    docs = _docs()
    for part in range(2):
        with open(tmp_path / f"part{part}.jsonl", "w") as f:
            for d in docs[part::2]:
                f.write(json.dumps({"body": d, "id": 1}) + "\n")
    return tmp_path, docs


def _cfg(path, **kw):
    defaults = dict(path=str(path), text_column="body", seq_len=16, batch_size=2, eval_fraction=0.2, shuffle_buffer=8)
    return DataConfig(**{**defaults, **kw})


def _texts(ds, column="text"):
    """A column as a plain list, for map-style and streaming datasets alike."""
    return [row[column] for row in ds]


def _split_docs(tokens, tok):
    """Decode a flat token list into the documents it holds (eos-separated; partial ones at the ends dropped)."""
    cuts = [i for i, t in enumerate(tokens) if t == EOS]
    return [tok.decode(tokens[a + 1 : b]) for a, b in zip(cuts, cuts[1:])]


# ----------------------------------------------------------------------------- built-in corpus


def test_builtin_corpus_is_stdlib_in_path_order_capped():
    ds = load_documents(DataConfig(max_bytes=300_000), "train")
    paths = _texts(ds, "path")
    assert paths == sorted(paths) and paths[0].endswith(".py")
    assert not any("site-packages" in p or "dist-packages" in p for p in paths)
    assert sum(len(t.encode()) for t in _texts(ds)) == 300_000  # the last file is cut to the cap
    with open(f"{sysconfig.get_paths()['stdlib']}/{paths[0]}", encoding="utf-8") as f:
        assert ds[0]["text"] == f.read()


def test_builtin_split_is_by_path_and_disjoint():
    cfg = DataConfig()
    train, held = train_documents(cfg), eval_documents(cfg)
    assert len(held) > 0 and not set(_texts(held, "path")) & set(_texts(train, "path"))
    assert len(train) + len(held) == len(load_documents(cfg, "train"))
    assert 0.005 < len(held) / (len(train) + len(held)) < 0.05


def test_builtin_defaults_give_enough_eval_batches(tok):
    cfg = DataConfig()
    batches = eval_batches(tok, cfg, 8)
    assert len(batches) == 8 and all(b.shape == (8, 128) and b.dtype == torch.long for b in batches)
    first = eval_documents(cfg)[0]["text"]
    assert batches[0].flatten()[:64].tolist() == list(first.encode())[:64]  # document order, not shuffled
    assert all(torch.equal(a, b) for a, b in zip(batches, eval_batches(tok, cfg, 8)))


def test_builtin_rows_give_the_batches_a_datasets_dataset_gave(tok, monkeypatch):
    """The built-in corpus is held as Rows (no datasets import): the train stream, its resume and the eval batches
    are what the same columns as a ``datasets.Dataset`` give, so data orders, and digests, did not change."""
    cfg = DataConfig(batch_size=4, seq_len=64)

    def batches() -> list[torch.Tensor]:
        stream = PackedStream(tok, cfg, seed=3)
        train = [stream.next_batch() for _ in range(10)]
        state = stream.state_dict()
        train += [stream.next_batch() for _ in range(20)]
        resumed = PackedStream(tok, cfg, seed=3)
        resumed.load_state_dict(state)
        assert torch.equal(resumed.next_batch(), train[10])
        return train + [resumed.next_batch()] + eval_batches(tok, cfg, 3)

    ours = batches()
    as_rows = data_module._builtin_documents
    monkeypatch.setattr(data_module, "_builtin_documents",
                        lambda c: datasets.Dataset.from_dict(dict(as_rows(c)[list(range(len(as_rows(c))))])))
    theirs = batches()
    assert len(ours) == len(theirs) == 34 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    held = eval_documents(cfg)
    assert isinstance(held, datasets.Dataset)  # the comparison above really went through datasets
    monkeypatch.undo()
    assert _texts(eval_documents(cfg), "path") == _texts(held, "path")


def test_rows_answer_as_a_dataset_of_the_same_columns():
    from p2p_diloco.training.rows import Rows

    columns = {"text": [f"t{i}" for i in range(7)], "path": [f"p{i}" for i in range(7)]}
    rows, ds = Rows(columns), datasets.Dataset.from_dict(columns)
    assert rows.column_names == ds.column_names and len(rows) == len(ds) == 7
    assert rows[3] == ds[3] and rows[[5, 0, 2]] == ds[[5, 0, 2]]
    assert list(rows.select_columns(["path"]).iter(batch_size=3)) == list(ds.select_columns(["path"]).iter(3))
    assert rows.select([6, 1])[[0, 1]] == ds.select([6, 1])[[0, 1]]
    assert list(rows.to_iterable_dataset()) == list(ds.to_iterable_dataset())  # data.streaming = "true"
    with pytest.raises(ValueError, match="different lengths"):
        Rows({"text": ["a"], "path": []})
    with pytest.raises(ValueError, match="no column"):
        rows.select_columns(["nope"])


def test_a_peer_on_the_builtin_corpus_never_imports_datasets():
    code = ("import sys\n"
            "from p2p_diloco.config import DataConfig, TokenizerConfig\n"
            "from p2p_diloco.training.data import PackedStream, eval_batches\n"
            "from p2p_diloco.training.tokenizer import build_tokenizer\n"
            "tok = build_tokenizer(TokenizerConfig('byte'))\n"
            "PackedStream(tok, DataConfig(), seed=0).next_batch(), eval_batches(tok, DataConfig(), 2)\n"
            "print(sorted(m for m in ('datasets', 'pandas', 'pyarrow') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_builtin_stream_starts_fast_and_differs_by_seed(tok):
    start = time.perf_counter()
    stream = PackedStream(tok, DataConfig(), seed=0)
    first = stream.next_batch()
    assert time.perf_counter() - start < 5.0  # ~0.5 s on a laptop; generous for loaded CI machines
    assert first.shape == (8, 128) and first.dtype == torch.long and first.max() <= EOS
    assert stream.tokens_per_batch == 1024
    assert torch.equal(PackedStream(tok, DataConfig(), seed=0).next_batch(), first)
    assert not torch.equal(PackedStream(tok, DataConfig(), seed=1).next_batch(), first)


# ----------------------------------------------------------------------------- local files


@pytest.fixture
def make_stream():
    """PackedStreams closed at the end of the test (a streaming iterator left to the GC can deadlock CPython)."""
    made = []

    def make(*args, **kwargs):
        made.append(PackedStream(*args, **kwargs))
        return made[-1]

    yield make
    for stream in made:
        stream.close()


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_each_epoch_is_every_train_doc_once_in_a_new_order(tok, jsonl_dir, streaming, make_stream):
    path, docs = jsonl_dir
    cfg = _cfg(path, streaming=streaming)
    train, held = _texts(train_documents(cfg)), _texts(eval_documents(cfg))
    assert sorted(train + held) == sorted(docs) and held and not set(train) & set(held)

    per_epoch = sum(len(d.encode()) + 1 for d in train)
    stream = make_stream(tok, cfg, seed=3)
    tokens = []
    while len(tokens) < 2 * per_epoch + 1:
        tokens += stream.next_batch().flatten().tolist()
    epoch0 = _split_docs([EOS] + tokens[:per_epoch], tok)
    epoch1 = _split_docs([EOS] + tokens[per_epoch : 2 * per_epoch], tok)
    assert sorted(epoch0) == sorted(train) == sorted(epoch1)  # eval docs never trained on
    assert epoch0 != epoch1
    assert stream.state_dict()["epoch"] == 2


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_resume_from_state_dict_is_exact(tok, jsonl_dir, streaming, make_stream):
    cfg = _cfg(jsonl_dir[0], streaming=streaming)
    stream, drawn = make_stream(tok, cfg, seed=11), 0
    for steps in (0, 1, 7, 30, 61):  # 61 is in the second epoch
        for _ in range(steps - drawn):
            stream.next_batch()
        state = json.loads(json.dumps(stream.state_dict()))
        expected = [stream.next_batch() for _ in range(5)]
        drawn = steps + 5
        resumed = make_stream(tok, cfg, seed=11)
        resumed.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(expected, [resumed.next_batch() for _ in range(5)])), state
    assert state["epoch"] >= 1


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_same_seed_same_batches_other_seed_different(tok, jsonl_dir, streaming, make_stream):
    cfg = _cfg(jsonl_dir[0], streaming=streaming)
    a, b, c = (make_stream(tok, cfg, seed=s) for s in (1, 1, 2))
    batches = [(a.next_batch(), b.next_batch(), c.next_batch()) for _ in range(4)]
    assert all(torch.equal(x, y) for x, y, _ in batches)
    assert not all(torch.equal(x, z) for x, _, z in batches)


def test_parquet_glob_and_single_txt(tok, tmp_path):
    docs = _docs(20)
    (tmp_path / "sub").mkdir()
    pd.DataFrame({"text": docs[:10]}).to_parquet(tmp_path / "sub" / "a.parquet")
    pd.DataFrame({"text": docs[10:]}).to_parquet(tmp_path / "sub" / "b.parquet")
    assert _texts(load_documents(DataConfig(path=str(tmp_path / "**" / "*.parquet")), "train")) == docs
    (tmp_path / "c.txt").write_text("first para\nsecond line\n\nsecond para\n")
    assert _texts(load_documents(DataConfig(path=str(tmp_path / "c.txt")), "train")) == [
        "first para\nsecond line",
        "second para\n",
    ]


def test_directory_files_are_recursive_and_sorted(tmp_path):
    for name in ("b.txt", "a/z.txt", "a/y.txt", "notes.md", ".hidden.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    assert resolve_data_files(str(tmp_path)) == [str(tmp_path / n) for n in ("a/y.txt", "a/z.txt", "b.txt")]


def test_eval_batches_from_local_files(tok, jsonl_dir):
    cfg = _cfg(jsonl_dir[0], eval_fraction=0.5, seq_len=8)
    held = _texts(eval_documents(cfg))
    batches = eval_batches(tok, cfg, 3)
    flat = [t for b in batches for t in b.flatten().tolist()]
    expected = [t for d in held for t in [*d.encode(), EOS]][: len(flat)]
    assert flat == expected


def test_a_small_eval_set_shrinks_to_whole_batches_with_one_warning(tok, jsonl_dir, caplog):
    cfg = _cfg(jsonl_dir[0], eval_fraction=0.5, seq_len=8)
    held_tokens = sum(len(d.encode()) + 1 for d in _texts(eval_documents(cfg)))
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        batches = eval_batches(tok, cfg, 10_000)
    assert len(batches) == held_tokens // (2 * 8) > 0
    assert [b.shape for b in batches] == [(2, 8)] * len(batches)
    assert torch.equal(torch.stack(batches), torch.stack(eval_batches(tok, cfg, len(batches))))  # as if it fit
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"only {held_tokens} tokens of eval text" in warnings[0] and "instead of eval.batches = 10000" in warnings[0]
    with pytest.raises(ConfigError, match=f"not enough eval text .*: {held_tokens} tokens held out, one eval batch "
                                          f"needs {2 * 4096}"):
        eval_batches(tok, _cfg(jsonl_dir[0], eval_fraction=0.5, seq_len=4096), 1)


def test_a_small_personal_dataset_trains_after_a_warning(tmp_path, caplog):
    """A few KB of notes and the default eval.batches (8 x 8 x 128 tokens): a shrunk eval set, not an error."""
    words = "the a swarm peer round model data train loss step average tokens weight group".split()
    notes = ["note %d: " % i + " ".join(words[(i * j) % len(words)] for j in range(12 + i % 20)) for i in range(60)]
    (tmp_path / "notes.txt").write_text("\n\n".join(notes) + "\n")
    assert (tmp_path / "notes.txt").stat().st_size < 8192
    cfg = Config()
    cfg.data.path, cfg.data.eval_fraction, cfg.train.threads = str(tmp_path), 0.3, 1
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        training = Training(cfg)
    try:
        assert 0 < len(training.eval_set) < cfg.eval.batches
        assert [r.levelno for r in caplog.records if r.name.startswith("p2p_diloco")] == [logging.WARNING]
        training.start(data_seed=0)
        loss, tokens = training.step(0)
        assert tokens == cfg.data.batch_size * cfg.data.seq_len and loss == pytest.approx(loss) and loss > 0
        assert training.evaluate() > 0
    finally:
        training.close()


def test_no_held_out_text_is_an_error_before_the_swarm(tmp_path):
    (tmp_path / "a.txt").write_text("only one paragraph\n")
    cfg = Config()
    cfg.data.path, cfg.data.eval_fraction = str(tmp_path), 0.0
    with pytest.raises(ConfigError, match="not enough eval text"):  # eval_fraction 0 holds nothing out
        Training(cfg)


@pytest.mark.parametrize(
    "setup, kw, message",
    [
        (lambda p: None, {}, r"no data files \(.txt, .json, .jsonl, .parquet\) in directory "),
        (lambda p: (p / "a.txt").write_text("x"), {"path": "*.jsonl"}, r"no data files match .*/\*.jsonl"),
        (lambda p: (p / "a.txt").write_text("x") and (p / "b.jsonl").write_text('{"text": "y"}\n'), {}, "mix formats"),
        (lambda p: (p / "a.jsonl").write_text('{"body": "y", "id": 1}\n'), {"text_column": "x"}, "columns: body, id"),
        (lambda p: (p / "a.txt").write_text("x"), {"eval_split": "validation"}, "one split"),
        (lambda p: (p / "a.csv").write_text("x"), {"path": "*.csv"}, "unsupported data file type"),
        (lambda p: (p / "a.txt").write_text(""), {"path": "a.txt"}, "data file .*/a.txt is empty: it has no text"),
        (lambda p: (p / "a.txt").write_text("") or (p / "b.txt").write_text(""), {},
         "every data file of .* is empty \\(2 files, e.g. .*/a.txt\\)"),
        (lambda p: (p / "a.jsonl").write_text(""), {}, "data file .*/a.jsonl is empty"),
    ],
)
def test_bad_local_data_is_a_config_error(tok, tmp_path, setup, kw, message):
    setup(tmp_path)
    path = str(tmp_path / kw.pop("path")) if "path" in kw else str(tmp_path)
    with pytest.raises(ConfigError, match=message):
        PackedStream(tok, DataConfig(path=path, **kw), seed=0)


def test_missing_local_path(tok, tmp_path):
    with pytest.raises(ConfigError, match=f"data path {tmp_path}/nope does not exist"):
        load_documents(DataConfig(path=str(tmp_path / "nope")), "train")


def test_hub_datasets_stream_through_the_same_code_path(tok, monkeypatch):
    """No network here: stand in for the hub with a generator-backed (column-less) IterableDataset."""
    splits = {"train": _docs(40), "validation": [f"held out {i} " * 9 for i in range(20)]}
    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        gen = lambda docs: ({"body": d, "id": i} for i, d in enumerate(docs))  # noqa: E731
        return IterableDataset.from_generator(gen, gen_kwargs={"docs": splits[split]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(data_module, "check_hub_dataset", lambda path, streaming: None)  # a reachable hub
    cfg = DataConfig(path="allenai/c4", name="en", text_column="body", eval_split="validation")
    cfg.seq_len, cfg.batch_size = 16, 2
    stream = PackedStream(tok, cfg, seed=0)
    assert calls == [("allenai/c4", "en", "train", True)]
    trained = "".join(tok.decode(stream.next_batch().flatten().tolist()) for _ in range(20))
    assert "doc " in trained and "held out" not in trained
    batches = eval_batches(tok, cfg, 2)
    assert calls[-1] == ("allenai/c4", "en", "validation", True)
    assert tok.decode(batches[0].flatten().tolist()).startswith("held out 0 held out 0")


def test_a_data_build_under_the_cli_logging_draws_no_progress_bar(tmp_path):
    """datasets draws "Generating train split: ..." on stderr when it first reads a file; our commands turn it off."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(200)))
    code = ("import logging, sys\n"
            "from p2p_diloco.cli.util import setup_logging\n"
            "setup_logging(logging.INFO)\n"
            "from p2p_diloco.config import DataConfig, TokenizerConfig\n"
            "from p2p_diloco.training.data import eval_batches, train_documents\n"
            "from p2p_diloco.training.tokenizer import build_tokenizer\n"
            f"cfg = DataConfig(path={str(tmp_path / 'data')!r}, eval_fraction=0.5, seq_len=64, batch_size=2)\n"
            "print(len(eval_batches(build_tokenizer(TokenizerConfig('byte')), cfg, 2)), len(train_documents(cfg)))\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_DISABLE_PROGRESS_BARS")}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")  # a cold cache: datasets generates the split
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "2" and int(r.stdout.split()[1]) > 50
    assert r.stderr == "", r.stderr


def test_the_data_source_is_checked_without_torch_or_datasets(tmp_path):
    """check_data_source can run before a command's heavy imports: a bad data.path then fails in a fraction of a
    second instead of after the ~4 s of importing torch, transformers, datasets and hivemind."""
    (tmp_path / "empty.txt").write_text("")
    code = ("import sys\n"
            "from p2p_diloco.config import ConfigError, DataConfig\n"
            "from p2p_diloco.training.sources import check_data_source\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        check_data_source(DataConfig(path=path))\n"
            "        print('ok')\n"
            "    except ConfigError as e:\n"
            "        print(e)\n"
            "print(sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))\n")
    paths = [str(tmp_path / "empty.txt"), str(tmp_path / "nope"), str(tmp_path / "*.jsonl"), "builtin:stdlib",
             "allenai/c4"]
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"data file {tmp_path}/empty.txt is empty: it has no text",
                                     f"data path {tmp_path}/nope does not exist",
                                     f"no data files match {tmp_path}/*.jsonl", "ok", "ok", "[]"]
