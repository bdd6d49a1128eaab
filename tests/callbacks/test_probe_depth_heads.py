"""The online probe's heads over depth (callbacks/measurement/online_probe/depth_heads.py): which
blocks' outputs a hand-built case hands the heads, bad settings refused, and each block's head
equal to a probe of that block alone, with the blocks' feature norms against float64 numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from callbacks.measurement.online_probe import DepthHeads, LinearHeads, OnlineLinearProbe
from lightning_mods.evaluation.over_depth import DEPTH_FILE
from helpers.tiny_runs import TinyData, fit_blocks, rows_by_block


def outputs_of(num_blocks: int) -> list[torch.Tensor]:
    """Block ``b``'s output is the constant ``b`` (one sample, two columns), in float64."""
    return [torch.full((1, 2), float(b), dtype=torch.float64) for b in range(1, num_blocks + 1)]


@pytest.mark.parametrize("blocks, chosen", [("all", [1, 2, 3, 4]), ([1, -1], [1, 4]), ([-2], [3]), ([3, 1], [1, 3])])
def test_the_chosen_blocks_outputs(blocks, chosen):
    picked = DepthHeads(blocks).choose(outputs_of(4), [], torch.device("cpu"))
    assert list(picked) == chosen
    assert all(f.dtype == torch.float32 and float(f[0, 0]) == b for b, f in picked.items())


def test_built_heads_decide_the_blocks_and_missing_blocks_are_refused():
    depth = DepthHeads("all")
    assert list(depth.choose(outputs_of(4), [2, 4], torch.device("cpu"))) == [2, 4]  # a restored probe's heads
    with pytest.raises(ValueError, match=r"blocks \[5\] do not exist: the model has 4 blocks"):
        DepthHeads([5]).choose(outputs_of(4), [], torch.device("cpu"))


@pytest.mark.parametrize("blocks", [[], [0], [1, 1], "some", [True]])
def test_bad_blocks_are_a_one_line_error(blocks):
    with pytest.raises(ValueError, match="^OnlineLinearProbe: blocks must be null"):
        OnlineLinearProbe(depth=DepthHeads(blocks))


def test_per_block_online_heads_equal_probes_of_each_block_alone(tmp_path):
    data = TinyData(n_train=96, n_val=30, num_classes=4, spread=0.5)
    together = OnlineLinearProbe(heads=LinearHeads(lr=0.05), every_n_steps=1, max_samples=None, depth=DepthHeads("all"))
    _, module = fit_blocks(tmp_path / "all", [together], data=data, max_epochs=3)
    all_rows = rows_by_block(tmp_path / "all" / DEPTH_FILE, epoch=2)
    module.eval()
    with torch.no_grad():  # each block's mean feature norm over the validation images, in float64 numpy
        # in the validation's batches: a product's rounding may depend on the rows it is computed with
        parts = [module.forward_intermediates(x, intermediates_only=True)
                 for x in data.val_dataset.tensors[0].split(data.batch_size)]
        val_blocks = [torch.cat(blocks) for blocks in zip(*parts)]
    for block in (1, 2):
        norms = np.linalg.norm(val_blocks[block - 1].double().numpy(), axis=1)
        assert all_rows[block]["feature/norm"] == pytest.approx(float(norms.mean()), rel=1e-12), block
    for block in (1, 2):
        alone = OnlineLinearProbe(heads=LinearHeads(lr=0.05), every_n_steps=1, max_samples=None,
                                  depth=DepthHeads([block]))
        fit_blocks(tmp_path / f"b{block}", [alone], data=data, max_epochs=3)
        row = rows_by_block(tmp_path / f"b{block}" / DEPTH_FILE, epoch=2)[block]
        assert row["online_probe/val_top1"] == all_rows[block]["online_probe/val_top1"], block
        for a, b in zip(together.probe_heads.block_heads[block][0].state_dict().values(),
                        alone.probe_heads.block_heads[block][0].state_dict().values()):
            # equal up to float rounding: the stacked optimiser step runs each head's slice through
            # other vector lanes when the stack holds other heads
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"block {block}")