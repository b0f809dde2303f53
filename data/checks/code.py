"""code: the response is a program, run in a sandbox against the row's tests.

    data:
      kind: file
      path: problems.jsonl          # {"prompt": ..., "answer": <the tests>}
      check: {kind: code, reward: fraction}

The program is the response's last fenced block (```python ... ```), or the whole text
where it has none. The tests are the row's answer, in one of two forms:

- assert statements (Python), each on its own: `assert add(2, 3) == 5`. The program runs as
  a module named `solution`, so its `if __name__ == "__main__":` block does not.
- stdin-to-stdout cases, a JSON list: `[{"input": "2 3\\n", "output": "5\\n"}, ...]`. Each case
  is a run of its own; its output is compared with the expected one line by line, trailing
  spaces and blank lines aside.

`reward: pass` gives 1 when every test passes, else 0; `fraction` the share that passed. A
verdict is right when all pass. Every run is in a sandbox of its own (data/procs/sandbox.py:
bubblewrap, no network, a read-only system, a private /tmp, no inherited environment, CPU,
memory, process, file-size, output and wall-time limits, death with its parent), up to
`workers` at once. A program that breaks a limit, crashes, or prints past the output limit
fails its tests; the stage goes on.

The verdict is decided where the program cannot reach. In assert form the program and the
tests run in two sandboxes joined by a pipe (data/checks/code_sides.py): the tests run in an
interpreter of their own, where each name the program defines stands for the program's
object; a call sends its arguments to the program's side and gets back data (numbers,
strings, and containers of them) that the tests' side rebuilds as Python's own types and
compares with its own `==`. The expected values never reach the program, and what it returns
cannot be an object that says it equals anything (an object of the program's comes back as a
reference: its `==` is identity). So a program passes a test only by answering the test's
calls with the wanted values: printing a pass, ending early, rewriting the harness or its
counters, or reading `__main__` gain nothing. A test can call the program's functions, read
its names and its objects' attributes, iterate, index and print them, and catch Python's own
exceptions it raises; it cannot pass the program a function, and a name the program defines
that shadows a builtin (`len`) stays the builtin in the tests. In stdin-to-stdout form the
output is compared outside the sandbox.

If the sandbox cannot start here, the check says so before any model loads, with the fix.
`sandbox: none` runs programs with the same limits but without the sandbox, for trusted
code, and says so on the console.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checks.base import Check, Item, Tally, Verdict
from ratchet.data.procs.sandbox import Ran, SandboxSettings, run_pair

FENCE = "```"

SIDES = Path(__file__).with_name("code_sides.py")


def program_of(response: str) -> str:
    """The last fenced block's body (its language tag dropped), or the whole text; a block left
    open at the end (a cut response) runs to the end. Linear in the text."""
    end = response.rfind(FENCE)
    if end < 0:
        return response
    start = response.rfind(FENCE, 0, end)
    if start < 0:  # one fence: the text after it, an unclosed block
        start, end = end, len(response)
    body = response[start + len(FENCE):end]
    newline = body.find("\n")
    head = body[:newline] if newline >= 0 else ""
    if newline >= 0 and (not head.strip() or head.strip().replace("+", "").replace("-", "").isalnum()):
        body = body[newline + 1:]  # ```python, ```py3, ```c++: a language tag
    return body


def io_cases(tests: str) -> list[tuple[str, str]] | None:
    """stdin-to-stdout cases, where the tests are a JSON list of {"input", "output"}; None for
    assert statements."""
    if not tests.lstrip().startswith("["):
        return None
    try:
        cases = json.loads(tests)
    except ValueError:
        return None
    if isinstance(cases, list) and cases and all(
            isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
            for c in cases):
        return [(c["input"], c["output"]) for c in cases]
    return None


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip("\n").splitlines()]  # noqa: E731
    return norm(got) == norm(want)


class CodeCheck(Check, SandboxSettings):
    """The response's program against the row's tests, in a sandbox."""

    extracts: ClassVar[bool] = False  # a program, not an answer samples could vote with
    kind: Literal["code"] = "code"
    reward: Literal["pass", "fraction"] = Field(default="pass", description="pass: 1 when every test passes, else "
                                                "0; fraction: the share of tests that passed")

    def problems(self, fields=()) -> list[str]:
        return self.probe(self.place)

    def check(self, response: str, answer: str) -> Verdict:
        return self.check_many([Item(response, answer)])[0]

    def check_many(self, items: list[Item], tally: Tally | None = None) -> list[Verdict]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(self._verdict, items))

    def _verdict(self, item: Item) -> Verdict:
        if item.answer is None:
            return Verdict(None, None)
        program = program_of(item.response)
        cases = io_cases(item.answer)
        if cases is not None:
            passed = sum(self._io(program, i, o) for i, o in cases)
            total = len(cases)
        else:
            passed, total = self._asserts(program, item.answer)
        if total == 0:
            return Verdict(None, None)
        return Verdict(passed == total, None, passed / total if self.reward == "fraction" else None,
                       {"tests_passed_frac": passed / total})

    def _io(self, program: str, stdin: str, want: str) -> bool:
        ran = self._run({"program.py": program}, ["{box}/program.py"], stdin)
        return ran.status == 0 and not ran.cut and not ran.timed_out and _same_output(ran.stdout, want)

    def _asserts(self, program: str, tests: str) -> tuple[int, int]:
        sides = _sides()
        _, report = run_pair(({"sides.py": sides, "program.py": program}, [self.interpreter, "{box}/sides.py",
                                                                             "program", "{box}/program.py"]),
                             ({"sides.py": sides, "tests.py": tests}, [self.interpreter, "{box}/sides.py", "tests",
                                                                       "{box}/tests.py", str(self.output_kb << 10)]),
                             self.limits, self.sandbox)
        lines = report.stderr.splitlines()
        if lines and lines[0].startswith("tests ") and lines[0][6:].isdigit():
            return sum(line.startswith("pass ") for line in lines[1:]), int(lines[0][6:])
        try:  # the tests' side never said (it could not start): nothing passed, of however many there are
            import ast

            return 0, len(ast.parse(tests).body)
        except (SyntaxError, ValueError):
            return 0, 0

    def _run(self, files: dict[str, str], argv: list[str], stdin: str) -> Ran:
        return self.run(files, argv, stdin)


@cache
def _sides() -> str:
    return SIDES.read_text(encoding="utf-8")
