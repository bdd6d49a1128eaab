"""Checkpoint files: written whole or not at all (`atomic_files`, `checkpoint_io`), and the
network a checkpoint was written by, rebuilt from the checkpoint alone (`rebuild`)."""
