"""Process-wide logger set-up with a rank prefix, so driver and worker lines can be told apart."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s [%(name)s%(rank)s] %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = os.environ.get("RANK")
        record.rank = f" rank{rank}" if rank is not None else ""
        return True


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    root = logging.getLogger("rlsp")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("RLSP_LOG_LEVEL", "INFO"))
        root.propagate = False
    return logger
