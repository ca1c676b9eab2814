"""A run's life around its training: the dir it may write (`claim`), the checkpoint it continues from
(`resume`), its wall time and metric rows across attempts (`attempt_clock`, `csv_history`), its
``summary.json`` (`summary`), its MLflow store (`mlflow_logger`), and its place in a SLURM job or
sweep (`slurm_layout`, `slurm_sweep`, `hydra_callbacks`); `wandb_logger` quiets one of wandb's warnings.

A floor below the library: nothing here knows a backend, a dataset or a model, so anything above may
ask where a run stands. The modules import little at load time (`attnlab.config.resolvers` reads
`resume` before Hydra starts; the Hydra callbacks are built in every ``train.py`` process).
"""
