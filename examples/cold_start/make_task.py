"""Writes the cold-start example's task and demonstrations (flows/configs/cold_start_tool.yaml):

    python examples/cold_start/make_task.py

remainders.jsonl: 170 problems "What is the remainder when A * B is divided by 997?" (4-digit A and B;
the config holds 50 of them out), which the default model does not solve, with or without its Python
tool. demos.jsonl: 64 worked episodes of other problems (no problem of the task's), each the model
writing a program, the tool's output, and the answer: what the cold start trains on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
M = 997


def problem(a: int, b: int) -> str:
    return f"What is the remainder when {a} * {b} is divided by {M}?"


def main() -> None:
    rng = random.Random(2026)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < 170 + 64:
        pair = (rng.randint(1000, 9999), rng.randint(1000, 9999))
        if pair not in pairs:
            pairs.append(pair)
    task, demos = pairs[:170], pairs[170:]
    with open(HERE / "remainders.jsonl", "w") as f:
        for i, (a, b) in enumerate(task):
            f.write(json.dumps({"id": f"rem-{i}", "prompt": problem(a, b), "answer": str(a * b % M)}) + "\n")
    with open(HERE / "demos.jsonl", "w") as f:
        for i, (a, b) in enumerate(demos):
            r = a * b % M
            f.write(json.dumps({"id": f"demo-{i}", "answer": str(r), "messages": [
                {"role": "user", "content": problem(a, b)},
                {"role": "assistant", "content": f"I will compute it with Python.\n```python\nprint({a} * {b} % {M})\n```"},
                {"role": "tool", "content": str(r)},
                {"role": "assistant", "content": f"The remainder is {r}."}]}) + "\n")


if __name__ == "__main__":
    main()
