"""What the package needs from its dependencies beyond their public API, in one place
(``lightning_private``), with the versions it is tested on."""
