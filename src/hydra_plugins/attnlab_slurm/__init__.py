"""attnlab's SLURM launcher for Hydra: submitit's, waiting for runs that SLURM requeued.

It lives under ``hydra_plugins`` because Hydra instantiates launchers only from that package. The work
is in :mod:`attnlab.run.slurm_sweep`, imported when a sweep is launched: Hydra imports this module on
every start.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.utils import JobReturn

# the module, not the class: Hydra lists every class a plugin module holds as a plugin of that module
from hydra_plugins.hydra_submitit_launcher import submitit_launcher


class RequeueAwareSlurmLauncher(submitit_launcher.SlurmLauncher):
    """submitit's SLURM launcher, except that ``launch`` returns once every run has written its
    ``summary.json`` or failed, not when the first attempt of each job has returned.

    A run pre-empted before its time limit returns from its first attempt (submitit records that as the
    job's result) while SLURM requeues it; the stock launcher would end the sweep then.
    """

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from attnlab.run.slurm_sweep import launch_and_wait

        return launch_and_wait(self, job_overrides, initial_job_idx)
