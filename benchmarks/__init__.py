"""shortcutlab's benchmark suite: every figure a ratio measured side by side in one process.

    python -m benchmarks [--quick] [--device cuda] [--precision bf16-mixed] [--only GROUP ...] [--out FILE.md]

See ``python -m benchmarks --help`` and the README's Performance section.
"""
