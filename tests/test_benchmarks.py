"""Smoke test of the benchmark suite (benchmarks/): the network and training groups run on tiny
sizes and write a well-formed Markdown table and JSON; ``--device cuda`` without a GPU skips
cleanly: the suite of docs/performance.md in its quick mode. (The start-up group spawns fresh
interpreters and is left to ``python -m benchmarks``.)
"""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.timing import Row

STATUSES = {"PASS", "MISS", "info", "SKIP"}


@pytest.mark.slow
def test_quick_suite_writes_markdown_and_json(tmp_path):
    out = tmp_path / "results.md"
    assert main(["--quick", "--only", "models", "training", "several", "depth", "data", "probe-accuracy", "--threads", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert report["environment"]["quick"] is True and report["environment"]["rounds"] == 1
    sections = {row["section"] for row in rows}
    for expected in ("backbones vs timm (fwd+bwd)", "U-ViT vs plain U-ViT from timm Blocks (fwd+bwd)",
                     "MAE train step vs He et al.'s MAE (timm Blocks)", "achieved FLOP/s / matmul rate",
                     "peak memory, MAE step vs He et al.'s MAE", "Lightning overhead (quickstart, reliability callbacks on)",
                     "evaluation callbacks' share of a quickstart run", "ResidualDroppath",
                     "evaluation callbacks' share, per-block heads and kNN (configs/digits_mae.yaml, blocks: all)",
                     "several settings in one pass", "evaluation over depth",
                     "data pipeline (ImageNet train transform, 224 px)", "online probe accuracy on the quickstart"):
        assert expected in sections, expected
    for row in rows:
        assert row["status"] in STATUSES
        if row["status"] != "SKIP":
            assert row["median"] is not None and row["minimum"] <= row["median"] + 1e-12, row
        if row["status"] in ("PASS", "MISS"):
            assert row["goal"].split()[0] in ("<=", ">=")
    lines = out.read_text().splitlines()
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| figure")]
    assert len(table) == len(rows)
    assert all(line.count(" | ") == 5 for line in table)  # six columns per row
    mfu = [row for row in rows if row["section"] == "achieved FLOP/s / matmul rate"]
    assert all(row["median"] > 0 for row in mfu)
    # the evaluations' forward passes are a part of what the five callbacks spend, never all of it
    shares = {row["name"]: row["median"] for row in rows if row["section"] == "evaluation callbacks' share of a quickstart run"}
    floor = shares["their forward passes alone (no head, rank, picture or bookkeeping)"]
    assert 0 < floor < shares["all five together at the shipped cadences"]


def test_status_compares_the_median_with_the_goal():
    assert Row("s", "n", 1.01, 0.99, "<= 1.02").status == "PASS"
    assert Row("s", "n", 1.03, 0.99, "<= 1.02").status == "MISS"
    assert Row("s", "n", 0.55, 0.50, ">= 0.60").status == "MISS"
    assert Row("s", "n", 0.70, 0.50, ">= 0.60").status == "PASS"
    assert Row("s", "n", 1.5).status == "info" and Row("s", "n", None).status == "SKIP"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_without_a_gpu_skips_cleanly(tmp_path):
    out = tmp_path / "cuda.md"
    assert main(["--device", "cuda", "--precision", "bf16-mixed", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["status"] for row in rows] == ["SKIP"]
    assert "no CUDA device" in out.read_text()


def test_a_suite_stopped_part_way_keeps_the_groups_it_finished(tmp_path, monkeypatch):
    """gpu-check stops the suite at its time limit: the table is written after each group."""
    import benchmarks.__main__ as suite

    def stopped(settings):
        raise KeyboardInterrupt  # as a time limit's kill would end it
    monkeypatch.setattr(suite, "GROUPS", {"first": lambda settings: [Row("first group", "a figure", 1.5)],
                                          "second": stopped})
    out = tmp_path / "results.md"
    with pytest.raises(KeyboardInterrupt):
        suite.main(["--only", "first", "second", "--out", str(out)])
    assert [row["name"] for row in json.loads(out.with_suffix(".json").read_text())["rows"]] == ["a figure"]
    assert "| a figure |" in out.read_text()


def test_overhead_accounting_splits_set_up_from_epochs():
    """A hand-computed case of the fit / plain loop accounting (benchmarks/quickstart_training.py): each fit
    epoch runs from its start to the next one's, less the plain steps taken in it; one measured
    epoch is its own steady cost; later epochs' mean plus the first one's excess make a run."""
    from benchmarks.quickstart_training import PlainStepAfterEach, over_a_run

    clock = PlainStepAfterEach(iter(()), torch.device("cpu"))
    clock.marks, clock.epoch_seconds = [10.0, 11.0, 12.1, 13.0], [0.5, 0.5, 0.45]
    assert clock.fit_epoch_seconds() == pytest.approx([0.5, 0.6, 0.45])
    assert over_a_run([0.5, 0.6, 0.45], 100) == pytest.approx(0.525)  # no excess: the first is below the mean
    assert over_a_run([0.8, 0.6, 0.4], 100) == pytest.approx(0.5 + 0.3 / 100)
    assert over_a_run([0.7], 100) == pytest.approx(0.7)


def test_a_partial_run_never_replaces_the_whole_suites_table(tmp_path, monkeypatch):
    """``--only`` some groups writes ``results-<groups>.md`` beside ``results.md``; the whole suite
    (every group, in any order) writes ``results.md``; ``--out`` still wins."""
    import benchmarks.__main__ as suite

    monkeypatch.setattr(suite, "RESULTS", tmp_path / "results.md")
    monkeypatch.setattr(suite, "GROUPS", {"first": lambda settings: [Row("first group", "a figure", 1.5)],
                                          "second": lambda settings: [Row("second group", "another", 2.5)]})
    (tmp_path / "results.md").write_text("the whole suite's table\n")
    assert suite.main(["--only", "second"]) == 0
    assert (tmp_path / "results.md").read_text() == "the whole suite's table\n"
    assert [r["name"] for r in json.loads((tmp_path / "results-second.json").read_text())["rows"]] == ["another"]
    assert suite.main(["--only", "second", "first"]) == 0
    assert "| a figure |" in (tmp_path / "results.md").read_text()
    assert suite.main(["--only", "first", "--out", str(tmp_path / "mine.md")]) == 0
    assert "| a figure |" in (tmp_path / "mine.md").read_text()


def test_timm_s_model_tests_are_prepared_for_the_registered_networks(tmp_path):
    """``make timm-tests``: the fetched test file gets the registry module in its forward_intermediates
    list (and nothing else changes), the folder's conftest registers the networks; a file without
    the list is refused in one line."""
    from benchmarks.timm_model_tests import prepare

    original = "X = 1\nFEAT_INTER_FILTERS = [\n    'vision_transformer', 'resnet',\n]\nY = 2\n"
    (tmp_path / "test_models.py").write_text(original)
    (tmp_path / "conftest.py").write_text("import pytest\n")
    prepare(tmp_path)
    assert (tmp_path / "test_models.py").read_text() == original.replace("= [\n", "= ['timm_registry', \n")
    assert (tmp_path / "conftest.py").read_text().startswith("import pytest\n")
    assert "import lightning_mods.backbone" in (tmp_path / "conftest.py").read_text()
    (tmp_path / "test_models.py").write_text("X = 1\n")
    with pytest.raises(SystemExit, match="lists its forward_intermediates models another way"):
        prepare(tmp_path)


def test_the_knn_bank_rows_measure_in_quick_mode():
    """The speed and storage rows of the kNN bank group (its memory rows launch 7 processes: `make bench`)."""
    from benchmarks.knn_at_scale import dtype_rows, scoring_rows
    from benchmarks.settings import Settings

    rows = scoring_rows(Settings(quick=True, rounds=1)) + dtype_rows(Settings(quick=True, rounds=1))
    assert [row.goal for row in rows] == ["<= 1.15", None, None]
    assert rows[0].median > 0 and all(abs(row.median) < 5 for row in rows[1:])
    assert "% of the 20 neighbours differ" in rows[1].detail


def test_the_imagenet_knn_row_runs_on_cuda_and_says_so_elsewhere():
    """The ImageNet-1K scoring row times a pass on a GPU; without one it is skipped with the command."""
    import torch

    from benchmarks.knn_at_scale import imagenet_rows
    from benchmarks.settings import Settings

    [row] = imagenet_rows(Settings(quick=True, rounds=1))
    assert row.status == "SKIP" and "--device cuda --only knn" in row.detail
    if torch.cuda.is_available():
        [row] = imagenet_rows(Settings(device="cuda", quick=True, rounds=1))
        assert row.median > 0 and row.unit == "s" and "blocks: all" in row.detail


@pytest.mark.slow
def test_the_reproducible_mode_row_times_both_modes_in_fresh_interpreters():
    """docs/performance.md's reproducible-mode row, in quick mode (a small quickstart each way)."""
    from benchmarks.reproducible_mode import run
    from benchmarks.settings import Settings

    rows = run(Settings(quick=True, rounds=1))
    assert len(rows) == 1 and rows[0].median > 0 and "on " in rows[0].detail and "off " in rows[0].detail


def test_the_sweep_check_rows_time_both_grid_shapes():
    """docs/performance.md's sweep-check rows, in quick mode (a 4-point grid of each shape)."""
    from benchmarks.settings import Settings
    from benchmarks.sweep_check import grids, run

    shapes = grids(100)
    assert [len(shape) for shape in shapes.values()] == [4, 2]
    assert [len(arg.split("=")[1].split(",")) for arg in shapes["10 alpha_min x 10 seeds"][1::2]] == [10, 10]
    assert len(set(shapes["100 alpha_min"][1].split("=")[1].split(","))) == 100
    rows = run(Settings(quick=True, rounds=1))
    assert [row.unit for row in rows] == ["s", "s"] and all(row.median > 0 for row in rows)
    assert all("points checked a second" in row.detail for row in rows)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:unclosed file <_io.FileIO name=.*chunk-.*:ResourceWarning")  # litdata's reader
def test_the_object_storage_rows_read_an_epoch_from_a_real_s3_server():
    """docs/multi-gpu.md's object-storage rows, in quick mode (16 JPEGs): an epoch from the server
    fetches each chunk once, no more bytes than the conversion's."""
    from benchmarks.object_storage import run
    from benchmarks.settings import Settings

    rows = {row.name: row for row in run(Settings(quick=True, rounds=1))}
    assert rows["requests for chunks in an epoch / the conversion's train chunks"].median == 1.0
    assert 0.9 < rows["bytes fetched in an epoch / the conversion's train chunks"].median <= 1.1
    assert rows["images/s per worker from the S3 server"].median > 0
