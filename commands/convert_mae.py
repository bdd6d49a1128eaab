"""Checkpoint interchange for the MAE (:class:`~lightning_mods.mae.MaskedAutoencoder`).

``import`` reads one of three foreign layouts and writes a shortcutlab checkpoint that
``shortcutlab validate --ckpt_path``, ``Trainer.validate(ckpt_path=...)``,
``MaskedAutoencoder.load_from_checkpoint`` and ``LinearProbe(checkpoint=...)`` accept:

- ``authors``: the decay paper's ``MAE/models_mae.py`` (xiao7199/decayed_Identity_shortcuts):
  ``skip.{i}.fc.{0,2}``, ``skip.{i}.mask_token``, ``decoder_cls_token``, no encoder ``norm``. The
  decay is not in the weights: it comes from the checkpoint's ``args.min_decay`` or ``--alpha-min``.
- ``official``: He et al.'s ``models_mae.py`` (facebookresearch/mae): encoder ``norm``,
  ``decoder_embed`` (enc -> dec), ``mask_token``, ``decoder_*``; plain shortcuts (alpha_min 1).
- ``timm``: a timm ``VisionTransformer`` state_dict (``vit_base_patch16_224.mae``): the encoder
  with its final ``norm`` and no head. Like the released ``mae_pretrain_vit_*.pth`` files it has
  no decoder, so ``--new-decoder`` must say that a freshly initialised classic decoder is wanted.

Files may wrap the weights in ``model`` (both MAE repositories) or ``state_dict`` and may carry
DDP's ``module.`` prefix; ``.safetensors`` files are read with safetensors. The architecture
(width, depth, patch size, image size, channels, MLP ratio, decoder width/depth, skips or not,
final norm) is read from the tensors' shapes; head counts cannot be and come from
``--num-heads`` / ``--decoder-num-heads`` (defaults: the ViT-S/B/L/H convention, 16 in the decoder).

``export-timm`` writes our encoder as a timm ``VisionTransformer`` state_dict that loads strictly
into ``timm.create_model("vit_base_patch16_224", num_classes=0, final_norm=...)`` of the same
dims. timm's blocks have plain shortcuts, so an exported decayed encoder (alpha_min < 1)
computes another function there: it is refused unless ``--allow-decayed`` (e.g. to fine-tune it
as a standard ViT).

    python -m commands.convert_mae import checkpoint-last.pth mae.ckpt   # authors', args inside
    python -m commands.convert_mae import mae_pretrain_vit_base.pth mae.ckpt --new-decoder
    python -m commands.convert_mae export-timm last.ckpt vit_encoder.pth
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Optional

import lightning
import torch
from timm.models.vision_transformer import VisionTransformer

import lightning_mods.exit_statuses as exit_statuses
from lightning_mods.checkpointing.atomic_files import write_bytes_atomically
from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.checkpoint_io import save_torch_atomically
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.checkpointing.rebuild import load_run, read_torch_file
from lightning_mods.backbone._hub_args import VIT_WIDTHS
from lightning_mods.backbone.mae_weights import checkpoint_filter_fn
from lightning_mods.backbone.residual import shortcut_alphas, timm_state_dict
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

LAYOUTS = ("auto", "authors", "official", "timm")
CLASS_PATH = "lightning_mods.mae.MaskedAutoencoder"
# timm's ViT-S/B/L/H (and MAE's) head counts by width; anything else needs --num-heads
DEFAULT_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}

# --- reading -------------------------------------------------------------------------------------
def read_weights(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, training args)`` of a foreign file; one-line errors for anything else."""
    args: dict[str, Any] = {}
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"source: no file at {path!r}")
        from safetensors.torch import load_file
        raw: Any = load_file(path)
    else:  # the MAE repositories pickle their argparse Namespace next to the weights
        raw = read_torch_file(path, "source", noun="torch file", safe_globals=[argparse.Namespace])
    if isinstance(raw, dict) and isinstance(raw.get("args"), (argparse.Namespace, dict)):
        args = dict(vars(raw["args"]) if isinstance(raw["args"], argparse.Namespace) else raw["args"])
    for key in ("model", "state_dict"):
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            raw = raw[key]
            break
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ValueError(f"source: {path!r} holds no state_dict of tensors (looked at the file, 'model' and "
                         "'state_dict')")
    return {re.sub(r"^module\.", "", k): v for k, v in raw.items()}, args


