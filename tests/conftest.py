"""Test-wide settings: in-process vLLM on CPU and quiet tokenizers (tests pass their own cache dirs), and
Ctrl-C as Python's default even when the suite was started with SIGINT ignored."""

import os
import signal

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config) -> None:
    # A suite started as a background job of a non-interactive shell inherits SIGINT as ignored, and Python
    # then installs no KeyboardInterrupt handler (nor do the runs the tests start, which inherit the ignore).
    # The Ctrl-C tests need the default: a handler set here is reset to the default in every exec'd child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
