"""Weights of the two MAE repositories in this package's networks: the one map every reader uses.

Both ``models_mae.py`` files (He et al.'s ``facebookresearch/mae`` and the decay paper's
``xiao7199/decayed_Identity_shortcuts``) name their encoder as timm does and their decoder their
own way; their files are ``checkpoint-*.pth`` (``{'model': ..., 'optimizer': ..., 'args': ...}``)
or the released ``mae_pretrain_vit_*.pth`` / ``mae_visualize_vit_*.pth`` (``{'model': ...}``),
possibly with DDP's ``module.`` prefix.

- :func:`checkpoint_filter_fn` turns such a file (or a shortcutlab MAE's own state_dict) into
  exactly the state_dict a strict ``load_state_dict`` of a :class:`MaskedAutoencoderViT` takes;
- :func:`encoder_filter_fn` does the same for the encoder half, into a ``vit_*_decayed``
  (:class:`~lightning_mods.backbone.vit.DecayedVisionTransformer`), as timm's own
  ``vit_base_patch16_224.mae`` loads the encoder of He et al.'s file.

Neither repository stores the shortcut weights (the decay lives in the authors' ``--min_decay``
argument): what a file lacks of them comes from the schedule of the network it is loaded into.
Everything else must come from the file: a file that would leave any weight of the network at
its initialisation is refused in one line that names the weights and the argument that would
match (a fresh classifier head aside, which timm re-initialises too).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from .residual import SHORTCUT_KEY

# the MAE repositories' weight names -> ours, first matching rule (their encoders use timm's names)
FOREIGN_NAMES = [
    (r"^decoder_cls_token$", "decoder.cls_token"), (r"^mask_token$", "decoder.mask_token"),
    (r"^decoder_embed\.", "decoder.embed."), (r"^decoder_blocks\.", "decoder.blocks."),
    (r"^decoder_norm\.", "decoder.norm."), (r"^decoder_pred\.", "decoder.pred."),
    (r"^skip\.(\d+)\.fc\.0\.", r"decoder.fusions.\1.fc1."), (r"^skip\.(\d+)\.fc\.2\.", r"decoder.fusions.\1.fc2."),
    (r"^skip\.(\d+)\.mask_token$", r"decoder.fusions.\1.mask_token"),
    (r"^(cls_token|pos_embed|patch_embed\.|blocks\.|norm\.)", r"encoder.\1"),
]
ENCODER_PREFIX = "encoder."
# a classifier's head: timm re-initialises one the file does not hold, or holds for other classes
HEAD_NAMES = ("head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias", "fc.weight", "fc.bias")


def foreign_name(name: str) -> str:
    """One weight name of either repository's ``models_mae.py`` as ours (a name already ours, or
    of neither, comes back unchanged)."""
    for pattern, ours in FOREIGN_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, ours, name)
    return name


def unwrap(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state_dict inside a file's dict (``model`` of both repositories, ``state_dict`` of a
    Lightning checkpoint), DDP's ``module.`` prefix dropped."""
    for key in ("model", "state_dict"):
        if isinstance(checkpoint.get(key), Mapping):
            checkpoint = checkpoint[key]
            break
    return {re.sub(r"^module\.", "", k): v for k, v in checkpoint.items()}


def is_foreign(state_dict: Mapping[str, Any]) -> bool:
    """Whether the names are the repositories' (no ``encoder.``/``decoder.`` module of ours)."""
    return not any(k.startswith(("encoder.", "decoder.")) for k in state_dict)


def _check_fixed_embedding(value: torch.Tensor, model: Optional[nn.Module]) -> None:
    """The decoder's sin-cos position embedding is computed, not loaded: it must be the file's."""
    ours = getattr(getattr(model, "decoder", None), "pos_embed", None)
    if ours is None or ours.is_meta:
        return
    if value.shape != ours.shape or not torch.allclose(value.to(ours), ours, atol=1e-5):
        raise ValueError(f"decoder_pos_embed {tuple(value.shape)} is not MAE's fixed 2-D sin-cos embedding of this "
                         f"network's grid {tuple(ours.shape)} (another img_size, patch_size or decoder_embed_dim)")


def _own_names(state_dict: dict[str, torch.Tensor], model: Optional[nn.Module]) -> dict[str, torch.Tensor]:
    """A repository's names as ours: the fixed decoder embedding checked and dropped, and the
    authors' fusions of skips no decoder block reads (``skip.{i}``, ``i >= decoder_depth``) dropped."""
    fusions = getattr(getattr(model, "decoder", None), "fusions", None)
    out = {}
    for key, value in state_dict.items():
        if key == "decoder_pos_embed":
            _check_fixed_embedding(value, model)
            continue
        m = re.match(r"^skip\.(\d+)\.", key)
        if m and fusions is not None and int(m.group(1)) >= len(fusions):
            continue
        out[foreign_name(key)] = value
    return out


def fill_shortcut_weights(state_dict: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor]
                          ) -> dict[str, torch.Tensor]:
    """The network's own ``shortcut_weights`` (its schedule) where the file has none."""
    for key, value in own.items():
        if (key == SHORTCUT_KEY or key.endswith("." + SHORTCUT_KEY)) and key not in state_dict:
            state_dict[key] = value
    return state_dict


