"""``shortcutlab sweep`` and ``shortcutlab report`` (part 2).

The report is checked on hand-written CSVLogger files against numpy float64 (mean, ddof=1 std,
``np.corrcoef``); the sweep's naming and ``--print`` on their own; one slow test sweeps two tiny
digits fits for real, reports on them, reruns (skipping the finished runs) and sweeps a failing run: the
commands of docs/reproducing.md on tiny runs.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from commands import _run_folder, _sweep_grid, report, sweep

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# hand-written final values: alpha_min -> seed -> (knn, online probe, offline probe, effective rank)
FINALS = {
    "0.6": {0: (0.812, 0.701, 0.905, 31.5), 1: (0.794, 0.688, 0.897, 29.25), 2: (0.830, 0.735, 0.912, 33.0)},
    "1.0": {0: (0.652, 0.602, 0.851, 18.75), 1: (0.671, 0.611, 0.866, 20.5), 2: (0.644, 0.590, 0.842, 17.0)},
}
# effective rank at the first evaluation (epoch 1): the curve's first point
FIRST_RANK = {"0.6": {0: 12.0, 1: 11.0, 2: 13.5}, "1.0": {0: 10.0, 1: 9.5, 2: 11.25}}


def write_run(experiment: Path, alpha: str, seed: int, finals: tuple, first_rank: float,
              status: int = 0) -> Path:
    """A run folder as the sweep leaves it: sparse CSVLogger rows (step-wise losses, two
    evaluations at epochs 1 and 3, an earlier kNN value that is not the final one), a probe."""
    knn, online, offline, rank = finals
    run = experiment / f"alpha_min={alpha},seed={seed}"
    (run / "probe").mkdir(parents=True)
    run.joinpath("metrics.csv").write_text(
        "epoch,knn/top1,online_probe/val_top1,rank/effective_rank,rank/entropy,step,train/loss_epoch,train/loss_step\n"
        "0,,,,,4,,0.93\n"
        "0,,,,,9,0.91,\n"
        f"1,0.5,0.45,{first_rank},{np.log(first_rank)},19,,\n"
        "1,,,,,19,0.85,\n"
        "2,,,,,29,0.80,0.79\n"
        f"3,{knn},{online},{rank},{np.log(rank)},39,,\n"
        "3,,,,,39,0.75,\n")
    run.joinpath("probe", "metrics.csv").write_text(
        "epoch,step,train/loss,val/loss,val/top1\n"
        "0,4,1.2,,\n"
        "0,4,,1.0,0.5\n"
        f"1,9,,0.4,{offline}\n")
    run.joinpath("sweep.json").write_text(json.dumps({"name": run.name, "status": status, "evaluations": {
        "probe": {"status": 0, "command": "shortcutlab fit ..."}}}))
    return run


@pytest.fixture()
def experiment(tmp_path) -> Path:
    """2 alphas x 3 seeds of hand-written runs."""
    folder = tmp_path / "runs" / "toy"
    for alpha, seeds in FINALS.items():
        for seed, finals in seeds.items():
            write_run(folder, alpha, seed, finals, FIRST_RANK[alpha][seed])
    return folder


def cell(mean: float, std: float, scale: float, digits: int) -> str:
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}"


def test_report_table_matches_numpy(experiment, capsys):
    result = report.main([str(experiment)])
    out = experiment / "report"
    markdown = (out / "report.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if re.match(r"\| (0\.6|1\.0) \|", line)}
    assert set(rows) == {"0.6", "1.0"}
    header = [c.strip() for c in markdown.splitlines()[2].strip("|").split("|")]
    assert header == ["alpha_min", "n (seeds)", "kNN top-1 (%)", "online probe top-1 (%)",
                      "offline probe top-1 (%)", "effective rank exp(H)", "rank entropy H"]
    data = json.loads((out / "report.json").read_text())
    for alpha, seeds in FINALS.items():
        values = np.array(list(seeds.values()), dtype=np.float64)  # seeds x 4
        mean, std = values.mean(axis=0), values.std(axis=0, ddof=1)
        entropy = np.log(values[:, 3])  # the files hold H = log of the effective rank
        expected = [alpha, "3"] + [cell(mean[i], std[i], 100.0, 1) for i in range(3)] + [cell(mean[3], std[3], 1.0, 3)] \
            + [cell(entropy.mean(), entropy.std(ddof=1), 1.0, 3)]
        assert rows[alpha] == expected
        group = next(g for g in data["groups"] if g["group"] == {"alpha_min": alpha})
        for i, name in enumerate(["knn/top1", "online_probe/val_top1", "probe/val/top1", "rank/effective_rank"]):
            assert group["metrics"][name]["mean"] == pytest.approx(mean[i], rel=1e-12)
            assert group["metrics"][name]["std"] == pytest.approx(std[i], rel=1e-12)
            assert group["metrics"][name]["n"] == 3
        assert group["metrics"]["train/loss"]["mean"] == pytest.approx(0.75)  # the last train/loss_epoch
    runs = [(a, s) for a in FINALS for s in FINALS[a]]
    ranks = np.array([FINALS[a][s][3] for a, s in runs])
    offline = np.array([FINALS[a][s][2] for a, s in runs])
    assert data["correlation"]["probe"] == "offline probe"
    assert data["correlation"]["n"] == 6
    assert data["correlation"]["r"] == pytest.approx(np.corrcoef(ranks, offline)[0, 1], rel=1e-12)
    assert f"{np.corrcoef(ranks, offline)[0, 1]:.3f}" in markdown
    assert "Missing or failed runs (not counted): none." in markdown
    for name in ("metrics_vs_alpha_min.png", "effective_rank_over_epochs.png", "probe_vs_effective_rank.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE, name
        assert out / name in result["files"]
    printed = capsys.readouterr().out
    assert "kNN top-1 (%)" in printed and str(out / "report.md") in printed


def test_report_counts_missing_failed_and_single_seed(experiment, tmp_path):
    """A folder without metrics.csv and a failed run are listed and not counted; a grid point
    without a folder is listed; a group left with one seed shows no ± ; the online probe stands in
    for the scatter when no run has an offline probe."""
    (experiment / "alpha_min=1.0,seed=1" / "metrics.csv").unlink()
    failed = experiment / "alpha_min=1.0,seed=2"
    failed.joinpath("sweep.json").write_text(json.dumps({"status": 1}))
    for run in experiment.iterdir():
        (run / "probe" / "metrics.csv").unlink(missing_ok=True)
        (run / "sweep.json").write_text(json.dumps({"status": 1 if run == failed else 0}))
    shutil.rmtree(experiment / "alpha_min=0.6,seed=2")
    out = tmp_path / "elsewhere"
    report.main([str(experiment), "--out", str(out)])
    markdown = (out / "report.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| 1.0 |"))
    knn = FINALS["1.0"][0][0]
    assert row.split("|")[2].strip() == "1" and f"| {100 * knn:.1f} |" in row and "±" not in row
    assert "offline probe" not in markdown.splitlines()[2]  # logged by no run: no column
    assert "alpha_min=1.0,seed=1: missing (no metrics.csv)" in markdown
    assert "alpha_min=1.0,seed=2: failed (exit status 1" in markdown
    assert "alpha_min=0.6,seed=2: missing (no run folder)" in markdown
    assert row.endswith("| seed=1 (missing), seed=2 (failed) |")
    assert next(line for line in markdown.splitlines() if line.startswith("| 0.6 |")).endswith(
        "| seed=2 (no folder) |")
    data = json.loads((out / "report.json").read_text())
    counted = [("0.6", 0), ("0.6", 1), ("1.0", 0)]
    ranks = [FINALS[a][s][3] for a, s in counted]
    online = [FINALS[a][s][1] for a, s in counted]
    assert data["correlation"]["probe"] == "online probe" and data["correlation"]["n"] == 3
    assert data["correlation"]["r"] == pytest.approx(np.corrcoef(ranks, online)[0, 1], rel=1e-12)


@pytest.mark.parametrize("record", [
    {"status": 0, "evaluations": {"probe": {"status": 1, "command": "shortcutlab fit ..."}}},
    {"status": 0, "probe_status": 1, "probe_command": "shortcutlab fit ..."},  # written by the release before
], ids=["evaluation-record", "earlier-record"])
def test_failed_probe_is_not_counted(experiment, record):
    """A run whose --then probe failed counts for the run's metrics, not for the offline probe."""
    experiment.joinpath("alpha_min=0.6,seed=1", "sweep.json").write_text(json.dumps(record))
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    row = [c.strip() for c in next(line for line in markdown.splitlines() if line.startswith("| 0.6 |")).split("|")]
    offline = np.array([FINALS["0.6"][0][2], FINALS["0.6"][2][2]])
    assert row[2] == "3"
    assert row[5] == f"{100 * offline.mean():.1f} ± {100 * offline.std(ddof=1):.1f} (n=2)"
    assert row[8] == "seed=1 (probe failed)"
    assert "alpha_min=0.6,seed=1: probe failed (exit status 1)" in markdown


