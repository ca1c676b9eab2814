"""Gradient accumulation that keeps a stated global batch whatever the number of devices.

``${attnlab_accumulate:<global batch>,<micro-batch>,<devices>,<nodes>}`` in a config (the MLM paper
preset's ``trainer.accumulate_grad_batches``): the global batch is micro-batch × devices × nodes ×
accumulation, so changing ``trainer.devices`` or ``trainer.num_nodes`` keeps it. No torch import: the
resolver is registered when ``attnlab`` is imported, before Hydra starts.
"""

from __future__ import annotations

from attnlab.errors import ConfigError


def accumulation(global_batch: int, micro_batch: int, devices, num_nodes=1) -> int:
    """Micro-batches per optimizer step so that ``micro_batch × devices × num_nodes × it = global_batch``."""
    if not (isinstance(devices, int) and devices >= 1):
        raise ConfigError(
            f"trainer.devices={devices!r}: the global batch of {global_batch} is split over devices, so give "
            "their number (an integer >= 1), not 'auto' or a list"
        )
    replicas = micro_batch * devices * int(num_nodes)
    if micro_batch < 1 or global_batch % replicas:
        raise ConfigError(
            f"global batch {global_batch} is not a multiple of task.data.batch_size={micro_batch} × "
            f"trainer.devices={devices} × trainer.num_nodes={num_nodes} = {replicas}: "
            + (
                f"choose a micro-batch that divides {global_batch // (devices * int(num_nodes))}"
                if global_batch % (devices * int(num_nodes)) == 0
                else f"{global_batch} sequences do not split evenly over {devices * int(num_nodes)} devices"
            )
        )
    return global_batch // replicas
