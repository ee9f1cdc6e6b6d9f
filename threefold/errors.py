"""User-facing errors: each becomes ONE line on stderr and exit code 2, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input that the user can fix. `str(err)` is the whole message, one line."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration key has an invalid value: names the key, the problem, what is valid."""

    def __init__(self, key: str, problem: str, valid: str | None = None):
        self.key, self.problem, self.valid = key, problem, valid
        text = f"{key}: {problem}"
        if valid:
            text += f" ({valid})"
        super().__init__(text)


class DataError(UserError):
    """A data file or directory is missing, empty or does not fit the model."""