def test_classifier_runs_report_their_own_val_top1(tmp_path):
    """A classifier sweep (no kNN, no probe): its val/top1 is the accuracy column and the scatter's."""
    experiment = tmp_path / "cls"
    accuracy = {(0.6, 0): 0.91, (0.6, 1): 0.93, (1.0, 0): 0.88, (1.0, 1): 0.87}
    rank = {(0.6, 0): 7.5, (0.6, 1): 8.0, (1.0, 0): 9.0, (1.0, 1): 10.5}
    for (alpha, seed), top1 in accuracy.items():
        run = experiment / f"alpha_min={alpha},seed={seed}"
        run.mkdir(parents=True)
        run.joinpath("metrics.csv").write_text("epoch,rank/effective_rank,step,val/loss,val/top1\n"
                                               f"0,2.0,9,1.5,0.3\n1,{rank[alpha, seed]},19,0.4,{top1}\n")
        run.joinpath("fit_end.json").write_text('{"epochs": 2, "steps": 20}')  # a cluster job's: no sweep.json
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    assert markdown.splitlines()[2] == "| alpha_min | n (seeds) | val top-1 (%) | effective rank exp(H) |"
    top1 = np.array([0.91, 0.93])
    assert f"| 0.6 | 2 | {100 * top1.mean():.1f} ± {100 * top1.std(ddof=1):.1f} |" in markdown
    data = json.loads((experiment / "report" / "report.json").read_text())
    assert data["correlation"]["probe"] == "val" and data["correlation"]["n"] == 4
    assert data["correlation"]["r"] == pytest.approx(
        np.corrcoef(list(rank.values()), list(accuracy.values()))[0, 1], rel=1e-12)
    assert "Counted by their fit_end.json, without a sweep.json" in markdown


