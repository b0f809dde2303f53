"""Programs written to do harm, and what a test of a sandbox needs to see that they did none:
the code check and the Python tool run the same list."""

import os
import socket
import threading
from pathlib import Path

import pytest


def hostile_programs(port: int, canary: Path, ok: str) -> dict[str, str]:
    """name -> program. Each attack is followed by `ok` (a program that passes only if the
    attack did not raise); `port` is a loopback listener's, `canary` a directory outside."""
    home = Path.home()
    return {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "infinite loop": "while True:\n    pass",
        "10 GB": "x = bytearray(10 * 1024 ** 3)\nx[-1] = 1" + ok,
        "write $HOME": f"open({str(home / 'pwned-by-ratchet-test')!r}, 'w').write('x')" + ok,
        "write outside": f"open({str(canary / 'pwned')!r}, 'w').write('x')" + ok,
        "write /etc": "open('/etc/pwned-by-ratchet-test', 'w').write('x')" + ok,
        "read the secret": "import os\nassert os.environ['RATCHET_TEST_SECRET'] == 's3cr3t-value'" + ok,
        "read the parent's environment": "assert b's3cr3t' in open('/proc/%d/environ' % __import__('os').getppid(), "
                                         "'rb').read()" + ok,
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')" + ok,
        "signal the parent": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n"
                             "os.kill(os.getppid(), signal.SIGKILL)" + ok,
        "print a gigabyte": "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)" + ok,
        "fill /tmp": "f = open('/tmp/big', 'wb')\nfor _ in range(4096):\n    f.write(b'x' * (1 << 20))" + ok,
    }


_BEFORE: set[int] = set()  # processes below this one when the test began (an earlier test's helpers)


@pytest.fixture
def adopting():
    """This process adopts every orphan below it (PR_SET_CHILD_SUBREAPER), so whatever a sandbox
    leaves behind ends up as a child of the test, where `leftovers` finds it. What was already
    running below it (a helper an earlier test keeps) is not the test's."""
    import ctypes

    _BEFORE.clear()
    _BEFORE.update(int(x.split()[0]) for x in live_children())
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    yield
    prctl(36, 0)


def leftovers(wait_s: float = 5.0) -> list[str]:
    """Live processes left below this one since the test began (with `adopting`, orphans
    included). A dead one not yet collected (bwrap's init inside a sandbox exits just after
    bwrap does) is collected here; one caught while exiting is given `wait_s` to finish."""
    import time

    deadline = time.time() + wait_s
    while (out := [x for x in live_children() if int(x.split()[0]) not in _BEFORE]) and time.time() < deadline:
        time.sleep(0.1)
    return out


def live_children() -> list[str]:
    children, out = [], []
    for task in os.listdir("/proc/self/task"):
        try:
            children += map(int, open(f"/proc/self/task/{task}/children").read().split())
        except OSError:  # a thread that has ended since
            continue
    for pid in children:
        try:
            status = open(f"/proc/{pid}/status").read()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if status.split("State:")[1].split()[0] == "Z":
            os.waitpid(pid, 0)
        else:
            out.append(f"{pid} {cmd[:120]}")
    return out


@pytest.fixture
def listener():
    """A TCP server on loopback that counts the connections it gets."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.settimeout(0.2)
    got, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = s.accept()
                got.append(conn.recv(100))
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield s.getsockname()[1], got
    stop.set()
    t.join()
    s.close()
