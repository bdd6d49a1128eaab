"""Callbacks that show a run: the progress bar, the model summary, the end-of-run summary and the
prediction writer."""
