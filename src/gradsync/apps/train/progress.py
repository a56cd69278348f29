"""What ``gradsync train`` shows: a live bar per epoch (rank 0 only) and the final table."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class EpochProgress:
    """A progress bar over one epoch's steps with the running loss and samples/s; inert when
    ``show`` is False (other ranks, ``--quiet``)."""

    def __init__(self, show: bool, epoch: int, epochs: int, steps: int, done: int = 0) -> None:
        self.show = show
        self._loss = 0.0
        self._n = 0
        self._progress: Progress | None = None
        if show:
            self._progress = Progress(
                TextColumn(f"epoch {epoch + 1}/{epochs}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} samples/s"),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._task = self._progress.add_task("train", total=steps, completed=done, loss="-", rate="-")

    def __enter__(self) -> EpochProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def advance(self, loss: float, samples_per_s: float) -> None:
        if self._progress is None:
            return
        self._loss += loss
        self._n += 1
        self._progress.update(
            self._task, advance=1, loss=f"{self._loss / self._n:.4f}", rate=f"{samples_per_s:.0f}"
        )

    def log(self, line: str) -> None:
        """A line above the bar (plain stderr without one)."""
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()


def print_summary(summary: dict[str, Any]) -> None:
    """The per-epoch table on standard output."""
    lm = summary["task"] == "lm"
    title = (
        f"gradsync train: {summary['model']} on {summary['data']}, {summary['world']} workers "
        f"({summary['nodes']} x {summary['per_node']}), scheme {summary['scheme']}"
    )
    table = Table(title=title)
    cols = [
        "epoch",
        "train loss",
        "val ppl" if lm else "val acc %",
        "samples/s",
        "step ms",
        "MB/step intra",
        "MB/step inter",
        "MB/step world",
        "compression",
        "exposed sync %",
    ]
    for c in cols:
        table.add_column(c, justify="right")
    for r in summary["history"]:
        metric = f"{r['val_perplexity']:.2f}" if lm else f"{100 * r['val_accuracy']:.2f}"
        table.add_row(
            str(r["epoch"]),
            f"{r['train_loss']:.4f}",
            metric,
            f"{r['samples_per_s']:.0f}",
            f"{r['step_ms']:.1f}",
            f"{r['bytes_per_step_intra'] / 1e6:.3f}",
            f"{r['bytes_per_step_inter'] / 1e6:.3f}",
            f"{r['bytes_per_step_world'] / 1e6:.3f}",
            f"x{r['compression_ratio']:.1f}",
            f"{100 * r['exposed_sync_share']:.1f}",
        )
    (Console() if sys.stdout.isatty() else Console(width=160)).print(table)
    if summary.get("plan_table"):
        print("synchronization plan:\n" + summary["plan_table"])
    if summary.get("plan_summary"):
        print(summary["plan_summary"])
