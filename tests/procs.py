"""Process helpers the tests share."""

import os
import signal
import time


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` is gone within `seconds`; one still there is killed, so no test leaves
    it running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return False
