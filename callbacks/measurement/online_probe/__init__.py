"""Online linear probe: a linear classifier trained during pre-training on detached features
(callbacks; the MAE linear probe's head of the decay paper, section 4, trained online as in lightly's
``OnlineLinearClassifier``).

Every ``every_n_steps``-th training batch the callback embeds the first ``max_samples`` images of
the batch (augmented, full, unmasked) with an EXTRA forward pass ``pl_module.forward_features``,
in eval mode, under ``torch.no_grad`` and with forked RNG states, adds those features to a
replay of the last ``replay_samples`` probed samples (:mod:`.feature_replay`) and takes
``every_n_steps`` optimiser steps of its own head (BatchNorm without affine, as MAE's linear
probe, then Linear) on batches of ``replay_samples // every_n_steps`` replayed samples, newest
first: one head step per training batch, on as many samples as the every-batch probe's.
Nothing the pre-training sees changes: not the module's gradients, weights, batch-norm
statistics or train/eval modes, nor the global RNG streams that draw the MAE masks and the data
order, so the pre-training is the same run with and without the callback.

Cost and accuracy: the extra forward runs over ALL tokens while an MAE training step encodes a
quarter of them; the defaults (every 4th batch, its first 16 of 128 images) embed 1/32 of what
probing every full batch would, and the head steps are written by hand
(:mod:`callbacks.measurement.online_probe._stacked_heads`: all heads of one width in one step). After the quickstart's 100 epochs the
shipped probe reads 56.4 % validation top-1 against the every-batch probe's 57.5 % at the same
rate (``python -m benchmarks --only probe-accuracy``; other cadences in docs/performance.md).
``every_n_steps=1, max_samples=None, replay_samples=None`` is lightly's every-batch probe. The
training loss and accuracy, over the fresh samples before the head steps on them, are summed on
the device and logged once per epoch; the validation accuracy reads the validation features kNN
and effective rank read (:mod:`callbacks.measurement.shared_features`) when the datamodule has a
``val_dataset``, else it embeds the validation loop's batches itself.

No host read per probe: the heads step on a probe's samples at the next probe (or the epoch's
end, a validation, the end of training), once the check of their finiteness, copied to the host
asynchronously, has arrived; the same samples in the same order, and a checkpoint in between
keeps the waiting samples.

Under DDP the heads are outside the DDP-wrapped module: their gradients are averaged over ranks
before each step and their batch-norm statistics after it, and the replay holds every rank's
samples (one all_gather per probe), so every rank holds the same heads and rank 0's checkpoint
resumes every rank exactly. Validation accuracy counts every validation sample once (each rank
scores its strided shard of the shared features; the duplicates a DistributedSampler pads with
are masked out), summed over ranks by torchmetrics.

The package holds the callback (``probe``) and its private parts: the heads with their replay,
step and validation scores (``_heads``), the heads of one width stacked and stepped together
(``_stacked_heads``), the replay of probed features (``_feature_replay``) and the samples of a
probe waiting for their finiteness check (``_probed_samples``).
"""
from .probe import DEFAULT_LR, OnlineLinearProbe

__all__ = ["OnlineLinearProbe", "DEFAULT_LR"]
