"""The most a hostile program takes from the machine in the code check's sandbox, with the
default limits (data/procs/sandbox.py), with the run's cgroup and without one, side by side.

Each attack runs once in each setting while this script samples the machine's memory in use
(MemTotal - MemAvailable, every 20 ms) and counts the run's processes; it prints the peak
above what was in use before, and how the run ended.

    python bench/sandbox_bench.py [--memory-mb 512] [--processes 16]
"""

from __future__ import annotations

import argparse
import threading
import time

from ratchet.data.procs import sandbox
from ratchet.data.procs.sandbox import Limits, RunGroup, run

ATTACKS = {
    "every process fills its address space": (
        "import os\n"
        "for _ in range(15):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            break\n"
        "    except OSError:\n"
        "        pass\n"
        "x = bytearray(400 << 20)\n"
        "for i in range(0, len(x), 4096):\n"
        "    x[i] = 1\n"
        "import time\ntime.sleep(3)\n"),
    "fill every place it can write": (
        "import os\n"
        "for d in ('/tmp', '/dev/shm', '/', '/dev', '/box'):\n"
        "    for i in range(64):\n"
        "        try:\n"
        "            with open(os.path.join(d, f'f{i}'), 'wb') as f:\n"
        "                f.write(b'x' * (16 << 20))\n"
        "        except OSError:\n"
        "            break\n"
        "import time\ntime.sleep(3)\n"),
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
}


def used_mb() -> float:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    kb = lambda k: int(info[k].split()[0])  # noqa: E731
    return (kb("MemTotal") - kb("MemAvailable")) / 1024


def measure(program: str, limits: Limits) -> tuple[float, str]:
    base, peak, stop = used_mb(), [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], used_mb() - base)
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    try:
        ran = run({"p.py": program}, ["python3", "{box}/p.py"], "", limits, "bwrap")
    finally:
        stop.set()
        t.join()
    how = "timed out" if ran.timed_out else f"exit {ran.status}"
    return peak[0], how


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--processes", type=int, default=16)
    args = ap.parse_args()
    limits = Limits(memory_mb=args.memory_mb, processes=args.processes, wall_s=8.0, cpu_s=5)
    group = RunGroup.make(limits)
    if group is None:
        print("no cgroup can be made here: only the per-process limits hold")
        settings = {"per-process limits": False}
    else:
        group.close()
        settings = {"with the run's cgroup": True, "per-process limits alone": False}
    made = RunGroup.make
    print(f"limits: memory_mb={limits.memory_mb} processes={limits.processes} file_mb={limits.file_mb}")
    print(f"{'attack':<40} {'setting':<26} {'peak MiB':>9}  ended")
    for name, program in ATTACKS.items():
        for setting, cgroup in settings.items():
            sandbox.RunGroup.make = made if cgroup else classmethod(lambda cls, limits: None)
            try:
                peak, how = measure(program, limits)
            finally:
                sandbox.RunGroup.make = made
            print(f"{name:<40} {setting:<26} {peak:>9.0f}  {how}")


if __name__ == "__main__":
    main()
