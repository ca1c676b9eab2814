"""Logger factories for the `conf/logger/*.yaml` files that need more than Lightning's constructor.

`mlflow_logger` exists because a project-wide SQLite store is shared by every run: MLflow creates and
migrates the schema the first time a client opens the file, and several jobs doing that at once (a
SLURM array starting together) race on the migration, fail with errors such as ``table
_alembic_tmp_metrics already exists`` and leave a half-migrated store that breaks every later run.
Here one process at a time, under a file lock beside the store, creates and migrates it and creates
the experiment; the others then find both ready. Logging itself is safe to run concurrently: MLflow
sets a SQLite busy timeout (20 s) on every session, so writers wait for each other instead of failing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnlab.errors import UserError, first_line
from attnlab.files import file_lock

if TYPE_CHECKING:
    from lightning.pytorch.loggers import MLFlowLogger

SQLITE_PREFIX = "sqlite:///"


class MlflowStoreError(UserError):
    """The MLflow store could not be opened or migrated, or no tracking server answers; the message
    names the store or server and a way out."""


def sqlite_store_path(tracking_uri: str | None) -> Path | None:
    """The database file of a ``sqlite:///<path>`` tracking URI; None for servers, folders and memory."""
    if not tracking_uri or not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    path = tracking_uri[len(SQLITE_PREFIX) :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def prepare_mlflow_store(
    tracking_uri: str, experiment_name: str | None = None, artifact_location: str | None = None
) -> str | None:
    """Create and migrate a SQLite store once, and its experiment, under a lock; return the experiment id.

    A no-op (returning None) for anything but a SQLite file: a tracking server serialises clients itself.
    """
    db = sqlite_store_path(tracking_uri)
    if db is None:
        return None
    for name in ("alembic", "mlflow.store.db.utils"):  # a line per migration plugin and step: noise
        logging.getLogger(name).setLevel(logging.WARNING)
    from alembic.util import CommandError
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from sqlalchemy.exc import SQLAlchemyError

    with file_lock(db.with_name(db.name + ".lock")):
        try:
            client = MlflowClient(tracking_uri)  # opening the store creates or migrates its schema
            if experiment_name is None:
                return None
            experiment = client.get_experiment_by_name(experiment_name)
            if experiment is not None and experiment.lifecycle_stage != "deleted":
                return experiment.experiment_id
            return client.create_experiment(experiment_name, artifact_location=artifact_location)
        except (MlflowException, SQLAlchemyError, CommandError, OSError) as err:
            raise _store_error(db, err) from err


def _store_error(db: Path, err: Exception) -> MlflowStoreError:
    return MlflowStoreError(
        f"cannot open the MLflow store {db}: {first_line(err)}. If an earlier crash left it half-created, "
        f"upgrade it (`mlflow db upgrade sqlite:///{db}`) or move it aside to start a new one "
        "(the runs' summary.json files are not affected)"
    )


def mlflow_logger(**kwargs: Any) -> MLFlowLogger:
    """Lightning's `MLFlowLogger` (same arguments), once its SQLite store and experiment are ready.

    Arguments left out keep Lightning's defaults (``tracking_uri`` from ``MLFLOW_TRACKING_URI``).
    """
    from lightning.pytorch.loggers import MLFlowLogger

    tracking_uri = kwargs.get("tracking_uri") or os.getenv("MLFLOW_TRACKING_URI")
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        check_tracking_server(tracking_uri)
    elif tracking_uri:
        prepare_mlflow_store(
            tracking_uri, kwargs.get("experiment_name", "lightning_logs"), kwargs.get("artifact_location")
        )
    return MLFlowLogger(**kwargs)


def check_tracking_server(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, naming the URI, when no server answers there.

    MLflow's client retries a refused connection with back-off for minutes before it gives up; one
    plain request first turns that into one line. Any HTTP answer (even an error status) counts as a
    server: only a connection that cannot be made is refused here.
    """
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # something answers: MLflow will say what it thinks of the requests
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise MlflowStoreError(
            f"logger.mlflow.tracking_uri={tracking_uri}: no MLflow server answers ({reason}); start one "
            "(`mlflow server --host HOST --port 5000`) or log to the local store (leave tracking_uri unset)"
        ) from None
