"""The model summary printed when a fit starts: Lightning's rich table without its FLOPs column.

Lightning 2.6 counts FLOPs by forwarding the module's ``example_input_array`` under torch's
``FlopCounterMode``; without one the column reads 0 on every row. Our modules set none, on
purpose: on the quickstart's MAE the counted forward added about 1.5 s to every start (2 CPU
cores; seconds more for a ViT-B, and for every fit the tests run), the MAE's blocks run one by
one (U-Net skips) so the ``encoder`` rows would still read 0, and the in/out-size columns that
come with an example input print the decoder's 13 skip tensors in one cell. So the column goes.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from callbacks.cost import ONCE

RIGHT_ALIGNED = ("Params", "Params per Device", "In sizes", "Out sizes")


class RichModelSummaryWithoutFlops(RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` (same arguments) without the
    per-layer FLOPs column and the "Total FLOPs" line."""
    cost = ONCE

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name in RIGHT_ALIGNED else "left",
                             style="dim" if name == " " else None, no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        totals = Table.grid(expand=True)
        totals.add_column()
        for label, value in (
                ("Trainable params", get_human_readable_count(int(trainable_parameters))),
                ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                ("Total params", get_human_readable_count(int(total_parameters))),
                ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                ("Modules in train mode", str(total_training_modes["train"])),
                ("Modules in eval mode", str(total_training_modes["eval"]))):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(totals)
