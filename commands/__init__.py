"""Commands of ``shortcutlab`` besides training (and the LightningCLI that trains): each module has a ``main(args)``."""
