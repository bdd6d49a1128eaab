"""PatchFeaturePicture: the same images at every evaluation, one column each, input above its
patch colours at the stated tile size (the picture's colours: tests/lightning_mods/test_feature_pictures.py)."""
from __future__ import annotations

from callbacks.measurement.patch_features import PatchFeaturePicture
from test_feature_pictures import MIN_TILE, png_size
from helpers.tiny_runs import fit_blocks
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT


def test_the_callback_draws_the_same_images_at_every_evaluation(tmp_path):
    from datamodules.digits import Digits
    from lightning_mods.mae import MaskedAutoencoder

    module = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), num_reconstructions=0)
    fit_blocks(tmp_path, [PatchFeaturePicture(num_images=5)], module=module, data=Digits(batch_size=64, image_size=16))
    pictures = sorted((tmp_path / "pictures").glob("features_patch_pca_step*.png"))
    assert len(pictures) == 2
    width, height = png_size(pictures[-1])
    assert width >= 5 * MIN_TILE and height >= 2 * MIN_TILE  # 5 columns, input above colours
