"""A member that dies in the middle of a direct-TCP all-reduce (fastpath.py) costs its slice, not a restart.

Why: with whole-swarm groups the chance that some member dies during a sync grows with the group size times the
sync time; restarting the whole transfer on every death may never finish at 32 peers and a sync of minutes
(issue 20). What the survivors do, each on its own observation (its connection to the dead member broke) or on a
survivor's claim (a part of the dead member's slice sent to it for re-reduction):

* every reducer of a live slice reduces it over the parts it holds. The dead member's part is in if it arrived
  whole before the reduction began, out otherwise (a part counts only once all its bytes authenticated), so each
  slice is the exact weighted average of the parts it names. Nothing of those slices crosses the network again:
  making them all exclude the dead member would mean answering every survivor again, half of the all-reduce.
* the dead member's slice is re-reduced by the survivor with the lowest index: every other survivor sends it its
  own part of that slice, re-encoded from its input as it was (the vector averaged in place may hold half of
  the dead reducer's answer: the part is read from the host, source_channel.py), and receives the average. Only
  that slice crosses the network again: N - 2 parts up and N - 2 answers down, 1/N of the all-reduce's bytes.

Every survivor decodes the same bytes of every slice, so theta stays bit-identical. A survivor that had finished
before it learnt of the death holds the dead reducer's own answer instead: its digest differs, the commit step
certifies neither result, and the round is retried as before. A second death, a group of two, or any failure of
the repair fails the all-reduce. The group that commits is the survivors (``FastAllReduce.dead`` leaves the dead
member out of the gathered members: exact_averager.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ..outer.aggregation import Contribution
from .data_auth import DataAuthError
from .data_wire import Sender
from .sockets import FastPathError, view_of


class SliceRepair:
    """The re-reduction of dead member ``dead``'s slice in one ``FastAllReduce`` (module docstring).

    ``bytes_sent`` / ``bytes_received``: what the repair's connections moved (also counted in the all-reduce's).
    """

    def __init__(self, allreduce: Any, dead: int):  # (a FastAllReduce: fastpath.py imports us)
        self.allreduce, self.dead = allreduce, dead
        self.survivors = [i for i in range(allreduce.n) if i != dead]
        self.reducer = self.survivors[0]
        self.bytes_sent = self.bytes_received = 0
        loop = asyncio.get_event_loop()
        self.averaged: asyncio.Future = loop.create_future()  # the slice's encoded average (the re-reducer's)
        self.all_served: asyncio.Future = loop.create_future()
        self.connected: set[int] = set()
        self.contributions: list[Contribution] = []
        self.served = 0
        self._reducing = False

    async def _own_part(self) -> torch.Tensor:
        bounds = self.allreduce.bounds
        return await self.allreduce.read_source(bounds[self.dead], bounds[self.dead + 1])

    def authenticate(self, sender: Sender) -> Sender:
        """A survivor's repair connection (its header authenticated by the all-reduce): one each."""
        if sender.index in self.connected:
            raise DataAuthError(f"a second repair connection from member {sender.index}")
        self.connected.add(sender.index)
        return sender

    async def serve(self, sock, sender: Sender) -> None:
        """The re-reducer's side of one survivor's connection: its part in, the slice's average out."""
        ar = self.allreduce
        try:
            numel = ar._numel(self.dead)
            data = ar.workspace.get(f"repair{sender.index}", ar.codec.payload_bytes(numel), torch.uint8)
            await ar.receive_part(sock, sender, data, also=self)
            self.contributions.append(Contribution(sender.index, ar.codec.decode(data, numel), sender.weight))
            await self._reduce_when_complete()
            await ar.answer(sock, sender, await asyncio.shield(self.averaged), also=self)
        finally:
            self.served += 1
            if self.served == len(self.survivors) - 1 and not self.all_served.done():
                self.all_served.set_result(None)

    async def _reduce_when_complete(self) -> None:
        if self._reducing or len(self.contributions) < len(self.survivors):
            return
        self._reducing = True
        ar = self.allreduce
        encoded = await ar._in_thread(ar._reduce_slice, list(self.contributions), {}, "repaired")
        if self.averaged.done():  # failed meanwhile
            return
        if encoded is None:
            self.averaged.set_exception(FastPathError(f"no valid contribution to slice {self.dead}"))
        else:
            self.averaged.set_result(encoded)

    async def take_part(self) -> None:
        """Our part: as the re-reducer, take every survivor's part and answer it; else send ours to the
        re-reducer. Either way the slice's average ends in our output. Raises if the repair fails."""
        ar = self.allreduce
        if ar.index == self.reducer:
            self.contributions.append(Contribution(ar.index, await self._own_part(), ar.weight))
            await self._reduce_when_complete()
            try:  # the others send at once, each on its own observation or on a survivor's claim
                encoded = await asyncio.wait_for(asyncio.shield(self.averaged), ar.chunk_timeout)
            except asyncio.TimeoutError:
                missing = sorted(set(self.survivors) - {c.sender for c in self.contributions})
                raise FastPathError(f"members {missing} sent no part of dead member {self.dead}'s slice") from None
            ar._decode_into(encoded, self.dead)
            if len(self.survivors) > 1:
                await asyncio.wait_for(asyncio.shield(self.all_served), ar.wait_timeout)
            return
        data, part = ar._receive_buffer(self.dead), await self._own_part()
        try:
            await ar.exchange(self.reducer, self.dead, view_of(ar.codec.encode(part)), data, also=self)
        except ConnectionError as e:
            raise FastPathError(f"the re-reducer {self.reducer} of slice {self.dead} dropped us: {e}") from None
        ar._decode_into(data, self.dead)

    def fail(self, reason: str) -> None:
        """The all-reduce failed or ended: whatever still waits on the repair stops."""
        for future in (self.averaged, self.all_served):
            if not future.done():
                future.set_exception(FastPathError(reason))
                future.exception()  # (retrieved: nobody may wait on it any more)
