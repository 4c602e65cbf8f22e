"""A stand-in for a peer's model and trainer (:class:`~p2p_diloco.training.part.Training`) in protocol scenarios:
a few small tensors that each inner step pulls towards a target, with this peer's own noise, taking virtual time.

It learns (the eval loss, the squared distance of theta to the target, goes down as rounds are averaged), its
steps are deterministic in (run seed, data seed, step), and it checkpoints and restores like the real one."""

from __future__ import annotations

import torch

from ..outer import optimizer as opt

SHAPES = ((16,), (4, 4))
PULL, NOISE = 0.1, 0.05


class FakeReplica:
    """The local model as the global state sees it (:class:`~p2p_diloco.training.inner.Replica`)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params

    def pseudo_gradient(self, theta, out) -> None:
        opt.pseudo_gradient(theta, self.params, out)

    def load(self, theta) -> None:
        opt.load_into(self.params, theta)


class FakeTraining:
    """Args:
        cfg: the peer's run config (``run.seed`` gives theta(0) and the target; the batch gives tokens per step).
        clock: the simulation's clock.
        step_seconds: virtual seconds per inner step (a slow peer has more).
        stalls: ``{round k: seconds}``: stall that long before the first inner step of round k (a stuck but live
            peer: its records stay fresh).
    """

    def __init__(self, cfg, clock, step_seconds: float = 0.05, stalls: dict[int, float] | None = None):
        self.cfg, self.clock, self.step_seconds = cfg, clock, step_seconds
        self.stalls = dict(stalls or {})
        seed = torch.Generator().manual_seed(cfg.run.seed)
        self.params = [torch.randn(s, generator=seed) for s in SHAPES]
        self.target = [torch.randn(s, generator=seed) for s in SHAPES]
        self.replica = FakeReplica(self.params)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum
        self.data_seed: int | None = None
        self.cursor = 0  # inner steps taken: the "data" position
        self.steps = 0  # inner steps taken by this training (a stall is checked once per round)

    def start(self, data_seed: int) -> None:
        self.data_seed = data_seed

    def step(self, schedule_step: int) -> tuple[float, int]:
        k = schedule_step // self.cfg.train.inner_steps + 1
        stall = self.stalls.pop(k, 0.0)
        if stall:
            self.clock.sleep(stall)
        self.clock.sleep(self.step_seconds)
        noise = torch.Generator().manual_seed(self.data_seed * 1_000_003 + self.cursor)
        with torch.no_grad():
            for p, t in zip(self.params, self.target):
                p.add_(PULL * (t - p) + NOISE * torch.randn(p.shape, generator=noise))
        self.cursor += 1
        return self.evaluate(), self.tokens_per_step

    def mfu(self, tokens_per_s: float) -> float | None:
        return None  # a stand-in has no FLOPs and no device peak

    def evaluate(self) -> float:
        return float(sum(((p - t) ** 2).sum() for p, t in zip(self.params, self.target)))

    def model_state(self) -> dict:
        return {"params": [p.clone() for p in self.params]}

    def optimizer_state(self) -> dict:
        return {}

    def data_state(self) -> dict:
        return {"cursor": self.cursor}

    def restore(self, model_state: dict, optimizer_state: dict, data_state: dict) -> None:
        for p, saved in zip(self.params, model_state["params"], strict=True):
            p.copy_(saved)
        self.cursor = data_state["cursor"]

    def close(self) -> None:
        pass
