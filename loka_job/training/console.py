"""The job's console: log lines and the progress bar share it without writing into each other's line.

tqdm redraws its bar in place on the console (a carriage return, then the bar). A log record
written to the same stream by a plain ``logging.StreamHandler`` lands after the bar's text on the
bar's line, and the next redraw overwrites part of it. :class:`ProgressBarConsoleHandler` writes
each record through ``tqdm.write``, which clears the bars on that stream, writes the line, and
draws the bars again below it; without a bar it is a plain write. tqdm's own
``logging_redirect_tqdm`` swaps handlers for the length of a block and drops their level (the
job's console shows warnings only, its loggers pass info to the log file), so the job uses this
handler instead, from the start.
"""

from __future__ import annotations

import logging

__all__ = ["ProgressBarConsoleHandler"]


class ProgressBarConsoleHandler(logging.StreamHandler):
    """A ``StreamHandler`` whose records go above any tqdm progress bar on its stream."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # no progress bar without tqdm: nothing to keep apart
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # as logging.StreamHandler.emit: a failing record must not end the job
            self.handleError(record)
