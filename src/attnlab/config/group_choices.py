"""A config-group choice that names no config file, said in one line before Hydra composes anything.

Hydra's own report of ``task=lisops`` is twenty lines (every choice, its search path, a hint about
``HYDRA_FULL_ERROR``) and exits 0 under some launchers; ``check_group_choices`` says which choice is
missing, what the group offers and the closest name, and ``train.py`` stops with it. Choices in the
directories of ``hydra.searchpath=[file://...]`` count (docs/extending.md adds backends that way).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

_CHOICE = re.compile(r"^[+~]?(?P<group>[a-z_]+(?:/[a-z_]+)*)=(?P<values>[^=]*)$")
_SEARCHPATH = re.compile(r"^hydra\.searchpath=\[(?P<paths>.*)\]$")
_NAMES = re.compile(r"^\[?(?P<names>[\w./-]+(?:,[\w./-]+)*)\]?$")  # a name, a sweep a,b or a list [a,b]


def _named_choices(values: str) -> list[str]:
    """The plain names of an override's value (``softmax``, ``softmax,linear``, ``[csv,tensorboard]``,
    quoted or not); none for Hydra's sweep functions (``glob(*)``, ``choice(...)``, ``range``) and
    interpolations, which Hydra itself expands and checks."""
    values = values.strip()
    if len(values) > 1 and values[0] == values[-1] and values[0] in "'\"":
        values = values[1:-1]
    match = _NAMES.match(values)
    if not match or values.startswith("[") != values.endswith("]"):
        return []
    return match.group("names").split(",")


def _config_dirs(args: list[str], conf_dir: Path) -> list[Path] | None:
    """``conf_dir`` and the file directories of a ``hydra.searchpath`` override; None when the search
    path holds something this check cannot list (a ``pkg://`` entry)."""
    dirs = [conf_dir]
    for arg in args:
        match = _SEARCHPATH.match(arg)
        if not match:
            continue
        for entry in filter(None, (e.strip().strip("'\"") for e in match.group("paths").split(","))):
            if not entry.startswith("file://"):
                return None
            dirs.append(Path(entry.removeprefix("file://")))
    return dirs


def check_group_choices(args: list[str], conf_dir: Path) -> str | None:
    """The first ``group=choice`` of ``args`` whose config file does not exist, in one line, or None."""
    if any(arg.startswith(("--config-dir", "-cd")) for arg in args):
        return None  # another config tree: Hydra reads it
    dirs = _config_dirs(args, conf_dir)
    if dirs is None:
        return None
    for arg in args:
        match = _CHOICE.match(arg)
        if not match or match.group("group").startswith("hydra/"):
            continue
        group = match.group("group")
        groups = [d / group for d in dirs if (d / group).is_dir()]
        if not groups:
            continue  # a plain key (seed=1), not a group
        files = [(g, p) for g in groups for p in g.rglob("*.yaml")]
        offered = sorted({p.relative_to(g).with_suffix("").as_posix() for g, p in files})
        for value in _named_choices(match.group("values")):  # a sweep or a list: every name must exist
            if value == "null" or value in offered:
                continue
            close = difflib.get_close_matches(value, offered, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return f"{group}={value}: no such {group}{hint}; {group} is one of: {', '.join(offered)}"
    return None
