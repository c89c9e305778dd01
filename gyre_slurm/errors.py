"""Error types. A `UserError` is a mistake the user can fix: its message says what was
wrong and how to fix it, and the CLI prints it without a traceback."""


class UserError(ValueError):
    """Bad input from the user (config, files, arguments)."""


class ConfigError(UserError):
    """A config file or override that does not fit the schema."""


class JobFailed(RuntimeError):
    """The job stopped for a cause outside its config that its message names, with where
    to look (a node agent gone, no cell left, the call store unwritable). The CLI prints
    it without a traceback (`-v` logs one) and exits 1: not 2, which says the input was
    wrong."""


class CommandRefused(Exception):
    """An environment refuses a scaffold's command now (its episode's limits or end); the
    gateway answers 409 with the message."""
