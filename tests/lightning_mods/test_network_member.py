"""The MAE recipe holds the network it is given (a config class_path, a timm registry name, a
module); a checkpoint of an earlier release, whose recipe was its network, loads and resumes
exactly through :mod:`lightning_mods.checkpointing.migration`.

``tests/data/written_before_0_2_0`` holds the saved config and the epoch-0 and epoch-1
checkpoints of one uninterrupted 2-epoch run of the quickstart MAE (width 24, 2 blocks, 2 batches
an epoch) written by the last code before the recipe held its network."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from commands import lightning_cli as cli
from conftest import make_cifar10
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.rebuild import load_run
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.mae import MaskedAutoencoder

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "tests" / "data" / "written_before_0_2_0"
RELEASE_0_1_0 = ROOT / "tests" / "data" / "written_by_0_1_0" / "last.ckpt"


def saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_the_shortcut_setting_reaches_the_blocks_through_the_networks_constructor():
    """alpha_min 0.3 at the last of the 4 sub-layers, 1 at the first, linear between (by hand)."""
    recipe = MaskedAutoencoder(MaskedAutoencoderViT(
        img_size=8, in_chans=1, patch_size=4, embed_dim=8, depth=2, num_heads=2, decoder_embed_dim=8,
        decoder_depth=1, decoder_num_heads=2, shortcut={"kind": "linear", "alpha_min": 0.3}))
    weights = [float(blk.shortcut_weight(j)) for blk in recipe.network.encoder.blocks for j in (0, 1)]
    assert weights == pytest.approx([1 - 0.7 * k / 3 for k in range(4)], abs=1e-7)
    assert recipe.hparams["network"]["init_args"]["shortcut"]["alpha_min"] == 0.3
    assert not hasattr(recipe, "encoder")  # the recipe is not the network


def test_a_network_that_does_not_record_its_own_argument_is_refused():
    class Forgetful(MaskedAutoencoderViT):
        def __init__(self, extra: int = 1, **kwargs):
            super().__init__(**kwargs)

    with pytest.raises(ValueError, match="Forgetful takes extra, which its settings do not record"):
        MaskedAutoencoder(Forgetful(img_size=8, in_chans=1, patch_size=4, embed_dim=8, depth=2, num_heads=2))


@pytest.mark.slow
def test_a_fit_with_a_network_given_by_its_registry_name_trains(tmp_path):
    make_cifar10(tmp_path / "data", n_per_batch=8)
    out = cli.main(["fit", "--model=MaskedAutoencoder", "--model.network=mae_vit_tiny_patch4_32_decayed",
                    "--model.warmup_epochs=0", "--data=CIFAR10", f"--data.data_dir={tmp_path / 'data'}",
                    "--data.batch_size=8", "--data.num_workers=0", "--trainer.max_steps=2",
                    "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
                    f"--trainer.default_root_dir={tmp_path}"])
    network = out.trainer.lightning_module.network
    assert type(network) is MaskedAutoencoderViT and network.settings["embed_dim"] == 192
    assert torch.isfinite(out.trainer.callback_metrics["train/loss"])
    (ckpt,) = [p for p in tmp_path.rglob("*.ckpt") if not p.is_symlink()]
    module, _ = load_run(ckpt, with_data=False)
    assert all(torch.equal(v, network.state_dict()[k]) for k, v in module.network.state_dict().items())


@pytest.mark.parametrize("path", [RELEASE_0_1_0, BEFORE / "epoch1.ckpt"], ids=["0.1.0", "before-0.2.0"])
def test_a_checkpoint_of_an_earlier_release_loads_its_own_weights(path):
    module, _ = load_run(path, with_data=False)
    written = saved(path)["state_dict"]
    assert type(module) is MaskedAutoencoder and type(module.network) is MaskedAutoencoderViT
    own = module.state_dict()
    assert set(own) == {f"network.{k}" for k in written}
    assert all(torch.equal(own[f"network.{k}"], v) for k, v in written.items())


def test_the_probe_holds_only_the_network_of_an_earlier_releases_checkpoint():
    probe = LinearProbe(checkpoint=str(RELEASE_0_1_0), num_classes=10, feature_pool="cls")
    assert type(probe.backbone) is MaskedAutoencoderViT and probe.backbone.feature_pool == "cls"
    assert probe.hparams["backbone"]["class_path"].endswith("MaskedAutoencoderViT")
    written = saved(RELEASE_0_1_0)["state_dict"]
    assert all(torch.equal(probe.backbone.state_dict()[k], v) for k, v in written.items())


def resume(config: Path, ckpt: Path, root: Path) -> dict[str, torch.Tensor]:
    out = cli.main(["fit", f"--config={config}", f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={root}",
                    "--trainer.enable_progress_bar=false"])
    assert out.trainer.global_step == 4
    return {k: v.detach().clone() for k, v in out.trainer.lightning_module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("family, steps, member", [("", ["mae_img_size", "mae_network_member"], ""),
                                                   ("diffusion", ["diffusion_network_member"], "model.")],
                         ids=["mae", "diffusion"])
def test_a_checkpoint_written_before_the_change_resumes_exactly(tmp_path, family, steps, member):
    """Resumed from its epoch-0 checkpoint, the run is the one the same checkpoint gives once
    upgraded and saved in this release's layout, bit for bit; and it ends at the weights its
    uninterrupted run wrote at epoch 1 (bit for bit on the machine that wrote them; within float32
    rounding where the thread count or the CPU differ). The diffusion run's EMA keeps the training
    weights beside the averaged ones: both move."""
    written = BEFORE / family
    config = migration.upgrade_config(yaml.safe_load((written / "config.yaml").read_text()))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    upgraded = saved(written / "epoch0.ckpt")
    assert migration.upgrade(upgraded) == steps
    torch.save(upgraded, tmp_path / "upgraded.ckpt")
    old = resume(tmp_path / "config.yaml", written / "epoch0.ckpt", tmp_path / "old")
    new = resume(tmp_path / "config.yaml", tmp_path / "upgraded.ckpt", tmp_path / "new")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    expected = saved(written / "epoch1.ckpt")
    assert expected["global_step"] == 4
    renamed = {f"network.{k.removeprefix(member)}": v for k, v in expected["state_dict"].items()}
    assert set(renamed) <= set(old)
    for k, v in renamed.items():
        torch.testing.assert_close(old[k], v, rtol=1e-4, atol=1e-6)


def test_the_diffusion_recipe_holds_its_u_vit_and_checks_its_classes():
    from lightning_mods.backbone.uvit import UViT
    from lightning_mods.diffusion import DiffusionModule

    tiny = dict(img_size=8, in_chans=1, patch_size=4, embed_dim=8, depth=2, num_heads=2)
    module = DiffusionModule(UViT(**tiny, num_classes=3), num_classes=3, class_conditional=True, pixel_mean=[0.5],
                             pixel_std=[0.5], num_sample_images=0)
    assert module.hparams["network"]["init_args"]["num_classes"] == 3 and module.network.null_class == 3
    assert set(module.state_dict()) == {f"network.{k}" for k in module.network.state_dict()}
    with pytest.raises(ValueError, match="network.num_classes is 0; a class-conditional model's network embeds"):
        DiffusionModule(UViT(**tiny), num_classes=3, class_conditional=True)
    with pytest.raises(ValueError, match="class_conditional is false: the class embeddings would never be trained"):
        DiffusionModule(UViT(**tiny, num_classes=3), num_classes=3)
    by_name = DiffusionModule("uvit_small_patch2_32_decayed", num_sample_images=0)
    assert type(by_name.network) is UViT and by_name.hparams["network"]["init_args"]["embed_dim"] == 512


@pytest.mark.parametrize("path", [RELEASE_0_1_0, BEFORE / "diffusion" / "epoch1.ckpt"], ids=["mae", "diffusion"])
def test_load_from_checkpoint_reads_an_earlier_release(path):
    from lightning_mods.diffusion import DiffusionModule

    written = saved(path)
    cls = MaskedAutoencoder if "mae" in written["hyper_parameters"]["_class_path"] else DiffusionModule
    module = cls.load_from_checkpoint(path, map_location="cpu")
    member = "" if cls is MaskedAutoencoder else "model."
    own = module.state_dict()
    assert all(torch.equal(own[f"network.{k.removeprefix(member)}"], v) for k, v in written["state_dict"].items())
