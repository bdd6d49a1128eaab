"""Callbacks that measure what the shortcut does: kNN, the online linear probe, effective rank,
the patch-feature picture and FID/KID/IS, over one shared evaluation pass (`shared_features`)."""
