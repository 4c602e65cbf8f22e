"""One rank of a test's torchrun peer forked from its agent (``torchrun --start-method fork --run-path`` this file,
tests/swarm/helpers.py: Proc), whose process came from the tests' zygote: torchrun's own agent, rendezvous and rank
environment, without a new interpreter and its imports for each rank.

What an exec'd rank gets at start and a forked one must be given: torch's thread count from ``OMP_NUM_THREADS``
(torchrun sets it to 1 for its ranks; OpenMP read it when the zygote loaded it) and hivemind's process-shared
locks of its own (tests/zygote.py). Then it runs ``python -m MODULE ARGS`` as a rank would (usage: ``torchrun_rank.py
MODULE ARGS``)."""

import os
import runpy
import sys

import numpy
import torch
from hivemind.utils.mpfuture import MPFuture

if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    MPFuture.reset_backend()
    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
