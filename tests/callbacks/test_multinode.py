"""Two nodes x one process through torchrun on one host (gloo, CPU): the same run as two
processes on one node.

Each "node" is its own ``torchrun --nnodes 2 --node_rank R --master_addr 127.0.0.1`` launcher,
as on a cluster (docs/multi-gpu.md); the reference is ``torchrun --nnodes 1
--nproc_per_node 2``. Both train the tiny MAE of tests/callbacks/test_callbacks_ddp.py with the online
probe and must end with the same weights, probe head and logged values.
"""
from __future__ import annotations

from helpers import folders

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_callbacks_ddp import REPO, TESTS, free_port

SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    import torch
    sys.path[:0] = {tests!r}
    warnings.filterwarnings("ignore")
    from lightning.pytorch import Trainer, seed_everything
    from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
    from test_callbacks_ddp import ImageData, make_model

    out = Path(sys.argv[1])
    seed_everything(0)
    model, probe = make_model(), OnlineLinearProbe(heads=LinearHeads(lr=1e-2), every_n_steps=1)
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = Trainer(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                      strategy="ddp", max_epochs=1, limit_train_batches=2, callbacks=[probe], default_root_dir=out,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=ImageData())
    seen = {{"world_size": trainer.world_size, "node_rank": trainer.node_rank,
             "probe_val_top1": float(trainer.callback_metrics["online_probe/val_top1"]),
             "val_loss": float(trainer.callback_metrics["val/loss"])}}
    (out / f"rank{{trainer.global_rank}}.json").write_text(json.dumps(seen))
    if trainer.is_global_zero:
        torch.save({{"model": model.state_dict(), "probe": probe.state_dict()["heads"][0]["head"]}}, out / "final.pt")
    # end the process group before exit: left to interpreter shutdown, gloo's threads sometimes
    # end a rank with "terminate called without an active exception" (exit -6)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
""")


def launch(warm: list[str], script: Path, out: Path, nnodes: int, nproc: int, node_rank: int,
           port: int) -> subprocess.Popen:
    """One node's torchrun; its workers are warm forks (tests/helpers/fork_server.py)."""
    from helpers.fork_server import torchrun_workers

    out.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
           "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(script), str(out)]
    return subprocess.Popen(torchrun_workers(cmd, warm), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_two_nodes_equal_one_node_with_two_processes(tmp_path, warm_shortcutlab):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    multi_port, single_port = free_port(), free_port()
    # the two-node run first, the reference after it: three launchers at once sometimes raced for ports
    procs = {"node 0": launch(warm_shortcutlab, script, tmp_path / "multi", 2, 1, 0, multi_port),
             "node 1": launch(warm_shortcutlab, script, tmp_path / "multi", 2, 1, 1, multi_port)}
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name], _ = proc.communicate(timeout=240)
        procs["single node"] = launch(warm_shortcutlab, script, tmp_path / "single", 1, 2, 0, single_port)
        outputs["single node"], _ = procs["single node"].communicate(timeout=240)
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a torchrun launch timed out (did both nodes join the rendezvous?)")
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-5000:]}"

    multi = [json.loads((tmp_path / "multi" / f"rank{r}.json").read_text()) for r in range(2)]
    single = [json.loads((tmp_path / "single" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [m["node_rank"] for m in multi] == [0, 1] and [s["node_rank"] for s in single] == [0, 0]
    assert all(m["world_size"] == 2 for m in multi + single)
    for m, s in zip(multi, single):
        assert {k: m[k] for k in ("probe_val_top1", "val_loss")} == {k: s[k] for k in ("probe_val_top1", "val_loss")}
    a = torch.load(tmp_path / "multi" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "single" / "final.pt", weights_only=True)
    for part in ("model", "probe"):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), f"{part}.{key}"
