"""`attnlab bench authors` on a small layer: the figures docs/attention.md quotes, in their places."""

from __future__ import annotations

from attnlab.cli.main import build_parser


def test_bench_authors_figures(capsys):
    """16 real tokens, as the command's default: padded to 24 and 28, both lengths take the same
    evaluation (``path="auto"``: dense and sorted agree to rounding only, not to the bit)."""
    args = build_parser().parse_args(
        ["bench", "authors", "--dim", "16", "--heads", "4", "--seq-len", "12", "--real-tokens", "16"]
    )
    assert args.func(args) == 0
    table = capsys.readouterr().out
    rows = {
        line.split(" | ")[0].strip("| "): [cell.strip(" |") for cell in line.split(" | ")[1:]]
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    for relu, bump in [rows["authors vs score_layout=authors"], rows["reshape fixed vs token"]]:
        assert float(relu) < 1e-12 and float(bump) < 1e-12
    assert all(float(v) > 1e-3 for v in rows["authors vs token (attnlab's default)"])
    assert rows["padding 8 -> 12: attnlab's default"] == ["0", "0"]
    assert rows["padding 8 -> 12: authors' layer"] == rows["padding 8 -> 12: attnlab as the authors' layer"]
    assert float(rows["padding 8 -> 12: authors' layer, reshape fixed"][0]) > 1e-3  # the padding rule
    assert rows["\\|dscore_0/dx_1\\|, token"] == ["0", "0"]
    assert rows["train-mode output dropout p=0.1: dropout_site=projection"][1] == "0"  # the bump's
