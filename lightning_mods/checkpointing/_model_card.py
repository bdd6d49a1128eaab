"""The model card (``README.md``) of an exported network: what it is, the run's settings, its
data and epochs, the numbers the run measured, how to load it and the paper to cite; in the form
of timm's own cards (``timm.models.generate_readme``: front matter, details, usage, citation)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

DECAY_PAPER = """@article{zhang2024residual,
  title={Residual Connections Harm Generative Representation Learning},
  author={Zhang, Xiao and Jiang, Ruoxi and Gao, William and Willett, Rebecca and Maire, Michael},
  journal={arXiv preprint arXiv:2404.10947},
  year={2024}
}"""
DROPPATH_PAPER = """@misc{park_residualdroppath,
  title={ResidualDroppath: Enhancing Feature Reuse over Residual Connections},
  author={Park, Sejik}
}"""


def run_summary(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The ``summary.json`` of the run that wrote ``checkpoint`` (``<run folder>/checkpoints/<file>``;
    empty when the fit did not end with one)."""
    path = Path(checkpoint).resolve().parent.parent / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def training_length(ckpt: dict[str, Any], summary: dict[str, Any]) -> str:
    """``"N epochs (M steps)"`` of the run (its summary's), else of the checkpoint."""
    if "epochs" in summary and "steps" in summary:
        epochs = int(summary["epochs"])
        return f"{epochs} epoch{'s' if epochs != 1 else ''} ({int(summary['steps'])} steps)"
    return f"{int(ckpt.get('global_step', 0))} steps (checkpoint of epoch index {int(ckpt.get('epoch', 0))})"


def _settings_block(settings: dict[str, Any]) -> str:
    return "```yaml\n" + yaml.safe_dump(settings, sort_keys=False, default_flow_style=None).strip() + "\n```"


def usage_text(architecture: str, what: str) -> str:
    """The lines that load the exported folder (and where it came from)."""
    return (f"{what[0].upper() + what[1:]}, trained with shortcutlab. Load it with timm after importing "
            "shortcutlab's networks, which registers them:\n\n"
            "```python\nimport timm\nimport lightning_mods.backbone  # registers the decayed networks\n\n"
            f"model = timm.create_model(\"hf-hub:OWNER/NAME\", pretrained=True)  # or \"local-dir:FOLDER\"\n```\n\n"
            f"`config.json` names `{architecture}` with every argument that shapes the network (`model_args`, the "
            "shortcut schedule included); `pretrained_cfg` holds the input size, mean and std of its data.\n")


def model_card_text(export: Any, ckpt: dict[str, Any], checkpoint: str | os.PathLike, datamodule: Any,
                    name: str) -> str:
    """The card's text (``export``: a :class:`~lightning_mods.checkpointing.hub_export.Export`; ``name``:
    the model's name, its folder's)."""
    from lightning_mods._compat.library_private import generate_readme  # timm's card layout

    hparams = dict(ckpt.get("hyper_parameters") or {})
    summary = run_summary(checkpoint)
    recipe = str(hparams.get("_class_path", "")).rpartition(".")[2] or "a shortcutlab recipe"
    data = type(datamodule).__name__ if datamodule is not None else "unrecorded"
    details: dict[str, Any] = {
        "Model Type": "Image classification / feature backbone" if export.model_args.get("num_classes")
        else "Feature backbone / generative network",
        "Network": f"{export.what} ({export.architecture} in timm's registry, through shortcutlab)",
        "Shortcut schedule": json.dumps(export.model_args.get("shortcut")),
        "Trained by": f"{recipe}, {training_length(ckpt, summary)}",
        "Dataset": data,
        "Params (M)": round(sum(p.numel() for p in export.network.parameters()) / 1e6, 3),
    }
    numbers = {name: value for name, value in (summary.get("metrics") or {}).items() if value is not None}
    details["Numbers the run measured"] = (
        {name: f"{value:.4g}" for name, value in numbers.items()} if numbers
        else "none (its summary.json holds no evaluation)" if summary
        else "none recorded (no summary.json in the run's folder, beside checkpoints/)")
    droppath = "ResidualDroppath" in json.dumps(ckpt.get("callbacks", {}), default=str)
    card = {"description": f"{export.what[0].upper() + export.what[1:]} with decayed identity shortcuts "
                           "(`x <- alpha_k * x + f(x)`, alpha falling over depth).",
            "details": details, "license": "apache-2.0",
            "tags": ["image-feature-extraction" if not export.model_args.get("num_classes") else "image-classification",
                     "timm", "shortcutlab"],
            "usage": usage_text(export.architecture, export.what) + "\n### The run's settings\n\n"
                     + _settings_block({k: v for k, v in hparams.items() if not k.startswith("_")})
                     + ("\n\n### Its data\n\n" + _settings_block(dict(getattr(datamodule, "hparams", {}) or {}))
                        if datamodule is not None else ""),
            "citation": [DECAY_PAPER] + ([DROPPATH_PAPER] if droppath else [])}
    return generate_readme(card, name, task_name=card["tags"][0])
