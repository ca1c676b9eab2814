"""The structure drawn from the imports: no import circle between modules, every import
going down the floors below, no module reaching for another's ``_private`` name, the float64
references apart from the ops, and no source file over 600 lines.

Read from the source with ``ast`` (imports inside functions count too: a lazy import still ties two
modules together), so the test needs no import of the package and names the offending file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attnlab"
MAX_LINES = 600

#: lowest first; a module may import only from its own group or a lower floor. A group is a
#: subpackage of attnlab (``attnlab.data``) or a top-level module (``attnlab.pipeline``).
FLOORS: list[set[str]] = [
    {"errors", "threads", "allocator", "files"},  # the ground: user errors, CPU threads, malloc, file writes
    {"run"},  # a run's dir, checkpoints, clock, summary, SLURM: knows no model or data
    {"attention"},
    {"flops", "data", "config"},
    {"models"},
    {"tasks", "callbacks", "reporting"},
    {"bench"},  # the benchmark library: measures models and tasks, prints tables
    {"pipeline"},
    {"cli", "__init__"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The attnlab modules ``path`` imports (``from attnlab.x import y`` counts as ``attnlab.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return {name for name in found if name == "attnlab" or name.startswith("attnlab.")}


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(group: str) -> int:
    for level, groups in enumerate(FLOORS):
        if group in groups:
            return level
    raise AssertionError(f"attnlab.{group} has no floor in tests/test_architecture.py FLOORS: place it")


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    graph = {}
    for module, path in sources.items():
        targets = set()
        for name in _imports(path):
            # `from attnlab.data import glue` names a package: the edge goes to the package itself
            while name not in sources and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in sources and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exports its modules; those edges point down into the package
    for module in graph:
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".")}
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_go_down_the_floors():
    upward = []
    for module, targets in _graph().items():
        here = _floor(_group(module))
        for target in targets:
            if module == "attnlab" or target.startswith(module + "."):
                continue
            if _floor(_group(target)) > here:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports up a floor:\n" + "\n".join(sorted(upward))


def _private_uses(path: Path, module: str, sources: dict[str, Path]) -> list[str]:
    """``from attnlab.x import _name`` and ``x._name`` (``x`` an attnlab module imported here) where
    ``attnlab.x`` is another module: what ``path`` takes of another module's private names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, str] = {}  # local name -> the attnlab module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attnlab"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in sources:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name.startswith("_") and node.module != module:
                    found.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attnlab") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and modules[node.value.id] != module
        ):
            found.append(f"{module}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_takes_another_modules_private_name():
    """A ``_name`` is its module's own: one that another module needs is public (or lives there)."""
    sources = _sources()
    found = []
    for module, path in sources.items():
        found += _private_uses(path, module, sources)
    assert not found, "private names taken from another module:\n" + "\n".join(sorted(found))


REFERENCES = sorted(PACKAGE.glob("attention/*/reference.py"))


@pytest.mark.parametrize("path", REFERENCES, ids=lambda p: p.parent.name)
def test_references_import_nothing_from_the_ops(path):
    """A family's float64 reference shares no code with its ops (it would share their bugs): it may
    import only the masks the references share, which import nothing of attnlab."""
    masks = PACKAGE / "attention" / "common" / "reference_masks.py"
    assert not _imports(masks), f"{masks.relative_to(SRC)} imports {sorted(_imports(masks))}"
    allowed = {"attnlab.attention.common.reference_masks"}
    assert _imports(path) <= allowed, f"{path.relative_to(SRC)} imports {sorted(_imports(path) - allowed)}"


def test_every_family_has_a_reference():
    assert {p.parent.name for p in REFERENCES} >= {
        "softmax",
        "linear",
        "performer",
        "sliced_relu",
        "sliced_relu_bump",
    }


ROOT = SRC.parent
SHORT = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]


@pytest.mark.parametrize("path", sorted(SHORT), ids=lambda p: str(p.relative_to(ROOT)))
def test_source_file_is_short(path):
    """The package, its tests and scripts: no file a newcomer has to scroll through 600 lines of."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it"


def test_the_checker_finds_a_private_import(tmp_path):
    """The private-name search itself, on a planted module."""
    planted = tmp_path / "planted.py"
    planted.write_text("from attnlab.errors import _hidden\nfrom attnlab import errors\nerrors._other\n")
    sources = {"attnlab.errors": SRC / "attnlab" / "errors.py", "attnlab.planted": planted}
    assert _private_uses(planted, "attnlab.planted", sources) == [
        "attnlab.planted:1 imports attnlab.errors._hidden",
        "attnlab.planted:3 uses attnlab.errors._other",
    ]


def test_the_checker_finds_a_circle():
    """The search itself: a planted circle and an acyclic graph."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
