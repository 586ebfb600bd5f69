"""The job's console: a log line written while the progress bar runs gets a line of its own."""

import io
import logging
import sys

import pytest
from tqdm import tqdm

from loka_job.train import _setup_logging
from loka_job.training.console import ProgressBarConsoleHandler


def _console_text(handler_cls) -> str:
    stream = io.StringIO()
    logger = logging.getLogger("loka_job.test_console")
    handler = handler_cls(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        bar = tqdm(total=10, file=stream, ascii=True, mininterval=0, desc="train")
        bar.update(3)
        logger.warning("dispatch: layer over.0 falls back to bf16")
        bar.update(1)
        bar.close()
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def _visible_line(text: str, needle: str) -> str:
    """What a terminal shows on the line holding ``needle``: the text after its last carriage return."""
    line = next(line for line in text.split("\n") if needle in line)
    return line.split("\r")[-1].strip()


def test_a_log_line_does_not_land_in_the_progress_bar_line():
    assert _visible_line(_console_text(ProgressBarConsoleHandler), "falls back") == "WARNING dispatch: layer over.0 falls back to bf16"
    plain = _visible_line(_console_text(logging.StreamHandler), "falls back")
    assert plain.startswith("train:") and plain.endswith("falls back to bf16")  # what the plain handler did


@pytest.fixture
def restored_loggers():
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level, logging.getLogger(name).propagate)
             for name in ("loka_torchrec", "loka_job")}  # fmt: skip
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_the_jobs_console_on_rank_0_writes_above_the_bar_and_keeps_its_level(tmp_path, restored_loggers):
    _setup_logging(str(tmp_path), 0)
    consoles = [h for h in logging.getLogger("loka_torchrec").handlers if isinstance(h, logging.StreamHandler) and h.stream is sys.stderr]
    assert len(consoles) == 1 and isinstance(consoles[0], ProgressBarConsoleHandler) and consoles[0].level == logging.WARNING
