"""``compile=true``: the task's model under ``torch.compile``, and what the compiler did in the log.

`compile_model` compiles the model in place (``nn.Module.compile``), so its ``state_dict`` keys,
checkpoints and resumes are those of the eager model. Shapes are dynamic from the first compile
(``dynamic=True``): the batch size and length are symbols, so a task's varying lengths reuse one
graph; a new graph is compiled only where the code branches on a length (the sliced ops' dense and
sorted paths, `attnlab.attention.sliced_common.path`) and for evaluation (no autograd, no dropout).
The CPU thread count is held fixed (`attnlab.callbacks.threads`): the graphs are specialised to it.

`CompileLog` reports the frames compiled, the recompiles and their reasons, and the seconds spent,
after the first training step (where the first compile happens) and at the end of the fit, from
torch's own record of each compile (``torch._dynamo.utils.get_compilation_metrics``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn

log = logging.getLogger(__name__)

#: ``torch.compile`` modes the ``compile_mode`` option takes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    return mode


def compile_model(model: nn.Module, mode: str = "default", backend: str = "inductor") -> nn.Module:
    """``model`` itself, compiled in place (its forward runs under ``torch.compile`` from the next call).

    ``backend`` is for tests: ``aot_eager`` traces the same graphs without generating code."""
    check_compile_mode(mode)
    model.compile(mode=mode, backend=backend, dynamic=True)
    log.info(
        "compile=true: %s compiled with torch.compile (mode=%s, backend=%s, dynamic shapes); "
        "the first training and evaluation steps compile",
        type(model).__name__,
        mode,
        backend,
    )
    return model


@dataclass(frozen=True)
class CompileReport:
    """What the compiler did since a starting point: graphs compiled (a frame's first compile and
    its recompiles; each with its backward, which inductor compiles with it or at the first backward),
    the seconds spent, and why each recompile happened."""

    graphs: int
    seconds: float
    recompile_reasons: tuple[str, ...]

    def line(self) -> str:
        text = f"{self.graphs} graph(s) compiled in {self.seconds:.1f} s"
        if self.recompile_reasons:
            text += "; recompiled for: " + "; ".join(self.recompile_reasons)
        return text


def compile_report(since: float = 0.0) -> CompileReport:
    """The compiler's work that started at or after time ``since`` (``time.time()``). torch keeps
    its latest 64 compiles' metrics: a fit that compiles more reports its latest 64."""
    metrics = [m for m in torch._dynamo.utils.get_compilation_metrics() if (m.start_time or 0.0) >= since]
    frames = [m for m in metrics if m.is_forward and m.entire_frame_compile_time_s is not None]
    seconds = sum(m.entire_frame_compile_time_s for m in frames)
    seconds += sum((m.backward_cumulative_compile_time_us or 0) for m in metrics if not m.is_forward) / 1e6
    reasons = [_short(m.recompile_reason) for m in frames if m.recompile_reason]
    return CompileReport(len(frames), seconds, tuple(dict.fromkeys(reasons)))


def _short(reason: str) -> str:
    """A recompile reason without the source excerpt torch appends to each guard (after ``  #``)."""
    lines = [line.split("  #")[0].strip() for line in reason.splitlines()]
    return ", ".join(line for line in lines if line)


class CompileLog(L.Callback):
    """Logs the compiler's work after the first training step and at the end of the fit."""

    def __init__(self) -> None:
        self.since = time.time()
        self.first_step_logged = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.first_step_logged:
            self.first_step_logged = True
            log.info("torch.compile, first training step: %s", compile_report(self.since).line())

    def on_fit_end(self, trainer, pl_module) -> None:
        log.info("torch.compile, whole fit: %s", compile_report(self.since).line())
