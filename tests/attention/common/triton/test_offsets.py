"""No Triton kernel computes a memory offset across rows in 32-bit integers.

Offsets that span rows (row count × row length, B·H·T) pass 2³¹ on real GPU workloads (B·H = 64 at
T = 32M, B·H = 1,024 at T = 2M); in int32 they wrap and the loads and stores land out of bounds. Each
kernel is built for sm_80 (as the compile matrix builds it: Triton's cache makes the second build
cheap) and its TTIR read: every 32-bit multiply whose result reaches a pointer offset
(``tt.addptr``) must have a compile-time constant factor (a block width times an index) or be one of
the per-row products listed in ``WITHIN_ONE_ROW`` (bounded by one row's 2T entries).
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from triton_builds import KERNELS, build  # noqa: E402

# (factor, factor) of products bounded by one row: a chunk's first entry in its row's merged stream
# (chunk < L / CHUNK), a segment's first position in causal linear attention (seg < T / SEG)
WITHIN_ONE_ROW = {frozenset({"chunk", "CHUNK"}), frozenset({"seg", "SEG"})}
_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+) (.*)$")
_I32 = re.compile(r": (i32|tensor<[\dx]+xi32>)\s*(loc\(.*\))?$")


def narrow_address_products(ttir: str) -> list[str]:
    """The 32-bit multiplies of ``ttir`` with no constant factor whose results reach an offset of
    ``tt.addptr`` (through integer arithmetic, splats and broadcasts), minus ``WITHIN_ONE_ROW``."""
    defs: dict[str, tuple[str, list[str], str]] = {}
    users: dict[str, list[str]] = {}
    for line in ttir.splitlines():
        match = _DEF.match(line)
        if not match:
            continue
        result, op, rest = match.groups()
        operands = re.findall(r"%[\w#]+", rest.split(" loc(")[0].split(" : ")[0])
        defs[result] = (op, operands, line.strip())
        for operand in operands:
            users.setdefault(operand, []).append(result)

    def reaches_offset(value: str) -> bool:
        stack, seen = [value], {value}
        while stack:
            current = stack.pop()
            for user in users.get(current, []):
                op, operands, _ = defs[user]
                if op == "tt.addptr" and operands[1:2] == [current]:
                    return True
                arithmetic = op.startswith(("arith.", "tt.splat", "tt.broadcast", "tt.expand_dims"))
                if arithmetic and op not in ("arith.cmpi", "arith.select") and user not in seen:
                    seen.add(user)
                    stack.append(user)
        return False

    def name(value: str) -> str:
        return re.sub(r"_\d+$", "", value.lstrip("%"))

    narrow = []
    for result, (op, operands, line) in defs.items():
        if op != "arith.muli" or not _I32.search(line):
            continue
        if any(defs.get(x, ("",))[0] == "arith.constant" or re.match(r"%c\d", x) for x in operands):
            continue
        if frozenset(map(name, operands)) in WITHIN_ONE_ROW:
            continue
        if reaches_offset(result):
            narrow.append(line)
    return narrow


def test_the_checker_finds_a_row_product_in_int32():
    """The analysis itself: ``N * T`` reaching a store's offset is found, a per-row product is not."""
    ttir = "\n".join(
        [
            "    %c4_i32 = arith.constant 4 : i32 loc(#loc1)",
            "    %0 = arith.muli %N, %T : i32 loc(#loc2)",
            "    %1 = arith.addi %0, %i : i32 loc(#loc3)",
            "    %2 = tt.splat %1 : i32 -> tensor<32xi32> loc(#loc4)",
            "    %3 = tt.addptr %ptr, %2 : tensor<32x!tt.ptr<f32>>, tensor<32xi32> loc(#loc5)",
            "    %start = arith.muli %chunk, %CHUNK : i32 loc(#loc6)",
            "    %4 = tt.addptr %p, %start : !tt.ptr<f32>, i32 loc(#loc7)",
            "    %5 = arith.muli %x, %c4_i32 : i32 loc(#loc8)",
            "    %6 = tt.addptr %p, %5 : !tt.ptr<f32>, i32 loc(#loc9)",
            "    %7 = arith.muli %a, %b : i32 loc(#loc10)",  # never an offset
            "    %8 = arith.cmpi slt, %7, %b : i32 loc(#loc11)",
        ]
    )
    assert narrow_address_products(ttir) == ["%0 = arith.muli %N, %T : i32 loc(#loc2)"]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_no_kernel_offsets_rows_in_int32(kernel):
    assert narrow_address_products(build(kernel, "sm_80", "fp32").asm["ttir"]) == []
