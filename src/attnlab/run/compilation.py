"""``compile=true``: the task's model under ``torch.compile``, and what the compiler did in the log.

`compile_model` compiles the model in place (``nn.Module.compile``), so its ``state_dict`` keys,
checkpoints and resumes are those of the eager model. Shapes are dynamic from the first compile
(``dynamic=True``): the batch size and length are symbols, so a task's varying lengths reuse one
graph; a new graph is compiled only where the code branches on a length (the sliced ops' dense and
sorted paths, `attnlab.attention.sliced_common.path`) and for evaluation (no autograd, no dropout):
a handful, within `RECOMPILE_LIMIT`. Past it torch would run the model eagerly for new shapes
without a word; `CompileLog` warns when that happens.
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

from attnlab.run.compile_modes import COMPILE_MODES

log = logging.getLogger(__name__)


#: graphs a compiled function may have before torch stops compiling it (its default is 8): a model
#: has one per autograd mode (training, validation without grad, test in inference mode) times
#: each side of the sliced ops' dense/sorted crossover, per input whose length crosses it
RECOMPILE_LIMIT = 16


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    return mode


def compile_model(model: nn.Module, mode: str = "default", backend: str = "inductor") -> nn.Module:
    """``model`` itself, compiled in place (its forward runs under ``torch.compile`` from the next call).

    ``backend`` is for tests: ``aot_eager`` traces the same graphs without generating code."""
    check_compile_mode(mode)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
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
    limit_hit: tuple[str, ...] = ()  # the functions that reached torch's recompile limit

    def line(self) -> str:
        text = f"{self.graphs} graph(s) compiled in {self.seconds:.1f} s"
        if self.recompile_reasons:
            text += "; recompiled for: " + "; ".join(self.recompile_reasons)
        return text

    def limit_warning(self) -> str | None:
        """What to tell the user when a function reached the recompile limit (None: none did).
        torch then runs that function eagerly for every shape its graphs do not fit, silently."""
        if not self.limit_hit:
            return None
        return (
            f"torch.compile reached its recompile limit ({torch._dynamo.config.recompile_limit} graphs) "
            f"for {', '.join(self.limit_hit)}: calls that fit none of its graphs now run eagerly; "
            "the reasons above say what varied (TORCH_LOGS=recompiles shows each)"
        )


def compile_report(since: float = 0.0) -> CompileReport:
    """The compiler's work that started at or after time ``since`` (``time.time()``). torch keeps
    its latest 64 compiles' metrics: a fit that compiles more reports its latest 64."""
    metrics = [m for m in torch._dynamo.utils.get_compilation_metrics() if (m.start_time or 0.0) >= since]
    frames = [m for m in metrics if m.is_forward and m.entire_frame_compile_time_s is not None]
    seconds = sum(m.entire_frame_compile_time_s for m in frames)
    seconds += sum((m.backward_cumulative_compile_time_us or 0) for m in metrics if not m.is_forward) / 1e6
    reasons = [_short(m.recompile_reason) for m in frames if m.recompile_reason]
    names = {_frame(m): f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" for m in frames}
    hits = [names.get(_frame(m), "a function") for m in metrics if m.fail_type == "RecompileLimitExceeded"]
    return CompileReport(len(frames), seconds, tuple(dict.fromkeys(reasons)), tuple(dict.fromkeys(hits)))


def _frame(metrics) -> str:
    """The frame a compile belongs to: the first part of its id ("0" of "0/3")."""
    return str(metrics.compile_id).split("/")[0]


def _short(reason: str) -> str:
    """A recompile reason without the source excerpt torch appends to each guard (after ``  #``)."""
    lines = [line.split("  #")[0].strip() for line in reason.splitlines()]
    return ", ".join(line for line in lines if line)


class CompileLog(L.Callback):
    """Logs the compiler's work after the first training step and at the end of the fit, and warns
    once, at the step it happens, when a function reaches torch's recompile limit."""

    def __init__(self) -> None:
        self.since = time.time()
        self.first_step_logged = False
        self.limit_warned = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.first_step_logged:
            self.first_step_logged = True
            self._log("first training step")
        elif not self.limit_warned:
            self._warn_at_limit(compile_report(self.since))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._log("whole fit")

    def _log(self, when: str) -> None:
        report = compile_report(self.since)
        log.info("torch.compile, %s: %s", when, report.line())
        self._warn_at_limit(report)

    def _warn_at_limit(self, report: CompileReport) -> None:
        if not self.limit_warned and (warning := report.limit_warning()):
            self.limit_warned = True
            log.warning(warning)
