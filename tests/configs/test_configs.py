"""Every composition in configs/compositions.yaml (each paper-table row's command) and every
single-file config in configs/ parses, and runs ``fit`` for one step (the rows that stand for the
others: composed_configs.representatives), with data roots pointed at files
generated in the real on-disk formats (tests/conftest.py). Diffusion rows need a VAE, latents
and an FID extractor and are run, with ``validate`` too, in test_diffusion_configs.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from commands import lightning_cli as cli
from helpers.composed_configs import (CONFIG_DIR, REPO, ROWS, SINGLE_FILES, SWEPT, command_args, declared_section,
                              is_diffusion, narrow_args, representatives, sizes)

RUNS = list(ROWS) + SINGLE_FILES


def probe_checkpoint(name: str, folder: Path) -> list[str]:
    """A linear-probe or fine-tuning config takes its network from a checkpoint: a tiny MAE one of the data's geometry."""
    if declared_section(name, "model").get("class_path") not in ("lightning_mods.linear_probe.LinearProbe",
                                                                  "lightning_mods.finetune.FineTuneClassifier"):
        return []
    import torch

    from lightning_mods.checkpointing.rebuild import build_module

    data = declared_section(name, "data")
    size = int(data["init_args"].get("image_size") or 32)
    network = {"class_path": "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT", "init_args": dict(
        img_size=size, in_chans=1 if data["class_path"].endswith(("Digits", "MNIST")) else 3, patch_size=size // 2,
        embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)}
    module, _ = build_module({"class_path": "lightning_mods.mae.MaskedAutoencoder", "init_args": {"network": network}})
    path = folder / "backbone.ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return [f"--model.init_args.checkpoint={path}"]


def test_every_row_of_the_readme_is_a_composition_and_back():
    """configs/README.md shows exactly the commands of compositions.yaml, and every file in
    configs/ is used by a row or is a single-file config."""
    readme = (CONFIG_DIR / "README.md").read_text()
    shown = dict(re.findall(r"^\| `([\w.]+)` \| `shortcutlab fit ([^`]*)`", readme, flags=re.M))
    assert set(shown) == set(ROWS)
    for name, row in ROWS.items():
        expected = " ".join([f"--config configs/{c}" for c in row["configs"]] + list(row.get("args", [])))
        assert shown[name] == expected, name
    used = {c for row in ROWS.values() for c in row["configs"]}
    fragments = {str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.glob("*/*.yaml")}
    add_ons = {f for f in fragments if f.startswith("loggers/")}  # added to any row (docs/loggers.md)
    assert fragments - add_ons == used
    assert all(f"`{f}`" in readme for f in add_ons)
    assert all((REPO / "configs" / c).is_file() for c in used)


def test_the_rows_the_one_step_fits_leave_out_parse_with_their_own_values():
    """A row no one-step fit runs (another alpha_min or seed of a fitted one, or a pairing of
    data, network and method that fitted rows run two by two) parses as ``fit`` would parse it."""
    left_out = sorted(set(RUNS) - set(representatives(RUNS)))
    assert left_out  # the alpha_min rows of the tables, and ResidualDroppath rows
    checker = cli.ArgumentChecker()
    bad = {name: reason for name in left_out if (reason := checker(["fit", *command_args(name)])) is not None}
    assert bad == {}


def test_every_config_file_and_value_of_a_row_runs_in_a_one_step_fit():
    """The rows left to parsing take nothing the fitted ones do not: each ``--config`` file and
    each value a row sets (less the swept ones) is in at least one fitted row."""
    def settings(names: list[str]) -> set[str]:
        return {s for n in names if n in ROWS
                for s in ROWS[n]["configs"] + [a for a in ROWS[n].get("args", []) if not any(w in a for w in SWEPT)]}
    trained = [n for n in RUNS if not is_diffusion(n)]
    assert settings(representatives(trained)) == settings(trained)


@pytest.mark.slow
@pytest.mark.parametrize("name, full_size", sizes(representatives([n for n in RUNS if not is_diffusion(n)])))
def test_fit_one_step(name, full_size, tmp_path, data_roots):
    data = declared_section(name, "data")
    backbone = probe_checkpoint(name, tmp_path / "ckpt")
    overrides = data_roots(data["class_path"], data["init_args"]) + backbone
    overrides += narrow_args(declared_section(name, "model").get("class_path", ""), full_size)
    if data["class_path"].endswith(".ImageNet") and not backbone and not full_size:
        overrides.append("--data.init_args.image_size=64")  # the 224 px step is the full_size row's
    run = cli.main(["fit", *command_args(name), *overrides,
              "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.precision=32-true", "--trainer.strategy=auto",
              "--trainer.sync_batchnorm=false", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    # every callback the run carried is in its resolved config (what --print_config shows), but
    # Lightning's own SaveConfigCallback
    listed = {c["class_path"].rpartition(".")[2] for c in run.config["fit"]["trainer"]["callbacks"]}
    carried = {type(c).__name__ for c in run.trainer.callbacks} - {"SaveConfigCallback"}
    assert carried <= listed, sorted(carried - listed)
