"""Pictures of the features (items 3 and 4): the principal components against numpy
float64 ``svd`` of the centred tokens (up to sign); the patch colours; the callback's and the
``shortcutlab features`` command's pictures with their stated size; predict's embedding map."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from commands import features as features_command
from commands import lightning_cli as cli
from lightning_mods.pictures._embedding_map import subsample
from lightning_mods.pictures._patch_pca import patch_rgb, principal_components, upsample

MIN_TILE = 96  # pixels per tile at least (lightning_mods.pictures.grids.labelled_grid)
ROOT = Path(__file__).resolve().parents[2]
README_CHECKPOINT = "runs/digits_mae/lightning_logs/version_0/checkpoints/last.ckpt"


def readme_command(start: str) -> list[str]:
    """The arguments of docs/metrics.md's command line that starts with ``start`` (after the program)."""
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith(start):
            return line.split()[2:]
    raise AssertionError(f"no docs/metrics.md line starts with {start!r}")
TINY_QUICKSTART = ["--config=configs/digits_mae.yaml", "--trainer.enable_progress_bar=false",
                   "--model.network.depth=2", "--model.network.decoder_depth=1", "--model.network.embed_dim=32", "--model.network.num_heads=2"]


def test_principal_components_are_numpy_svd_of_the_centred_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(40, 6)) @ np.diag([5.0, 3.0, 2.0, 1.0, 0.5, 0.1]) + 7.0
    components, projections = principal_components(torch.from_numpy(tokens).float())
    centred = tokens.astype(np.float32).astype(np.float64)
    centred = centred - centred.mean(axis=0)
    _, _, vh = np.linalg.svd(centred, full_matrices=False)
    for i in range(3):
        sign = np.sign(components[i].numpy() @ vh[i])  # an eigenvector's sign is arbitrary
        np.testing.assert_allclose(sign * components[i].numpy(), vh[i], atol=1e-10)
        np.testing.assert_allclose(sign * projections[:, i].numpy(), centred @ vh[i], atol=1e-9)


def test_patch_colours_are_the_components_min_max_scaled_over_the_set():
    rng = np.random.default_rng(1)
    features = torch.from_numpy(rng.normal(size=(3, 2, 2, 5)))
    rgb = patch_rgb(features)
    assert rgb.shape == (3, 2, 2, 3)
    flat = rgb.reshape(-1, 3)
    np.testing.assert_allclose(flat.min(dim=0).values.numpy(), 0.0, atol=1e-6)  # scaled over all images
    np.testing.assert_allclose(flat.max(dim=0).values.numpy(), 1.0, atol=1e-6)
    _, projections = principal_components(features.reshape(12, 5))
    expected = (projections - projections.min(0).values) / (projections.max(0).values - projections.min(0).values)
    np.testing.assert_allclose(flat.numpy(), expected.numpy(), atol=1e-6)
    # a patch stays a square block of equal pixels
    big = upsample(rgb.numpy(), 8, 8)
    assert big.shape == (3, 8, 8, 3) and np.array_equal(big[:, :4, :4], np.broadcast_to(rgb.numpy()[:, :1, :1], (3, 4, 4, 3)))


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


@pytest.fixture(scope="module")
def quickstart_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("quick")
    cli.main(["fit", *TINY_QUICKSTART, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
              f"--trainer.default_root_dir={root}"])
    return next(root.rglob("last.ckpt"))


@pytest.mark.slow
def test_features_command_on_a_split_and_on_a_folder(quickstart_checkpoint, tmp_path, capsys, monkeypatch):
    """docs/metrics.md's command (its checkpoint: this fit's), then a folder of images."""
    argv = readme_command(".venv/bin/shortcutlab features ")
    argv = [str(quickstart_checkpoint) if a == README_CHECKPOINT else a for a in argv]
    monkeypatch.chdir(tmp_path)  # --out pictures/ is relative
    features_command.main(argv + ["--num-images", "4"])
    written = Path("pictures") / "patch_features_blocklast.png"
    assert capsys.readouterr().out.strip() == f"wrote {written}"
    assert png_size(written)[0] >= 4 * MIN_TILE
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):  # other sizes and colour: converted to the model's 1 channel and 16 pixels
        Image.fromarray((np.random.default_rng(i).random((20, 30, 3)) * 255).astype(np.uint8)).save(folder / f"{i}.png")
    features_command.main(["--ckpt_path", str(quickstart_checkpoint), "--images", str(folder), "--out",
                           str(tmp_path / "b"), "--block", "1"])
    assert png_size(tmp_path / "b" / "patch_features_block1.png")[0] >= 3 * MIN_TILE


@pytest.mark.parametrize("argv, message", [
    (["--images", "nowhere"], "--images: 'nowhere' is neither val, train nor a folder"),
    (["--block", "7"], "--block: 7 does not exist in this MaskedAutoencoder"),
    (["--block", "0"], "--block: 1 is the block nearest the input, -1 the last; 0 is none"),
])
def test_features_command_bad_input_is_one_line(quickstart_checkpoint, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        features_command.main(["--ckpt_path", str(quickstart_checkpoint), "--out", str(tmp_path), *argv])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == f"shortcutlab features: error: {message}"


@pytest.mark.slow
def test_predict_draws_the_embedding_map(quickstart_checkpoint, tmp_path):
    """docs/metrics.md's predict command on this fit's checkpoint (and its tiny architecture)."""
    argv = readme_command(".venv/bin/shortcutlab predict --config configs/digits_mae.yaml --ckpt_path")
    argv = [str(quickstart_checkpoint) if a == README_CHECKPOINT else a for a in argv]
    out = cli.main(["predict", *argv, *TINY_QUICKSTART[1:], f"--trainer.default_root_dir={tmp_path}"])
    writer = next(cb for cb in out.trainer.callbacks if type(cb).__name__ == "PredictionWriter")
    assert writer.map_written is not None and writer.map_written.name == "embedding_map.png"
    assert writer.map_written.parent == writer.written.parent
    width, height = png_size(writer.map_written)
    assert (width, height) == (640, 520)  # 6.4 x 5.2 inches at 100 dpi


def test_the_map_subsamples_seeded_above_its_size():
    assert list(subsample(5, 10, seed=0)) == [0, 1, 2, 3, 4]
    chosen = subsample(1000, 50, seed=3)
    assert len(chosen) == 50 == len(set(chosen.tolist())) and list(chosen) == sorted(chosen)
    assert np.array_equal(chosen, subsample(1000, 50, seed=3)) and not np.array_equal(chosen, subsample(1000, 50, 4))
