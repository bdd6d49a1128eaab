"""The reproducible CPU mode gives the same weights, bit for bit, however the machine would
otherwise compute them: the quickstart network trained a few steps in fresh interpreters with the
ISA ceiling lowered (ATen's kernel level, MKL's instructions) and at 1, 2 and 4 threads. Without
the mode the same ways give other weights, so the test can fail. Also: how the shortcutlab
command decides on the mode from its command line and configs, before torch loads."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from commands import reproducible_cpu
from helpers import folders

TRAIN = textwrap.dedent("""
    import hashlib, os, sys
    from commands import reproducible_cpu
    if os.environ.get("MODE") == "on":
        reproducible_cpu.enable()  # before torch, as the shortcutlab command does
    import torch
    if os.environ.get("MODE") == "on":
        reproducible_cpu.finish()
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
    from lightning_mods.backbone.shortcut import ShortcutSchedule

    torch.manual_seed(0)
    # the quickstart's network (configs/digits_mae.yaml) on its 16 x 16 digits
    network = MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=96, depth=12, num_heads=3,
                                   decoder_embed_dim=64, decoder_depth=4, decoder_num_heads=4,
                                   shortcut=ShortcutSchedule(kind="linear", alpha_min=0.6), mask_ratio=0.75,
                                   norm_pix_loss=True)
    digits = torch.tensor(load_digits().images[:384], dtype=torch.float32).unsqueeze(1) / 16
    images = F.interpolate(digits, size=(16, 16), mode="bilinear", align_corners=False)
    optimizer = torch.optim.AdamW(network.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.05)
    for batch in images.split(128):
        loss, _, _ = network(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    module = network
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    print(digest.hexdigest(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
""")

# the ways a machine differs: its kernel level (lowered here), MKL's instructions and the thread count
WAYS = {"avx512 or best, 1 thread": {"OMP_NUM_THREADS": "1"},
        "avx2, MKL AVX2, 4 threads": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                      "OMP_NUM_THREADS": "4"},
        "baseline kernels, MKL SSE4.2, 2 threads": {"ATEN_CPU_CAPABILITY": "default",
                                                    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "2"}}
MODE_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  reproducible_cpu.SWITCH, reproducible_cpu.THREADS_VARIABLE)


def trained(mode: str, way: dict[str, str]) -> str:
    """The weights' digest after a few steps, and the kernel level and threads they ran with."""
    env = {k: v for k, v in os.environ.items() if k not in MODE_VARIABLES}
    env.update(way, MODE=mode, PYTHONPATH=os.pathsep.join([str(folders.REPO), folders.WITHOUT_WANDB]))
    done = subprocess.run([sys.executable, "-c", TRAIN], cwd=folders.REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.slow
def test_the_mode_gives_the_same_weights_whatever_the_kernels_and_threads():
    found = {name: trained("on", way) for name, way in WAYS.items()}
    digests = {digest for digest, _, _ in found.values()}
    assert len(digests) == 1, found
    assert all(level == "DEFAULT" and threads == str(reproducible_cpu.THREADS) for _, level, threads in found.values())


@pytest.mark.slow
def test_without_the_mode_the_same_ways_give_other_weights():
    found = {name: trained("off", way) for name, way in WAYS.items()}
    assert len({digest for digest, _, _ in found.values()}) > 1, found


@pytest.mark.parametrize("argv, config, expected", [
    (["fit"], None, False),
    (["fit", "--config", "{config}"], "reproducible: true\n", True),
    (["fit", "--config={config}"], "reproducible: true\n", True),
    (["fit", "--config", "{config}", "--reproducible=false"], "reproducible: true\n", False),
    (["fit", "--reproducible=false", "--config", "{config}"], "reproducible: true\n", True),  # later wins
    (["fit", "--config", "{config}"], "trainer: {max_epochs: 1}\n", False),
    (["fit", "--reproducible"], None, True),
    (["fit", "--reproducible", "true"], None, True),
])
def test_the_command_line_decides_as_lightningcli_reads_it(tmp_path, monkeypatch, argv, config, expected):
    monkeypatch.delenv(reproducible_cpu.SWITCH, raising=False)
    path = tmp_path / "run.yaml"
    if config is not None:
        path.write_text(config)
    assert reproducible_cpu.requested([word.format(config=path) for word in argv]) is expected


def test_the_environment_switch_decides_for_every_run(monkeypatch):
    monkeypatch.setenv(reproducible_cpu.SWITCH, "0")
    assert reproducible_cpu.requested(["fit", "--reproducible=true"]) is False
    monkeypatch.setenv(reproducible_cpu.SWITCH, "1")
    assert reproducible_cpu.requested(["fit"]) is True
    monkeypatch.setenv(reproducible_cpu.SWITCH, "maybe")
    with pytest.raises(ValueError, match="reproducible must be true or false"):
        reproducible_cpu.requested(["fit"])


def test_a_process_that_loaded_torch_without_the_mode_is_refused_in_one_line():
    """The CLI's check: torch loaded without the mode's environment (here a fresh interpreter that
    imported torch first) cannot be made reproducible any more, and says so."""
    script = ("import torch, sys\nfrom commands import reproducible_cpu\n"
              "try:\n    reproducible_cpu.check(True)\nexcept ValueError as err:\n    print(err); sys.exit(2)\n")
    env = {k: v for k, v in os.environ.items() if k not in MODE_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(folders.REPO), folders.WITHOUT_WANDB])
    done = subprocess.run([sys.executable, "-c", script], cwd=folders.REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout.count("\n") == 1
    assert "reproducible: true needs the reproducible CPU mode set before torch loads" in done.stdout


def test_the_python_block_of_docs_reproducing_md_puts_a_process_in_the_mode():
    """docs/reproducing.md, "The same numbers on any machine": its Python block, as written."""
    page = (folders.REPO / "docs" / "reproducing.md").read_text()
    block = page.split("<!-- tested: tests/test_reproducible_cpu.py -->\n```python\n", 1)[1].split("```", 1)[0]
    env = {k: v for k, v in os.environ.items() if k not in MODE_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(folders.REPO), folders.WITHOUT_WANDB])
    done = subprocess.run([sys.executable, "-c", block], cwd=folders.REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
