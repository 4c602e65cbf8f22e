"""Exceptions shared across layers (kept free of hivemind so that the round protocol can catch them)."""


class UsageError(ValueError):
    """Bad user input (flags, config, addresses). The CLI prints it on one line and exits with code 2."""


class ConfigError(UsageError):
    """Bad configuration input (missing file, unknown key, bad value). The CLI turns it into exit code 2."""


class SwarmError(UsageError):
    """The swarm could not be started or reached (bad or unreachable initial peers)."""


class ConfigMismatch(SwarmError):
    """A live peer of the same run id uses another config: a fingerprinted setting (model, tokenizer, outer, ...) or
    a shared one (H, the lr schedule, the protocol's timeouts; :mod:`p2p_diloco.config.sharing`)."""


class RoundFailed(RuntimeError):
    """An all-reduce did not complete for every value; nothing was applied.

    Attributes:
        bytes_sent: all-reduce bytes this process wrote for the failed attempt before it failed, summed over its
            averagers: on the direct-TCP data plane every byte of the attempt's connections that the kernel took
            (headers, sealed parts and answers), on libp2p the serialized tensor parts handed to the streams
            (swarm/fastpath.py, swarm/runner.py; the same counts as a successful all-reduce's). 0 where nothing
            moved (no group was found) or nothing is known (a failure outside an all-reduce).
        bytes_received: likewise, the bytes read.
        regroup: the attempt ended early because its matchmaking leader expects another group
            (swarm/led_matchmaking.py): read the records again and retry at once; nobody failed.
    """

    def __init__(self, *args, bytes_sent: int = 0, bytes_received: int = 0, regroup: bool = False):
        super().__init__(*args)
        self.bytes_sent, self.bytes_received, self.regroup = bytes_sent, bytes_received, regroup


class RunError(RuntimeError):
    """The run cannot go on as asked (a checkpoint cannot be written). The peer stops; the CLI prints one line and
    exits with code 1."""
