"""Overrides that shrink a training run to seconds, shared by the tests that train (tiny ListOps)."""

TINY_LISTOPS_DATA = [
    "task.data.source.sizes.train=192",
    "task.data.source.sizes.val=64",
    "task.data.source.sizes.test=64",
    "task.data.source.min_length=10",
    "task.data.source.max_length=60",
    "task.data.batch_size=16",
]
TINY_MODEL = ["task.model.dim=16", "task.model.mlp_dim=32"]
QUIET = ["trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0"]
TINY_LISTOPS = [*TINY_LISTOPS_DATA, *TINY_MODEL, *QUIET]
