"""Every picture, table and final number a run shows reaches every logger in its own form, read
back from each logger's own store: a short fit of each family (the quick configs, a smaller MAE)
with TensorBoard, W&B (offline) and MLflow (a local SQLite store) at once, each family with
another logger first (the one that names the run's folder). Two runs with the same logger
settings keep their files apart. The commands and the YAML block of docs/loggers.md."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from commands import lightning_cli as cli
from helpers.logger_stores import mlflow_run, png_pixels, tensorboard_run, wandb_run

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SHORT = ["--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=1", "--trainer.limit_train_batches=2",
         "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"]
FAMILIES = {
    "MAE": (["configs/digits_mae.yaml"],
            ["--model.network.embed_dim=32", "--model.network.depth=2", "--model.network.num_heads=2",
             "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
             "--model.network.decoder_num_heads=2"]),
    "classifier": (["configs/data/digits.yaml", "configs/digits_resnet/base.yaml", "configs/digits_resnet/decay.yaml"],
                   ["--data.init_args.batch_size=128"]),
    "diffusion": (["configs/digits_diffusion_quick.yaml"],
                  ["--model.num_sampling_steps=10", "--model.num_sample_images=4", "--trainer.limit_val_batches=2",
                   "--trainer.callbacks+=RunSummary"]),
}
# the logger that comes first names the run's folder
FIRST = {"MAE": "WandbLogger", "classifier": "MLFlowLogger", "diffusion": "TensorBoardLogger"}


@pytest.fixture(autouse=True)
def wandb_home(tmp_path_factory, monkeypatch):
    """W&B's own caches and settings in a temporary folder, not the user's home."""
    home = tmp_path_factory.mktemp("wandb_home")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def loggers(root: Path, family: str) -> list[dict]:
    """configs/loggers/all.yaml's three loggers (``FIRST[family]`` first), their folders under ``root``
    and MLflow's experiment named after the family."""
    shipped = yaml.safe_load((CONFIGS / "loggers" / "all.yaml").read_text())["trainer"]["logger"]
    by_name = {entry["class_path"].rpartition(".")[2]: entry for entry in shipped}
    places = {"TensorBoardLogger": {"save_dir": str(root / "tensorboard")},
              "WandbLogger": {"save_dir": str(root / "wandb")},
              "MLFlowLogger": {"experiment_name": family, "tracking_uri": f"sqlite:///{root / 'mlflow.db'}",
                               "artifact_location": str(root / "mlflow-artifacts")}}
    assert by_name.keys() == places.keys()
    order = [FIRST[family], *(name for name in by_name if name != FIRST[family])]
    return [{"class_path": by_name[name]["class_path"], "init_args": {**by_name[name]["init_args"], **places[name]}}
            for name in order]


def fit(family: str, root: Path, logger_config: list[dict]) -> None:
    import wandb

    configs, smaller = FAMILIES[family]
    fragment = root / "loggers.yaml"
    fragment.parent.mkdir(parents=True, exist_ok=True)
    fragment.write_text(yaml.safe_dump({"trainer": {"logger": logger_config}}))
    try:
        cli.run_reporting_stops(["fit", *(f"--config={REPO / c}" for c in configs), f"--config={fragment}", *smaller,
                                 *SHORT, f"--trainer.default_root_dir={root / 'default_root'}"])
    finally:
        wandb.finish()  # Lightning leaves the W&B run open: the next fit of this process would log into it


