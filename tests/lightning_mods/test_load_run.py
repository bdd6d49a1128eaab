"""``load_run`` rebuilds the run a checkpoint was written by: the network with exactly the
checkpoint's weights, and the datamodule with the settings the checkpoint holds (a checkpoint of
the release before, ``tests/data/written_by_0_1_0``); docs/checkpoints.md's snippet runs on it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mods.checkpointing.rebuild import load_run

OLD_CKPT = Path(__file__).resolve().parents[1] / "data" / "written_by_0_1_0" / "last.ckpt"


@pytest.fixture(scope="module")
def written():
    return torch.load(OLD_CKPT, map_location="cpu", weights_only=True)


def test_the_network_and_the_data_of_the_run(written):
    module, datamodule = load_run(OLD_CKPT)
    assert type(module).__name__ == "MaskedAutoencoder" and type(datamodule).__name__ == "Digits"
    state = module.state_dict()  # release 0.1.0's MAE was its network: its weights are the network's now
    assert set(state) == {f"network.{k}" for k in written["state_dict"]}
    assert all(torch.equal(state[f"network.{k}"], v) for k, v in written["state_dict"].items())
    saved = written["datamodule_hyper_parameters"]
    assert (datamodule.batch_size, datamodule.image_size) == (saved["batch_size"], saved["image_size"]) == (128, 16)


def test_data_settings_on_top_and_a_wrong_one_is_one_line():
    _, datamodule = load_run(OLD_CKPT, data={"batch_size": 7})
    assert datamodule.batch_size == 7 and datamodule.image_size == 16
    with pytest.raises(ValueError, match=r"^data: Digits of .*last\.ckpt.*no_such_setting") as caught:
        load_run(OLD_CKPT, data={"no_such_setting": 1})
    assert "\n" not in str(caught.value)


def test_no_datamodule_when_not_asked_or_not_named(written, tmp_path):
    assert load_run(OLD_CKPT, with_data=False)[1] is None
    path = tmp_path / "outside_the_cli.ckpt"
    torch.save({k: v for k, v in written.items() if k != "datamodule_hyper_parameters"}, path)
    module, datamodule = load_run(path)
    assert datamodule is None and type(module).__name__ == "MaskedAutoencoder"


def test_a_model_setting_that_disagrees_is_refused():
    with pytest.raises(ValueError, match=r"model\.network\.depth"):
        load_run(OLD_CKPT, {"init_args": {"network": {"init_args": {"depth": 3}}}}, with_data=False)


def test_allow_override_builds_the_given_setting_and_its_old_name_is_taken_with_a_notice():
    from lightning_mods.backbone.residual import shortcut_alphas

    given = {"init_args": {"network": {"init_args": {"shortcut": {"init_args": {"alpha_min": 1.0}}}}}}
    with pytest.warns(UserWarning, match="allow_override: building with the given settings"):
        module, _ = load_run(OLD_CKPT, given, allow_override=True, with_data=False)
    assert set(shortcut_alphas(module.network)) == {1.0}
    with pytest.warns(FutureWarning, match="^load_run: allow_model_override is allow_override since release 0.3$"):
        with pytest.warns(UserWarning, match="allow_override: building"):
            module, _ = load_run(OLD_CKPT, given, allow_model_override=True, with_data=False)
    assert set(shortcut_alphas(module.network)) == {1.0}


def test_the_snippet_of_the_docs():
    page = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    snippet = next(block for block in page.split("```python")[1:] if "load_run" in block).split("```")[0]
    path = "runs/digits_mae/lightning_logs/version_0/checkpoints/last.ckpt"
    assert path in snippet
    found: dict = {}
    exec(snippet.replace(path, str(OLD_CKPT)), found)  # noqa: S102 (the page's own code)
    assert type(found["module"]).__name__ == "MaskedAutoencoder" and found["datamodule"].batch_size == 64
