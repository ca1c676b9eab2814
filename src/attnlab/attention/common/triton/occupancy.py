"""How many programs of a compiled Triton kernel one SM runs at once, from the registers, threads and
shared memory the compiler gave it. Kernels that split rows into chunks (sliced ReLU's streams) size
the chunks to fill whole waves of those programs: the chunk count is a trade between idle SMs (too
few programs) and carried sums (too many), and where it lands depends on how many programs an SM
holds, which only the compiled kernel says (a register cap, a dtype or a GPU generation moves it).

Why by hand: Triton reports a kernel's registers (``n_regs``) and shared memory but not its
occupancy, and torch has no occupancy calculator; the rules are CUDA's (registers allocated per warp
in units of 256, whole blocks per SM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REGISTER_UNIT = 256  # registers are allocated to a warp in multiples of this
WARP = 32


@dataclass(frozen=True)
class SMLimits:
    """What one SM holds: 32-bit registers, threads, resident blocks, shared memory (bytes)."""

    registers: int
    threads: int
    blocks: int
    shared: int


# resident blocks per SM by compute capability (CUDA's occupancy tables); others: 16
_MAX_BLOCKS = {(7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24, (9, 0): 32}
A100 = SMLimits(registers=65536, threads=2048, blocks=32, shared=167936)
H100 = SMLimits(registers=65536, threads=2048, blocks=32, shared=233472)


def sm_limits(device: torch.device) -> SMLimits:
    """The limits of one SM of the CUDA ``device``, from its properties."""
    props = torch.cuda.get_device_properties(device)
    return SMLimits(
        registers=props.regs_per_multiprocessor,
        threads=props.max_threads_per_multi_processor,
        blocks=_MAX_BLOCKS.get((props.major, props.minor), 16),
        shared=props.shared_memory_per_multiprocessor,
    )


def blocks_per_sm(registers: int, num_warps: int, shared: int, sm: SMLimits) -> int:
    """Blocks of ``num_warps`` warps, ``registers`` a thread and ``shared`` bytes each that one SM
    runs at once: the least that its registers, threads, shared memory and block slots allow."""
    per_warp = -(-registers * WARP // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (sm.registers // per_warp) // num_warps if per_warp else sm.blocks
    by_threads = sm.threads // (num_warps * WARP)
    by_shared = sm.shared // shared if shared else sm.blocks
    return min(by_registers, by_threads, by_shared, sm.blocks)


def compiled_blocks_per_sm(compiled, device: torch.device) -> int:
    """``blocks_per_sm`` of a kernel Triton compiled for ``device`` (a ``CompiledKernel``, as a
    launch or ``warmup`` returns it): its registers are known once it is loaded on the device."""
    compiled._init_handles()
    return blocks_per_sm(
        compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, sm_limits(device)
    )


__all__ = ["A100", "H100", "SMLimits", "blocks_per_sm", "compiled_blocks_per_sm", "sm_limits"]
