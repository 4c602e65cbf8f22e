"""The run configuration's schema: one dataclass per TOML section, and the fingerprint peers must agree on.

A setting that takes one of a fixed set of strings is annotated ``Literal[...]``; the checks read the allowed values
from the annotation (:func:`choices`), so a new choice is added in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints

# The choices of the enum-like settings. Compression and Aggregation repeat outer/codecs.py CODECS and
# outer/aggregation.py METHODS (tests/unit/test_config.py checks that they agree) rather than importing them, so that
# reading a config never imports torch: bad input must fail in a tenth of a second.
Autocast = Literal["auto", "bf16", "off"]
Device = Literal["cpu", "cuda", "auto"]
Parallelism = Literal["ddp", "fsdp"]
Streaming = Literal["auto", "true", "false"]
Compression = Literal["none", "fp16", "bf16", "int8", "int4", "topk"]
Sharding = Literal["rank0", "sharded"]
Aggregation = Literal["mean", "trimmed_mean", "centered_clip"]
RoundMode = Literal["fixed_steps", "swarm_target"]
Transport = Literal["tcp", "p2p"]
Deadlines = Literal["adaptive", "fixed"]

# Settings of the fingerprinted sections that are fingerprinted only in sharded mode: the logical shards decide the
# averagers' keys and the digest, so every peer of a run must use the same mode and shard count (any rank layout:
# a 1-rank and an 8-rank peer average together in either mode). A rank0-mode fingerprint is as it always was.
SHARDED_ONLY = frozenset({"outer.sharding", "outer.shards"})
# Settings added after runs were made: fingerprinted only when not at their default, so a run (and its checkpoints)
# made before they existed keeps its fingerprint, while peers that set them differently still cannot average.
OMITTED_AT_DEFAULT = frozenset({"outer.aggregation", "outer.norm_bound", "outer.trim", "train.total_steps",
                                "outer.topk_density", "outer.topk_bits", "outer.fragments", "outer.fragment_alpha",
                                "outer.topk_error_decay"})
# Single settings of the other sections that every peer of a run must share: the seed of theta(0), the round mode,
# and the horizon of the inner lr schedule (so that every peer trains a round with the same lr, whatever its
# --max-rounds, and a run stopped and resumed with a larger --max-rounds continues exactly).
FINGERPRINTED_SETTINGS = ("run.seed", "round.mode", "train.total_steps")


@dataclass
class RunConfig:
    """Identity of the run: peers with the same ``run_id`` and fingerprint train one model together."""

    run_id: str = "p2p-diloco-tiny"
    seed: int = 0  # initial weights come from this seed, so every peer starts from the same theta(0)
    max_rounds: int = 0  # 0 = run until stopped


@dataclass
class ModelConfig:
    """A causal LM that transformers can build: a preset, a config JSON, or a local/hub ``name_or_path``."""

    preset: str = "tiny-llama"  # used when name_or_path and config_json are empty
    name_or_path: str = ""  # from_pretrained (works offline from a local directory)
    config_json: str = ""  # path to a transformers config.json (random init)
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 344
    max_seq_len: int = 256


@dataclass
class TokenizerConfig:
    """``name_or_path = "byte"`` is the built-in byte-level tokenizer; anything else goes to AutoTokenizer."""

    name_or_path: str = "byte"


@dataclass
class DataConfig:
    """Where text comes from. ``path = "builtin:stdlib"`` is the offline default corpus."""

    path: str = "builtin:stdlib"  # hub dataset name, local directory, or a glob of text/json/jsonl/parquet files
    name: str = ""  # hub dataset config name (e.g. "en" for allenai/c4)
    text_column: str = "text"
    train_split: str = "train"
    eval_split: str = ""  # a separate split for eval; empty = hold out documents by hash
    eval_fraction: float = 0.02  # fraction of documents held out (by a hash of the document) when eval_split is empty
    streaming: Streaming = "auto"  # "auto" (stream hub datasets, load local ones), "true", "false"
    seq_len: int = 128
    batch_size: int = 8
    seed: int = -1  # this peer's data order; -1 = derived from the peer id
    max_bytes: int = 8_000_000  # cap on the built-in corpus (the whole stdlib is ~30 MB)
    shuffle_buffer: int = 10_000  # streaming shuffle buffer


@dataclass
class TrainConfig:
    """Inner optimisation (AdamW), run by every peer on its own data for ``inner_steps`` per round."""

    inner_steps: int = 50  # H
    lr: float = 1e-3
    warmup_steps: int = 20
    # Cosine horizon in schedule steps, swarm-wide (fingerprinted; never derived from --max-rounds, so a run can be
    # stopped and extended exactly); 0 = constant lr after warmup.
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    autocast: Autocast = "auto"  # "auto" = bf16 where the device supports it (CUDA), "bf16", "off"
    device: Device = "cpu"  # "cpu", "cuda", "auto"
    threads: int = 0  # torch CPU threads; 0 = leave torch's default
    parallelism: Parallelism = "ddp"  # local ranks of a torchrun peer (p2p_diloco/local/cluster.py): ddp | fsdp (FSDP2)
    # the device's peak in TFLOP/s for MFU (training/throughput.py); 0 = a known GPU's dense bf16 peak, else no MFU
    peak_tflops: float = 0.0
    # recompute each layer's activations in the backward pass instead of keeping them: memory for the big configs,
    # at about a third more compute; the gradients are the same
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the model (needs a C++ compiler on CPU; training/part.py)


@dataclass
class OuterConfig:
    """The outer optimiser: SGD with Nesterov momentum on the averaged pseudo-gradient.

    The defaults are for the tiny CPU default; the DiLoCo paper's lr 0.7 / momentum 0.9 (tuned at 150M+, ~180
    rounds) is in the hub configs. At tiny scale the outer step does best when ``lr / (1 - momentum)``, the
    multiple of the averaged pseudo-gradient applied once momentum has built up, is about 1 (FedAvg's); the
    paper's 7 ends ~20 % worse in eval loss (measured: ``docs/results.md``).
    """

    lr: float = 0.7
    momentum: float = 0.3  # lr / (1 - momentum) = 1.0
    nesterov: bool = True
    compression: Compression = "none"  # wire codec of pseudo-gradients (see outer/codecs.py)
    # topk: the fraction of every chunk of 4096 values sent, and the bits of each value sent (2, 4 or 8); what is
    # not sent stays in this peer's error feedback (outer/error_feedback.py) and goes out in later rounds
    topk_density: float = 1 / 64
    topk_bits: int = 2
    # topk: the error feedback is multiplied by this before each round's pseudo-gradient is added (SparseLoCo's
    # beta, arXiv 2508.15706: with outer.momentum = 0 the accumulator stands in for outer momentum); 1 = nothing
    # unsent is ever dropped
    topk_error_decay: float = 1.0
    overlap: bool = False  # average round r in the background while training round r+1 (outer step one round late)
    # Streaming DiLoCo (p2p_diloco/outer/fragments.py): a round syncs 1 of `fragments` parts of the parameters, in
    # turn, so each part is synced every `fragments` rounds; its new theta is merged into the weights that kept
    # training as alpha * local + (1 - alpha) * theta. 1 = off (every round syncs the whole model).
    fragments: int = 1
    fragment_alpha: float = 0.5
    # where theta and the outer momentum live (p2p_diloco/outer/shards.py): "rank0" = whole, on one process (rank 0 of a
    # torchrun peer); "sharded" = cut into `shards` logical shards, each rank keeping its own, one averager each
    sharding: Sharding = "rank0"
    shards: int = 8
    # How each reducer combines the contributions to its slice (p2p_diloco/outer/aggregation.py; docs/security.md):
    # trimmed_mean (default: one insider in a group of 3 or more cannot steer it) | centered_clip | mean (token
    # weighted, not robust to an insider). Every method first leaves out non-finite contributions and those whose
    # RMS exceeds norm_bound x the median (in a pair: x the reducer's own); norm_bound also caps a peer's weight at
    # the median weight. norm_bound = 0 turns both off.
    aggregation: Aggregation = "trimmed_mean"
    norm_bound: float = 10.0
    trim: float = 0.25  # trimmed_mean: the fraction of contributions cut at each end of every coordinate


@dataclass
class RoundConfig:
    """When a round's inner training ends.

    ``fixed_steps``: every peer does ``train.inner_steps`` (H) steps; with peers of different speeds the fast ones
    wait for the slow ones. ``swarm_target``: the round ends for everyone once the swarm's combined progress,
    counted in tokens, reaches a target (by default H steps of every live peer), so a fast peer does more steps
    and a slow one fewer, and all of them enter the all-reduce together; the average is weighted by tokens.
    """

    mode: RoundMode = "fixed_steps"  # fixed_steps | swarm_target
    target_tokens: int = 0  # swarm_target: tokens per round for the whole swarm; 0 = H x each live peer's batch
    progress_period: float = 0.5  # swarm_target: seconds between reads of the peers' progress records


@dataclass
class EvalConfig:
    every_rounds: int = 1
    batches: int = 8


@dataclass
class SwarmConfig:
    """Networking and timeouts. Every wait in the round protocol is bounded by one of these."""

    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])  # every interface
    announce_maddrs: list[str] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)
    # RSA key file (hivemind's format) that fixes this peer's id across restarts; created if missing.
    # Empty: a fresh identity per run. The same key signs the peer's DHT records (swarm/identity.py).
    identity_path: str = ""
    startup_timeout: float = 30.0  # p2pd start
    # Keep trying the initial peers this long when none answers (peers started together with their initial peer,
    # which is not listening yet); 0: fail at once, as a mistyped address should.
    initial_peers_wait: float = 0.0
    # No inbound connections (behind NAT): the peer dials out only, reduces no slice, serves no state, and
    # still contributes its pseudo-gradient. Its DHT node stores nothing for others.
    client_mode: bool = False
    use_relay: bool = True  # libp2p circuit relay: reach (and be reached through) relaying peers
    use_auto_relay: bool = False  # look for relays and advertise addresses through them (peers behind NAT)
    min_peers: int = 1  # before the first round, wait (up to min_peers_timeout) until this many peers are live
    min_peers_timeout: float = 120.0
    heartbeat_period: float = 1.0  # how often a peer refreshes its live record
    peer_ttl: float = 6.0  # a live record expires after this long without a refresh
    matchmaking_time: float = 8.0  # how long a leader waits for the whole group before giving up
    request_timeout: float = 3.0  # must stay below matchmaking_time (hivemind)
    allreduce_timeout: float = 60.0
    next_chunk_timeout: float = 10.0
    round_timeout: float = 600.0  # give up waiting for stragglers of one round after this long
    # "adaptive": the straggler wait, the all-reduce timeout and the matchmaking window follow observed times
    # (deadlines.py); the three constants above are their caps. "fixed": the constants themselves.
    deadlines: Deadlines = "adaptive"
    straggler_floor: float = 30.0  # an adaptive straggler wait is never shorter than this
    state_timeout: float = 60.0  # downloading state from a donor
    part_size_bytes: int = 2**20
    # all-reduce bytes: "tcp" = direct sockets, authenticated per member (fast), "p2p" = libp2p streams
    transport: Transport = "tcp"
    encrypt_data: bool = False  # "tcp": also encrypt the bytes (ChaCha20-Poly1305); one member asking is enough
    data_port: int = 0  # TCP port of the direct data plane (0 = any free port)
    # A private run: only these peers (base58 peer ids, or files of them, one per line, '#' comments) may match
    # with us, download our state, or count as live peers; empty = an open swarm. See docs/security.md.
    allowed_peers: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    """Round-boundary checkpoints (``--checkpoint-dir``, ``--resume``). Empty ``dir`` = no checkpoints."""

    dir: str = ""
    keep: int = 3  # the newest ``keep`` checkpoints are kept
    every_rounds: int = 1  # save after every N-th round (and always on a graceful stop)
    resume: bool = False  # continue from the newest checkpoint in ``dir`` (an error if there is none)


@dataclass
class DebugConfig:
    """Hooks the project's benchmarks need in real peer processes (``--debug-*`` flags). Never set them in a real
    run. (The fault hooks of the tests live in the tests and in :mod:`p2p_diloco.testing`.)"""

    step_delay: float = 0.0  # seconds slept after every inner step: a slow peer for tests and benchmarks
    # A malicious peer for the security tests and benchmarks: send a corrupted pseudo-gradient every round
    # ("nan", "scale:<k>" or "random"; see outer.aggregation.corrupt_).
    corrupt_pseudo_gradient: str = ""


@dataclass
class Config:
    """The whole run configuration: one attribute per TOML section."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        """``{section: {key: value}}``: plain dicts and lists, as in a TOML file."""
        return dataclasses.asdict(self)

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings that must agree for peers to average together (flattened ``section.key`` -> value)."""
        names = [*FINGERPRINTED_SETTINGS,
                 *(f"{section}.{f.name}" for section in ("model", "tokenizer", "outer")
                   for f in dataclasses.fields(getattr(self, section)))]
        out: dict[str, Any] = {}
        for name in names:
            section, key = name.split(".")
            obj = getattr(self, section)
            value = getattr(obj, key)
            if name in SHARDED_ONLY and self.outer.sharding != "sharded":
                continue
            if name in OMITTED_AT_DEFAULT and value == getattr(type(obj)(), key):
                continue
            out[name] = value
        return out

    def fingerprint(self) -> str:
        """Short hash of :meth:`fingerprint_fields`; part of the matchmaking key."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@cache
def field_types(section: type) -> dict[str, Any]:
    """The resolved annotation of every field of a section dataclass.

    Args:
        section: A section class such as :class:`OuterConfig`.

    Returns:
        ``{field name: type}``; the annotations are strings here (``from __future__ import annotations``), so they
        are evaluated once, by :func:`typing.get_type_hints`, and cached.
    """
    return get_type_hints(section)


def choices(annotation: Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal[...]`` annotation.

    Args:
        annotation: A field's type, as :func:`field_types` returns it.

    Returns:
        The literal values, in their declared order, or ``()`` for any other type.
    """
    return get_args(annotation) if get_origin(annotation) is Literal else ()
