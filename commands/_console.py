"""What the ``shortcutlab`` command prints: Lightning's info lines on stdout, third-party noise
that concerns neither the run nor the user's settings filtered by exact message, Lightning's
eval-mode warning answered for intentionally frozen modules, and a warning for bf16 on a CPU
without native bf16."""
from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.warnings import PossibleUserWarning


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 matmuls (Linux ``/proc/cpuinfo`` flag).

    AVX512-BF16 alone is not enough: on the 2-core reference machine, which has it, bf16 ran
    from 0.7x to ~24x the fp32 time depending on the torch build and the model
    (``benchmarks/bf16_cpu.py``; numbers in docs/performance.md).
    """
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def warn_on_slow_precision(precision: Optional[str], accelerator: Optional[str]) -> None:
    """Warn that bf16 on a CPU without AMX has no reliable speed-up and can be far slower."""
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if precision is not None and "bf16" in str(precision) and on_cpu and not cpu_has_native_bf16():
        warnings.warn(
            f"trainer.precision={precision!r} on a CPU without native bf16 (AMX): no reliable "
            "speed-up over fp32 (0.7x to ~24x its time on the reference 2-core machine, by torch "
            "build and model; run benchmarks/bf16_cpu.py here); use precision=32-true on this CPU.",
            stacklevel=2,
        )


def info_logs_to_stdout() -> None:
    """Lightning's info lines ("Seed set to 0", "GPU available") go to stdout, so stderr holds
    only warnings and errors (and a bad input, one line)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                handler.setStream(sys.stdout)


# Third-party output that says nothing about the run, silenced by exact message (and, for
# warnings, category and emitting module), so that any other message still shows:
LIGHTNING_INFO_NOISE = (
    # advertisements for Lightning's cloud services, on every fit
    r"^💡 Tip: For seamless cloud (logging and experiment tracking|uploads and versioning), try installing",
    # our configs list RichModelSummary on purpose; Lightning reports that it adds no default summary
    r"^Trainer already configured with model summary callbacks: ",
    # our recipes size their schedules with trainer.estimated_stepping_batches; an internal step
    r"^Loading `train_dataloader` to estimate number of stepping batches\.$",
)


class _DropMessages(logging.Filter):
    """Drops log records whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.search(record.getMessage()) for p in self.patterns)


_LIGHTNING_INFO_FILTER = _DropMessages(LIGHTNING_INFO_NOISE)


def silence_third_party_noise() -> None:
    """Filter the third-party lines every fit printed that concern neither the run nor the user's
    settings. Idempotent."""
    # rank_zero_info's records are created on this logger (lightning.pytorch.utilities.rank_zero)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_LIGHTNING_INFO_FILTER)
    # torch 2.15 deprecated LeafSpec; Lightning 2.6's own _pytree helper still builds one per
    # batch it flattens: nothing a user of shortcutlab can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")


def frozen_eval_mode_count(model: torch.nn.Module) -> Optional[int]:
    """The number of modules in eval mode (Lightning's count, root included) when every one of
    them lies in a frozen subtree (a module in eval mode with parameters, none of them
    trainable: the LinearProbe's backbone); ``None`` when there are none, or when any other
    module is in eval mode."""
    frozen: set[int] = set()
    for module in model.modules():
        params = list(module.parameters())
        if not module.training and params and not any(p.requires_grad for p in params):
            frozen.update(id(sub) for sub in module.modules())
    in_eval = [module for _, module in model.named_modules() if not module.training]
    if not in_eval or any(id(module) not in frozen for module in in_eval):
        return None
    return len(in_eval)


def expect_frozen_eval_modules(model: torch.nn.Module) -> None:
    """Silence Lightning's "Found N module(s) in eval mode at the start of training" when the N
    are exactly the model's intentionally frozen modules (:func:`frozen_eval_mode_count`): a
    module left in eval mode by mistake changes N, and the warning shows."""
    count = frozen_eval_mode_count(model)
    if count is not None:
        warnings.filterwarnings("ignore", message=rf"Found {count} module\(s\) in eval mode at the start of training",
                                category=PossibleUserWarning, module=r"lightning\.pytorch\.loops\.fit_loop")


def answer_repeated_samples_warning(model: torch.nn.Module) -> None:
    """Lightning warns that a DDP ``validate``/``test`` evaluates some samples twice (its
    ``DistributedSampler`` evens out the ranks). A model that leaves those repeats out
    (:class:`lightning_mods.evaluation._distributed_eval.ExactEvaluation`) reports the one-process
    numbers, so the warning does not apply to it; any other model still gets it."""
    from lightning_mods.evaluation._distributed_eval import ExactEvaluation

    if isinstance(model, ExactEvaluation):
        warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders\. During "
                                r"`trainer\.(validate|test)\(\)`", category=PossibleUserWarning)


def answer_resume_warnings(trainer: Any, subcommand: str, ckpt_path: Optional[str]) -> None:
    """Lightning's warnings that contradict what the package makes exact: a mid-epoch resume of a
    fit that carries ``ExactResume`` continues its data where it stopped (the warning says the
    dataloader is not resumable), and ``validate``/``test``/``predict`` of a checkpoint save no
    checkpoint, so the ModelCheckpoint folder they would use does not matter ("The dirpath has
    changed"). Any other run still gets both."""
    if not ckpt_path:
        return
    from callbacks.reliability.exact_resume import ExactResume

    if subcommand == "fit" and any(isinstance(cb, ExactResume) for cb in trainer.callbacks):
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch "
                                r"ended and your dataloader is not resumable")
    if subcommand in ("validate", "test", "predict"):
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
