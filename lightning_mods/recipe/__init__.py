"""The training recipe the LightningModules share: AdamW with the papers' parameter groups and
schedules (`optim`), and the classification steps of the classifiers and probes
(`classification_steps`)."""
