"""Process helpers the tests share."""

import os
import signal
import time


def killed_at(script: str, marker, seconds: float = 180) -> None:
    """Run `python -c script` and SIGKILL it once the file `marker` exists (or after `seconds`)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + seconds
    while time.time() < deadline and not marker.exists():
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


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


def carrying(marker: str) -> list[int]:
    """The processes whose environment holds `marker` (a variable a test set for a command:
    every process below it inherits it, whatever its session or group)."""
    needle = marker.encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                pass
    return out
