"""Errors that are the user's to fix: ``python train.py`` prints their message alone, without a traceback.

Each message names the bad key, value or file and says what is allowed.
"""

import errno
import re


class UserError(ValueError):
    """Bad config, bad input file or bad request; the message says what to change."""


class ConfigError(UserError):
    """A config value of the wrong type or out of range (the message names the key)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used (the message names the file and what is wrong with it)."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name where it has none): the reason a one-line
    warning or error message gives for what it caught."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def user_error(error: BaseException) -> UserError | None:
    """The `UserError` behind ``error``, if any.

    Hydra's ``instantiate`` wraps what a constructor raises (``__cause__``), and a DataLoader worker
    re-raises an error it cannot rebuild as ``RuntimeError("Caught DataError in DataLoader worker
    process 0. Original Traceback ...")``: the original message is the traceback's last line.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        from_worker = _from_loader_worker(error)
        if from_worker is not None:
            return from_worker
        refused = _refused_by_constructor(error)
        if refused is not None:
            return refused
        if isinstance(error, OSError) and error.filename and error.errno in _ENVIRONMENT_ERRNOS:
            return UserError(f"{error.filename}: {error.strerror}")
        seen.add(id(error))
        error = error.__cause__
    return None


def _refused_by_constructor(error: BaseException) -> UserError | None:
    """A config value that a constructor refused with a plain ValueError or TypeError, as one line
    naming the config node (Hydra's ``instantiate`` reports it in several lines with a traceback)."""
    cause = error.__cause__
    if type(error).__name__ != "InstantiationException" or not isinstance(cause, ValueError | TypeError):
        return None
    if isinstance(cause, UserError):
        return cause
    key = re.search(r"^full_key: (\S+)", str(error), re.M)
    target = re.search(r"call to target '([^']+)'", str(error))
    where = key.group(1) if key else (target.group(1) if target else "config")
    return UserError(f"{where}: {cause}")


#: what a file system answers that the user fixes (space, quota, permissions, a read-only mount, a
#: folder where a file belongs or the reverse)
_ENVIRONMENT_ERRNOS = {
    *(errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO),
    *(errno.EISDIR, errno.ENOTDIR),
}

_WORKER_ERROR = re.compile(r"^Caught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback", re.S)


def _from_loader_worker(error: BaseException) -> UserError | None:
    """The `UserError` a DataLoader worker raised, rebuilt from torch's re-raised text."""
    match = _WORKER_ERROR.match(str(error))
    if match is None or match.group(1) not in _user_error_names():
        return None
    last = str(error).rstrip().splitlines()[-1]  # "attnlab.data.errors.DataError: <file>:<line>: <why>"
    message = last.split(f"{match.group(1)}: ", 1)[-1]
    return UserError(message)


def _user_error_names() -> set[str]:
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names
