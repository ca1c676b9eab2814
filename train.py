"""Train one attention backend on one task: ``python train.py task=listops attn=sliced_relu``.

See README.md for the config groups (task, attn, trainer, logger, experiment) and overrides.
"""

import sys

import attnlab.threads

# first, before anything loads torch: OpenMP reads its wait policy once, when torch loads it
attnlab.threads.configure()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import attnlab  # noqa: E402, F401  registers the config resolvers (hydra.run.dir of a resumed run)
from attnlab.errors import user_error  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # imported late so `--help` and config errors stay fast
    from attnlab.pipeline import discard_unstarted_run_dir, train
    from attnlab.summary import exit_status

    try:
        summary = train(cfg)
    except Exception as err:
        cause = user_error(err)
        if cause is None:
            raise
        discard_unstarted_run_dir(
            cfg.paths.run_dir, cfg.paths.output_dir
        )  # a bad command leaves no empty dir
        sys.exit(f"error: {cause}")  # the user's to fix: the message says what, a traceback would bury it
    except KeyboardInterrupt:  # Ctrl-C before training started (in training, the run saves and says so)
        discard_unstarted_run_dir(cfg.paths.run_dir, cfg.paths.output_dir)
        print(
            "error: interrupted (Ctrl-C); nothing half-written was kept, the next run starts clean",
            file=sys.stderr,
        )
        sys.exit(130)
    if summary.get("interrupted"):  # SIGTERM/SIGINT: last.ckpt saved, the closing lines say how to resume
        sys.exit(exit_status(summary))  # 143 or 130, as if the signal had ended the process
    return summary["val_acc"]  # the value a Hydra sweeper would optimise


if __name__ == "__main__":
    from pathlib import Path

    from attnlab.overrides import check_attention_options

    problem = check_attention_options(sys.argv[1:], Path(__file__).resolve().parent / "conf")
    if problem:  # before Hydra, whose own message would point at `+attn....` instead of the spelling
        sys.exit(f"error: {problem}")
    main()
