"""What the tests share, as Lightning keeps it in ``tests_pytorch/helpers/``: where the tests are
(``folders``), tiny modules and data (``tiny_runs``, ``line_module``, ``diffusion_modules``,
``latent_fixtures``, ``tiny_feature_extractor``), independent references (``mae_references``,
``reference_stems``), the shipped configs as the tests compose them (``composed_configs``), the
pre-emption tests' callback (``signal_helpers``), a warm fork of the CLI (``fork_server``) and
readers of the loggers' own stores (``logger_stores``). Imported as ``helpers.<module>``: the
``tests/`` folder is on ``sys.path`` (``conftest.py``, and ``folders.PYTHONPATH`` for the
processes the tests start)."""
