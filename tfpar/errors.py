"""Errors meant for people: a setting, the value it had, and what would work."""


class TfparError(Exception):
    """A problem with the user's input or environment that tfpar can explain in one line.

    `python -m tfpar.train` and the other entry points print these as a single
    `tfpar: error: ...` line and exit with status 2 (1 for a `PeerError`), never with a
    traceback.
    """


class PeerError(TfparError):
    """Other workers failed, stalled or never started: a restart may mend it, so
    `python -m tfpar.train` exits with status 1 (which `tfpar.launch` retries), not 2
    (which it does not: the same command would fail the same way)."""


class ConfigError(TfparError, ValueError):
    """A setting (flag, `ParallelConfig` field, `TF_CONFIG` field) has a bad value."""

    def __init__(self, setting, value, expected):
        self.setting = setting
        self.value = value
        self.expected = expected
        super().__init__(f"{setting}={value!r} is invalid: {expected}")
