"""Pictures of a run: labelled grids and where they are written (``grids``); the patch-feature
picture and the embedding map of predictions are drawn by ``_patch_pca`` and ``_embedding_map``."""
__all__ = ["grids"]
