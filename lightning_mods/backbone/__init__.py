"""The shared shortcut backbone (the decay paper, section 3.1): the decayed identity shortcut schedule, residual
blocks, and the ViT, ResNet, U-ViT, residual-MLP and masked-autoencoder networks built from
them, plain ``nn.Module``s registered in timm's registry (``timm.create_model``).

Public (stable) names are listed in ``__all__``; the extension points are
:meth:`ShortcutSchedule.decayed_alpha` (a schedule of one's own), :class:`DecayedResidual`
(a residual block of one's own: set ``sublayer_types`` and ``alpha_names``, compute each
sub-layer with ``self.residual(j, shortcut, branch)``) and its ``branch_hook`` (read or change
a branch's output, e.g. for a measurement).
"""
from .masked_autoencoder import MaskedAutoencoderViT
from .residual import DecayedResidual, apply_shortcut_schedule, residual_blocks, shortcut_alphas
from .resnet import DecayedBasicBlock, DecayedBottleneck, DecayedResNet, ResNet18Cifar, ResNet50, ResNet50d
from .residual_mlp import ResidualMLP
from .shortcut import ShortcutSchedule, schedule_class_at, transformer_sublayer_types
from .uvit import UViT
from .vit import DecayedBlock, DecayedVisionTransformer
from . import timm_registry  # noqa: F401 (registers the decayed networks with timm.create_model)

__all__ = ["ShortcutSchedule", "schedule_class_at", "transformer_sublayer_types", "DecayedResidual",
           "apply_shortcut_schedule", "residual_blocks", "shortcut_alphas", "DecayedBlock",
           "DecayedVisionTransformer", "DecayedBasicBlock", "DecayedBottleneck", "DecayedResNet", "ResNet18Cifar",
           "ResNet50", "ResNet50d", "UViT", "ResidualMLP", "MaskedAutoencoderViT"]