def detect_layout(state: dict[str, torch.Tensor]) -> str:
    """``authors``, ``official`` or ``timm`` from the key names."""
    if any(k.startswith("skip.") for k in state) or "decoder_cls_token" in state:
        return "authors"
    if "decoder_embed.weight" in state:
        return "official"
    if "blocks.0.attn.qkv.weight" in state and "patch_embed.proj.weight" in state:
        return "timm"
    raise ValueError("layout: the keys match none of authors (skip.*, decoder_cls_token), official "
                     f"(decoder_embed.*) or timm (blocks.*, patch_embed.*); first key: {next(iter(state))!r}")


def _count(state: dict[str, torch.Tensor], prefix: str) -> int:
    return len({int(m.group(1)) for k in state if (m := re.match(rf"^{re.escape(prefix)}(\d+)\.", k))})


def _heads(width: int, given: Optional[int], flag: str) -> int:
    heads = given if given is not None else DEFAULT_HEADS.get(width)
    if heads is None:
        raise ValueError(f"{flag}: the head count cannot be read from the weights and width {width} has no default "
                         f"({', '.join(f'{w}: {h}' for w, h in DEFAULT_HEADS.items())}); pass {flag}")
    if heads <= 0 or width % heads:
        raise ValueError(f"{flag} must divide the width {width}, got {heads}")
    return heads


def infer_architecture(state: dict[str, torch.Tensor], layout: str, num_heads: Optional[int] = None,
                       decoder_num_heads: Optional[int] = None) -> dict[str, Any]:
    """MaskedAutoencoder init args readable from the shapes (``decoder_*`` only when present)."""
    for key in ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.bias", "blocks.0.mlp.fc1.weight"):
        if key not in state:
            raise ValueError(f"source: {key} is missing; expected an MAE ViT with qkv bias (layout {layout})")
    embed_dim, in_chans, patch, _ = state["patch_embed.proj.weight"].shape
    num_patches = state["pos_embed"].shape[1] - 1
    grid = int(round(num_patches ** 0.5))
    if grid * grid != num_patches or "cls_token" not in state:
        raise ValueError(f"source: pos_embed {tuple(state['pos_embed'].shape)} is not a cls token plus a square grid")
    arch: dict[str, Any] = dict(
        img_size=grid * patch, in_chans=in_chans, patch_size=patch, embed_dim=embed_dim,
        depth=_count(state, "blocks."), num_heads=_heads(embed_dim, num_heads, "--num-heads"),
        mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        unet_skips=layout == "authors", encoder_final_norm="norm.weight" in state)
    if "decoder_pred.weight" in state:
        dec_dim = state["decoder_pred.weight"].shape[1]
        if state["decoder_pred.weight"].shape[0] != patch * patch * in_chans:
            raise ValueError(f"source: decoder_pred predicts {state['decoder_pred.weight'].shape[0]} values per patch, "
                             f"not patch_size**2 * in_chans = {patch * patch * in_chans}")
        arch.update(decoder_embed_dim=dec_dim, decoder_depth=_count(state, "decoder_blocks."),
                    decoder_num_heads=_heads(dec_dim, 16 if decoder_num_heads is None else decoder_num_heads,
                                             "--decoder-num-heads"))
        dec_ratio = state["decoder_blocks.0.mlp.fc1.weight"].shape[0] / dec_dim if arch["decoder_depth"] else None
        if dec_ratio not in (None, arch["mlp_ratio"]):
            raise ValueError(f"source: decoder mlp ratio {dec_ratio} differs from the encoder's {arch['mlp_ratio']}; "
                             "MaskedAutoencoder has one mlp_ratio")
    return arch


