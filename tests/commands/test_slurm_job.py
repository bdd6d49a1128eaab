"""docs/multi-gpu.md's complete SLURM job (2 nodes x 8 GPUs, requeued on pre-emption) agrees with the
configs it runs: one task per GPU (its srun line, with the environment SLURM gives a task of that
job, resolves to 2 nodes x 8 devices under DDP), the paper's global batch of 1024 kept on 16 GPUs,
loader workers that fit the task's CPUs, the environment activated, a fixed root folder that a
requeued job resumes from, and the pre-emption signal and requeue asked for; and its srun line runs
as SLURM starts it on a simulated 2-node x 1-task allocation. The requeue itself is run by
tests/commands/test_slurm_requeue.py (one node, simulated srun)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import folders

from helpers.composed_configs import resolved_config
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


@pytest.mark.slow
def test_the_job_runs_under_simulated_slurm_on_two_nodes(tmp_path, warm_shortcutlab):
    """The script's srun line as SLURM starts it on a 2-node x 1-task allocation (the 2 x 8 job's
    shape, one task per node here; ``shortcutlab`` a warm fork of the CLI): each task gets SLURM's environment for its node and rank,
    Lightning forms one DDP group of 2 over gloo from it, and the run writes its checkpoint under
    the script's fixed folder. On stand-in ImageNet-100 (a generated two-class tree), one step of
    a narrow MAE on 32-pixel crops in fp32."""
    from test_callbacks_ddp import free_port
    from test_imagenet_commands import SMALL_PRETRAINING, one_step, write_stand_in

    (line,) = [line for line in job_script() if line.startswith("srun ")]
    allocation = {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1"}
    words = [re.sub(r"\$(\w+)", lambda m: allocation[m.group(1)], w) for w in shlex.split(line)[1:]]
    assert words[:2] == ["shortcutlab", "fit"]
    user = tmp_path / "checkout"
    user.mkdir()
    (user / "configs").symlink_to(ROOT / "configs")
    class_list = write_stand_in(tmp_path / "imagenet")
    budget = [f"--{setting}" for setting in [*one_step(tmp_path / "imagenet", one_process=False),
                                             f"data.init_args.class_list={class_list}", *SMALL_PRETRAINING]]
    port = str(free_port())
    tasks = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=folders.PYTHONPATH, OMP_NUM_THREADS="1", SLURM_JOB_ID="4343",
                   SLURM_JOB_NAME="mae_in100_vit_b16", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                   SLURM_LOCALID="0", SLURM_NODEID=str(rank), SLURM_NODELIST="localhost",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **allocation)
        tasks.append(subprocess.Popen([*warm_shortcutlab, *words[1:], *budget], cwd=user, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [task.communicate(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for rank, out in enumerate(outs):  # Lightning's line as each task joins the group SLURM described
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in out, out[-3000:]
    (run,) = (user / "runs" / "mae_in100_vit_b16" / "lightning_logs").iterdir()
    assert run.name == "version_4343"  # under SLURM, Lightning names the version after the job id
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["trainer"]["num_nodes"], str(config["trainer"]["devices"]), config["trainer"]["strategy"]) == (2, "1", "ddp")
    assert torch.load(run / "checkpoints" / "latest.ckpt", weights_only=True, map_location="cpu")["global_step"] == 1


def reproducing_block(marker: str) -> str:
    """The shell block of docs/reproducing.md holding ``marker``, continuation lines joined."""
    text = (ROOT / "docs" / "reproducing.md").read_text()
    at = text.index(marker)
    start = text.rindex("```bash", 0, at) + len("```bash")
    return text[start:text.index("```", at)].replace("\\\n", " ")


@pytest.mark.slow
def test_the_array_job_of_printed_sweep_lines_runs_under_a_stand_in_sbatch(tmp_path, data_root):
    """docs/reproducing.md's cluster sweep as written: ``sweep --print`` writes one line per run,
    ``sbatch --array=1-18 --wrap '...'`` (a stand-in ``sbatch`` on PATH that runs the first array
    task as SLURM would, with ``SLURM_ARRAY_TASK_ID=1``) activates the environment and runs line 1,
    and ``report`` counts that run and names the 17 not run. On the generated CIFAR-10 pickles, one
    step of each fit (the budget given to the sweep with ``--set``)."""
    lines = [line.strip() for line in reproducing_block("cifar10_resnet18_alpha.commands").strip().splitlines()]
    sweep_line, sbatch_line, report_line = lines
    user = tmp_path / "checkout"
    user.mkdir()
    (user / "configs").symlink_to(ROOT / "configs")
    (user / ".venv").symlink_to(Path(sys.prefix))  # the environment running the tests
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "sbatch"  # the first array task, as SLURM runs it: the --wrap command under bash
    stand_in.write_text("#!/usr/bin/env python3\nimport os, subprocess, sys\n"
                        "args = sys.argv[1:]\nwrap = args[args.index('--wrap') + 1]\n"
                        "assert any(a.startswith('--array=1-') for a in args), args\n"
                        "sys.exit(subprocess.run(['bash', '-c', wrap], env=dict(os.environ, SLURM_ARRAY_TASK_ID='1'))"
                        ".returncode)\n")
    stand_in.chmod(0o755)
    budget = " ".join(f"--set {s}" for s in (
        f"data.init_args.data_dir={data_root['root']}", "data.init_args.num_workers=0", "data.init_args.batch_size=4",
        "trainer.accelerator=cpu", "trainer.precision=32", "trainer.max_epochs=1", "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"))
    sweep_command, _, redirect = sweep_line.partition(">")
    script = "\n".join([f"{sweep_command} {budget} >{redirect}", sbatch_line, report_line])
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=folders.PYTHONPATH,
               OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=user, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len((user / "cifar10_resnet18_alpha.commands").read_text().splitlines()) == 18
    experiment = user / "runs" / "cifar10_resnet18_alpha"
    first = experiment / "alpha_min=1.0,seed=0"
    assert (first / "fit_end.json").is_file()  # line 1 ran to its end, logging to its run folder
    data = yaml.safe_load((experiment / "report" / "report.json").read_text())
    counted = [run["name"] for run in data["runs"] if run["counted"]]
    assert counted == ["alpha_min=1.0,seed=0"]
    problems = [line for group in data["groups"] for line in group["problems"]]
    assert len(problems) == 17 and all("missing" in line for line in problems)
