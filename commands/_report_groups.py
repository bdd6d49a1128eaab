"""The rows and columns of a sweep's report (``shortcutlab report``): a reported metric, the
summary of its values over seeds, and a group of runs. Shared by :mod:`commands.report` (the
table) and :mod:`commands._report_figures` (the pictures), which import it, not each other."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from commands._run_metrics import Run


@dataclass(frozen=True)
class ReportedMetric:
    """A column of the table: the logged ``name`` (in the run's, or an evaluation's
    ``metrics.csv``)."""

    name: str
    label: str
    percent: bool
    # None: logged by the run itself; a name: by that evaluation (<run>/<name>/metrics.csv; the
    # offline probe of --then is the evaluation "probe")
    fit: Optional[str] = None

    def shown(self, value: float) -> float:
        return 100.0 * value if self.percent else value



@dataclass
class Summary:
    """Mean and sample standard deviation (ddof=1; None for one value) of ``values``."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(np.asarray(self.values, dtype=np.float64)))

    @property
    def std(self) -> Optional[float]:
        return float(np.std(np.asarray(self.values, dtype=np.float64), ddof=1)) if self.n > 1 else None


@dataclass
class Group:
    """The runs sharing every grid value but the seed."""

    key: dict[str, str]
    runs: list[Run]
    missing: list[str]  # run names expected from the grid whose folder does not exist

    @property
    def counted(self) -> list[Run]:
        return [run for run in self.runs if run.counted]

    def summary(self, metric: ReportedMetric) -> Optional[Summary]:
        values = [run.final(metric.name, metric.fit) for run in self.counted]
        values = [v for v in values if v is not None]
        return Summary(values) if values else None

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.key.items()) or "all runs"
