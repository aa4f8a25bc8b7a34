"""What a run leaves to look at: metric loggers (metrics.jsonl, TensorBoard) and the HTML run report.

    efficient report RUN_DIR [--open]        # RUN_DIR/report.html
    efficient report RUN_A RUN_B             # two runs side by side
"""

from __future__ import annotations

from typing import Any

from efficient.report.loggers import LOGGERS, build_loggers

__all__ = ["LOGGERS", "build_loggers", "write_run_report", "write_comparison"]


def __getattr__(name: str) -> Any:  # the page pulls in matplotlib: import it when asked for
    if name in ("write_run_report", "write_comparison"):
        from efficient.report import html

        return getattr(html, name)
    raise AttributeError(name)
