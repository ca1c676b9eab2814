"""Errors that are the user's to fix: ``python train.py`` prints their message alone, without a traceback.

Each message names the bad key, value or file and says what is allowed.
"""


class UserError(ValueError):
    """Bad config, bad input file or bad request; the message says what to change."""


class ConfigError(UserError):
    """A config value of the wrong type or out of range (the message names the key)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used (the message names the file and what is wrong with it)."""


def user_error(error: BaseException) -> UserError | None:
    """The `UserError` behind ``error``, if any: Hydra's ``instantiate`` wraps what a constructor raises."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None
