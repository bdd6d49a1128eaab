"""What each logger keeps of a run, read back from the logger's own store (no mocks): pictures
as pixel arrays, tables as ``(columns, rows)`` and final numbers, each by its name.

- TensorBoard: the event files, as TensorBoard reads them (``EventAccumulator``); the final
  numbers are the metrics of its hyper-parameter view.
- W&B (offline): the run's transaction log (``run-<id>.wandb``: LevelDB-log records of W&B's
  protobuf ``Record``), read for the run summary, and the media files it names.
- MLflow (local store): through ``MlflowClient``: image artifacts, table artifacts, metrics.
"""
from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from PIL import Image


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# --- TensorBoard -------------------------------------------------------------------------------
def tensorboard_run(folder: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    events.Reload()
    images = {tag: png_pixels(events.Images(tag)[-1].encoded_image_string) for tag in events.Tags()["images"]}
    try:
        content = events.PluginTagToContent("hparams")
    except KeyError:  # no hyper-parameter view in this run
        content = {}
    final = {}
    if "_hparams_/experiment" in content:
        experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        final = {m.name.tag: events.Scalars(m.name.tag)[-1].value for m in experiment.metric_infos}
    return {"images": images, "final": final}


# --- W&B ---------------------------------------------------------------------------------------
def _records(path: Path) -> Iterator[Any]:
    """The ``Record`` messages of a ``.wandb`` file: a 7-byte header, then 32 KiB blocks of
    ``crc32 (4) | length (2) | type (1) | data`` chunks (types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(save_dir: Path) -> dict[str, Any]:
    """The one offline run under ``save_dir/wandb`` (:func:`wandb_runs`)."""
    [run] = wandb_runs(save_dir)
    return run


def wandb_runs(save_dir: Path) -> list[dict[str, Any]]:
    """Each offline run under ``save_dir/wandb``: its name and group, its summary's numbers, latest
    image of each key and latest table of each key."""
    return [_wandb_offline_run(run) for run in sorted((save_dir / "wandb").glob("offline-run-*"))]


def _wandb_offline_run(run: Path) -> dict[str, Any]:
    [log] = run.glob("run-*.wandb")
    summary: dict[tuple, Any] = {}
    named = {}
    for record in _records(log):
        if record.WhichOneof("record_type") == "run":
            named = {"name": record.run.display_name, "group": record.run.run_group}
        if record.WhichOneof("record_type") == "summary":
            for update in record.summary.update:
                summary[tuple(update.nested_key) or (update.key,)] = json.loads(update.value_json)
    nested: dict[str, dict[str, Any]] = {}
    numbers = {}
    for path, value in summary.items():
        if len(path) == 1 and not path[0].startswith("_"):
            numbers[path[0]] = value
        elif len(path) == 2:
            nested.setdefault(path[0], {})[path[1]] = value
    files = run / "files"
    images = {key: png_pixels((files / entry["filenames"][-1]).read_bytes())
              for key, entry in nested.items() if entry.get("_type") == "images/separated"}
    tables = {}
    for key, entry in nested.items():
        if entry.get("_type") == "table-file":
            table = json.loads((files / entry["path"]).read_text())
            tables[key] = (table["columns"], table["data"])
    return {**named, "numbers": numbers, "images": images, "tables": tables, "run_id": log.stem[len("run-"):],
            "files": {p.relative_to(files).as_posix(): p.read_bytes() for p in files.rglob("*.yaml")}}


# --- MLflow ------------------------------------------------------------------------------------
def mlflow_run(tracking_uri: str, experiment_name: str) -> dict[str, Any]:
    """The one run of ``experiment_name`` (:func:`mlflow_runs`)."""
    [run] = mlflow_runs(tracking_uri, experiment_name)
    return run


def mlflow_runs(tracking_uri: str, experiment_name: str) -> list[dict[str, Any]]:
    """Each run of ``experiment_name``: its name, metrics (latest values), latest image of each key,
    latest table of each name and the files at the artifacts' root."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    return [_mlflow_run(client, run) for run in client.search_runs([experiment.experiment_id])]


def _mlflow_run(client: Any, run: Any) -> dict[str, Any]:
    run_id = run.info.run_id
    root = Path(client.download_artifacts(run_id, ""))
    images: dict[str, tuple[int, np.ndarray]] = {}
    for path in (root / "images").glob("*.png"):  # <key with / as ~>+step+<step>+timestamp+...
        key, _, step, *_ = path.name.split("+")
        if key.replace("~", "/") not in images or int(step) >= images[key.replace("~", "/")][0]:
            images[key.replace("~", "/")] = (int(step), png_pixels(path.read_bytes()))
    tables: dict[str, tuple[str, Any]] = {}
    for path in (root / "tables").glob("*_step*.json"):
        name, _, step = path.stem.rpartition("_step")
        if name not in tables or step > tables[name][0]:
            table = json.loads(path.read_text())
            tables[name] = (step, (table["columns"], table["data"]))
    return {"name": run.info.run_name, "numbers": dict(run.data.metrics), "tags": dict(run.data.tags), "run_id": run_id,
            "images": {key: pixels for key, (_, pixels) in images.items()},
            "tables": {name: table for name, (_, table) in tables.items()},
            "files": sorted(p.name for p in root.iterdir() if p.is_file()),
            "csv": {p.name: p.read_bytes() for p in (root / "tables").glob("*.csv")}}