# --- import --------------------------------------------------------------------------------------
def import_checkpoint(src: str, layout: str = "auto", alpha_min: Optional[float] = None,
                      num_heads: Optional[int] = None, decoder_num_heads: Optional[int] = None,
                      new_decoder: bool = False, decoder_embed_dim: int = 512, decoder_depth: int = 8,
                      norm_pix_loss: Optional[bool] = None, mask_ratio: Optional[float] = None,
                      seed: int = 0) -> dict[str, Any]:
    """The shortcutlab checkpoint (a dict for ``torch.save``) of the foreign file ``src``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    state, args = read_weights(src)
    found = detect_layout(state)
    if layout != "auto" and layout != found:
        raise ValueError(f"layout: {src!r} looks like the {found} layout, not {layout}")
    layout = found
    alpha_min = _alpha_min(layout, alpha_min, args)
    arch = infer_architecture(state, layout, num_heads, decoder_num_heads)
    has_decoder = "decoder_embed_dim" in arch
    if not has_decoder:
        if not new_decoder:
            raise ValueError(f"new_decoder: {src!r} holds an encoder only ({layout} layout); pass --new-decoder to "
                             "pair it with a freshly initialised classic MAE decoder (fine for features and probes)")
        arch.update(decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth,
                    decoder_num_heads=_heads(decoder_embed_dim, 16 if decoder_num_heads is None else decoder_num_heads,
                                             "--decoder-num-heads"))
    elif new_decoder:
        raise ValueError(f"new_decoder: {src!r} has its own decoder ({layout} layout); drop --new-decoder")
    ratio = mask_ratio if mask_ratio is not None else float(args.get("mask_ratio", 0.75))
    norm_pix = norm_pix_loss if norm_pix_loss is not None else bool(args.get("norm_pix_loss", False))
    torch.manual_seed(seed)  # the fresh decoder, when there is one
    model = MaskedAutoencoder(MaskedAutoencoderViT(**arch, shortcut=ShortcutSchedule("linear", alpha_min),
                                                   norm_pix_loss=norm_pix, mask_ratio=ratio))
    load_weights(model, state, layout, new_decoder=not has_decoder)
    return lightning_checkpoint(model, {"source": os.path.abspath(src), "layout": layout,
                                        "new_decoder": not has_decoder})


def _alpha_min(layout: str, given: Optional[float], args: dict[str, Any]) -> float:
    if layout != "authors":
        if given not in (None, 1.0):
            raise ValueError(f"alpha_min: {layout} weights were trained with plain shortcuts; alpha_min must be 1, "
                             f"got {given}")
        return 1.0
    stored = args.get("min_decay")
    if given is None and stored is None:
        raise ValueError("alpha_min: the authors' decay is not in the weights and the file has no args.min_decay; "
                         "pass --alpha-min (the value of their --min_decay)")
    if given is not None and stored is not None and float(given) != float(stored):
        raise ValueError(f"alpha_min: --alpha-min {given} contradicts the file's args.min_decay {stored}")
    return float(given if given is not None else stored)


def load_weights(model: MaskedAutoencoder, state: dict[str, torch.Tensor], layout: str, new_decoder: bool) -> None:
    """The file's weights into ``model`` through the one map of both repositories' names
    (:func:`~lightning_mods.backbone.mae_weights.checkpoint_filter_fn`): every weight from the file
    (a new decoder's aside), the fixed embeddings checked, a strict load."""
    if layout == "timm":  # an encoder alone in timm's names: ours under encoder.
        state = {f"encoder.{k}": v for k, v in state.items()}
    try:
        converted = checkpoint_filter_fn(state, model.network, keep_initial=("decoder.",) if new_decoder else ())
    except ValueError as err:
        raise ValueError(f"source: {err}") from None
    model.network.load_state_dict(converted, strict=True)


def lightning_checkpoint(model: MaskedAutoencoder, converted_from: dict[str, Any]) -> dict[str, Any]:
    """What ``shortcutlab fit`` writes, minus optimiser and loop state (not resumable with ``fit``)."""
    hparams = dict(model.hparams)
    hparams.update(_class_path=CLASS_PATH, _instantiator="lightning.pytorch.cli.instantiate_module")
    return migration.stamped({"epoch": 0, "global_step": 0, "pytorch-lightning_version": lightning.__version__,
                              "state_dict": model.state_dict(), "hyper_parameters": hparams,
                              "converted_from": converted_from})


# --- export --------------------------------------------------------------------------------------
def timm_encoder(model: MaskedAutoencoder) -> VisionTransformer:
    """A timm ``VisionTransformer`` (no head, token pooling) holding our encoder's weights."""
    hp = model.network.settings
    vit = VisionTransformer(img_size=hp["img_size"], patch_size=hp["patch_size"], in_chans=hp["in_chans"],
                            embed_dim=hp["embed_dim"], depth=hp["depth"], num_heads=hp["num_heads"],
                            mlp_ratio=hp["mlp_ratio"], qkv_bias=True, num_classes=0, final_norm=hp["encoder_final_norm"])
    ours = timm_state_dict(model.network.encoder, force=True)  # decayed or not: export_timm asked the user
    wanted = vit.state_dict()
    missing = [k for k in wanted if k not in ours or ours[k].shape != wanted[k].shape]
    if missing:
        raise ValueError(f"export: the encoder has no {missing[0]} of timm's shape")
    vit.load_state_dict({k: ours[k] for k in wanted}, strict=True)
    return vit


def is_plain(model: MaskedAutoencoder) -> bool:
    """Whether every shortcut weight is 1 and every branch weight 1 (timm's residual sums)."""
    schedule = model.network.shortcut
    branch_scaled = schedule.kind in ("scaled_branch", "scaled_sum") and schedule.scale != 1.0
    return not branch_scaled and all(a == 1.0 for a in shortcut_alphas(model.network.encoder))


def export_timm(src: str, allow_decayed: bool = False) -> dict[str, torch.Tensor]:
    """Our encoder as a timm ``VisionTransformer`` state_dict."""
    model = load_run(src, {"class_path": CLASS_PATH}, with_data=False)[0]
    if not is_plain(model) and not allow_decayed:
        raise ValueError(f"allow_decayed: the encoder's shortcuts are decayed ({model.network.shortcut!r}); timm's blocks sum "
                         "plainly, so these weights compute another function there; pass --allow-decayed to export "
                         "anyway (e.g. to fine-tune as a standard ViT)")
    return timm_encoder(model).state_dict()


def encoder_rebuild_call(model: MaskedAutoencoder, path: str) -> str:
    """The ``timm.create_model`` call that rebuilds the exported encoder: every argument it needs."""
    hp = model.network.settings
    name = VIT_WIDTHS.get(hp["embed_dim"], "vit_base_patch16_224_decayed")
    shortcut = f"shortcut={model.network.shortcut.as_dict()!r}"
    return (f"timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file={path!r}), "
            f"img_size={hp['img_size']}, patch_size={hp['patch_size']}, in_chans={hp['in_chans']}, "
            f"embed_dim={hp['embed_dim']}, depth={hp['depth']}, num_heads={hp['num_heads']}, "
            f"mlp_ratio={hp['mlp_ratio']}, final_norm={bool(hp['encoder_final_norm'])}, {shortcut}, num_classes=0)")


def save(obj: Any, path: str) -> None:
    """``torch.save`` (or safetensors for ``.safetensors``) whole or not at all
    (:mod:`lightning_mods.checkpointing.atomic_files`): an existing file is replaced only by a complete one."""
    if path.endswith(".safetensors"):  # missing folders are created (--help)
        from safetensors.torch import save as to_bytes
        write_bytes_atomically(path, to_bytes({k: v.contiguous() for k, v in obj.items()}))
    else:
        save_torch_atomically(obj, path)


# --- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commands.convert_mae", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a foreign MAE checkpoint -> a shortcutlab .ckpt")
    imp.add_argument("source", help="authors' / official .pth, timm .pth or .safetensors")
    imp.add_argument("output", help="the shortcutlab checkpoint to write (.ckpt); missing folders are created")
    imp.add_argument("--layout", choices=LAYOUTS, default="auto")
    imp.add_argument("--alpha-min", type=float, default=None,
                     help="authors' layout: their --min_decay when the file has no args (required then)")
    imp.add_argument("--num-heads", type=int, default=None, help="encoder heads (default: 3/6/12/16/16 for "
                     "width 192/384/768/1024/1280)")
    imp.add_argument("--decoder-num-heads", type=int, default=None, help="decoder heads (default 16)")
    imp.add_argument("--new-decoder", action="store_true",
                     help="encoder-only source: add a freshly initialised classic decoder")
    imp.add_argument("--decoder-embed-dim", type=int, default=512, help="with --new-decoder")
    imp.add_argument("--decoder-depth", type=int, default=8, help="with --new-decoder")
    imp.add_argument("--norm-pix-loss", action=argparse.BooleanOptionalAction, default=None,
                     help="default: the file's args, else false (both repositories' default)")
    imp.add_argument("--mask-ratio", type=float, default=None, help="default: the file's args, else 0.75")
    imp.add_argument("--seed", type=int, default=0, help="initialisation of a new decoder")
    exp = sub.add_parser("export-timm", help="a shortcutlab MAE .ckpt -> a timm VisionTransformer state_dict")
    exp.add_argument("checkpoint")
    exp.add_argument("output", help=".pth (torch.save) or .safetensors; missing folders are created")
    exp.add_argument("--allow-decayed", action="store_true", help="export an encoder with alpha_min < 1 anyway")
    enc = sub.add_parser("export-encoder", help="a shortcutlab MAE .ckpt -> its encoder's state_dict, shortcut "
                         "weights included, for timm.create_model('vit_*_decayed', pretrained=True, "
                         "pretrained_cfg_overlay=dict(file=...))")
    enc.add_argument("checkpoint")
    enc.add_argument("output", help=".pth (torch.save) or .safetensors; missing folders are created")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "import":
            ckpt = import_checkpoint(args.source, args.layout, args.alpha_min, args.num_heads,
                                     args.decoder_num_heads, args.new_decoder, args.decoder_embed_dim,
                                     args.decoder_depth, args.norm_pix_loss, args.mask_ratio, args.seed)
            save(ckpt, args.output)
            hp = ckpt["hyper_parameters"]["network"]["init_args"]
            print(f"wrote {args.output}: {ckpt['converted_from']['layout']} layout, ViT depth {hp['depth']} width "
                  f"{hp['embed_dim']} patch {hp['patch_size']} image {hp['img_size']}, alpha_min "
                  f"{hp['shortcut']['alpha_min']}, {'U-Net skip' if hp['unet_skips'] else 'classic'} decoder"
                  + (" (new)" if ckpt["converted_from"]["new_decoder"] else ""))
        elif args.command == "export-encoder":
            model = load_run(args.checkpoint, {"class_path": CLASS_PATH}, with_data=False)[0]
            save(model.network.encoder.state_dict(), args.output)
            print(f"wrote {args.output}: the encoder, shortcut weights included; rebuild it with "
                  f"{encoder_rebuild_call(model, args.output)}")
        else:
            save(export_timm(args.checkpoint, args.allow_decayed), args.output)
            print(f"wrote {args.output}: timm VisionTransformer state_dict (num_classes=0)")
    except (ValueError, FileNotFoundError) as err:
        print(f"shortcutlab convert-mae: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    except OSError as err:  # the output's folder cannot be made or written (a file in its way, permissions)
        print(f"shortcutlab convert-mae: error: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)


if __name__ == "__main__":
    main()
