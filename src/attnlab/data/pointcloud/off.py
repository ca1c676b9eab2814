"""OFF meshes (Object File Format), as ModelNet ships them, read strictly.

A file is ``OFF``, a counts line ``<vertices> <faces> <edges>``, one ``x y z`` line per vertex and
one ``n i_1 ... i_n`` line per face. About a fifth of ModelNet40's files fuse the first two lines
(``OFF490 518 0``); those are read like the others. Comments (``#``), blank lines, CRLF line ends
and trailing colour values on face lines are tolerated.

Why not PyG's ``torch_geometric.io.read_off``: it drops the last line of a file that does not end in a
newline (so a face disappears silently), fails on ``OFF`` followed by a space with an unpacking
error that names no file, keeps only triangles and quads, and reads a truncated file
without noticing (fewer vertices, faces pointing past them). Here every such file stops with a
`DataError` naming it and the line, and polygons are fan-triangulated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.data.errors import DataError


def _content_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, stripped content) of every line that is not blank or a comment."""
    rows = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            rows.append((number, line))
    return rows


def _counts(path: Path, rows: list[tuple[int, str]]) -> tuple[int, int, int]:
    """Vertex and face counts, and the index of the first vertex row; handles ``OFF<counts>``."""
    if not rows:
        raise DataError(path, "empty file: expected an OFF header")
    number, first = rows[0]
    if not first.startswith("OFF"):
        raise DataError(path, f"not an OFF file: first line is {first[:40]!r}, expected 'OFF'", number)
    rest, start = first[3:].strip(), 1
    if not rest:  # the usual layout: the counts are on the next content line
        if len(rows) < 2:
            raise DataError(path, "file ends after the OFF header: expected '<vertices> <faces> <edges>'")
        number, rest = rows[1]
        start = 2
    fields = rest.split()
    try:
        vertices, faces = int(fields[0]), int(fields[1])
    except (IndexError, ValueError):
        raise DataError(
            path, f"bad counts line {rest[:60]!r}: expected '<vertices> <faces> <edges>'", number
        ) from None
    if vertices < 1 or faces < 0:
        raise DataError(path, f"bad counts: {vertices} vertices, {faces} faces", number)
    return vertices, faces, start


def _parse_triangles_fast(text: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The common case in one vectorised pass: no comments, only triangles, nothing extra.

    ModelNet40 holds hundreds of millions of vertex and face lines; a Python loop per line would make
    the one-time processing take many times longer. Anything unusual returns None, and the careful
    line-by-line parser (which names the bad line) takes over.
    """
    if "#" in text:
        return None
    tokens = text.split()
    if not tokens or not tokens[0].startswith("OFF"):
        return None
    head = tokens[0][3:]
    counts = ([head] if head else []) + tokens[1 if head else 1 :][: 3 - (1 if head else 0)]
    offset = 1 + 3 - (1 if head else 0)
    try:
        num_vertices, num_faces = int(counts[0]), int(counts[1])
    except (IndexError, ValueError):
        return None
    if num_vertices < 1 or num_faces < 0 or len(tokens) != offset + 3 * num_vertices + 4 * num_faces:
        return None
    try:
        vertices = np.array(tokens[offset : offset + 3 * num_vertices], dtype=np.float32).reshape(-1, 3)
        faces = np.array(tokens[offset + 3 * num_vertices :], dtype=np.int64).reshape(-1, 4)
    except ValueError:
        return None
    if not np.isfinite(vertices).all() or (faces[:, 0] != 3).any():
        return None
    faces = faces[:, 1:]
    if faces.size and (faces.min() < 0 or faces.max() >= num_vertices):
        return None
    return vertices, faces


def parse_off(text: str, path: str | Path = "<string>") -> tuple[np.ndarray, np.ndarray]:
    """Vertices ``(V, 3)`` float32 and triangles ``(F', 3)`` int64 of an OFF file's text."""
    fast = _parse_triangles_fast(text)
    if fast is not None:
        return fast
    path = Path(path)
    rows = _content_lines(text)
    num_vertices, num_faces, start = _counts(path, rows)
    have = len(rows) - start
    if have < num_vertices + num_faces:
        last = rows[-1][0] if rows else 0
        raise DataError(
            path,
            f"truncated: the header announces {num_vertices} vertices and {num_faces} faces, "
            f"the file ends after {max(0, min(have, num_vertices))} vertices and "
            f"{max(0, have - num_vertices)} faces",
            last,
        )
    if have > num_vertices + num_faces:  # a wrong count would silently drop part of the mesh
        extra = rows[start + num_vertices + num_faces]
        raise DataError(
            path,
            f"the header announces {num_vertices} vertices and {num_faces} faces, but the file holds "
            f"{have - num_vertices - num_faces} more line(s) after them, from {extra[1][:40]!r}",
            extra[0],
        )
    vertex_rows = rows[start : start + num_vertices]
    try:
        vertices = np.array([row.split()[:3] for _, row in vertex_rows], dtype=np.float32)
    except ValueError:
        for number, row in vertex_rows:  # find the line to name
            fields = row.split()
            try:
                if len(fields) < 3:
                    raise ValueError
                [float(x) for x in fields[:3]]
            except ValueError:
                raise DataError(path, f"bad vertex {row[:60]!r}: expected 'x y z'", number) from None
        raise
    if vertices.shape != (num_vertices, 3):
        number = next(n for n, row in vertex_rows if len(row.split()) < 3)
        raise DataError(path, "bad vertex: expected 'x y z'", number)
    if not np.isfinite(vertices).all():
        number = vertex_rows[int(np.argwhere(~np.isfinite(vertices))[0, 0])][0]
        raise DataError(path, "vertex coordinate is not a finite number", number)
    triangles = []
    for number, row in rows[start + num_vertices : start + num_vertices + num_faces]:
        fields = row.split()
        try:
            size = int(fields[0])
            corners = [int(x) for x in fields[1 : 1 + size]]
        except ValueError:
            raise DataError(path, f"bad face {row[:60]!r}: expected 'n i_1 ... i_n'", number) from None
        if size < 3 or len(corners) != size:
            raise DataError(path, f"bad face {row[:60]!r}: a face needs n >= 3 vertex indices", number)
        if min(corners) < 0 or max(corners) >= num_vertices:
            raise DataError(
                path, f"face {row[:60]!r} refers to a vertex outside 0..{num_vertices - 1}", number
            )
        triangles += [(corners[0], corners[i], corners[i + 1]) for i in range(1, size - 1)]
    faces = np.array(triangles, dtype=np.int64).reshape(-1, 3)
    return vertices, faces


def read_off(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Vertices and triangles of the OFF file at ``path``; a malformed file raises `DataError` naming it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as err:
        raise DataError(path, f"not an ASCII OFF file (byte {err.start} is not ASCII)") from None
    return parse_off(text, path)


def write_off(path: str | Path, vertices: np.ndarray, faces: np.ndarray, fused_header: bool = False) -> None:
    """Write a mesh; ``fused_header=True`` writes ``OFF<counts>`` on one line, as many ModelNet files do."""
    vertices, faces = np.asarray(vertices), np.asarray(faces)
    counts = f"{len(vertices)} {len(faces)} 0"
    lines = [f"OFF{counts}"] if fused_header else ["OFF", counts]
    lines += [f"{x:.6f} {y:.6f} {z:.6f}" for x, y, z in vertices]
    lines += [f"{len(face)} " + " ".join(str(int(i)) for i in face) for face in faces]
    Path(path).write_text("\n".join(lines) + "\n")
