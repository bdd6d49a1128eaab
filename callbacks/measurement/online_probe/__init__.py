"""Online linear probe: linear heads on detached features, trained during pre-training and
measured at validation (the MAE linear probe's head of the decay paper, trained online as
lightly's ``OnlineLinearClassifier``).

Read :mod:`.probe` first: the callback, lightly's probe with a cadence, six arguments. Every
``every_n_steps``-th training batch it embeds the batch's first ``max_samples`` images with an
extra ``forward_features`` pass and steps its heads on them; at validation it scores every
validation sample once. The pre-training is the same run with and without it.

The pieces it takes, settings objects each in its own module (in a config, a mapping of their
settings: ``replay: {samples: 512}``):

- :class:`.linear_heads.LinearHeads` (``heads``): classes, optimiser and rate; a list of rates
  (``heads: {lr: [0.001, 0.01]}``) trains one head per rate on the same features.
- :class:`.replay.Replay` (``replay``, by default 512 samples): the last probed samples'
  features, swept once per probe, so the heads take the every-batch probe's steps while the
  network embeds 1/32 of the images (16 of 128 every 4th batch). After the quickstart's 100
  epochs the shipped probe reads 61.7 % validation top-1 against the every-batch probe's 65.6 %
  (``python -m benchmarks --only probe-accuracy``).
- :class:`.depth_heads.DepthHeads` (``depth: {blocks: all}``): a head per block, rows over depth.

Under them, private: the heads of one width stacked and stepped in a few calls
(``_stacked_heads``), grouped with their replays and saved in a per-head layout (``_heads``),
their validation counts (``_validation_scores``), and the probed samples waiting for the
asynchronous check of their finiteness, gathered from every rank under DDP (``_probed_samples``).
Under DDP the heads' gradients and batch-norm statistics are averaged over ranks at each step, so
every rank holds the same heads and rank 0's checkpoint resumes every rank exactly.
"""
from .depth_heads import DepthHeads
from .linear_heads import DEFAULT_LR, LinearHeads
from .probe import OnlineLinearProbe
from .replay import Replay

__all__ = ["OnlineLinearProbe", "LinearHeads", "Replay", "DepthHeads", "DEFAULT_LR"]
