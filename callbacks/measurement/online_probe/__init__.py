"""Online linear probe: a linear head on detached features, trained during pre-training and
measured at validation (the MAE linear probe's head of the decay paper, trained online as
lightly's ``OnlineLinearClassifier``).

Read :mod:`.probe` first: the callback, lightly's probe with a cadence. Every ``every_n_steps``-th
training batch it embeds the batch's first ``max_samples`` images with an extra
``forward_features`` pass and steps its head on them; at validation it scores every validation
sample once. The pre-training is the same run with and without it.

The pieces that make it accurate at a fraction of the cost, each in its own module:

- :mod:`.replay` (``replay_samples``, ``head_batch``, ``head_steps``): the last probed samples'
  features, swept once per probe, so the head takes the every-batch probe's steps while the
  network embeds 1/32 of the images (the defaults: 16 of 128 every 4th batch, a replay of 512).
  After the quickstart's 100 epochs the shipped probe reads 56.4 % validation top-1 against the
  every-batch probe's 57.5 % (``python -m benchmarks --only probe-accuracy``).
- :mod:`.rates` (``lr: [0.001, 0.01]``): one head per rate on the same features.
- :mod:`.depth_heads` (``blocks``): a head per block, rows over depth.

Under them, private: the heads of one width stacked and stepped in a few fused calls
(``_stacked_heads``), grouped with their replays and saved in a per-head layout (``_heads``),
their validation counts (``_validation_scores``), and one probe's samples waiting for the
asynchronous check of their finiteness, gathered from every rank under DDP (``_probed_samples``).
Under DDP the heads' gradients and batch-norm statistics are averaged over ranks at each step, so
every rank holds the same heads and rank 0's checkpoint resumes every rank exactly.
"""
from .probe import OnlineLinearProbe
from .rates import DEFAULT_LR

__all__ = ["OnlineLinearProbe", "DEFAULT_LR"]
