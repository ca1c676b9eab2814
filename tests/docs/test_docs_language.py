"""What a user reads speaks of attnlab only: no issue numbers, no account of the runs and machines
it was developed on, no commit ids in prose (a figure's commit stands on its machine line in
docs/benchmarks.md, and history in CHANGELOG.md), and a README short enough to read in two minutes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150

#: what a user reads: the docs, the build files, and the code's comments and docstrings
READ = [
    "README.md",
    "CHANGELOG.md",
    "Makefile",
    "pyproject.toml",
    "train.py",
    "data/README.md",
    "slurm/README.md",
    "docs/*.md",
    "scripts/*.sh",
    "conf/**/*.yaml",
    "src/**/*.py",
    "tests/**/*.py",
]
PROCESS = [
    (re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
    (re.compile(r"\b(this|earlier|previous|another|other) sessions?\b", re.I), "a development session"),
    (re.compile(r"\bdevelopment machine\b|\bthis 2-core (machine|VM)\b|\b(downloaded|measured) here\b", re.I),
     "the development machine"),
    (re.compile(r"\bwould be the next step\b|\bdesign notes shared with the team\b|\ba helper's\b", re.I),
     "how the project was built"),
]  # fmt: skip
#: a commit id: a 7-40 digit hex word after "commit", or anywhere when it has a letter and a digit
COMMIT = re.compile(r"\bcommit [0-9a-f]{7,40}\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _files() -> list[Path]:
    """Every file of ``READ`` but this one, which spells the phrases out to look for them."""
    found = {path for pattern in READ for path in REPO_ROOT.glob(pattern) if path.is_file()}
    return sorted(found - {Path(__file__).resolve()})


def _lines_with(pattern: re.Pattern, path: Path) -> list[str]:
    return [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()[:120]}"
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip


@pytest.mark.parametrize(("pattern", "what"), PROCESS, ids=[what for _, what in PROCESS])
def test_no_process_language(pattern, what):
    found = [line for path in _files() for line in _lines_with(pattern, path)]
    assert not found, f"{what} in what users read:\n" + "\n".join(found)


def test_no_commit_id_in_prose():
    """Commit ids stand only on docs/benchmarks.md's machine lines (with "commit") and in the changelog."""
    found = []
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for line in _lines_with(COMMIT, path):
            if path.name == "benchmarks.md" and "commit" in line:
                continue
            found.append(line)
    assert not found, "commit ids in prose:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    assert PROCESS[0][0].search("as issue 31 measured") and COMMIT.search("at commit 2025933 on")
    assert PROCESS[1][0].search("earlier sessions measured") and PROCESS[2][0].search(
        "none can be downloaded here"
    )
    assert not COMMIT.search("1e10, 2026-12-04, sm_90, 4,514,726") and not PROCESS[0][0].search("issues")


def test_readme_is_short_and_the_pages_it_promises_exist():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for page in (
        "docs/benchmarks.md",
        "docs/index.md",
        "docs/cli.md",
        "docs/configuration.md",
        "CHANGELOG.md",
    ):
        assert (REPO_ROOT / page).is_file(), page
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links and all((REPO_ROOT / link).exists() for link in links), links


def test_every_doc_page_is_listed_in_the_index():
    index = (REPO_ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in (REPO_ROOT / "docs").glob("*.md") if p.name != "index.md"]
    assert [p for p in pages if f"({p}" not in index] == []
