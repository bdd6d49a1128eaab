"""shortcutlab command line: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    shortcutlab fit --config configs/digits_mae.yaml
    python cli.py validate --config configs/digits_mae.yaml --ckpt_path runs/.../last.ckpt

Values that data and model must agree on (image size, channels, number of classes) are
linked from the datamodule to the model; a model that has no such argument ignores the link.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

DEFAULT_CALLBACKS = [
    {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
    {"class_path": "lightning.pytorch.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},
]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 matmuls (Linux ``/proc/cpuinfo`` flag).

    AVX512-BF16 alone is not enough: on the 2-core reference machine, which has it,
    ``bf16-mixed`` measured ~24x slower than fp32 (see ``benchmarks/bf16_cpu.py``).
    """
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def warn_on_slow_precision(precision: Optional[str], accelerator: Optional[str]) -> None:
    """bf16 on a CPU without native support is ~24x slower than fp32 (measured on 2 cores)."""
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if precision is not None and "bf16" in str(precision) and on_cpu and not cpu_has_native_bf16():
        warnings.warn(
            f"trainer.precision={precision!r} on a CPU without native bf16 is much slower than fp32 "
            "(about 24x on the reference 2-core machine); use precision=32-true on this CPU.",
            stacklevel=2,
        )


class ShortcutLabCLI(LightningCLI):
    """LightningCLI with the data -> model links and the default callbacks."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
        for name in ("image_size", "in_chans", "num_classes"):
            parser.link_arguments(
                "data", f"model.init_args.{name}", compute_fn=lambda data, name=name: getattr(data, name),
                apply_on="instantiate",
            )
        # set_defaults (not trainer_defaults) keeps these replaceable from YAML
        parser.set_defaults({"trainer.callbacks": DEFAULT_CALLBACKS})

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        trainer_cfg = cfg.get("trainer", {})
        warn_on_slow_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))


def main(args: Optional[list[str]] = None) -> ShortcutLabCLI:
    """Entry point of the ``shortcutlab`` console command."""
    return ShortcutLabCLI(
        LightningModule, LightningDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
