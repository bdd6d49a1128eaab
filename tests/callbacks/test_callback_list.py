"""The callbacks a run carries are one visible list: the CLI's defaults, shown by
``--print_config`` with what the config appends (docs/callbacks.md); the two the CLI must keep
come back, with a line, when a config replaces the list; every shipped callback states when it
works in its ``cost`` attribute, which ``shortcutlab --help`` and the docs table show."""
from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from callbacks.cost import COSTS
from commands import _catalogue as catalogue
from commands import lightning_cli as cli
from commands.cli_settings import DEFAULT_CALLBACKS, add_required_callbacks

ROOT = Path(__file__).resolve().parents[2]
TABLE_ROW = re.compile(r"^\| `([\w.]+)` \| ([\w ]+) \| (yes)? \| .+ \|$", re.M)


def shipped() -> dict[str, type]:
    """Every callback class the package ships, imported by its module path (not read from source)."""
    found = {}
    for f in catalogue.find("callback"):
        found[f.class_path] = getattr(importlib.import_module(f.module), f.name)
    return found


def test_every_shipped_callback_states_when_it_works_and_help_reads_the_same():
    classes = shipped()
    assert len(classes) >= 20
    read_by_help = {f.class_path: f.cost for f in catalogue.find("callback")}
    for path, cls in classes.items():
        assert cls.__dict__.get("cost") in COSTS or cls.cost in COSTS, path
        assert read_by_help[path] == cls.cost, path


def test_the_docs_table_lists_every_callback_with_its_cost_and_the_defaults():
    rows = {path: (cost, every_run == "yes")
            for path, cost, every_run in TABLE_ROW.findall((ROOT / "docs" / "callbacks.md").read_text())}
    defaults = {c["class_path"] for c in DEFAULT_CALLBACKS}
    expected = {}
    for path, cls in shipped().items():
        public = f"{cls.__module__.rpartition('.probe')[0]}.{cls.__name__}" if cls.__module__.endswith(".probe") else path
        expected[public] = (cls.cost, path in defaults or public in defaults)
    assert rows == expected


def test_print_config_shows_the_defaults_then_what_the_config_appends(capsys):
    """docs/callbacks.md's command: the quickstart's list is the defaults followed by its own."""
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(ROOT / "configs" / "digits_mae.yaml"), "--print_config"])
    printed = [c["class_path"] for c in yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]]
    own = [c["class_path"] for c in yaml.safe_load((ROOT / "configs" / "digits_mae.yaml").read_text())["trainer"]["callbacks+"]]
    assert printed == [c["class_path"] for c in DEFAULT_CALLBACKS] + own
    assert "callbacks.reliability.lost_rank.LostRankReport" in printed and "EpochResumePoint" in printed[len(DEFAULT_CALLBACKS)]


def test_a_replaced_list_gets_the_two_required_callbacks_back_and_says_so(tmp_path, caplog):
    from callbacks.reliability.bad_input_cleanup import RemoveLogsOnBadInput
    from callbacks.reliability.lost_rank import LostRankReport

    trainer = Trainer(default_root_dir=tmp_path, callbacks=[], enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.INFO):
        add_required_callbacks(trainer)
    added = [c for c in trainer.callbacks if isinstance(c, (RemoveLogsOnBadInput, LostRankReport))]
    assert sorted(type(c).__name__ for c in added) == ["LostRankReport", "RemoveLogsOnBadInput"]
    assert "added RemoveLogsOnBadInput, LostRankReport" in caplog.text
    cleanup = next(c for c in added if isinstance(c, RemoveLogsOnBadInput))
    assert tmp_path / "lightning_logs" in cleanup.created  # the log folders that do not exist yet
    caplog.clear()
    with caplog.at_level(logging.INFO):
        add_required_callbacks(trainer)  # nothing missing: nothing added, nothing said
    assert len(trainer.callbacks) == len(set(map(id, trainer.callbacks))) and "added" not in caplog.text


def test_no_shared_evaluation_adds_itself_to_a_trainer():
    """Without one among the callbacks, each request gets a pass of its own that keeps nothing;
    with one, every request gets that one."""
    from callbacks.measurement.shared_features import SharedEvaluation

    trainer = Trainer(logger=False, callbacks=[], enable_progress_bar=False, enable_model_summary=False)
    alone = SharedEvaluation.of(trainer)
    assert trainer.callbacks == [] or not any(isinstance(c, SharedEvaluation) for c in trainer.callbacks)
    assert SharedEvaluation.of(trainer) is not alone
    listed = SharedEvaluation()
    trainer = Trainer(logger=False, callbacks=[listed], enable_progress_bar=False, enable_model_summary=False)
    assert SharedEvaluation.of(trainer) is listed and SharedEvaluation.of(trainer) is listed
