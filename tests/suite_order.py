"""When the test suite's two workers end, under xdist's order of the groups and under ours.

    RATCHET_TEST_TIMELINE=/tmp/timeline.jsonl make test     # each test phase's worker, start and stop
    python tests/suite_order.py /tmp/timeline.jsonl

Replays pytest-xdist's LoadScope rule with the run's own per-test times: the groups of
tests/conftest.py (`group_of`) are queued in an order, each worker starts with one, and a worker is
given the next group as soon as 2 or fewer of its tests are left. Two orders, side by side: xdist's
own (the groups in collection order, sorted by test count) and the one tests/conftest.py hands out
(`pytest_collection_modifyitems`: the most integration tests first). It prints each worker's end
and the idle time of the one that ends first. A replay, not a run: it leaves out what one test's
time does to the other worker's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import group_of  # noqa: E402


def durations(path: Path) -> dict[str, float]:
    """Seconds per test (setup, call and teardown), each phase counted once."""
    seen, out = set(), {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if (r["id"], r["when"]) not in seen:
            seen.add((r["id"], r["when"]))
            out[r["id"]] = out.get(r["id"], 0.0) + r["stop"] - r["start"]
    return out


def groups(order: list[str]) -> list[list[str]]:
    out: dict[str, list[str]] = {}
    for nodeid in order:
        out.setdefault(group_of(nodeid), []).append(nodeid)
    return list(out.values())


def replay(queue: list[list[str]], took: dict[str, float], workers: int = 2) -> list[float]:
    """Each worker's end, in seconds from the start."""
    queue, pending, clock = deque(queue), [deque() for _ in range(workers)], [0.0] * workers
    for w in list(range(workers)) * 2:  # one group each, then a second where the first is short
        if queue and (not pending[w] or len(pending[w]) <= 2):
            pending[w].extend(queue.popleft())
    while any(pending):
        w = min((i for i in range(workers) if pending[i]), key=lambda i: clock[i])
        clock[w] += took.get(pending[w].popleft(), 0.0)
        if queue and len(pending[w]) <= 2:
            pending[w].extend(queue.popleft())
    return clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline", type=Path, help="the JSON lines a run with RATCHET_TEST_TIMELINE=FILE wrote")
    a = ap.parse_args()
    took = durations(a.timeline)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT,
                               capture_output=True, text=True).stdout
    ours = [line for line in collected.splitlines() if "::" in line]  # tests/conftest.py's order
    by_path = sorted(groups(ours), key=lambda g: min(n.split("::")[0] for n in g))  # pytest collects by path
    xdist = sorted(by_path, key=len, reverse=True)
    print(f"{len(took)} tests timed of {len(ours)} collected; {sum(took.values()):.0f} s of tests in all")
    for name, queue in (("xdist's order (by test count)", xdist), ("tests/conftest.py's order", groups(ours))):
        ends = replay(queue, took)
        print(f"{name:<32} workers end at {', '.join(f'{e:.0f} s' for e in ends)}; "
              f"the first idles {max(ends) - min(ends):.0f} s")


if __name__ == "__main__":
    main()
