"""Pictures of a run: labelled grids and where they are written (`grids`), the patch-feature
picture (`patch_pca`) and the embedding map of predictions (`embedding_map`)."""
__all__ = ["grids", "patch_pca", "embedding_map"]
