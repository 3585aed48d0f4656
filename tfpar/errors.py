"""Errors meant for people: a setting, the value it had, and what would work."""


class TfparError(Exception):
    """A problem with the user's input or environment that tfpar can explain in one line.

    `python -m tfpar.train` and the other entry points print these as a single
    `tfpar: error: ...` line and exit with status 2, never with a traceback.
    """


class ConfigError(TfparError, ValueError):
    """A setting (flag, `ParallelConfig` field, `TF_CONFIG` field) has a bad value."""

    def __init__(self, setting, value, expected):
        self.setting = setting
        self.value = value
        self.expected = expected
        super().__init__(f"{setting}={value!r} is invalid: {expected}")
