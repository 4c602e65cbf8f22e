"""Exceptions shared across layers (kept free of hivemind so that the round protocol can catch them)."""


class UsageError(ValueError):
    """Bad user input (flags, config, addresses). The CLI prints it on one line and exits with code 2."""


class ConfigError(UsageError):
    """Bad configuration input (missing file, unknown key, bad value). The CLI turns it into exit code 2."""


class SwarmError(UsageError):
    """The swarm could not be started or reached (bad or unreachable initial peers)."""


class ConfigMismatch(SwarmError):
    """A live peer of the same run id uses another model/tokenizer/outer config."""


class RoundFailed(RuntimeError):
    """An all-reduce did not complete for every value; nothing was applied."""
