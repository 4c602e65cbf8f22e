"""Building a real peer: the production wiring of :class:`~p2p_diloco.peer.peer.Peer`'s parts.

Parse, build, run, close (``p2p-diloco join``: :mod:`p2p_diloco.cli.commands`). The in-memory wiring for tests is
:mod:`p2p_diloco.testing.harness`.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any, Callable

import torch

from ..config import Config
from ..metrics import Metrics
from ..errors import ConfigError
from ..outer.fragment_state import FragmentState
from ..outer.state import GlobalState, WholeState
from ..runtime.clock import Clock, RealClock
from ..runtime.forks import keep_out_of_children
from ..swarm.port import SwarmFactory
from ..training.model import count_parameters
from ..training.part import Training
from .checkpoints import check_checkpoint_dir, load_resumed
from .context import PeerContext
from .peer import Peer

log = logging.getLogger("p2p_diloco.peer")


def build_state(cfg: Config, cluster, params) -> GlobalState:
    """The global state in the layout ``outer.sharding`` asks for, starting from the model's initial weights."""
    if cfg.outer.sharding == "sharded":
        from ..outer.sharded_state import ShardedState  # imports torch.distributed helpers only when needed

        return ShardedState(cfg, cluster, params)
    o = cfg.outer
    if o.fragments > 1:
        if cluster is not None:  # (local/cluster.py's check refuses it on every rank before this)
            raise ConfigError("outer.fragments > 1 does not work under torchrun with several ranks yet")
        try:
            return FragmentState(params, o.lr, o.momentum, o.nesterov, cfg.fingerprint(), o.fragments,
                                 o.fragment_alpha)
        except ValueError as e:  # more fragments than parameter tensors
            raise ConfigError(str(e)) from None
    return WholeState(params, o.lr, o.momentum, o.nesterov, cfg.fingerprint())


def build_peer(cfg: Config, metrics: Metrics, swarm_factory: SwarmFactory, stop: threading.Event | None = None,
               on_started: Callable[[Any], None] | None = None, cluster=None, clock: Clock | None = None,
               on_training: Callable[[], None] | None = None) -> Peer:
    """A peer of ``cfg`` that reaches the swarm through ``swarm_factory`` (:class:`~p2p_diloco.swarm.swarm.Swarm`).

    Raises:
        CheckpointError: ``checkpoint.dir`` is not a writable directory, or ``checkpoint.resume`` is set and the
            newest checkpoint is missing, corrupt or belongs to another config (raised here, before anything joins
            the swarm).
    """
    check_checkpoint_dir(cfg)  # every start-up check before the model is built and the swarm joined
    resumed = load_resumed(cfg, cluster)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    training = Training(cfg, cluster)
    state = build_state(cfg, cluster, training.params)
    # the DHT and averager processes fork from here on: they never read the weights or the outer state
    keep_out_of_children([*training.params, *state.held_tensors()])
    swarm = swarm_factory(cfg, state.tensors_like(), state.donate, **state.swarm_options())
    clock = clock or RealClock()
    ctx = PeerContext(cfg, clock, stop or clock.event(), metrics, swarm, state, random.Random())
    log.info("model: %d parameters, fingerprint %s", count_parameters(training.model), cfg.fingerprint())
    return Peer(ctx, training, resumed=resumed, cluster=cluster, on_started=on_started, on_training=on_training)
