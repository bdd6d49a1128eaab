"""Private functions of timm, torch and numpy the package uses, each through one function here
(recorded in :data:`lightning_mods._compat.private_uses.PRIVATE_USES` with the releases tested)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from lightning_mods._compat.private_uses import reaches

TESTED_TIMM = ("1.0.31",)
TESTED_TORCH = ("2.14.1",)
TESTED_NUMPY = ("2.4.6",)


@reaches("timm", "timm.models._features.feature_take_indices", TESTED_TIMM)
def feature_take_indices(num_blocks: int, indices: Optional[Union[int, Sequence[int]]]) -> tuple[list[int], int]:
    """timm's reading of ``forward_intermediates``' ``indices`` (an int: the last n; a list: those,
    negatives from the end): ``(the indices taken, the largest)``, as every timm network reads it."""
    from timm.models._features import feature_take_indices as take

    return take(num_blocks, indices)


@reaches("timm", "timm.models._hub.generate_readme", TESTED_TIMM)
def generate_readme(card: dict, name: str, task_name: str) -> str:
    """timm's model card text (front matter, details, usage, citation) for ``card``."""
    from timm.models._hub import generate_readme as readme

    return readme(card, name, task_name=task_name)


@reaches("torch", "torch.utils._foreach_utils._get_fused_kernels_supported_devices", TESTED_TORCH)
def fused_kernel_devices() -> set[str]:
    """The device types torch has fused optimiser kernels for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return set(_get_fused_kernels_supported_devices())


@reaches("torch", "torch._inductor.list_mode_options", TESTED_TORCH)
def inductor_mode_options(mode: Optional[str]) -> dict[str, Any]:
    """Inductor's options of a ``torch.compile`` mode (every mode's for None); raises for an unknown one."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode)


@reaches("numpy", "numpy._core.multiarray._reconstruct (numpy.core.multiarray before numpy 2)", TESTED_NUMPY)
def reconstruct_array(subtype: type, shape: Any, dtype: Any) -> Any:
    """numpy's ``_reconstruct``, which a pickled ndarray calls to be built again."""
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core.multiarray import _reconstruct
    return _reconstruct(subtype, shape, dtype)


TESTED_LITDATA = ("0.2.76",)


@reaches("litdata", "litdata.streaming.fs_provider._get_fs_provider", TESTED_LITDATA)
def object_store(url: str, storage_options: Optional[dict] = None) -> Any:
    """litdata's client of the object store ``url`` names (``s3://``, ``gs://``, ``r2://``), built from
    ``storage_options`` as litdata's own reads and writes build it (``upload_file``, ``download_file``,
    ``exists``, ``delete_file_or_directory``)."""
    from litdata.streaming.fs_provider import _get_fs_provider

    return _get_fs_provider(url, storage_options or {})


@reaches("litdata", "litdata.StreamingDataset._on_demand_bytes", TESTED_LITDATA)
def read_whole_chunks(stream: Any) -> Any:
    """``stream`` (a ``StreamingDataset`` not read yet) fetching a sample's whole chunk into its
    cache when it reads the sample by index, as it does when iterated, rather than the sample's
    bytes alone (its public ``on_demand_bytes`` can be set only once its cache exists, which the
    first read makes; a slice, which also fetches whole chunks, counts the rank's share only)."""
    stream._on_demand_bytes = False
    return stream
