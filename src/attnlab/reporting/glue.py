"""The GLUE table beside the sliced ReLU paper's Table 4: MLM loss, then GLUE dev scores.

Table 4 covers similarity, paraphrase, sentiment and entailment tasks, scored by accuracy (STS-B by
Spearman). CoLA (acceptability) is none of these: its column is ours, last and marked so.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnlab.reporting.formats import MISSING, markdown_table
from attnlab.reporting.runs import GLUE_PREFIX, RunSummary, backend_sort_key

#: GLUE columns: (task, header, summary fields shown as a/b, in percent). The first figure is Table 4's
#: metric (accuracy; STS-B Spearman); GLUE's own metric follows where it differs. CoLA is ours.
GLUE_COLUMNS = (
    ("sst2", "SST-2", ("test_accuracy",)),
    ("mrpc", "MRPC (acc/F1)", ("test_accuracy", "test_f1")),
    ("stsb", "STS-B (S/P)", ("test_spearman", "test_pearson")),
    ("qqp", "QQP (acc/F1)", ("test_accuracy", "test_f1")),
    ("mnli", "MNLI (m/mm)", ("test_accuracy", "test_accuracy_mismatched")),
    ("qnli", "QNLI", ("test_accuracy",)),
    ("rte", "RTE", ("test_accuracy",)),
    ("cola", "CoLA, ours (acc/MCC)", ("test_accuracy", "test_mcc")),
)


def best_by_validation(runs: Sequence[RunSummary]) -> RunSummary | None:
    """The run with the highest ``val_acc`` (a grid's best configuration); ties: the first path."""
    scored = [r for r in runs if r.get("val_acc") is not None]
    return max(sorted(scored, key=lambda r: str(r.path)), key=lambda r: r.get("val_acc"), default=None)


def glue_markdown(runs: Sequence[RunSummary]) -> str:
    """Per backend, the MLM eval loss, then each GLUE task's dev score (percent): Table 4's tasks, then
    CoLA (ours).

    Each cell is the run with the best validation score among that task's and backend's runs (the
    grid's best configuration), reporting its dev metrics; the MLM column is the best (by validation)
    task=mlm run's ``test_loss``. Empty when no GLUE run is given.
    """
    glue = [r for r in runs if r.task.startswith(GLUE_PREFIX)]
    if not glue:
        return ""
    backends = sorted({r.attn for r in glue}, key=backend_sort_key)
    header = ["backend", "MLM eval loss", *(title for _, title, _ in GLUE_COLUMNS)]
    rows = []
    for backend in backends:
        mlm = best_by_validation([r for r in runs if r.task == "mlm" and r.attn == backend])
        loss = mlm.get("test_loss") if mlm is not None else None
        row = [backend, MISSING if loss is None else f"{loss:.3f}"]
        for task, _, keys in GLUE_COLUMNS:
            best = best_by_validation([r for r in glue if r.task == GLUE_PREFIX + task and r.attn == backend])
            values = [best.get(k) for k in keys] if best is not None else [None]
            row.append(MISSING if None in values else "/".join(f"{100 * v:.1f}" for v in values))
        rows.append(row)
    title = (
        "## GLUE dev\n\n"
        "Per task and backend: the run with the best validation score (of a grid), its dev metrics in "
        "percent. MLM eval loss: test_loss (nats) of the best task=mlm run. The tasks of the sliced ReLU "
        "paper's Table 4, then CoLA, which it does not list (ours).\n\n"
    )
    return title + markdown_table(header, rows)
