"""Fine-tuning a pre-trained MAE (lightning_mods/finetune.py; docs/reproducing.md, "In small, on
the digits"): the parameter groups of a ViT-B
carry MAE's layer-decay rates and weight-decay flags (against MAE's rule written out by hand,
facebookresearch/mae util/lr_decay.py), the network keeps the encoder's weights and shortcut
schedule, and on the digits, from an MAE checkpoint, a fit trains with mixup, reports top-1 and
top-5, and resumes exactly from a mid-run checkpoint; a checkpoint of another family is one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import folders
from commands import lightning_cli as cli
from lightning_mods.backbone.residual import shortcut_alphas
from lightning_mods.checkpointing.rebuild import load_run
from lightning_mods.finetune import FineTuneClassifier, fine_tuning_network
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

MAE_CKPT = folders.TESTS / "data" / "written_by_0_1_0" / "last.ckpt"
VIT_B = {"class_path": "lightning_mods.mae.MaskedAutoencoder", "init_args": {"network": {
    "class_path": "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT",
    "init_args": {"img_size": 224, "patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12,
                  "decoder_embed_dim": 64, "decoder_depth": 2, "decoder_num_heads": 2}}}}


def maes_rule(names_and_ndims: list[tuple[str, int]], depth: int, layer_decay: float,
              weight_decay: float) -> dict[str, tuple[float, float]]:
    """MAE's param_groups_lrd, by hand: name -> (lr scale, weight decay)."""
    num_layers = depth + 1
    rule = {}
    for name, ndim in names_and_ndims:
        if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
            layer = 0
        elif name.startswith("blocks"):
            layer = int(name.split(".")[1]) + 1
        else:
            layer = num_layers
        no_decay = ndim == 1 or name in ("pos_embed", "cls_token", "dist_token")
        rule[name] = (layer_decay ** (num_layers - layer), 0.0 if no_decay else weight_decay)
    return rule


def test_vit_b_groups_carry_maes_layer_decay_and_weight_decay_flags():
    module = FineTuneClassifier(network=VIT_B, num_classes=100)
    groups = module.parameter_groups(peak_lr=1.0)
    names = {id(p): n for n, p in module.network.named_parameters()}
    got = {names[id(p)]: (group["lr_scale"], group["weight_decay"]) for group in groups for p in group["params"]}
    params = [(n, p.ndim) for n, p in module.network.named_parameters() if p.requires_grad]
    want = maes_rule(params, 12, 0.65, 0.05)
    assert set(got) == set(want)
    for name, (scale, decay) in want.items():
        assert got[name][0] == pytest.approx(scale, rel=1e-12), name
        assert got[name][1] == decay, name
    assert got["head.weight"] == (1.0, 0.05) and got["patch_embed.proj.weight"][0] == pytest.approx(0.65 ** 13)
    assert all(g["lr"] == g["lr_scale"] for g in groups)


def test_the_network_is_the_encoder_with_a_new_head():
    mae, _ = load_run(MAE_CKPT, with_data=False)  # a checkpoint of release 0.1.0, upgraded as it is read
    module = FineTuneClassifier(checkpoint=str(MAE_CKPT), num_classes=10)
    net = module.network
    assert shortcut_alphas(net) == shortcut_alphas(mae.network.encoder) and min(shortcut_alphas(net)) < 1.0  # decayed
    encoder = mae.network.encoder.state_dict()
    for name, value in net.state_dict().items():
        if not name.startswith(("head.", "fc_norm.")):
            assert torch.equal(value, encoder[name]), name
    assert net.head.weight.detach().std() < 1e-4 and float(net.head.bias.detach().abs().max()) == 0.0
    assert net.global_pool == "avg" and isinstance(net.norm, torch.nn.Identity)


def test_a_checkpoint_of_another_family_is_one_line(tmp_path):
    from lightning_mods.backbone.residual_mlp import ResidualMLP
    from lightning_mods.spiral_classifier import SpiralClassifier

    path = tmp_path / "spiral.ckpt"
    module = SpiralClassifier(ResidualMLP(depth=2, width=4))
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {
        **dict(module.hparams), "_class_path": "lightning_mods.spiral_classifier.SpiralClassifier"}}, path)
    with pytest.raises(ValueError, match="not a lightning_mods.mae.MaskedAutoencoder") as caught:
        FineTuneClassifier(checkpoint=str(path), num_classes=2)
    assert "\n" not in str(caught.value)


EVERY_3_STEPS = ('--trainer.callbacks+={"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
                 '{"filename": "every-{step}", "save_top_k": -1, "every_n_train_steps": 3}}')


def fine_tune(root: Path, ckpt_path: Path | None = None):  # noqa: ANN201
    args = ["fit", f"--config={folders.REPO / 'configs' / 'finetune_digits.yaml'}", EVERY_3_STEPS,
            f"--model.checkpoint={MAE_CKPT}", "--trainer.max_epochs=3", "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=2", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.default_root_dir={root}"]
    return cli.main(args + ([f"--ckpt_path={ckpt_path}"] if ckpt_path else []))


@pytest.mark.slow
def test_fine_tuning_the_quickstart_checkpoint_trains_reports_and_resumes_exactly(tmp_path):
    straight = fine_tune(tmp_path / "straight")
    metrics = straight.trainer.callback_metrics
    assert {"val/top1", "val/top5", "val/loss", "train/loss"} <= set(metrics)
    assert straight.model.mixup is not None
    resumed = fine_tune(tmp_path / "resumed", next((tmp_path / "straight").rglob("every-step=6.ckpt")))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert float(resumed.trainer.callback_metrics["val/top1"]) == float(metrics["val/top1"])


def test_the_cls_token_pool_keeps_the_encoders_final_norm():
    """He et al.'s MAE (no U-Net skips) has a final encoder norm: fine-tuned on the cls token it
    is kept, with its pre-trained weights; the average pool replaces it by a new LayerNorm."""
    network = {"img_size": 8, "in_chans": 1, "patch_size": 4, "embed_dim": 16, "depth": 2, "num_heads": 2,
               "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2, "unet_skips": False,
               "encoder_final_norm": True}
    encoder = {"class_path": "lightning_mods.mae.MaskedAutoencoder",
               "init_args": {"network": {"class_path": "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT", "init_args": network}}}
    torch.manual_seed(0)
    token = FineTuneClassifier(network=encoder, num_classes=3, global_pool="token")
    torch.manual_seed(0)
    mae = MaskedAutoencoder(MaskedAutoencoderViT(**network))
    with torch.no_grad():
        mae.network.encoder.norm.weight.add_(0.5)  # a norm unlike a fresh one
    net = fine_tuning_network(mae, 3, 0.0, 2e-5, "token")
    assert torch.equal(net.norm.weight, mae.network.encoder.norm.weight)
    assert isinstance(token.network.fc_norm, torch.nn.Identity)
    avg = fine_tuning_network(mae, 3, 0.0, 2e-5, "avg")
    assert isinstance(avg.norm, torch.nn.Identity) and torch.equal(avg.fc_norm.weight, torch.ones(16))
