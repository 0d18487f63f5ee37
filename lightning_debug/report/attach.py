"""The report files in the logger's own run, where its charts are: a W&B artifact, MLflow artifacts (both work
offline).

Example::

    >>> attach_files([], [])
    []
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

ARTIFACT_PATH = "lightning_debug"
ARTIFACT_TYPE = "lightning-debug-report"
Store = tuple[str, Any, "str | None"]


def attach_files(stores: Iterable[Store], files: list[Path]) -> list[str]:
    """Attach ``files`` to each store (``("wandb", run, None)`` or ``("mlflow", client, run_id)``); returns where."""
    attached: list[str] = []
    for kind, handle, run_id in stores:
        if kind == "wandb":
            attached.append(_to_wandb(handle, files))
        elif kind == "mlflow" and run_id:
            attached.append(_to_mlflow(handle, run_id, files))
    return attached


def _to_wandb(run: Any, files: list[Path]) -> str:
    import wandb

    artifact = wandb.Artifact(f"lightning-debug-{run.id}", type=ARTIFACT_TYPE,
                              description="lightning-debug report, events and analysis plot of this run")
    for path in files:
        artifact.add_file(str(path), name=path.name)
    run.log_artifact(artifact)
    return f"W&B run {run.id}, artifact {artifact.name}"


def _to_mlflow(client: Any, run_id: str, files: list[Path]) -> str:
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_PATH)
    return f"MLflow run {run_id}, artifacts/{ARTIFACT_PATH}/"


def tracker_stores(trackers: Iterable[Any]) -> list[Store]:
    """The stores of Hugging Face Accelerate trackers (``accelerator.trackers``): W&B and MLflow."""
    stores: list[Store] = []
    for tracker in trackers:
        name = getattr(tracker, "name", "")
        if name == "wandb" and getattr(tracker, "run", None) is not None:
            stores.append(("wandb", tracker.run, None))
        elif name == "mlflow" and getattr(tracker, "active_run", None) is not None:
            from mlflow.tracking import MlflowClient

            stores.append(("mlflow", MlflowClient(), tracker.active_run.info.run_id))
    return stores
