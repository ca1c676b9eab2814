"""``compile=true``: the model compiled in place, the thread count held, the compiler's work logged,
and a bad ``compile_mode`` named before any work.

The fast tests compile with ``aot_eager`` (the same graphs and autograd as inductor, no C++ build);
the ``slow`` one trains each task that runs on generated or embedded data with inductor, exactly as
``python train.py task=<task> compile=true`` does.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from attnlab.config.validation import check_config
from attnlab.errors import ConfigError
from attnlab.pipeline import train
from attnlab.run import compilation
from attnlab.run.compilation import compile_model, compile_report
from tasks.test_glue_tasks import _write_sst2, pretrained  # noqa: F401  (pretrained: an MLM checkpoint)
from tasks.test_lm_tasks import VOCAB
from tasks.test_lra_tasks import lra_data  # noqa: F401  (the fixture: files in the official formats)
from tasks.test_pointcloud_tasks import TINY as TINY_POINTS
from tasks.test_pointcloud_tasks import modelnet40_off  # noqa: F401  (ModelNet40's OFF layout)
from tasks.test_vision_tasks import TINY_VIT, vision_data  # noqa: F401  (CIFAR-10, Tiny ImageNet)
from tiny_runs import QUIET, TINY_LISTOPS


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x).softmax(-1)


def test_bad_compile_mode_is_named_with_the_allowed_ones(train_config):
    with pytest.raises(ConfigError, match=r"compile_mode='fast'.*default, reduce-overhead, max-autotune"):
        check_config(train_config("compile=true", "compile_mode=fast"))
    with pytest.raises(ConfigError, match=r"compile='yes': expected true or false"):
        check_config(train_config("compile=yes"))


def test_compiled_model_keeps_its_weights_names_and_outputs():
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.randn(5, 4)
    want, keys = model(x), list(model.state_dict())
    start = compilation.time.time()
    torch._dynamo.reset()
    assert compile_model(model, "default", backend="aot_eager") is model
    assert torch.allclose(model(x), want, rtol=0, atol=1e-6)
    assert list(model.state_dict()) == keys  # checkpoints and resumes see the eager model's names
    model(torch.randn(9, 4))  # another batch size: dynamic from the first compile, no recompile
    model.train()(x)  # training mode: dropout, one more graph
    report = compile_report(start)
    assert report.graphs == 2, report
    assert len(report.recompile_reasons) == 1 and "training" in report.recompile_reasons[0], report
    assert "2 graph(s) compiled in" in report.line()


def test_bad_compile_mode_to_compile_model_is_a_value_error():
    with pytest.raises(ValueError, match=r"compile_mode must be one of 'default', 'reduce-overhead'"):
        compile_model(_Net(), "turbo")


def test_compile_true_trains_and_logs_the_compiler(train_config, tmp_path, caplog, monkeypatch):
    """The pipeline with ``compile=true`` on a softmax model (``aot_eager`` in place of inductor, for
    speed; the attention ops under compile: tests/attention/test_compile.py): the run
    trains and tests, its checkpoint loads into an eager model, and the log says what compiled."""
    real = compile_model
    monkeypatch.setattr(
        "attnlab.pipeline.compile_model", lambda model, mode: real(model, mode, backend="aot_eager")
    )
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO):
        overrides = [
            *TINY_LISTOPS,
            "attn=softmax",
            "task.model.depth=1",
            "logger=none",
            "trainer.max_steps=6",
        ]
        summary = train(train_config(*overrides, "compile=true"))
    assert summary["test_acc"] is not None and summary["steps"] == 6
    lines = caplog.text
    assert "SequenceClassifier compiled with torch.compile (mode=default" in lines
    assert "torch.compile, first training step: 1 graph(s) compiled in" in lines
    assert "torch.compile, whole fit:" in lines
    if "CPU threads: fixed at" in lines:  # adaptive threads apply only where attnlab set them
        assert "compile=true: a compiled graph is specialised to the thread count" in lines
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any("_orig_mod" in key for key in checkpoint["state_dict"])


# every task whose CPU default runs on data attnlab generates or embeds, at a tiny size
TASKS = {
    "listops": TINY_LISTOPS,
    "pathfinder": [
        "task=pathfinder", *QUIET, "task.data.source.num_images=160", "task.data.num_workers=0",
        "task.data.batch_size=16", "task.model.dim=16", "task.model.depth=1",
        "task.model.mlp_dim=32",
    ],
    "digits_vit": [
        "task=digits_vit", *QUIET, "task.model.stem_channels=[8]", "task.model.dim=16",
        "task.model.depth=1", "task.model.num_heads=2", "task.model.mlp_dim=32", "task.data.batch_size=16",
    ],
    "shapes": [
        "task=shapes", *QUIET, "task.data.source.train_per_class=8", "task.data.source.test_per_class=4",
        "task.data.source.sample_points=64", "task.data.num_points=64", "task.data.batch_size=16",
        "task.model.dim=32", "task.model.head_dims=[64]",
    ],
    "mqar": [
        "task=mqar", *QUIET, "task.data.source.vocab_size=32", "task.data.source.seq_len=24",
        "task.data.source.num_kv_pairs=3", "task.data.source.sizes.train=256",
        "task.data.source.sizes.val=64", "task.data.source.sizes.test=64", "task.model.dim=32",
    ],
    "lm": [
        "task=lm", *QUIET, f"task.data.source.tokenizer.vocab_size={VOCAB}", "task.data.seq_len=32",
        "task.data.batch_size=16", "task.model.dim=32", "task.model.depth=2", "task.model.num_heads=2",
    ],
    "mlm": [
        "task=mlm", *QUIET, f"task.data.source.tokenizer.vocab_size={VOCAB}", "task.data.seq_len=64",
        "task.data.batch_size=16", "task.model.dim=32", "task.model.mlp_dim=64",
    ],
}  # fmt: skip


# and the LRA tasks on small files in the official formats (the dual-encoder Retrieval model included)
LRA_FILES = {
    task: [f"task={task}", *QUIET, "task.data.num_workers=0", "task.data.batch_size=4",
           "task.data.eval_batch_size=8", "task.model.dim=16", "task.model.mlp_dim=32", *extra]
    for task, extra in {
        "text": ["task.data.source.max_length=64"],
        "retrieval": ["task.data.source.max_length=48"],
        "image": [],
    }.items()
}  # fmt: skip


# and the tasks on small fixtures in their datasets' own layouts: the ViTs on the CIFAR-10 pickles and
# Tiny ImageNet's folders, ModelNet40's OFF meshes, a GLUE task fine-tuning a short (softmax) MLM checkpoint
FIXTURE_TASKS = {
    "cifar10_vit": [
        "task=cifar10_vit", *QUIET, *TINY_VIT, "task.data.num_workers=0", "task.data.batch_size=8",
        "task.data.eval_batch_size=16", "task.data.source.val_per_class=2",
    ],
    "tinyimagenet_vit": [
        "task=tinyimagenet_vit", *QUIET, *TINY_VIT, "task.data.num_workers=0", "task.data.batch_size=8",
        "task.data.eval_batch_size=16", "task.data.source.val_per_class=1",
    ],
    "modelnet40": [
        "task=modelnet40", *QUIET, *(o for o in TINY_POINTS if "max_steps" not in o),
        "task.data.num_workers=0",
    ],
    "glue": ["task=glue", "task.glue_task=sst2", "attn=softmax", *QUIET, "task.data.batch_size=16"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("task", [*TASKS, *LRA_FILES, *FIXTURE_TASKS])
def test_each_task_trains_with_compile_true(task, train_config, corpus_data_dir, lra_data, request, caplog):  # noqa: F811
    """Every task but Path-X, whose 16K-token images no test trains (`test_pathx_builds_at_16k_tokens`)."""
    overrides = [*TASKS.get(task, LRA_FILES.get(task, FIXTURE_TASKS.get(task)))]
    overrides += ["logger=none", "trainer.max_steps=4", "compile=true"]
    if task in ("lm", "mlm"):
        overrides.append(f"paths.data_dir={corpus_data_dir}")
    if task in LRA_FILES:
        overrides.append(f"paths.data_dir={lra_data}")
    if task.endswith("_vit"):
        overrides.append(f"paths.data_dir={request.getfixturevalue('vision_data')}")
    if task == "modelnet40":
        overrides.append(f"paths.data_dir={request.getfixturevalue('modelnet40_off').parent}")
    if task == "glue":
        data = request.getfixturevalue("tmp_path") / "data"
        _write_sst2(data)
        overrides += [f"paths.data_dir={data}", f"task.pretrained={request.getfixturevalue('pretrained')}"]
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO):
        summary = train(train_config(*overrides))
    assert summary["steps"] == 4 and summary["test_acc"] is not None, summary
    assert "torch.compile, whole fit:" in caplog.text


def test_reaching_the_recompile_limit_is_a_warning(monkeypatch, caplog):
    """Past torch's recompile limit a function runs eagerly for every new shape, which torch says
    only once on stderr: the log says it too, naming the function."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    torch._dynamo.reset()
    start = compilation.time.time()

    def doubled(x):
        return x * 2

    compiled = torch.compile(doubled, backend="eager", dynamic=False)
    callback = compilation.CompileLog()
    callback.since = start
    with caplog.at_level(logging.INFO):
        compiled(torch.ones(1))
        callback.on_train_batch_end(None, None, None, None, 0)  # the first step: within the limit
        assert "recompile limit" not in caplog.text
        for n in range(2, 5):
            compiled(torch.ones(n))
        callback.on_train_batch_end(None, None, None, None, 1)
        callback.on_fit_end(None, None)
    warnings = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once, not every step
    assert "recompile limit (2 graphs) for doubled (" in warnings[0].getMessage()
