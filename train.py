"""Train one attention backend on one task: ``python train.py task=listops attn=sliced_relu``.

See README.md for the config groups (task, attn, trainer, logger, experiment) and overrides.
"""

import os
import sys
from pathlib import Path

import attnlab.allocator
import attnlab.threads


def _quiet_other_ranks() -> None:
    """Lightning's launcher re-runs this script for ranks 1.. of a one-node DDP run (``LOCAL_RANK``
    set): their standard output (progress bars, Gloo's connection lines, Lightning's tables) repeats
    rank 0's, interleaved into garble, so it goes to /dev/null unless ``ATTNLAB_ALL_RANKS=1``.
    Standard error (warnings, errors) stays; srun's processes (no ``LOCAL_RANK``) are left alone."""
    if os.environ.get("LOCAL_RANK", "0") == "0" or os.environ.get("ATTNLAB_ALL_RANKS") == "1":
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the fd itself: C++ (Gloo) writes there too
    os.close(devnull)


if __name__ == "__main__":  # first, before anything loads torch: OpenMP reads its wait policy once
    attnlab.threads.configure()  # (not on import: a program that imports `main` keeps its threads)
    attnlab.allocator.configure()  # freed buffers kept for the next step (attnlab.allocator)
    _quiet_other_ranks()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import attnlab  # noqa: E402, F401  registers the config resolvers (hydra.run.dir of a resumed run)
from attnlab.errors import user_error  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent / "conf"


# an absolute config path: the same configs when this file is imported under another module name
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _run(cfg: DictConfig) -> float | None:
    # imported late so `--help` and config errors stay fast
    from attnlab.pipeline import discard_unstarted_run_dir, train
    from attnlab.run.summary import exit_status

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
    except KeyboardInterrupt as stop:  # Ctrl-C (or SIGTERM while data is written) before training
        discard_unstarted_run_dir(cfg.paths.run_dir, cfg.paths.output_dir)
        name = getattr(stop, "signal_name", "Ctrl-C")
        print(
            f"error: interrupted ({name}); nothing half-written was kept, the next run starts clean",
            file=sys.stderr,
        )
        sys.exit(143 if name == "SIGTERM" else 130)
    if summary.get("interrupted"):  # SIGTERM/SIGINT: last.ckpt saved, the closing lines say how to resume
        sys.exit(exit_status(summary))  # 143 or 130, as if the signal had ended the process
    return summary["val_acc"]  # the value a Hydra sweeper would optimise


def _run_dir_problem(args: list[str]) -> str | None:
    """A ``hydra.run.dir`` that names an existing file (Hydra would fail making it, in a traceback),
    or a fresh run's dir that holds an earlier run: refused before Hydra writes its ``.hydra/`` and
    log there (the pipeline refuses it too, for dirs that the command line does not name)."""
    from attnlab.run.claim import RunDirError, claim_for_fresh_run

    settings = dict(arg.lstrip("+").split("=", 1) for arg in args if "=" in arg)
    if "hydra.run.dir" not in settings:
        return None
    path = Path(settings["hydra.run.dir"])
    if path.exists() and not path.is_dir():
        return f"hydra.run.dir={path}: a file, not a directory; give a run directory"
    fresh = settings.get("ckpt_path", "null") in ("null", "", "None")
    if os.environ.get("SLURM_JOB_ID") and any(path.glob("hpc_ckpt_*.ckpt")):
        fresh = False  # a requeued job resumes its hpc checkpoint (attnlab.run.resume.resolve_ckpt_path)
    if fresh and settings.get("overwrite", "false").lower() != "true":
        try:
            claim_for_fresh_run(path, False, f"ckpt_path=auto hydra.run.dir={path}")
        except RunDirError as err:
            return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    """``python train.py <argv>`` as a call: the exit status, the same messages on stderr.

    The command line's checks and errors can then be exercised without starting an interpreter.
    ``argv`` defaults to the process's own arguments.
    """
    from attnlab.config.group_choices import check_group_choices
    from attnlab.config.overrides import check_attention_options

    args = sys.argv[1:] if argv is None else list(argv)
    problem = check_group_choices(args, CONF_DIR) or check_attention_options(args, CONF_DIR)
    problem = problem or _run_dir_problem(args)
    if problem:  # before Hydra, whose own message would point at `+attn....` instead of the spelling
        print(f"error: {problem}", file=sys.stderr)
        return 1
    program = sys.argv
    sys.argv = [program[0] if argv is None else str(Path(__file__).resolve()), *args]  # Hydra parses these
    try:
        _run()
    except SystemExit as stop:  # sys.exit's meaning, which the interpreter applies to the command
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = program
    return 0


if __name__ == "__main__":
    sys.exit(main())
