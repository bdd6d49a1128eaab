"""A sweep logs every run to the loggers its configs chose, read back from each logger's own store
(the real wandb, offline, and mlflow, a SQLite store; no mocks): a two-point sweep of tiny
quickstart fits with TensorBoard, W&B and MLflow leaves two W&B runs in one group named after the
experiment and two MLflow runs in an experiment named after it, each named after its point with
its pictures, tables and final numbers; the CSV logger ``report`` reads still comes first and names
the run's folder, and the report reads its table. docs/reproducing.md's sweep with
configs/loggers/all.yaml, on tiny fits."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from commands import report, sweep
from helpers.logger_stores import mlflow_runs, png_pixels, tensorboard_run, wandb_runs

ROOT = Path(__file__).resolve().parents[2]
PICTURES = {"mae_reconstructions", "eval_over_depth", "rank_profile"}
TINY = ["--set", "trainer.max_epochs=1", "--set", "trainer.limit_train_batches=2", "--set", "trainer.limit_val_batches=1",
        "--set", "trainer.check_val_every_n_epoch=1", "--set", "trainer.enable_progress_bar=false",
        "--set", "trainer.accelerator=cpu", "--set", "model.network.embed_dim=32", "--set", "model.network.depth=2",
        "--set", "model.network.num_heads=2", "--set", "model.network.decoder_embed_dim=16",
        "--set", "model.network.decoder_depth=1", "--set", "model.network.decoder_num_heads=2"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """``sweep --grid seed_everything=0,1`` of the quickstart with configs/loggers/all.yaml's three
    loggers (their stores under a temporary folder)."""
    root = tmp_path_factory.mktemp("sweep_loggers")
    shipped = yaml.safe_load((ROOT / "configs" / "loggers" / "all.yaml").read_text())
    places = {"TensorBoardLogger": {"save_dir": str(root / "tensorboard")},
              "WandbLogger": {"save_dir": str(root / "wandb")},
              "MLFlowLogger": {"experiment_name": "not_the_sweep", "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                               "artifact_location": str(root / "mlflow-artifacts")}}
    for entry in shipped["trainer"]["logger"]:
        entry["init_args"].update(places[entry["class_path"].rpartition(".")[2]])
    (root / "loggers.yaml").write_text(yaml.safe_dump(shipped))
    home = root / "wandb_home"
    environment = {name: str(home / name.lower()) for name in
                   ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}
    environment.update(WANDB_SILENT="true", PYTHONPATH=str(ROOT))  # the runs import the real wandb
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        patch.chdir(root)
        sweep.main(["--experiment", "with_loggers", "--runs-dir", str(root / "runs"),
                    "--config", str(ROOT / "configs" / "digits_mae.yaml"), "--config", str(root / "loggers.yaml"),
                    "--grid", "seed_everything=0,1", *TINY])
    return root


def run_folders(root: Path) -> dict[str, Path]:
    return {name: root / "runs" / "with_loggers" / name for name in ("seed=0", "seed=1")}


def final_numbers(folder: Path) -> dict[str, float]:
    summary = json.loads((folder / "summary.json").read_text())
    return {name: value for name, value in summary["metrics"].items() if value is not None}


def picture_files(folder: Path) -> dict[str, np.ndarray]:
    return {p.name.rsplit("_step", 1)[0]: png_pixels(p.read_bytes()) for p in (folder / "pictures").glob("*.png")}


def test_wandb_holds_one_run_per_point_in_the_experiments_group(swept):
    folders = run_folders(swept)
    runs = {run["name"]: run for run in wandb_runs(swept / "wandb")}
    assert runs.keys() == folders.keys()
    for name, run in runs.items():
        folder = folders[name]
        assert run["group"] == "with_loggers"
        assert run["numbers"]["run_folder"] == str(folder)  # the CSV logger named the run's folder
        shown = {tag.replace("/", "_"): pixels for tag, pixels in run["images"].items()}
        files = picture_files(folder)
        assert shown.keys() == files.keys() == PICTURES
        for tag, pixels in shown.items():
            np.testing.assert_array_equal(pixels, files[tag], err_msg=f"{name}: {tag}")
        assert set(run["tables"]) == {"eval_per_block", "rank_per_block"}
        final = final_numbers(folder)
        assert final and {k: run["numbers"][k] for k in final} == pytest.approx(final, rel=1e-6)


def test_mlflow_holds_one_run_per_point_in_the_experiment_named_after_the_sweep(swept):
    folders = run_folders(swept)
    runs = {run["name"]: run for run in mlflow_runs(f"sqlite:///{swept / 'mlflow.db'}", "with_loggers")}
    assert runs.keys() == folders.keys()
    for name, run in runs.items():
        folder = folders[name]
        assert run["tags"]["run_folder"] == str(folder)
        assert {tag.replace("/", "_") for tag in run["images"]} == PICTURES
        assert set(run["tables"]) == {"eval_per_block", "rank_per_block"}
        final = {key.replace("@", "").replace("=", ""): value for key, value in final_numbers(folder).items()}
        assert {k: run["numbers"][k] for k in final} == pytest.approx(final, rel=1e-6)


def test_tensorboard_writes_into_the_run_folder_and_the_report_reads_the_csv(swept, tmp_path):
    for name, folder in run_folders(swept).items():
        assert {tag.replace("/", "_") for tag in tensorboard_run(folder)["images"]} == PICTURES
        assert (folder / "metrics.csv").is_file()
        assert "exists and is not empty" not in (folder / "sweep.log").read_text()  # no warning about its own folder
    assert not (swept / "tensorboard").exists()  # the configs' TensorBoard folder is the run's
    made = report.make_report(swept / "runs" / "with_loggers", tmp_path / "report")
    row = [c.strip() for c in made["markdown"].splitlines()[4].strip("|").split("|")]
    knn = [final_numbers(folder)["knn/top1"] for folder in run_folders(swept).values()]
    assert row[:2] == ["-", "2"] or row[1] == "2", row
    assert f"{100 * np.mean(knn):.1f} ± {100 * np.std(knn, ddof=1):.1f}" in row
