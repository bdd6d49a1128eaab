"""One versioned module upgrades the checkpoints of earlier releases: each step names the
releases that wrote the old layout and the release that drops it, and this test fails at that
release until the step is gone."""
from __future__ import annotations

import configparser
import math
from pathlib import Path

import torch

from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.checkpoint_io import AtomicCheckpointIO
from lightning_mods.checkpointing.rebuild import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RELEASE_0_1_0 = ROOT / "tests" / "data" / "written_by_0_1_0" / "last.ckpt"


def old_rank_state() -> dict:
    return {"callbacks": {"EffectiveRank{'per_block': True}": {"history": [
        {"epoch": 0, "step": 2, "metrics": {}, "profile": [3.0, 2.0, 1.5]}]}}}


def test_no_step_outlives_the_release_that_drops_it():
    version = configparser.ConfigParser()
    version.read(ROOT / "setup.cfg")
    assert migration.steps_due(version["metadata"]["version"]) == []
    assert migration.steps_due("0.3.0") == [step for step in migration.STEPS if step.dropped_in == "0.3.0"]
    assert migration.steps_due("0.4.0") == list(migration.STEPS)
    assert migration.steps_due("0.3.0.dev0") == []  # a development build comes before its release
    assert all(step.written_by and step.what for step in migration.STEPS)


def test_a_checkpoint_records_the_release_that_wrote_it_and_is_read_by_it_not_by_its_shape(tmp_path):
    """Every checkpoint a fit saves carries the installed release; the migration then applies no
    step, even to a file shaped like an earlier release's (the MAE's settings at the recipe's
    level, as 0.1.0 wrote them); the same file without the record is upgraded as before."""
    import copy
    import importlib.metadata

    from lightning_mods.checkpointing.checkpoint_io import AtomicCheckpointIO

    installed = importlib.metadata.version("shortcutlab")
    assert installed == configparser_version()
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "saved.ckpt")
    assert torch.load(tmp_path / "saved.ckpt", weights_only=True)["shortcutlab_version"] == installed
    old = torch.load(RELEASE_0_1_0, weights_only=True)
    assert "shortcutlab_version" not in old
    assert migration.upgrade(copy.deepcopy(old)) != []  # guessed from its shape: 0.1.0's layout
    stamped = {**copy.deepcopy(old), "shortcutlab_version": installed}
    assert migration.upgrade(stamped) == [] and stamped["hyper_parameters"] == old["hyper_parameters"]
    for written in ("0.2.0", "0.1.0", "not a version"):  # an old release, or a record that cannot be read
        assert migration.upgrade({**copy.deepcopy(old), "shortcutlab_version": written}) != [], written


def configparser_version() -> str:
    version = configparser.ConfigParser()
    version.read(ROOT / "setup.cfg")
    return version["metadata"]["version"]


def test_an_effective_rank_history_without_entropies_gets_one_nan_per_block():
    checkpoint = old_rank_state()
    assert migration.upgrade(checkpoint) == ["entropy_profile"]
    (entry,) = next(iter(checkpoint["callbacks"].values()))["history"]
    assert len(entry["entropy_profile"]) == 3 and all(math.isnan(h) for h in entry["entropy_profile"])
    assert entry["profile"] == [3.0, 2.0, 1.5]
    assert migration.upgrade(checkpoint) == []  # once upgraded, nothing more to do


def test_a_fits_checkpoint_io_upgrades_the_file_it_resumes_from(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, **old_rank_state()}, path)
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    (entry,) = next(iter(loaded["callbacks"].values()))["history"]
    assert len(entry["entropy_profile"]) == 3


def test_a_release_0_1_0_checkpoint_needs_no_upgrade_and_a_train_position_without_its_order_resumes_unchecked():
    assert migration.upgrade(load_checkpoint(RELEASE_0_1_0)) == []  # read by load_checkpoint: upgraded already
    assert migration.datamodule_state({"train_position": {"epoch": 1, "batches": 0}})["data_order"] is None
    kept = {"seed": 0, "batch_size": 8, "world_size": 1, "num_samples": 16}
    assert migration.datamodule_state({"train_position": None, "data_order": kept})["data_order"] == kept


def release_0_2_layout(checkpoint: dict, old_names: dict[str, str], old_prefix: str) -> dict:
    """A checkpoint as 0.2 wrote it, by hand: the settings under their 0.2 names, the network's
    weights under the 0.2 prefix."""
    return {**checkpoint,
            "hyper_parameters": {old_names.get(k, k): v for k, v in checkpoint["hyper_parameters"].items()},
            "state_dict": {(old_prefix + k.removeprefix("network.") if k.startswith("network.") else k): v
                           for k, v in checkpoint["state_dict"].items()}}


