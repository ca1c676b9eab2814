"""Where the ``lra_release`` tarball is: the documented place or the extra level it often has.

The tarball is documented at ``<data_dir>/lra_release/``; shared setups often have it one level
deeper, ``<data_dir>/lra_release/lra_release/``. Both are accepted; the sources say which they read.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.data.lra.pathfinder_generator import GENERATOR_FILE

LRA_DIR = "lra_release"


def release_roots(data_dir: str | Path) -> list[Path]:
    """Where the LRA release may sit, in order of preference: the documented
    ``<data_dir>/lra_release`` and the extra level ``<data_dir>/lra_release/lra_release``."""
    flat = Path(data_dir) / LRA_DIR
    return [flat, flat / LRA_DIR]


def layout_of(path: Path, data_dir: str | Path) -> str:
    """Which of the two release layouts ``path`` lies in, for logs and ``data_source``."""
    nested = release_roots(data_dir)[1]
    return "nested lra_release/lra_release layout" if path.is_relative_to(nested) else "lra_release layout"


def pick_release_dir(data_dir: str | Path, relative: str, wanted: list[str]) -> Path:
    """``<root>/<relative>`` for the first release root holding every ``wanted`` file there,
    else the first holding any of them (so a missing file is reported where the others are), else
    the documented flat place (where generated files go)."""
    candidates = [root / relative for root in release_roots(data_dir)]
    for test in (all, any):
        for folder in candidates:
            if test((folder / name).is_file() for name in wanted):
                return folder
    return candidates[0]


def release_parts(data_dir: str | Path) -> list[Path]:
    """Parts of the official LRA release present under ``data_dir`` (attnlab-generated sets excluded):
    when there are any, a missing Pathfinder set is an error rather than a reason to generate one."""
    found = []
    flat, nested = release_roots(data_dir)
    if nested.is_dir():
        found.append(nested)
    for root in (flat, nested):
        if (root / "tsv_data").is_dir():
            found.append(root / "tsv_data")
        listops_dir = root / "listops-1000"
        if listops_dir.is_dir() and not (listops_dir / "GENERATED_BY_ATTNLAB.json").is_file():
            found.append(listops_dir)
        for folder in sorted(root.glob("pathfinder*/curv_*")):
            if folder.is_dir() and not (folder / GENERATOR_FILE).is_file():
                found.append(folder)
    return found
