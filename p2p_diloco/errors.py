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
    """An all-reduce did not complete for every value; nothing was applied."""


class RunError(RuntimeError):
    """The run cannot go on as asked (a checkpoint cannot be written). The peer stops; the CLI prints one line and
    exits with code 1."""
