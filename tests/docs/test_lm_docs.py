"""The commands of docs/lm.md, run as written, in order, in a fresh folder: prepare the data, train a
language model, generate from it, bench generation. Only data and model sizes are
overridden, so the test takes seconds; the paper-scale preset is left to tests/docs/test_docs_commands.py.
Each command runs through its entry point's ``main(argv)`` in this process (the command line itself,
its exit status and threads, is tested in tests/test_train.py and tests/test_threads.py)."""

from __future__ import annotations

import re
import shlex

from tiny_runs import REPO_ROOT, attnlab_main, train_main

# data-size overrides only
TRAIN_SIZES = [
    "task.data.source.tokenizer.vocab_size=384", "task.data.seq_len=32", "task.data.batch_size=8",
    "task.model.dim=16", "task.model.depth=1", "task.model.num_heads=2", "task.max_steps=4",
    "task.val_check_interval=4", "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
]  # fmt: skip
SIZES = {
    ("data", "prepare"): ["task.data.source.tokenizer.vocab_size=384"],
    ("bench", "generate"): ["--contexts", "16", "64", "--dim", "32", "--depth", "1", "--repeats", "2"],
}


def documented_commands() -> list[str]:
    """docs/lm.md's bash-block commands, in order, but the paper-scale preset's (it needs a corpus)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO_ROOT / "docs" / "lm.md").read_text(), re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and "experiment=lm/gpt2_small" not in line]


def test_the_documented_lm_commands_run_as_written(tmp_path):
    commands = documented_commands()
    assert any(c.startswith("attnlab generate") for c in commands)
    assert any(c.startswith("attnlab bench generate") for c in commands)
    ran = 0
    for command in commands:
        words = shlex.split(command)
        data = f"paths.data_dir={tmp_path / 'data'}"
        if words[:2] == ["python", "train.py"]:
            if words[2:] == ["task=lm", "attn=sliced_relu"]:
                continue  # the same command with another backend: tests/tasks/test_lm_tasks.py trains each
            done = train_main(*words[2:], *TRAIN_SIZES, data, cwd=tmp_path)
        else:
            assert words[0] == "attnlab", command
            extra = SIZES.get(tuple(words[1:3]), [])
            if words[1:3] == ["data", "prepare"]:
                extra = [*extra, "--data-dir", str(tmp_path / "data")]
            done = attnlab_main(*words[1:], *extra, cwd=tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if words[:2] == ["attnlab", "generate"]:
            assert done.stdout.startswith("The for statement") and "tokens/s" in done.stderr
        ran += 1
    assert ran >= 5
