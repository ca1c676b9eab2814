"""Lightning's ``WandbLogger`` without the ``anonymous`` argument that wandb no longer reads.

Lightning always passes ``anonymous`` to ``wandb.init`` (None unless asked), and wandb since 0.19
warns "The anonymous setting has no effect" for any value, on every run: a line of noise that says
nothing about the run. wandb is imported only when the logger starts (it is an optional extra).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger``, the same arguments, less ``anonymous``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