def test_runs_and_probes_that_have_not_ended_are_not_counted(experiment):
    """Metrics of a fit that has not ended (no exit status and no fit_end.json: training, killed,
    or a crashed cluster job) are never averaged in; neither is a probe the sweep started but did
    not see end. A cluster run with fit_end.json counts."""
    training = experiment / "alpha_min=1.0,seed=0"
    (training / "sweep.json").unlink()
    cluster = experiment / "alpha_min=1.0,seed=1"
    (cluster / "sweep.json").unlink()
    (cluster / "fit_end.json").write_text('{"epochs": 4, "steps": 40}')
    (cluster / "probe" / "fit_end.json").write_text('{"epochs": 2, "steps": 10}')
    probing = experiment / "alpha_min=0.6,seed=2"
    (probing / "sweep.json").write_text(json.dumps({"status": 0}))  # as the sweep leaves it while the probe runs
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")]
            for line in markdown.splitlines() if line.startswith(("| 0.6 |", "| 1.0 |"))}
    knn = np.array([FINALS["1.0"][1][0], FINALS["1.0"][2][0]])
    assert rows["1.0"][2] == "2" and rows["1.0"][3] == cell(knn.mean(), knn.std(ddof=1), 100, 1)
    offline = np.array([FINALS["0.6"][0][2], FINALS["0.6"][1][2]])
    assert rows["0.6"][2] == "3" and rows["0.6"][5] == cell(offline.mean(), offline.std(ddof=1), 100, 1) + " (n=2)"
    assert "alpha_min=1.0,seed=0: incomplete (no exit status in sweep.json and no fit_end.json" in markdown
    assert "alpha_min=0.6,seed=2: probe incomplete" in markdown


def test_planned_runs_that_never_started_are_named_even_a_whole_row(experiment):
    """sweep_plan.json holds every run asked for: one whose folder never appeared is listed,
    also when no run of its row started (no other group has its seed to compare with)."""
    sweep.record_plan(experiment, [f"alpha_min={a},seed={s}" for a in ("0.6", "0.8", "1.0") for s in (0, 1, 2, 3)])
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| 0.8 |"))
    assert row.split("|")[2].strip() == "0" and row.endswith(
        "| seed=0 (missing), seed=1 (missing), seed=2 (missing), seed=3 (missing) |")
    for name in ("alpha_min=0.8,seed=0", "alpha_min=0.6,seed=3", "alpha_min=1.0,seed=3"):
        assert f"{name}: missing (planned, never started)" in markdown
    knn = np.array([FINALS["0.6"][s][0] for s in (0, 1, 2)])
    assert cell(knn.mean(), knn.std(ddof=1), 100, 1) in markdown


def test_a_final_value_from_before_the_runs_last_epoch_is_listed(experiment):
    """An evaluation cadence that missed the end: the value is counted and named with its epoch."""
    run = experiment / "alpha_min=0.6,seed=0"
    with open(run / "metrics.csv", "a") as f:
        f.write("4,,,,,49,0.70,\n5,,,,,59,0.69,\n")
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    assert "alpha_min=0.6,seed=0: kNN top-1 from epoch 3; its last logged epoch is 5" in markdown
    assert "alpha_min=0.6,seed=0: effective rank exp(H) from epoch 3; its last logged epoch is 5" in markdown
    assert "seed=1" not in markdown.split("from before the end of their run")[1]
    data = json.loads((experiment / "report" / "report.json").read_text())
    assert len(data["stale_values"]) == 4  # kNN, online probe, effective rank, rank entropy of that one run


