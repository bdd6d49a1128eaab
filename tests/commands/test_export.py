"""``shortcutlab export``: each family's network in timm's hub layout, rebuilt by
``timm.create_model("local-dir:...")`` with outputs equal to the run's own network (read back
independently from the checkpoint), the folder being exactly what timm's ``save_for_hf`` (the
writer ``push_to_hf_hub`` uploads) writes of that network; refusals in one line; docs/sharing.md's
export line and its Python block."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

import lightning_mods.backbone  # noqa: F401  (registers the decayed networks)
from commands import export as export_command
from commands import lightning_cli as cli
from lightning_mods.checkpointing.rebuild import load_run

REPO = Path(__file__).resolve().parents[2]
ONE_STEP = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.accelerator=cpu"]
FAMILIES = {
    "MAE": ["configs/digits_mae.yaml", "--model.network.embed_dim=32", "--model.network.depth=2",
            "--model.network.num_heads=2", "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
            "--model.network.decoder_num_heads=2"],
    "classifier": ["configs/data/digits.yaml", "configs/digits_resnet/base.yaml", "configs/digits_resnet/decay.yaml",
                   "--data.init_args.batch_size=32"],
    "diffusion": ["configs/digits_diffusion_quick.yaml"],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A two-step fit of each family (the quick configs, a smaller MAE): ``{family: last checkpoint}``."""
    found = {}
    for family, args in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        cli.run_reporting_stops(["fit", *(f"--config={REPO / a}" if a.endswith(".yaml") else a for a in args),
                                 *ONE_STEP, f"--trainer.default_root_dir={root}"])
        found[family] = max(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found


def export(checkpoint: Path, folder: Path, *extra: str) -> None:
    export_command.main([str(checkpoint), str(folder), *extra])


def run_network(checkpoint: Path, part: str) -> torch.nn.Module:
    """The network the run trained, rebuilt from its checkpoint as shortcutlab rebuilds it."""
    network = load_run(checkpoint, with_data=False)[0].eval().network
    return network.encoder if part == "encoder" and hasattr(network, "encoder") else network


CASES = [("MAE", "encoder"), ("MAE", "whole"), ("classifier", "auto"), ("diffusion", "auto")]


@pytest.mark.parametrize("family, part", CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_local_dir_rebuilds_the_run_network_exactly(family, part, checkpoints, tmp_path):
    folder = tmp_path / "exported"
    export(checkpoints[family], folder, *(["--part", part] if part != "auto" else []))
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    ours = run_network(checkpoints[family], part)
    torch.manual_seed(0)
    config = json.loads((folder / "config.json").read_text())
    chans, size = config["pretrained_cfg"]["input_size"][0], config["pretrained_cfg"]["input_size"][1]
    images = torch.randn(3, chans, size, size)
    with torch.no_grad():
        if family == "diffusion":
            t, y = torch.tensor([1, 100, 999]), torch.tensor([0, 3, 9])
            pairs = [(loaded(images, t, y), ours(images, t, y))]
        elif part == "whole":
            g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
            pairs = [(loaded.forward_features(images), ours.forward_features(images)),
                     *zip(loaded(images, generator=g()), ours(images, generator=g()))]
        else:
            pairs = [(loaded(images), ours(images)), (loaded.forward_features(images), ours.forward_features(images))]
    for theirs, mine in pairs:
        assert torch.equal(theirs, mine)  # max abs difference 0 in float32

    schedule = ours.shortcut.as_dict() if hasattr(ours, "shortcut") else None
    assert config["model_args"]["shortcut"] == schedule
    data = load_run(checkpoints[family])[1]
    assert config["pretrained_cfg"]["mean"] == list(data.mean) and config["pretrained_cfg"]["std"] == list(data.std)
    assert config["pretrained_cfg"]["input_size"] == [data.in_chans, data.image_size, data.image_size]
    if family == "classifier":
        assert config["label_names"] == [str(i) for i in range(10)] and config["num_classes"] == 10


def test_the_folder_is_what_timms_save_for_hf_writes(checkpoints, tmp_path):
    from timm.models import save_for_hf

    export(checkpoints["classifier"], tmp_path / "ours")
    model = timm.create_model(f"local-dir:{tmp_path / 'ours'}", pretrained=True)
    save_for_hf(model, tmp_path / "timm", model_config={"label_names": model.pretrained_cfg["label_names"]},
                safe_serialization=True)
    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "timm"))
    # timm's round trip: a loaded model's pretrained_cfg holds the label names, so its re-export repeats them there
    assert theirs["pretrained_cfg"].pop("label_names") == ours["label_names"]
    assert ours == theirs
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "timm" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_model_card_says_what_the_run_was(checkpoints, tmp_path):
    export(checkpoints["MAE"], tmp_path / "card")
    card = (tmp_path / "card" / "README.md").read_text()
    assert card.startswith("---\ntags:\n- image-feature-extraction\n- timm\n")
    for text in ("# Model card for card", "**Dataset:** Digits", "MaskedAutoencoder, 1 epoch (2 steps)", "none (its summary.json holds no evaluation)",
                 '"alpha_min": 0.6', "alpha_min: 0.6", "embed_dim: 32", "batch_size: 128",
                 "Residual Connections Harm Generative Representation Learning", 'timm.create_model("hf-hub:'):
        assert text in card, text
    assert "ResidualDroppath: Enhancing" not in card


def test_loading_a_folder_into_a_network_it_does_not_fill_is_one_line(checkpoints, tmp_path):
    export(checkpoints["MAE"], tmp_path / "enc")
    with pytest.raises(ValueError) as err:
        timm.create_model(f"local-dir:{tmp_path / 'enc'}", pretrained=True, depth=3)
    message = str(err.value)
    assert "\n" not in message and "leaves 12 weights at their initial value" in message and "depth=2" in message


@pytest.mark.parametrize("case", ["folder not empty", "part of a classifier", "no checkpoint"])
def test_bad_input_is_one_line_and_exit_2(case, checkpoints, tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep")
    args = {"folder not empty": [str(checkpoints["MAE"]), str(folder)],
            "part of a classifier": [str(checkpoints["classifier"]), str(tmp_path / "new"), "--part", "whole"],
            "no checkpoint": [str(tmp_path / "missing.ckpt"), str(tmp_path / "new")]}[case]
    with pytest.raises(SystemExit) as stop:
        export_command.main(args)
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.startswith("shortcutlab export: error: ") and error.count("\n") == 1, error
    assert (folder / "mine.txt").read_text() == "keep" and not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_the_pages_export_line_and_python_block_run(checkpoints, tmp_path, monkeypatch):
    """docs/sharing.md: its export line on the MAE checkpoint placed where the page's fit writes it,
    then its Python block as written, in that folder."""
    page = (REPO / "docs" / "sharing.md").read_text()
    blocks = re.findall(r"```(bash|python)\n(.*?)```", page, flags=re.S)
    [line] = [line for lang, code in blocks if lang == "bash" for line in code.splitlines() if " export " in line]
    words = shlex.split(line)
    assert words[:2] == [".venv/bin/shortcutlab", "export"]
    placed = tmp_path / words[2]
    placed.parent.mkdir(parents=True)
    shutil.copyfile(checkpoints["MAE"], placed)
    monkeypatch.chdir(tmp_path)
    export_command.main(words[2:])
    [code] = [code for lang, code in blocks if lang == "python" and "local-dir:" in code]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/sharing.md", "exec"), {})
    assert printed.getvalue().strip().endswith("torch.Size([2, 32])")
    assert os.path.isfile(tmp_path / words[3] / "model.safetensors")
