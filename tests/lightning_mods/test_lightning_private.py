"""Lightning's private state is reached from one module only, and that module still finds each
thing it reaches on the installed Lightning: a release that moved one fails here, in its name,
instead of resuming a run inexactly. On a Lightning release it is not tested on, ``ExactResume``
says so in one line when a fit starts."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from callbacks.reliability.exact_resume import ExactResume
from lightning_mods._compat import lightning_private

ROOT = Path(__file__).resolve().parents[2]
FENCE = ROOT / "lightning_mods" / "_compat" / "lightning_private.py"
PRIVATE_OF_THEIRS = re.compile(r"\b(trainer|loop|epoch_loop|fit_loop|pl_module|metric|connector)\b\.?\w*\._[a-z]\w*")


def test_no_other_module_reads_lightnings_private_state():
    found = []
    for path in [ROOT / "cli.py", *sorted(p for d in ("lightning_mods", "callbacks", "commands", "datamodules")
                                          for p in (ROOT / d).rglob("*.py"))]:
        if path == FENCE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if owner.split(".")[0] in {"trainer", "pl_module", "metric", "loop"} or "_loop" in owner:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "torchmetrics"):
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert found == []


class Logged(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 3)
        self.accuracy = MulticlassAccuracy(3)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        logits = self.layer(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.accuracy.update(logits, y)
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log("acc", self.accuracy, on_step=False, on_epoch=True)
        if batch_idx == 1:
            self.seen = (lightning_private.current_hook_name(self), dict(lightning_private.epoch_results(self.trainer)))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_private_thing_is_where_the_fence_reaches_for_it(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])), batch_size=2)
    module = Logged()
    trainer = Trainer(max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, data)
    hook, results = module.seen
    assert hook == "training_step" and {"training_step.loss", "training_step.acc"} <= set(results)
    loss = results["training_step.loss"]
    assert loss.is_tensor and loss.meta.name == "loss" and isinstance(loss.cumulated_batch_size, torch.Tensor)
    assert set(lightning_private.metric_state_names(module.accuracy)) >= {"tp", "fp", "tn", "fn"}
    before = module.accuracy.tp.clone()
    lightning_private.add_metric_states(module.accuracy, {n: getattr(module.accuracy, n).clone()
                                                          for n in lightning_private.metric_state_names(module.accuracy)})
    torch.testing.assert_close(module.accuracy.tp, 2 * before)  # summed, as the metric reduces
    lightning_private.raise_stop_flag(trainer)
    assert trainer.received_sigterm
    assert isinstance(lightning_private.original_signal_handlers(trainer), dict)
    lightning_private.without_sigterm_broadcast(trainer)
    assert lightning_private.connector_cluster_environment(trainer) is not None
    assert callable(getattr(LightningCLI, lightning_private.CLI_PARSE_CKPT_PATH))
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    assert logger._default_hp_metric is True
    lightning_private.without_hp_metric_placeholder(logger)
    assert logger._default_hp_metric is False


def test_an_untested_lightning_is_named_in_one_line_when_a_fit_starts(tmp_path, monkeypatch):
    assert lightning_private.untested_lightning_warning("2.6.6") is None
    line = lightning_private.untested_lightning_warning("9.0.0")
    assert "Lightning 9.0.0" in line and "\n" not in line
    monkeypatch.setattr(lightning_private, "untested_lightning_warning", lambda: line)
    data = DataLoader(TensorDataset(torch.randn(4, 2), torch.tensor([0, 1, 2, 0])), batch_size=2)
    trainer = Trainer(max_epochs=1, limit_train_batches=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[ExactResume()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Logged(), data)
    assert [str(w.message) for w in caught if "Lightning 9.0.0" in str(w.message)] == [f"ExactResume: {line}"]


def test_the_installed_lightning_is_reported_as_it_is():
    """On the installed release the warning is there exactly when it is not in the tested list."""
    version = lightning.__version__.split("+")[0]
    assert (lightning_private.untested_lightning_warning() is None) == (version in lightning_private.TESTED_LIGHTNING)


def test_every_private_use_names_what_it_reaches_and_the_releases_it_was_tested_on():
    """Each function of the fences (Lightning's, and timm's, torch's and numpy's) is in the one table
    with the private attribute it reaches and the releases of its library its tests passed on; the
    Lightning releases said overall are those every Lightning use passed on."""
    import inspect

    from lightning_mods._compat import library_private
    from lightning_mods._compat.private_uses import PRIVATE_USES

    functions = {f"{module.__name__}.{name}" for module in (lightning_private, library_private)
                 for name, f in inspect.getmembers(module, inspect.isfunction) if f.__module__ == module.__name__}
    fences = {f"{lightning_private.__name__}.{name}" for name in ("reaches", "untested_lightning_warning")}
    assert functions - fences == set(PRIVATE_USES)
    for name, use in PRIVATE_USES.items():
        assert "._" in use.private or "_" in use.private.split(".")[-1][:1], (name, use.private)
        assert use.tested_on and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in use.tested_on), name
        assert use.library in ("lightning", "timm", "torch", "numpy", "litdata"), name
    lightning_uses = [use for use in PRIVATE_USES.values() if use.library == "lightning"]
    common = set.intersection(*(set(use.tested_on) for use in lightning_uses))
    assert set(lightning_private.TESTED_LIGHTNING) == common


def test_no_module_outside_the_fences_imports_a_private_name_of_another_library():
    """A private function of timm, torch, numpy, Lightning or jsonargparse is imported only by
    lightning_mods/_compat (each through a recorded function); a private module of the package
    itself is the package's own business."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    own = ("commands", "lightning_mods", "callbacks", "datamodules", "cli")
    found = []
    for folder in ("commands", "lightning_mods", "callbacks", "datamodules", "cli.py"):
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else [root / folder]:
            if "_compat" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules, names = [node.module], [alias.name for alias in node.names]
                elif isinstance(node, ast.Import):
                    modules, names = [alias.name for alias in node.names], []
                else:
                    continue
                for module in modules:
                    if module.split(".")[0] in own:
                        continue
                    private = [part for part in module.split(".") + names
                               if part.startswith("_") and not part.startswith("__")]
                    if private:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {module} {private}")
    assert found == []