def keep_fresh_head(state_dict: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The network's own (new) classifier head where the file has none, or one of another shape
    (another number of classes), as timm's loader does; every other weight must come from the file."""
    for name in HEAD_NAMES:
        if name in own and (name not in state_dict or tuple(state_dict[name].shape) != tuple(own[name].shape)):
            state_dict[name] = own[name]
    return state_dict


def checkpoint_filter_fn(state_dict: Mapping[str, Any], model: Optional[nn.Module] = None,
                         keep_initial: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A file of either MAE repository, or a shortcutlab MAE's state_dict, as exactly the state_dict
    a strict load of ``model`` (a :class:`MaskedAutoencoderViT`) takes: timm's ``pretrained=True``
    calls it, and so does ``convert_mae import``.

    Without ``model`` only the names are mapped. With it, the shortcut weights the file lacks come
    from the model's schedule, and a file that does not fill the model is refused (ValueError, one
    line naming the weights and the argument that would match); the weights under a prefix of
    ``keep_initial`` (e.g. ``("decoder.",)`` for an encoder-only file) keep the model's own.
    """
    state = unwrap(state_dict)
    if is_foreign(state):
        state = _own_names(state, model)
    if model is None:
        return state
    own = model.state_dict()
    state = fill_shortcut_weights(state, own)
    if keep_initial:
        state.update({k: v for k, v in own.items() if k.startswith(keep_initial) and k not in state})
    require_filled(state, own, type(model).__name__, mae_hints)
    return state


def encoder_filter_fn(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder half of an MAE (either repository's file, a shortcutlab checkpoint, or an
    encoder exported by ``convert_mae export-encoder``) as exactly the state_dict a strict load of
    ``model`` (a ``vit_*_decayed``) takes; the decoder is dropped and a classifier head the file
    lacks keeps the model's fresh one. Refuses, in one line, a file that does not fill the rest."""
    state = unwrap(state_dict)
    if is_foreign(state):  # either repository's names, or an exported encoder's (timm's): under encoder.
        state = _own_names(state, None)
    state = {k[len(ENCODER_PREFIX):]: v for k, v in state.items() if k.startswith(ENCODER_PREFIX)}
    own = model.state_dict()
    state = keep_fresh_head(fill_shortcut_weights(state, own), own)
    require_filled(state, own, type(model).__name__, vit_hints)
    return state


# --- one-line refusals ------------------------------------------------------------------------------
def _block_count(names: Any, prefix: str) -> int:
    """Blocks the file's weights name (the shortcut weights a loader filled in from the network aside)."""
    return len({int(m.group(1)) for k in names
                if not k.endswith(SHORTCUT_KEY) and (m := re.match(rf"^{re.escape(prefix)}(\d+)\.", k))})


def _geometry_hints(state: Mapping[str, torch.Tensor], prefix: str) -> list[str]:
    """``img_size``, ``patch_size``, ``in_chans``, ``embed_dim`` and ``depth`` the file's shapes say."""
    hints = []
    proj, pos = state.get(prefix + "patch_embed.proj.weight"), state.get(prefix + "pos_embed")
    if proj is not None and proj.dim() == 4:
        width, chans, patch = int(proj.shape[0]), int(proj.shape[1]), int(proj.shape[2])
        hints += [f"embed_dim={width}", f"in_chans={chans}", f"patch_size={patch}"]
        if pos is not None and pos.dim() == 3:
            grid = int(round((pos.shape[1] - 1) ** 0.5))
            hints.append(f"img_size={grid * patch}")
    depth = _block_count(state, prefix + "blocks.")
    if depth:
        hints.append(f"depth={depth}")
    return hints


def vit_hints(state: Mapping[str, torch.Tensor], missing: list[str], unexpected: list[str]) -> list[str]:
    """The ``vit_*_decayed`` arguments that would match the file."""
    hints = _geometry_hints(state, "")
    if any(k.startswith("norm.") for k in missing):
        hints.append("final_norm=False (the file's encoder has no final norm)")
    if any(k.startswith("norm.") for k in unexpected):
        hints.append("final_norm=True (the file's encoder has a final norm)")
    return hints


def mae_hints(state: Mapping[str, torch.Tensor], missing: list[str], unexpected: list[str]) -> list[str]:
    """The ``MaskedAutoencoderViT`` arguments that would match the file."""
    hints = _geometry_hints(state, ENCODER_PREFIX)
    dec_depth = _block_count(state, "decoder.blocks.")
    if dec_depth:
        hints.append(f"decoder_depth={dec_depth}")
    pred = state.get("decoder.pred.weight")
    if pred is not None and pred.dim() == 2:
        hints.append(f"decoder_embed_dim={int(pred.shape[1])}")
    if any(k.startswith("decoder.fusions.") for k in missing):
        hints.append("unet_skips=False (the file's decoder has no U-Net skips; facebookresearch/mae's: also "
                     "alpha_min=1.0)")
    if any(k.startswith("decoder.fusions.") for k in unexpected):
        hints.append("unet_skips=True (the decay paper's skip decoder)")
    if any(k.startswith("encoder.norm.") for k in missing):
        hints.append("encoder_final_norm=False")
    if any(k.startswith("encoder.norm.") for k in unexpected):
        hints.append("encoder_final_norm=True")
    return hints


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def require_filled(state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], network: str,
                   hints: Any) -> None:
    """One-line ``ValueError`` unless ``state`` has every tensor of ``own``, of its shape, and nothing else."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and isinstance(state[k], torch.Tensor)
              and tuple(state[k].shape) != tuple(own[k].shape)]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"leaves {len(missing)} weights at their initial value ({_few(missing)})")
    if unexpected:
        parts.append(f"has {len(unexpected)} the network lacks ({_few(unexpected)})")
    if shapes:
        k = shapes[0]
        parts.append(f"differs in {len(shapes)} shapes ({k} is {tuple(state[k].shape)} there, "
                     f"{tuple(own[k].shape)} here)")
    advice = hints(state, missing, unexpected)
    raise ValueError(f"the file does not fit this {network}: it " + "; ".join(parts)
                     + (f"; the file matches {', '.join(advice)}" if advice else ""))