def read_csv(path: Path) -> tuple[list[str], list[list]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    cells = [[None if c == "" else (int(c) if c.lstrip("-").isdigit() else float(c)) for c in row] for row in rows[1:]]
    return rows[0], cells


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    fit(request.param, root, loggers(root, request.param))
    summaries = [p for p in root.rglob("summary.json") if "mlflow-artifacts" not in p.parts]
    assert len(summaries) == 1, summaries
    return request.param, root, summaries[0].parent


def test_every_logger_shows_the_pictures_the_files_hold(family_run):
    family, root, folder = family_run
    files = {p.name.rsplit("_step", 1)[0]: png_pixels(p.read_bytes()) for p in (folder / "pictures").glob("*.png")}
    expected = {"MAE": {"mae_reconstructions", "eval_over_depth", "rank_profile"},
                "classifier": {"rank_profile"}, "diffusion": {"diffusion_samples"}}[family]
    assert set(files) == expected
    stores = {"TensorBoard": tensorboard_run(next((root / "tensorboard").rglob("events.out.tfevents.*")).parent),
              "W&B": wandb_run(root / "wandb"),
              "MLflow": mlflow_run(f"sqlite:///{root / 'mlflow.db'}", family)}
    for name, store in stores.items():
        shown = {tag.replace("/", "_"): pixels for tag, pixels in store["images"].items()}
        assert set(shown) == expected, name
        for tag, pixels in shown.items():
            np.testing.assert_array_equal(pixels, files[tag], err_msg=f"{name}: {tag}")


def test_every_logger_shows_the_tables_and_the_final_numbers(family_run):
    family, root, folder = family_run
    tables = {p.stem: read_csv(p) for p in folder.glob("*.csv")}
    assert set(tables) == ({"eval_per_block", "rank_per_block"} if family != "diffusion" else set())
    summary = json.loads((folder / "summary.json").read_text())
    final = {name: value for name, value in summary["metrics"].items() if value is not None}
    assert final and summary["log_dir"] == str(folder)
    board = tensorboard_run(next((root / "tensorboard").rglob("events.out.tfevents.*")).parent)
    assert board["final"].keys() == final.keys()
    np.testing.assert_allclose([board["final"][k] for k in final], list(final.values()), rtol=1e-6)

    run = wandb_run(root / "wandb")
    assert run["tables"] == {name: table for name, table in tables.items()}
    assert {k: run["numbers"][k] for k in final} == pytest.approx(final, rel=1e-6)
    assert run["numbers"]["run_folder"] == str(folder) and run["numbers"]["steps"] == summary["steps"]
    assert run["files"]["shortcutlab/config.yaml"] == (folder / "config.yaml").read_bytes()

    ml = mlflow_run(f"sqlite:///{root / 'mlflow.db'}", family)
    assert ml["csv"] == {f"{name}.csv": (folder / f"{name}.csv").read_bytes() for name in tables}
    assert ml["tables"].keys() == tables.keys()
    for name, (columns, rows) in ml["tables"].items():  # MLflow's JSON: pandas' 10 significant digits, NaN as null
        assert columns == tables[name][0]
        for got, want in zip(rows, tables[name][1], strict=True):
            assert [g is None for g in got] == [w is None for w in want]
            assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], rel=1e-9)
    named = {name.replace("@", "").replace("=", ""): value for name, value in final.items()}
    assert {k: ml["numbers"][k] for k in named} == pytest.approx(named, rel=1e-6)
    assert ml["tags"]["run_folder"] == str(folder)
    assert {"config.yaml", "summary.json"} <= set(ml["files"])
    assert yaml.safe_load((folder / "config.yaml").read_text())["trainer"]["logger"][0]["class_path"].endswith(
        FIRST[family])


def test_the_first_logger_names_the_run_folder(family_run):
    family, root, folder = family_run
    if FIRST[family] == "WandbLogger":
        assert folder == root / "wandb" / "shortcutlab" / wandb_run(root / "wandb")["run_id"]
    elif FIRST[family] == "MLFlowLogger":  # no save_dir for a database store: default_root_dir/<experiment>/<run>
        run = mlflow_run(f"sqlite:///{root / 'mlflow.db'}", family)
        assert folder.name == run["run_id"] and folder.parent.parent == root / "default_root"
    else:
        assert folder == root / "tensorboard" / "lightning_logs" / "version_0"
    assert (folder / "config.yaml").is_file() and any((folder / "checkpoints").glob("*.ckpt"))


@pytest.mark.parametrize("logger_file", ["wandb.yaml", "mlflow.yaml"])
def test_two_runs_with_the_shipped_logger_settings_keep_their_files_apart(logger_file, tmp_path, monkeypatch):
    """configs/loggers/<file> as the docs run it (paths relative to the working folder), twice."""
    import wandb

    monkeypatch.chdir(tmp_path)
    configs, smaller = FAMILIES["MAE"]
    folders = []
    for run in range(2):
        try:
            cli.run_reporting_stops(["fit", *(f"--config={REPO / c}" for c in configs),
                                     f"--config={CONFIGS / 'loggers' / logger_file}", *smaller, *SHORT,
                                     "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path / 'root'}"])
        finally:
            wandb.finish()
        found = {p.parent for p in tmp_path.rglob("summary.json") if "mlflow-artifacts" not in p.parts}
        [folder] = found - set(folders)
        folders.append(folder)
    for folder in folders:
        assert (folder / "config.yaml").is_file() and (folder / "checkpoints" / "last.ckpt").is_file()
        assert yaml.safe_load((folder / "config.yaml").read_text())["trainer"]["default_root_dir"] == str(
            tmp_path / "root")
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent
    if logger_file == "wandb.yaml":
        assert folders[0].parent == tmp_path / "runs" / "wandb" / "shortcutlab"
    else:
        assert folders[0].parent.parent == tmp_path / "root" and (tmp_path / "runs" / "mlflow.db").is_file()
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "runs" / "config.yaml").exists()


def test_the_pages_yaml_block_is_the_shipped_wandb_config():
    page = (REPO / "docs" / "loggers.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((CONFIGS / "loggers" / "wandb.yaml").read_text())
    for name in ("wandb.yaml", "mlflow.yaml", "all.yaml"):
        assert f"--config configs/loggers/{name}" in page
