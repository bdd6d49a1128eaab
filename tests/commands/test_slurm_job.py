"""docs/multi-gpu.md's complete SLURM job (2 nodes x 8 GPUs, requeued on pre-emption) agrees with the
configs it runs: one task per GPU (its srun line, with the environment SLURM gives a task of that
job, resolves to 2 nodes x 8 devices under DDP), the paper's global batch of 1024 kept on 16 GPUs,
loader workers that fit the task's CPUs, the environment activated, a fixed root folder that a
requeued job resumes from, and the pre-emption signal and requeue asked for. The requeue itself is
run by tests/commands/test_slurm_requeue.py (one node, simulated srun)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from composed_configs import resolved_config
from datamodules import imagenet

ROOT = Path(__file__).resolve().parents[2]
JOB_ENV = {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8"}


def job_script() -> list[str]:
    text = (ROOT / "docs" / "multi-gpu.md").read_text()
    section = text[text.index("### A complete SLURM job"):]
    start = section.index("```bash") + len("```bash")
    return [line.strip() for line in section[start:section.index("```", start)].strip().splitlines()]


def sbatch(lines: list[str]) -> dict[str, str]:
    options = {}
    for line in lines:
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key.lstrip("-")] = value
    return options


def test_the_job_asks_for_one_task_per_gpu_the_cpus_its_workers_need_and_a_requeue(monkeypatch):
    lines = job_script()
    options = sbatch(lines)
    assert options["ntasks-per-node"] == options["gpus-per-node"] == JOB_ENV["SLURM_NTASKS_PER_NODE"]
    assert options["nodes"] == JOB_ENV["SLURM_NNODES"]
    assert "requeue" in options and options["open-mode"] == "append"
    assert re.fullmatch(r"SIGUSR1@\d+", options["signal"])
    assert "source .venv/bin/activate" in lines  # srun's tasks find shortcutlab
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", options["cpus-per-task"])
    assert imagenet.host_workers(8) == int(options["cpus-per-task"]) - 1 >= 8  # a worker fewer than its CPUs


def test_its_srun_line_is_16_ddp_tasks_with_the_paper_s_global_batch(monkeypatch):
    (line,) = [line for line in job_script() if line.startswith("srun ")]
    words = shlex.split(line)[1:]
    assert words[:2] == ["shortcutlab", "fit"]
    args = [re.sub(r"\$(\w+)", lambda m: JOB_ENV[m.group(1)], w) for w in words[2:]]
    root = [w for w in args if w.startswith("--trainer.default_root_dir=")]
    assert root and "$" not in root[0]  # a fixed folder: the requeued job resumes from it
    monkeypatch.chdir(ROOT)
    config = resolved_config(args)
    trainer, data = config["trainer"], config["data"]["init_args"]
    assert (int(trainer["num_nodes"]), int(trainer["devices"]), trainer["strategy"]) == (2, 8, "ddp")
    global_batch = data["batch_size"] * int(trainer["devices"]) * int(trainer["num_nodes"]) * (
        trainer.get("accumulate_grad_batches") or 1)
    recipe = (ROOT / "configs" / "mae" / "imagenet.yaml").read_text()
    assert "global batch 1024" in recipe and global_batch == 1024
    assert data.get("num_workers") is None  # the workers come from the task's CPUs
