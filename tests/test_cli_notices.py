"""The command drops torch's "No CUDA runtime is found" notice while it runs, and nothing else."""

from __future__ import annotations

import argparse
import logging

import pytest

from efficient import cli
from efficient.commands import validate

NOTICE = "No CUDA runtime is found, using CUDA_HOME='%s'"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_cuda_home_notice_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("torch.utils.cpp_extension")
    seen = _Collect()
    logger.addHandler(seen)

    def fake_run(args: argparse.Namespace) -> int:
        logger.warning(NOTICE, "/usr/local")
        logger.warning("Error checking compiler version for c++")
        return 0

    monkeypatch.setattr(validate, "run", fake_run)
    try:
        assert cli.main(["validate", "any.yaml"]) == 0
        assert seen.messages == ["Error checking compiler version for c++"]
        logger.warning(NOTICE, "/usr/local")  # outside the command the filter is gone
        assert seen.messages[-1] == "No CUDA runtime is found, using CUDA_HOME='/usr/local'"
    finally:
        logger.removeHandler(seen)