def test_a_release_0_2_classifier_and_fine_tuning_load_as_the_networks_they_wrote(tmp_path):
    """The classifier's ``backbone`` and the fine-tuning's ``encoder``/``model`` of release 0.2
    are read as ``network``: the rebuilt network has every weight of the one that wrote the file."""
    from lightning_mods.checkpointing.rebuild import module_from_checkpoint
    from lightning_mods.finetune import FineTuneClassifier
    from test_checkpoint_identity import FAMILIES, MAE, features, write_checkpoint

    classifier = write_checkpoint(tmp_path / "now.ckpt", FAMILIES["classifier"], 0.6)
    mae = write_checkpoint(tmp_path / "mae.ckpt", MAE, 0.6)
    torch.manual_seed(0)
    fine_tuning = FineTuneClassifier(checkpoint=str(tmp_path / "mae.ckpt"), num_classes=10, mixup=0, cutmix=0)
    fine_tuning.hparams["_class_path"] = "lightning_mods.finetune.FineTuneClassifier"  # as the CLI records it
    torch.save({"state_dict": fine_tuning.state_dict(), "hyper_parameters": dict(fine_tuning.hparams),
                "pytorch-lightning_version": "2.6.0"}, tmp_path / "ft_now.ckpt")
    cases = [(classifier, "now.ckpt", {"network": "backbone"}, "backbone.", "classifier_network_name"),
             (fine_tuning, "ft_now.ckpt", {"network": "encoder", "allow_override": "allow_encoder_override"},
              "model.", "finetune_network_name")]
    for writer, name, old_names, old_prefix, step in cases:
        old = release_0_2_layout(torch.load(tmp_path / name, weights_only=True), old_names, old_prefix)
        assert not any(k.startswith("network.") for k in old["state_dict"]) and "network" not in old["hyper_parameters"]
        assert migration.upgrade(dict(old, hyper_parameters=dict(old["hyper_parameters"]))) == [step]
        torch.save(old, tmp_path / f"old_{name}")
        rebuilt, _ = module_from_checkpoint(tmp_path / f"old_{name}")
        written = writer.state_dict()
        assert set(rebuilt.state_dict()) == set(written)
        for key, value in rebuilt.state_dict().items():
            assert torch.equal(value, written[key]), (name, key)
        assert torch.equal(features(rebuilt.eval(), "classifier" if "ft" not in name else "mae"),
                           features(writer.eval(), "classifier" if "ft" not in name else "mae"))


def test_a_saved_config_of_release_0_2_reads_as_this_release_s():
    old = {"class_path": "lightning_mods.classifier.ImageClassifier",
           "init_args": {"backbone": {"class_path": "lightning_mods.backbone.resnet.ResNet18Cifar"}, "num_classes": 10}}
    assert migration.upgrade_model_config(old) == {
        "class_path": "lightning_mods.classifier.ImageClassifier",
        "init_args": {"network": {"class_path": "lightning_mods.backbone.resnet.ResNet18Cifar"}, "num_classes": 10}}
    tuned = {"class_path": "lightning_mods.finetune.FineTuneClassifier",
             "init_args": {"checkpoint": "mae.ckpt", "allow_encoder_override": True}}
    assert migration.upgrade_model_config(tuned)["init_args"] == {"checkpoint": "mae.ckpt", "allow_override": True}
    for recipe, old in (("lightning_mods.linear_probe.LinearProbe", "allow_backbone_override"),
                        ("lightning_mods.finetune.FineTuneClassifier", "allow_network_override")):
        saved = {"class_path": recipe, "init_args": {"checkpoint": "mae.ckpt", old: True}}
        assert migration.upgrade_model_config(saved)["init_args"] == {"checkpoint": "mae.ckpt", "allow_override": True}


def test_an_online_probe_of_release_0_2_reads_in_its_parts():
    probe = "callbacks.measurement.online_probe.OnlineLinearProbe"
    saved = {"trainer": {"callbacks": [
        {"class_path": probe, "init_args": {"num_classes": 10, "feature_dim": 64, "optimizer": "sgd", "lr": [0.1, 0.2],
                                            "momentum": 0.8, "batch_norm": False, "seed": 3, "every_n_steps": 2,
                                            "max_samples": 8, "replay_samples": 64, "head_batch": 16, "head_steps": 3,
                                            "name": "mine", "blocks": [1, -1]}},
        {"class_path": probe, "init_args": {"replay_samples": None, "blocks": None, "head_batch": None}},
        {"class_path": "callbacks.measurement.knn.KNNEvaluator", "init_args": {"blocks": "all"}}]}}
    upgraded = migration.upgrade_config(saved)
    assert upgraded["trainer"]["callbacks"] == [
        {"class_path": probe, "init_args": {
            "every_n_steps": 2, "max_samples": 8, "name": "mine",
            "heads": {"num_classes": 10, "lr": [0.1, 0.2], "optimizer": "sgd", "momentum": 0.8, "batch_norm": False,
                      "seed": 3},
            "replay": {"samples": 64, "head_batch": 16, "head_steps": 3}, "depth": {"blocks": [1, -1]}}},
        {"class_path": probe, "init_args": {"replay": None}},
        {"class_path": "callbacks.measurement.knn.KNNEvaluator", "init_args": {"blocks": "all"}}]
    assert saved["trainer"]["callbacks"][1]["init_args"]["replay_samples"] is None  # the given config is kept


