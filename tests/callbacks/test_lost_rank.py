"""A lost rank ends the job promptly and clearly, with real processes killed by
SIGKILL mid-training: two processes of one ``shortcutlab fit`` (Lightning's launcher, gloo) and
two torchrun "nodes" on this host. The survivor exits within the bound with one line naming the
lost rank and the checkpoint to resume from, exit status 5 (``callbacks/reliability/lost_rank.py``)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from callbacks.reliability.lost_rank import looks_like_a_lost_peer, process_gone
from lightning_mods import exit_statuses
from test_callbacks_ddp import REPO, free_port

BOUND_S = 60  # the survivor's exit after the kill, generous for a loaded CI machine (seen: ~2 s)
FIT = ["fit", "--config=configs/digits_mae.yaml", "--model.network.depth=2", "--model.network.decoder_depth=1",
       "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.max_epochs=200",
       "--trainer.enable_progress_bar=false"]
LINE = re.compile(r"shortcutlab: error: rank 1 \(pid (\d+) on \S+\) was lost \(exited or killed\) at step \d+; "
                  r"rank 0 stops too \(exit status 5: requeue the job\); resume from (\S+\.ckpt)")


def environment() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def first_checkpoint(root: Path) -> bool:
    return any(root.rglob("last.ckpt"))


@pytest.mark.slow
def test_a_killed_rank_ends_a_two_process_fit_in_one_line(tmp_path):
    root = tmp_path / "run"
    fit = subprocess.Popen([sys.executable, "-m", "cli", *FIT, "--trainer.devices=2",
                            f"--trainer.default_root_dir={root}"], cwd=REPO, env=environment(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: first_checkpoint(root) or fit.poll() is not None, 240, "the first checkpoint")
        assert fit.poll() is None, fit.communicate()
        (rank1,) = [pid for pid in children(fit.pid) if "cli" in Path(f"/proc/{pid}/cmdline").read_text()]
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = fit.communicate(timeout=BOUND_S)
        took = time.monotonic() - killed_at
    finally:
        if fit.poll() is None:
            os.killpg(fit.pid, signal.SIGKILL)
    assert fit.returncode == exit_statuses.LOST_RANK, err[-3000:]
    assert took < BOUND_S
    lines = [line for line in err.splitlines() if line.startswith("shortcutlab: error:")]
    assert len(lines) == 1, err[-3000:]
    match = LINE.fullmatch(lines[0])
    assert match and int(match.group(1)) == rank1, lines[0]
    assert Path(match.group(2)).is_file()
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_a_killed_node_ends_the_other_torchrun_node_in_one_line(tmp_path):
    port = free_port()
    agents = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                   str(REPO / "cli.py"), *FIT, "--trainer.devices=1", "--trainer.num_nodes=2",
                   f"--trainer.default_root_dir={tmp_path / 'run'}"]
        agents.append(subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        wait_for(lambda: first_checkpoint(tmp_path / "run") or any(a.poll() is not None for a in agents), 240,
                 "the first checkpoint")
        assert all(a.poll() is None for a in agents), [a.communicate()[0][-3000:] for a in agents]
        (worker,) = children(agents[1].pid)  # node 1's only worker: global rank 1
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        out0, _ = agents[0].communicate(timeout=BOUND_S)
        took = time.monotonic() - killed_at
        agents[1].communicate(timeout=BOUND_S)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert took < BOUND_S
    assert agents[0].returncode != 0 and agents[1].returncode != 0
    lines = [line for line in out0.splitlines() if "shortcutlab: error:" in line]
    assert len(lines) == 1, out0[-4000:]
    line = lines[0][lines[0].index("shortcutlab: error:"):]  # torchrun may prefix the worker's lines
    assert LINE.fullmatch(line) and int(LINE.fullmatch(line).group(1)) == worker, line


def test_what_counts_as_a_lost_peer():
    assert looks_like_a_lost_peer(RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:3467: "
                                               "Connection reset by peer. This is typically caused by ..."))
    assert not looks_like_a_lost_peer(RuntimeError("CUDA out of memory"))
    assert not looks_like_a_lost_peer(ValueError("alpha_min must be in [0, 1]"))
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_gone(child.pid)


def test_the_documented_timeout_setting_reaches_the_strategy(tmp_path):
    """docs/reliability.md: ``--trainer.strategy=DDPStrategy --trainer.strategy.timeout=0:05:00``."""
    from datetime import timedelta

    from lightning.pytorch import LightningDataModule, LightningModule

    from commands.lightning_cli import ShortcutLabCLI

    readme = (REPO / "docs" / "reliability.md").read_text()
    assert "`--trainer.strategy=DDPStrategy --trainer.strategy.timeout=0:05:00`" in readme
    cli = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         run=False, save_config_callback=None,
                         args=["--config=configs/digits_mae.yaml", "--trainer.strategy=DDPStrategy",
                               "--trainer.strategy.timeout=0:05:00", "--trainer.accelerator=cpu",
                               f"--trainer.default_root_dir={tmp_path}"])
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
    assert cli.config["trainer"]["strategy"]["init_args"]["timeout"] == timedelta(minutes=5)
