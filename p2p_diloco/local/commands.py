"""The commands rank 0 of a cluster peer sends its other local ranks (:mod:`p2p_diloco.local.cluster`), one int64
broadcast each: what to do next, so that every decision is taken once, on rank 0."""

STEP, PARAMS, STATE, STOP, INIT, GATHER, OPTIM, EVAL = 1, 2, 3, 4, 5, 6, 7, 8
SPSEUDO, SSYNC, SSTEP, SLOAD, SDOWNLOAD, SSAVE, SRESTORE = 9, 10, 11, 12, 13, 14, 15  # outer.sharding = "sharded"
NAMES = {STEP: "STEP", PARAMS: "PARAMS", STATE: "STATE", STOP: "STOP", INIT: "INIT", GATHER: "GATHER",
         OPTIM: "OPTIM", EVAL: "EVAL", SPSEUDO: "SPSEUDO", SSYNC: "SSYNC", SSTEP: "SSTEP", SLOAD: "SLOAD",
         SDOWNLOAD: "SDOWNLOAD", SSAVE: "SSAVE", SRESTORE: "SRESTORE"}  # S*: p2p_diloco/local/sharded_ranks.py
