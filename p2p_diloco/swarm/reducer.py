"""A reducer that validates every contribution to a part and aggregates them robustly (libp2p transport).

hivemind's ``TensorPartReducer`` adds each sender's part into a running sum as it arrives, so one NaN or one
absurdly scaled pseudo-gradient poisons the whole slice for every peer. This reducer keeps the contributions of
the current part instead, and once every sender's part is in hands them to
:func:`p2p_diloco.outer.aggregation.aggregate`,
which leaves out the invalid ones and combines the rest (``outer.aggregation``). Each reducer does this for its own
slice only, so the butterfly layout keeps the work local, and every peer receives the reducer's encoded result, so
the outcome stays bit-identical across peers.

Memory: ``group size x part_size_bytes`` per reducer (the parts of one part index), instead of one part.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from ..outer.aggregation import Contribution, Policy, combine, validate


class ValidatingPartReducer(TensorPartReducer):
    """``TensorPartReducer`` with validation and robust aggregation of each part (see the module docstring).

    Attributes:
        excluded: ``{sender index: reason}`` of every sender left out of at least one part (first reason kept).
        failed_parts: parts for which no valid contribution was left; the runner refuses them (all-or-nothing).
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, policy: Policy, own: int | None = None):
        self.policy, self.own = policy, own  # own: our index among the senders (the norm bound's reference)
        self.contributions: list[Contribution] = []
        self.excluded: dict[int, str] = {}
        self.failed_parts: set[int] = set()
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        self.contributions = []
        self.accumulator = None  # the sum is never used: contributions are kept instead

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """Keep this sender's part; once every current sender's part is in, return the aggregate of the part.

        The waiting logic is hivemind's (parts are reduced strictly in order); only the accumulation differs.
        """
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            finished = asyncio.ensure_future(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.contributions.append(Contribution(sender_index, tensor_part.reshape(-1), float(weight)))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        shape = self.part_shapes[self.current_part_index]
        # sorted by sender: the same inputs give the same bytes whatever order the streams delivered them in
        contributions = sorted(self.contributions, key=lambda c: c.sender)
        kept, excluded = validate(contributions, self.policy, shape.numel(), self.own)
        if kept:
            averaged = combine(kept, self.policy).reshape(shape)
        else:  # every contribution was invalid: this part cannot be averaged, so the round fails
            averaged = torch.zeros(shape)
            self.failed_parts.add(self.current_part_index)
        for sender, reason in excluded.items():
            self.excluded.setdefault(sender, reason)
        self.current_part_future.set_result(averaged)
        self.reset_accumulators()
