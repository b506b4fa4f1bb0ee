import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/dist_helpers importable in spawned ranks


@pytest.fixture
def default_sigterm():
    """SIGTERM as a fresh `ganscale` process has it: an earlier in-process launcher test leaves torch elastic's
    handler installed in pytest's process."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)