def test_a_checkpoint_with_an_earlier_override_switch_loads_with_allow_override():
    """LinearProbe's allow_backbone_override and FineTuneClassifier's allow_network_override (a
    development build of 0.3) are allow_override in the checkpoint's settings."""
    for old in ("allow_backbone_override", "allow_network_override"):
        checkpoint = {"hyper_parameters": {"checkpoint": "mae.ckpt", old: True, "num_classes": 10}}
        assert migration.upgrade(checkpoint) == ["override_flag_name"]
        assert checkpoint["hyper_parameters"] == {"checkpoint": "mae.ckpt", "allow_override": True, "num_classes": 10}


def test_a_release_0_2_mae_and_spiral_load_as_the_networks_they_wrote(tmp_path):
    """The MAE network's ``image_size`` (now timm's ``img_size``) and the spiral classifier's own
    ``depth``/``width``/``shortcut`` and ``net.*`` weights (now its ``network``) of release 0.2."""
    from lightning_mods.checkpointing.rebuild import module_from_checkpoint
    from test_checkpoint_identity import FAMILIES, features, write_checkpoint

    mae = write_checkpoint(tmp_path / "mae.ckpt", FAMILIES["mae"], 0.6)
    old = torch.load(tmp_path / "mae.ckpt", weights_only=True)
    network = old["hyper_parameters"]["network"]
    network["init_args"] = {("image_size" if k == "img_size" else k): v for k, v in network["init_args"].items()}
    spiral = write_checkpoint(tmp_path / "spiral.ckpt", FAMILIES["spiral"], 0.6)
    old_spiral = torch.load(tmp_path / "spiral.ckpt", weights_only=True)
    hparams = dict(old_spiral["hyper_parameters"])
    built = hparams.pop("network")["init_args"]
    hparams.update(depth=built["depth"], width=built["width"], shortcut=built["shortcut"])  # as 0.2 recorded them
    old_spiral = {**old_spiral, "hyper_parameters": hparams,
                  "state_dict": {("net." + k.removeprefix("network.")): v for k, v in old_spiral["state_dict"].items()}}
    for writer, checkpoint, name, step in ((mae, old, "mae", "mae_img_size"),
                                           (spiral, old_spiral, "spiral", "spiral_network_member")):
        assert migration.upgrade(torch.load(tmp_path / f"{name}.ckpt", weights_only=True)) == []  # this release's
        torch.save(checkpoint, tmp_path / f"old_{name}.ckpt")
        assert migration.upgrade(torch.load(tmp_path / f"old_{name}.ckpt", weights_only=True)) == [step]
        rebuilt, settings = module_from_checkpoint(tmp_path / f"old_{name}.ckpt")
        for key, value in writer.state_dict().items():
            assert torch.equal(rebuilt.state_dict()[key], value), (name, key)
        assert torch.equal(features(rebuilt.eval(), name), features(writer, name))
    assert settings["init_args"]["network"]["init_args"]["depth"] == 4


def test_saved_configs_of_release_0_2_spell_img_size_and_hold_the_spiral_s_network():
    mae = {"class_path": "lightning_mods.mae.MaskedAutoencoder", "init_args": {"network": {
        "class_path": "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT",
        "init_args": {"image_size": 16, "patch_size": 4}}}}
    assert migration.upgrade_model_config(mae)["init_args"]["network"]["init_args"] == {"img_size": 16, "patch_size": 4}
    assert mae["init_args"]["network"]["init_args"] == {"image_size": 16, "patch_size": 4}  # the given one unchanged
    spiral = {"class_path": "lightning_mods.spiral_classifier.SpiralClassifier",
              "init_args": {"depth": 6, "width": 6, "lr": 0.1}}
    assert migration.upgrade_model_config(spiral)["init_args"] == {
        "network": {"class_path": "lightning_mods.backbone.residual_mlp.ResidualMLP",
                    "init_args": {"depth": 6, "width": 6, "in_features": 2, "num_classes": 2}}, "lr": 0.1}