def test_rank_curve_is_the_mean_over_seeds(experiment):
    group_keys, groups = report.group_runs(report.find_runs(experiment, skip=experiment / "report"))
    from commands._report_figures import _mean_curve

    for group in groups:
        alpha = group.key["alpha_min"]
        epochs, means, stds = _mean_curve(group.counted, "rank/effective_rank")
        first = np.array(list(FIRST_RANK[alpha].values()))
        last = np.array([FINALS[alpha][s][3] for s in range(3)])
        np.testing.assert_allclose(epochs, [2.0, 4.0])  # evaluated after epochs 1 and 3 (0-indexed)
        np.testing.assert_allclose(means, [first.mean(), last.mean()], rtol=1e-12)
        np.testing.assert_allclose(stds, [first.std(ddof=1), last.std(ddof=1)], rtol=1e-12)


@pytest.mark.parametrize("setup, message", [
    (lambda root: None, "no experiment folder"),
    (lambda root: root.mkdir(), "no runs in"),
])
def test_report_bad_input_is_one_line(tmp_path, capsys, setup, message):
    setup(tmp_path / "exp")
    with pytest.raises(SystemExit) as stop:
        report.main([str(tmp_path / "exp")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shortcutlab report: error: ") and message in err and "\n" not in err


def test_grid_points_first_axis_slowest_and_names_round_trip():
    axes = [sweep.parse_axis("model.network.shortcut.alpha_min=0.6,0.8,1.0"), sweep.parse_axis("--seed_everything=0,1")]
    points = sweep.grid_points(axes)
    assert [(p["model.network.shortcut.alpha_min"], p["seed_everything"]) for p in points] == \
        [("0.6", "0"), ("0.6", "1"), ("0.8", "0"), ("0.8", "1"), ("1.0", "0"), ("1.0", "1")]
    names = [sweep.run_name(p) for p in points]
    assert names[1] == "alpha_min=0.6,seed=1"
    assert [_sweep_grid.parse_run_name(n) for n in names] == \
        [{"alpha_min": p["model.network.shortcut.alpha_min"], "seed": p["seed_everything"]} for p in points]
    assert sweep.run_name({}) == "run" and _sweep_grid.parse_run_name("run") == {}


@pytest.mark.parametrize("axis", ["alpha_min", "alpha_min=", "=0.6", "alpha_min=0.6,,1.0", "data.root=/a/b",
                                  "x=a=b"])
def test_bad_grid_axis(axis):
    with pytest.raises(ValueError, match="--grid"):
        sweep.parse_axis(axis)


def test_same_short_name_twice_is_refused():
    with pytest.raises(ValueError, match="same short name"):
        sweep.grid_points([("model.alpha_min", ["1"]), ("data.alpha_min", ["2"])])


def test_print_gives_one_command_per_run(tmp_path, capsys):
    sweep.main(["--experiment", "e", "--config", "configs/digits_mae.yaml", "--runs-dir", str(tmp_path),
                "--grid", "model.network.shortcut.alpha_min=0.6,1.0", "--grid", "seed_everything=0,1",
                "--run-set", "trainer.max_epochs=3", "--set", "trainer.accelerator=cpu",
                "--then", "configs/linear_probe_digits.yaml", "--then-set", "trainer.max_epochs=2", "--print"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # one line per run: its fit && its probe
    fits, probes = zip(*((shlex.split(fit), shlex.split(probe)) for fit, probe in
                         (line.split(" && ") for line in lines)))
    expected = [("0.6", "0"), ("0.6", "1"), ("1.0", "0"), ("1.0", "1")]
    for args, (alpha, seed) in zip(fits, expected):
        name = f"alpha_min={alpha},seed={seed}"
        assert args[:3] == ["shortcutlab", "fit", "--config=configs/digits_mae.yaml"]
        assert f"--model.network.shortcut.alpha_min={alpha}" in args and f"--seed_everything={seed}" in args
        assert "--trainer.max_epochs=3" in args and "--trainer.accelerator=cpu" in args
        assert args[-1] == f"--config={tmp_path / 'e' / name / 'run.yaml'}"
        logger = json.loads((tmp_path / "e" / name / "run.yaml").read_text().split("\n", 1)[1])
        assert {lg["init_args"]["version"] for lg in logger["trainer"]["logger"]} == {name}
    for args, (alpha, seed) in zip(probes, expected):
        run = tmp_path / "e" / f"alpha_min={alpha},seed={seed}"
        checkpoint = next(a for a in args if a.startswith("--model.checkpoint="))
        assert checkpoint.startswith("--model.checkpoint=$(ls -t ")  # chosen when the line runs
        assert f"--seed_everything={seed}" in args and "--trainer.max_epochs=2" in args
        assert "--trainer.max_epochs=3" not in args and "--trainer.accelerator=cpu" in args  # --set, not --run-set
        assert args[-1] == f"--config={run / 'probe' / 'run.yaml'}"
    assert not any((tmp_path / "e").glob("*/sweep.json"))  # nothing ran
    # run by a shell (the array job's eval), the probe takes the newer of last.ckpt and latest.ckpt
    run = tmp_path / "e" / "alpha_min=0.6,seed=0"
    (run / "checkpoints").mkdir()
    for name, when in (("last.ckpt", 1_000_000_000), ("latest.ckpt", 2_000_000_000)):
        (run / "checkpoints" / name).write_bytes(b"")
        os.utime(run / "checkpoints" / name, ns=(when, when))
    probe_line = lines[0].split(" && ")[1]
    echoed = subprocess.run(["bash", "-c", "printf '%s\\n' " + probe_line.removeprefix("shortcutlab ")],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert f"--model.checkpoint={run / 'checkpoints' / 'latest.ckpt'}" in echoed


def test_sweep_bad_input_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--experiment", "e", "--config", "configs/no_such.yaml", "--print"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "shortcutlab sweep: error: --config: no file 'configs/no_such.yaml'"


def test_resume_and_probe_take_the_newer_of_last_and_latest(tmp_path):
    """last.ckpt goes stale off its save cadence (or after a pre-emption in a latest-only config):
    the newer file is the run's last network."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    assert _run_folder.last_checkpoint(tmp_path) is None
    last, latest = checkpoints / "last.ckpt", checkpoints / "latest.ckpt"
    last.write_bytes(b"epoch 19")
    latest.write_bytes(b"epoch 24")
    os.utime(last, ns=(1_000_000_000, 1_000_000_000))
    os.utime(latest, ns=(2_000_000_000, 2_000_000_000))
    assert _run_folder.last_checkpoint(tmp_path) == latest
    os.utime(last, ns=(3_000_000_000, 3_000_000_000))
    assert _run_folder.last_checkpoint(tmp_path) == last
    latest.unlink()
    assert _run_folder.last_checkpoint(tmp_path) == last


def test_resume_keeps_the_metrics_logged_before_the_checkpoint(tmp_path):
    """CSVLogger deletes metrics.csv when a resumed fit starts; the sweep puts the earlier rows
    back, dropping those the interrupted attempt logged after its checkpoint (logged again)."""
    earlier = ("epoch,knn/top1,step,train/loss\n"
               "0,,4,0.9\n"
               "0,0.5,9,\n"          # evaluation before the checkpoint (step 9)
               "1,,14,0.8\n")        # logged after the checkpoint by the interrupted attempt
    resumed = tmp_path / "metrics.csv"
    resumed.write_text("epoch,lr,step,train/loss\n"
                       "1,0.1,14,\n"
                       "1,,14,0.7\n")
    _run_folder.merge_metrics_csv(earlier, resumed)
    lines = resumed.read_text().splitlines()
    assert lines == ["epoch,knn/top1,lr,step,train/loss",
                     "0,,,4,0.9",
                     "0,0.5,,9,",
                     "1,,0.1,14,",
                     "1,,,14,0.7"]
    nothing_logged = tmp_path / "crashed.csv"  # the resumed attempt failed before logging: all kept
    _run_folder.merge_metrics_csv(earlier, nothing_logged)
    assert nothing_logged.read_text().splitlines()[1:] == ["0,,4,0.9", "0,0.5,9,", "1,,14,0.8"]


TINY = ["--config", str(ROOT / "configs" / "digits_mae.yaml"),
        "--set", "trainer.max_epochs=1", "--set", "trainer.limit_train_batches=2",
        "--set", "trainer.limit_val_batches=1", "--set", "trainer.check_val_every_n_epoch=1",
        "--set", "trainer.enable_progress_bar=false", "--set", "trainer.accelerator=cpu",
        "--run-set", "model.network.depth=2", "--run-set", "model.network.decoder_depth=1"]  # the MAE's, not the evaluations'


@pytest.mark.slow
def test_a_rerun_skips_finished_runs_and_a_failed_run_fails_the_sweep(tmp_path, monkeypatch, capsys):
    """The same sweep with one more, failing, grid value (a real fit that exits 2): the finished runs
    are skipped, the new one runs, and the sweep exits 1 naming it. (A real sweep of finished fits,
    rerun, and its report: tests/commands/test_imagenet_commands.py.)"""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    for alpha in ("0.6", "1.0"):  # finished before, as the sweep records it
        run = tmp_path / "tiny" / f"alpha_min={alpha}"
        run.mkdir(parents=True)
        (run / "sweep.json").write_text(json.dumps({"name": run.name, "status": 0, "seconds": 1.0}))
    args = ["--experiment", "tiny", "--runs-dir", str(tmp_path), *TINY]
    with pytest.raises(SystemExit) as stop:
        sweep.main([*args, "--grid", "model.network.shortcut.alpha_min=0.6,7.0,1.0"])
    printed = capsys.readouterr().out
    assert stop.value.code == 1
    assert printed.count("skipped") == 2
    assert "sweep tiny: 2 of 3 runs finished; failed: alpha_min=7.0" in printed
    failed = tmp_path / "tiny" / "alpha_min=7.0"
    assert json.loads((failed / "sweep.json").read_text())["status"] == 2
    assert not (failed / "fit_end.json").exists()
    assert json.loads((tmp_path / "tiny" / "sweep_plan.json").read_text())["runs"] == [
        "alpha_min=0.6", "alpha_min=7.0", "alpha_min=1.0"]
    assert "alpha_min" in (failed / "sweep.log").read_text().splitlines()[-1]


def test_several_knn_k_and_probe_rates_are_columns_of_their_own(tmp_path):
    """``KNNEvaluator(k=[10, 20])`` and ``OnlineLinearProbe(heads=LinearHeads(lr=[...]))`` log ``knn/top1@k=10`` ...;
    each becomes a column, ordered by its value, with mean and std over seeds (numpy float64)."""
    finals = {0: (0.61, 0.72, 0.50, 0.55), 1: (0.63, 0.70, 0.52, 0.51)}  # k=10, k=100, lr=0.001, lr=0.01
    for seed, (k10, k100, slow, fast) in finals.items():
        run = tmp_path / "multi" / f"alpha_min=0.6,seed={seed}"
        run.mkdir(parents=True)
        run.joinpath("metrics.csv").write_text(
            "epoch,knn/top1@k=100,knn/top1@k=10,online_probe/val_top1@lr=0.01,online_probe/val_top1@lr=0.001,step\n"
            f"0,{k100},{k10},{fast},{slow},9\n")
        run.joinpath("sweep.json").write_text(json.dumps({"name": run.name, "status": 0}))
    markdown = report.make_report(tmp_path / "multi", tmp_path / "multi" / "report")["markdown"]
    header = [c.strip() for c in markdown.splitlines()[2].strip("|").split("|")]
    assert header == ["alpha_min", "n (seeds)", "kNN top-1 @k=10 (%)", "kNN top-1 @k=100 (%)",
                      "online probe top-1 @lr=0.001 (%)", "online probe top-1 @lr=0.01 (%)"]
    row = [c.strip() for c in markdown.splitlines()[4].strip("|").split("|")]
    values = np.array(list(finals.values()), dtype=np.float64)
    assert row[2:] == [cell(values[:, i].mean(), values[:, i].std(ddof=1), 100.0, 1) for i in range(4)]


def test_one_parser_checks_every_point_of_a_grid(monkeypatch):
    """``sweep --print`` checks an 18-point grid with one parser (building one took about a second
    a point), and a bad point after good ones is still refused with the fresh parser's reason."""
    from commands import lightning_cli

    built = []
    original = lightning_cli.ShortcutLabCLI.init_parser
    monkeypatch.setattr(lightning_cli.ShortcutLabCLI, "init_parser",
                        lambda self, **kw: built.append(1) or original(self, **kw))
    checker = lightning_cli.ArgumentChecker()
    base = ["fit", "--config=configs/digits_mae.yaml"]
    good = [base + [f"--model.network.shortcut.alpha_min={a}", f"--seed_everything={s}"]
            for a in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0) for s in (0, 1, 2)]
    assert checker(good[0]) is None
    one_cli = len(built)  # LightningCLI builds a parser per subcommand
    assert [checker(args) for args in good[1:]] == [None] * 17
    bad = base + ["--model.network.shortcut.alpah_min=0.6"]
    reason = checker(bad)
    assert reason is not None and "alpha_min" in reason
    assert checker(good[0]) is None
    assert len(built) == one_cli
    assert lightning_cli.check_arguments(bad) == reason and len(built) == 2 * one_cli


SETTINGS = [("model.network.shortcut.alpha_min", "0.3"), ("model.network.shortcut.alpha_min", "abc"),
            ("model.network.shortcut.alpah_min", "0.6"), ("model.network.shortcut.kind", "cosine"),
            ("model.network.shortcut.kind", "cosin"), ("seed_everything", "7"), ("seed_everything", "x"),
            ("trainer.max_epochs", "5"), ("trainer.max_epochs", "five"), ("data.batch_size", "64"),
            ("data.batch_size", "1.5"), ("data.init_args.data_dir", "/data"), ("model.network.depth", "x"),
            ("trainer.callbacks.k", "x"), ("model", "lightning_mods.mae.NoSuchModel")]


def test_a_setting_checked_on_a_parsed_config_is_refused_exactly_when_a_full_parse_refuses_it(monkeypatch):
    """The grid's quick check of one value against its setting's type says what a full parse of the
    arguments with that value says (the reference), in the full parse's words."""
    from commands import lightning_cli

    monkeypatch.chdir(ROOT)
    checker = lightning_cli.ArgumentChecker()
    base = ["fit", "--config=configs/digits_mae.yaml", "--seed_everything=0"]
    for key, value in SETTINGS:
        full = lightning_cli.check_arguments([*base, f"--{key}={value}"])
        assert checker.check_setting(base, key, value) == full, (key, value, full)
    assert sum(lightning_cli.check_arguments([*base, f"--{k}={v}"]) is None for k, v in SETTINGS) == 5


def test_every_value_of_every_grid_key_is_checked_before_anything_starts(tmp_path, capsys, monkeypatch):
    """A bad value that only a later point has is refused in one line naming that point, before
    any line is printed or any run folder written; a grid over the loggers is refused."""
    monkeypatch.chdir(ROOT)
    args = ["--experiment", "e", "--config", "configs/digits_mae.yaml", "--runs-dir", str(tmp_path), "--print"]
    for grid, message in (
            (["model.network.shortcut.alpha_min=0.6,0.8,0.9", "seed_everything=0,1,x"],
             "grid point alpha_min=0.6,seed=x: seed_everything: must be of type bool or int; got 'x'"),
            (["model.network.shortcut.alpha_min=0.6,abc", "seed_everything=0,1"],
             "grid point alpha_min=abc,seed=0: model.init_args.network.init_args.shortcut.init_args.alpha_min: "
             "must be of type float; got 'abc'"),
            (["trainer.logger.init_args.project=a,b"], "--grid trainer.logger.init_args.project: every run of a "
                                                       "sweep logs to the same loggers")):
        with pytest.raises(SystemExit) as stop:
            sweep.main([*args, *(item for axis in grid for item in ("--grid", axis))])
        out, err = capsys.readouterr()
        assert stop.value.code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"shortcutlab sweep: error: {message}"), err
    assert not (tmp_path / "e").exists()


def test_evaluations_of_one_pre_training_are_columns_side_by_side(experiment):
    """Table 1's layout: kNN, then each --evaluate fit of the run's checkpoint (ft, lp) as its own
    column, mean ± std over the seeds; a failed evaluation is left out of its column and listed."""
    finals = {"ft": {0: 0.50, 1: 0.54, 2: 0.61}, "lp": {0: 0.20, 1: 0.26, 2: 0.23}}
    for seed in range(3):
        run = experiment / f"alpha_min=0.6,seed={seed}"
        record = json.loads((run / "sweep.json").read_text())
        record["evaluations"] = {}
        for name, values in finals.items():
            (run / name).mkdir()
            (run / name / "metrics.csv").write_text(f"epoch,step,val/top1\n0,4,0.1\n1,9,{values[seed]}\n")
            record["evaluations"][name] = {"command": "shortcutlab fit ...", "status": 1 if (name, seed) == ("lp", 2) else 0}
        (run / "sweep.json").write_text(json.dumps(record))
    report.main([str(experiment)])
    markdown = (experiment / "report" / "report.md").read_text()
    header = [c.strip() for c in markdown.splitlines()[2].split("|")[1:-1]]
    assert header[:5] == ["alpha_min", "n (seeds)", "kNN top-1 (%)", "ft top-1 (%)", "lp top-1 (%)"]
    row = [c.strip() for c in next(line for line in markdown.splitlines() if line.startswith("| 0.6 |")).split("|")]
    ft, lp = np.array(list(finals["ft"].values())), np.array([0.20, 0.26])
    assert row[4] == f"{100 * ft.mean():.1f} ± {100 * ft.std(ddof=1):.1f}"
    assert row[5] == f"{100 * lp.mean():.1f} ± {100 * lp.std(ddof=1):.1f} (n=2)"
    assert "alpha_min=0.6,seed=2: lp failed (exit status 1)" in markdown
    other = next(line for line in markdown.splitlines() if line.startswith("| 1.0 |"))
    assert [c.strip() for c in other.split("|")][4:6] == ["–", "–"]  # runs without evaluations
    data = json.loads((experiment / "report" / "report.json").read_text())
    assert data["groups"][0]["metrics"]["ft/val/top1"]["values"] == pytest.approx(list(ft))


@pytest.mark.parametrize("text, message", [
    ("ft", "expected NAME=CONFIG"), ("probe=configs/finetune_digits.yaml", "cannot name an evaluation folder"),
    ("ft=trainer.max_epochs=2", "names no config file"), ("ft=configs/nothing.yaml", "no file 'configs/nothing.yaml'")])
def test_bad_evaluations_are_one_line(text, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--experiment", "e", "--config", "configs/digits_mae.yaml", "--evaluate", text, "--print"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_print_chains_each_evaluation_after_the_run(tmp_path, capsys, monkeypatch):
    """docs/reproducing.md's Table 1 sweep, as printed: each run's fit, then its evaluations."""
    monkeypatch.chdir(ROOT)
    page = (ROOT / "docs" / "reproducing.md").read_text().replace("\\\n", " ")
    command = next(line for line in page.splitlines() if "--experiment table1_digits" in line)
    args = shlex.split(command)[2:]
    sweep.main([*args, "--runs-dir", str(tmp_path), "--print"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # one line per alpha_min
    fit, ft, lp_mae, lp = (shlex.split(part) for part in lines[0].split(" && "))
    run = tmp_path / "table1_digits" / "alpha_min=0.6"
    assert ft[:3] == ["shortcutlab", "fit", "--config=configs/finetune_digits.yaml"]
    assert ft[-1] == f"--config={run / 'ft' / 'run.yaml'}"
    assert lp_mae[2:4] == ["--config=configs/linear_probe_digits.yaml", "--config=configs/probe/mae_imagenet1k.yaml"]
    assert "--trainer.max_epochs=90" in lp_mae and "--trainer.max_epochs=90" not in lp
    assert lp[-1] == f"--config={run / 'lp' / 'run.yaml'}"
    assert all(any(a.startswith("--model.checkpoint=$(ls -t ") for a in part) for part in (ft, lp_mae, lp))


def test_then_is_the_evaluation_named_probe(tmp_path, monkeypatch, capsys):
    """``--then`` is recorded like every ``--evaluate`` fit (one shape in sweep.json), runs first,
    and a record written by the release before (``probe_status``) counts as that evaluation."""
    calls = []

    def fake_fit(args, folder, grace):
        calls.append(folder.name)
        return args, 0, 0.5

    monkeypatch.setattr(sweep, "fit_resuming", fake_fit)
    monkeypatch.setattr(sweep, "resumable_checkpoint", lambda run: run / "checkpoints" / "last.ckpt")
    monkeypatch.setattr(sweep, "check_points", lambda parsed, points: defaultdict(lambda: None))
    args = ["--experiment", "e", "--runs-dir", str(tmp_path), "--config", "configs/digits_mae.yaml",
            "--then", "configs/linear_probe_digits.yaml", "--then-set", "trainer.max_epochs=2",
            "--evaluate", "ft=configs/finetune_digits.yaml"]
    records = sweep.main(args)
    assert calls == ["run", "probe", "ft"]
    written = json.loads((tmp_path / "e" / "run" / "sweep.json").read_text())
    assert set(written) == {"name", "grid", "command", "status", "seconds", "evaluations", "arguments", "configs"}
    assert list(written["evaluations"]) == ["probe", "ft"] == list(records[0]["evaluations"])
    for entry in written["evaluations"].values():
        assert set(entry) == {"command", "status", "seconds"} and entry["status"] == 0
    assert "--trainer.max_epochs=2" in shlex.split(written["evaluations"]["probe"]["command"])
    assert "--trainer.max_epochs=2" not in shlex.split(written["evaluations"]["ft"]["command"])

    calls.clear()  # a record of the release before: the probe finished, ft not yet
    (tmp_path / "e" / "run" / "sweep.json").write_text(json.dumps(
        {"name": "run", "grid": {}, "status": 0, "probe_status": 0, "probe_command": "shortcutlab fit ..."}))
    records = sweep.main(args)
    assert calls == ["ft"]
    assert records[0]["evaluations"]["probe"] == {"status": 0, "command": "shortcutlab fit ..."}
    assert "probe_status" not in json.loads((tmp_path / "e" / "run" / "sweep.json").read_text())


def test_a_rerun_with_other_settings_is_refused_naming_the_difference(tmp_path, monkeypatch, capsys):
    """The same sweep with a changed setting, or an edited config file, never reuses (skips,
    resumes or reports) the runs of the old settings: one line names the difference, nothing
    starts, the old records stay; the same settings again are skipped."""
    calls = []

    def fake_fit(args, folder, grace):
        calls.append(folder.name)
        return args, 0, 0.5

    monkeypatch.setattr(sweep, "fit_resuming", fake_fit)
    monkeypatch.setattr(sweep, "check_points", lambda parsed, points: defaultdict(lambda: None))
    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  max_epochs: 4\n")
    args = ["--experiment", "e", "--runs-dir", str(tmp_path), "--config", str(config),
            "--grid", "model.network.shortcut.alpha_min=0.6,1.0"]
    sweep.main([*args, "--run-set", "trainer.max_epochs=4"])
    assert calls == ["alpha_min=0.6", "alpha_min=1.0"]
    before = {p: p.read_text() for p in sorted((tmp_path / "e").rglob("sweep.json"))}
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        sweep.main([*args, "--run-set", "trainer.max_epochs=6"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert (f"{tmp_path / 'e' / 'alpha_min=0.6'} was run with other settings (--trainer.max_epochs=4 then, "
            "--trainer.max_epochs=6 now)") in err
    assert calls == ["alpha_min=0.6", "alpha_min=1.0"]
    assert {p: p.read_text() for p in sorted((tmp_path / "e").rglob("sweep.json"))} == before
    sweep.main([*args, "--run-set", "trainer.max_epochs=4"])  # the same settings: skipped
    assert calls == ["alpha_min=0.6", "alpha_min=1.0"] and capsys.readouterr().out.count("skipped") == 2
    config.write_text("trainer:\n  max_epochs: 5\n")
    with pytest.raises(SystemExit):
        sweep.main([*args, "--run-set", "trainer.max_epochs=4"])
    assert f"({config} has changed since)" in capsys.readouterr().err
