"""data.check.kind=code: programs against their tests, in the sandbox. Hostile programs are
contained and scored as failures while the rest of the batch is checked as usual; afterwards
no process of theirs is left and nothing was written outside."""

import json
import os
import sys
from pathlib import Path

import pytest

from ratchet.data.checks.base import Item
from ratchet.data.checks.code import CodeCheck, io_cases, program_of
from tests.hostile import adopting, hostile_programs, leftovers, listener  # noqa: F401 - fixtures

FAST = dict(cpu_s=2, wall_s=6.0, memory_mb=256, processes=8, output_kb=64)
ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
SUM_IO = '[{"input": "1 2\\n", "output": "3\\n"}, {"input": "40 2", "output": "42"}]'
SUM = "```py\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"


def test_programs_pass_and_fail_their_tests_in_both_forms():
    c = CodeCheck(reward="fraction", **FAST)
    got = c.check_many([
        Item(ADD, ADD_TESTS), Item(ADD.replace("a + b", "abs(a) + b"), ADD_TESTS), Item(SUM, SUM_IO),
        Item(SUM.replace("a + b", "a * b"), SUM_IO), Item("no code at all", ADD_TESTS),
        Item("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    input()", ADD_TESTS),
        Item(ADD, "assert add(1, 2) == 3\nassert add(1, 1) == 3"), Item(ADD, None)])
    assert [v.correct for v in got] == [True, False, True, False, False, True, False, None]
    assert [v.reward for v in got] == [1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5, None]
    assert [v.reward for v in CodeCheck(**FAST).check_many([Item(ADD, "assert add(1, 2) == 3\nassert 0")])] == [0.0]


def test_a_program_cannot_pass_by_ending_early_or_printing_a_pass():
    c = CodeCheck(**FAST)
    forged = ["import os\nos._exit(0)", "import sys\nsys.exit(0)", "print('x 2 2')\nimport os\nos._exit(0)",
              "raise SystemExit", "import sys\nprint(sys.stdin.read())\nimport os\nos._exit(0)",
              "import builtins\nbuiltins.AssertionError = type('E', (Exception,), {})\ndef add(a, b): return -7",
              "import os\nprint(os.listdir('/box'))\nos._exit(0)"]
    assert [v.correct for v in c.check_many([Item(f, ADD_TESTS) for f in forged])] == [False] * len(forged)


# Programs written to pass tests they do not: each is scored a failure. ADD_TESTS asks add(1, 2) == 3 and
# add(-1, 1) == 0; EVEN_TESTS is_even(4) is True and is_even(7) is False.
EVEN_TESTS = "assert is_even(4) is True\nassert is_even(7) is False"
FORGERS = {
    "read __main__'s secret": ("import __main__\nprint(getattr(__main__, 'secret', ''))\n"
                               "print(vars(__main__))\ndef add(a, b): return -7", ADD_TESTS),
    "rewrite the counters": ("import sys\nm = sys.modules['__main__']\nfor k in ('passed', 'total'):\n"
                             "    setattr(m, k, 2)\ndef add(a, b): return -7", ADD_TESTS),
    "== is always true": ("class Yes:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
                          "def add(a, b): return Yes()", ADD_TESTS),
    "an int whose == is always true": ("class I(int):\n    def __eq__(self, other): return True\n"
                                       "    __hash__ = int.__hash__\ndef add(a, b): return I(7)", ADD_TESTS),
    "a list whose == is always true": ("class L(list):\n    def __eq__(self, other): return True\n"
                                       "def add(a, b): return L([9])", ADD_TESTS),
    "truthy for every assert": ("class T:\n    def __bool__(self): return True\n"
                                "def is_even(n): return T()", EVEN_TESTS),
    "rewrite the reply encoder": ("import sys\nm = sys.modules['__main__']\n"
                                  "m.encode = lambda value, handle, depth=0: True\ndef is_even(n): return 1",
                                  EVEN_TESTS),
    "rewrite json": ("import json\njson.dumps = lambda *a, **k: '{\"ok\": true}'\ndef is_even(n): return 1",
                     EVEN_TESTS),
    "write a report to every descriptor": ("import os\nfor fd in range(64):\n    try:\n"
                                           "        os.write(fd, b'tests 2\\npass 0\\npass 1\\ndone\\n')\n"
                                           "    except OSError:\n        pass\nos._exit(0)", ADD_TESTS),
    "read the tests": ("import glob\nfound = [open(f).read() for f in glob.glob('/box/test*') + glob.glob('/tmp/*') + glob.glob('/*/tests.py')]\n"
                       "WANT = [int(w) for t in found for w in t.replace(')', ' ').split() if w.lstrip('-').isdigit()]\n"
                       "def add(a, b): return WANT.pop(0) if WANT else -7", ADD_TESTS),
    "find the tests' process": ("import os\nPIDS = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                                "for p in PIDS:\n    try:\n        os.kill(int(p), 19)\n    except OSError:\n"
                                "        pass\ndef add(a, b): return len(PIDS)", ADD_TESTS),
    "raise AssertionError's opposite": ("import builtins\nbuiltins.AssertionError = KeyError\n"
                                        "def add(a, b): raise KeyError", ADD_TESTS),
    "shadow a builtin the tests use": ("def len(x): return 2\ndef add(a, b): return [0]", "assert len(add(1, 2)) == 2"),
    "end the interpreter before the tests": ("print('tests 2\\npass 0\\npass 1')\nraise SystemExit(0)", ADD_TESTS),
}


def test_a_verdict_cannot_be_forged_from_inside_the_program():
    """The tests run where the program cannot reach and compare plain values with their own ==:
    every forger fails every test, honest programs doing the same things pass."""
    c = CodeCheck(reward="fraction", **FAST, workers=4)
    got = c.check_many([Item(p, tests) for p, tests in FORGERS.values()])
    assert {name: v.reward for name, v in zip(FORGERS, got)} == {name: 0.0 for name in FORGERS}


HONEST = {  # each program passes its tests, which read the program in every way a test may
    "objects, methods and attributes": ("class Counter:\n    def __init__(self): self.n = 0\n"
                                        "    def add(self, k=1): self.n += k\n    def __len__(self): return self.n\n"
                                        "    def __str__(self): return f'Counter({self.n})'",
                                        "c = Counter()\nc.add()\nc.add(k=2)\nassert c.n == 3\nassert len(c) == 3\n"
                                        "assert str(c) == 'Counter(3)'\nassert c is not None"),
    "generators and iterators": ("def upto(n):\n    yield from range(n)",
                                 "assert list(upto(3)) == [0, 1, 2]\nassert sum(upto(4)) == 6\n"
                                 "assert 2 in upto(3)\nassert next(iter(upto(2))) == 0"),
    "values of every plain type": ("def f():\n    return (1, 2.5, -0.0, None, 'é', b'\\x00', {1: [2]}, {3}, "
                                   "frozenset({4}), 1j, float('inf'), 2 ** 200, True)",
                                   "assert f() == (1, 2.5, 0.0, None, 'é', b'\\x00', {1: [2]}, {3}, frozenset({4}), "
                                   "1j, float('inf'), 2 ** 200, 1)\nassert f()[-1] is True\n"
                                   "assert type(f()[0]) is int and type(f()) is tuple\n"
                                   "import math\nassert math.isclose(f()[1], 2.5)\nassert math.isnan(g())"),
    "exceptions it raises": ("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5",
                             "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError\n"
                             "assert root(4) == 2.0"),
    "its own objects passed back": ("class P:\n    def __init__(self, x): self.x = x\n"
                                    "def double(p): return P(p.x * 2)\nLIMIT = 10",
                                    "assert double(double(P(3))).x == 12\nassert LIMIT == 10"),
    "prints, input and a main block": ("print('loading')\ndef add(a, b):\n    print(a, b)\n    return a + b\n"
                                       "if __name__ == '__main__':\n    input()", ADD_TESTS),
}


def test_honest_programs_pass_however_their_tests_read_them():
    c = CodeCheck(reward="fraction", **FAST, workers=4)
    progs = {**HONEST, "values of every plain type": (HONEST["values of every plain type"][0] +
                                                      "\ndef g(): return float('nan')",
                                                      HONEST["values of every plain type"][1])}
    got = c.check_many([Item(p, tests) for p, tests in progs.values()])
    assert {name: v.reward for name, v in zip(progs, got)} == {name: 1.0 for name in progs}
    # and a test that compares the program's object itself, or sends it a function, fails rather than guess
    got = c.check_many([Item("class P:\n    pass\nONE = P()\ndef same(p): return p", "assert same(ONE) == ONE"),
                        Item("def apply(f, x): return f(x)", "assert apply(abs, -2) == 2"),
                        Item("class P:\n    pass", "assert P()")])
    assert [v.reward for v in got] == [1.0, 0.0, 0.0]  # identity holds; functions and truth are not sent


def test_program_of_takes_the_last_fenced_block_or_the_whole_text():
    assert program_of("x = 1") == "x = 1"
    assert program_of("a\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\n") == "y = 2\n"
    assert program_of("```python\nx = 1\nprint(x)") == "x = 1\nprint(x)"  # a block cut by the token limit
    assert program_of("```x = 1```") == "x = 1"
    assert program_of("text ``` " * 10_000).count("text") <= 1  # linear, whatever the fences
    assert io_cases(SUM_IO) == [("1 2\n", "3\n"), ("40 2", "42")]
    assert io_cases("assert f() == [1]") is None and io_cases("[1, 2]") is None and io_cases("[") is None


def test_hostile_programs_are_contained_and_scored_as_failures(tmp_path, listener, monkeypatch, adopting):
    port, connections = listener
    monkeypatch.setenv("RATCHET_TEST_SECRET", "s3cr3t-value")
    canary = tmp_path / "outside"
    canary.mkdir()
    home = Path.home()
    home_before = set(os.listdir(home))
    ok = "\ndef add(a, b):\n    return a + b\n"  # after the attack: the tests pass only if the attack did not raise
    hostile = hostile_programs(port, canary, ok)
    c = CodeCheck(**FAST, workers=4)
    items = [Item(ADD, ADD_TESTS)] + [Item(p, ADD_TESTS) for p in hostile.values()] + [Item(SUM, SUM_IO)]
    verdicts = c.check_many(items)
    assert verdicts[0].correct and verdicts[-1].correct  # the rest of the batch, checked as usual
    failed = {name: v.correct for name, v in zip(hostile, verdicts[1:-1])}
    # in assert form the program's prints go nowhere, so printing a gigabyte costs it nothing but time;
    # where its output is what is judged (stdin-to-stdout), the output limit ends it
    assert failed.pop("print a gigabyte") is True
    assert not any(failed.values()), failed
    (flood,) = c.check_many([Item(hostile["print a gigabyte"] + "\nprint(5)", '[{"input": "", "output": "5"}]')])
    assert flood.correct is False
    # the secret does not reach stdin-to-stdout programs either
    (leak,) = c.check_many([Item("import os\nprint(os.environ.get('RATCHET_TEST_SECRET'))",
                                 '[{"input": "", "output": "s3cr3t-value"}]')])
    assert leak.correct is False
    # and the machine after them: no process of theirs, nothing written outside, no connection
    assert leftovers() == []
    assert os.listdir(canary) == [] and set(os.listdir(home)) == home_before
    assert not os.path.exists("/etc/pwned-by-ratchet-test") and connections == []


def test_an_unsandboxed_check_runs_and_says_so(capsys):
    c = CodeCheck(sandbox="none", **FAST)
    assert c.problems() == []
    assert "data.check.sandbox=none: the model's programs run on this machine without a sandbox" in \
        capsys.readouterr().err
    assert [v.correct for v in c.check_many([Item(ADD, ADD_TESTS), Item("while True: pass", ADD_TESTS)])] == \
        [True, False]


def test_a_sandbox_that_cannot_start_is_reported_before_any_model_loads(monkeypatch):
    import ratchet.data.procs.sandbox as sandbox

    assert CodeCheck(**FAST).problems() == []
    (p,) = CodeCheck(interpreter="no-such-python", **FAST).problems()
    assert "data.check.interpreter='no-such-python': not found in the sandbox" in p
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/bin/false")  # a sandbox that exits at once
    (p,) = CodeCheck(**FAST).problems()
    assert "data.check.sandbox='bwrap': the sandbox could not run a program here" in p
    assert "unprivileged user namespaces" in p and "data.check.sandbox=none" in p
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: (_ for _ in ()).throw(sandbox.SandboxError("no bwrap: x")))
    assert CodeCheck(**FAST).problems() == ["data.check.sandbox='bwrap': no bwrap: x"]


def test_the_check_takes_its_place_in_a_config():
    from ratchet.flows.config import load_config

    root = Path(__file__).parents[2]
    cfg = load_config(root / "flows" / "configs" / "default.yaml", ["data.check={kind: code, reward: fraction}"])
    assert isinstance(cfg.data.check, CodeCheck) and cfg.data.check.sandbox == "bwrap"
    assert sys.platform.startswith("linux")


def test_the_built_in_code_task_is_solvable_and_not_passed_by_nothing():
    """examples/code_task: every problem's reference solution passes its tests, an empty program
    passes none, and the shipped config reads it."""
    import json

    from ratchet.flows.config import load_config

    root = Path(__file__).parents[2]
    rows = {r["id"]: r for r in map(json.loads, (root / "examples/code_task/problems.jsonl").read_text().splitlines())}
    sols = [json.loads(x) for x in (root / "examples/code_task/solutions.jsonl").read_text().splitlines()]
    assert sorted(s["id"] for s in sols) == sorted(rows) and len(rows) == 32
    c = CodeCheck(workers=2)
    assert all(v.correct for v in c.check_many([Item(s["solution"], rows[s["id"]]["answer"]) for s in sols]))
    assert not any(v.correct for v in c.check_many([Item("```python\npass\n```", r["answer"]) for r in rows.values()]))
    cfg = load_config(root / "flows" / "configs" / "code_rft.yaml", [])
    assert cfg.data.check.kind == "code" and cfg.data.path.endswith("problems.jsonl")


def test_a_program_that_answers_line_by_line_reads_a_megabyte_without_blocking():
    """Its input is written while its output is read: with all of it written first, a line-echo
    program fills its output pipe and both sides wait forever (here: until the wall time)."""
    from ratchet.data.procs.sandbox import Limits, run

    echo = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()"
    given = "".join(f"line {i:07d} of a long input\n" for i in range(32_000))  # ~1 MiB
    for sandbox in ("bwrap", "none"):
        ran = run({"echo.py": echo}, ["python3", "{box}/echo.py"], given,
                  Limits(cpu_s=10, wall_s=20, memory_mb=256, processes=8, output_kb=2048), sandbox)
        assert (ran.status, ran.timed_out, ran.cut) == (0, False, False), (sandbox, ran.stderr[-500:])
        assert ran.stdout == given, sandbox
    c = CodeCheck(**{**FAST, "output_kb": 2048, "wall_s": 20.0})
    (v,) = c.check_many([Item(f"```python\n{echo}\n```", json.dumps([{"input": given, "output": given}]))])
    assert v.correct


def test_a_run_can_write_only_its_capped_tmp_and_shm():
    """/ and /dev are read-only; /tmp holds twice file_mb, /dev/shm file_mb; each file at most file_mb."""
    from ratchet.data.procs.sandbox import Limits, run

    fill = ("import os\nfor d in ('/', '/dev', '/dev/shm', '/tmp', '/box'):\n    n = 0\n    try:\n"
            "        for i in range(16):\n            with open(os.path.join(d, f'f{i}'), 'wb') as f:\n"
            "                for _ in range(4):\n                    f.write(b'x' * (1 << 20))\n"
            "                    n += 1\n    except OSError as e:\n        pass\n    print(d, n)")
    ran = run({"fill.py": fill}, ["python3", "{box}/fill.py"], "", Limits(file_mb=4, wall_s=20), "bwrap")
    wrote = dict(line.split() for line in ran.stdout.splitlines())
    assert wrote == {"/": "0", "/dev": "0", "/dev/shm": "4", "/tmp": "32", "/box": "0"}, (wrote, ran.stderr[-500:])


def test_the_run_s_processes_share_one_memory_bound_where_a_cgroup_can_be_made(monkeypatch, adopting):
    """Four processes of 150 MiB each, under memory_mb=256: each is within its own address-space
    limit, so without the run's cgroup all four finish; in it, they cannot all hold their memory."""
    from ratchet.data.procs import sandbox
    from ratchet.data.procs.sandbox import Limits, RunGroup, run

    limits = Limits(memory_mb=256, processes=16, wall_s=30, cpu_s=20)
    group = RunGroup.make(limits)
    if group is None:
        pytest.skip("no cgroup can be made on this machine (not root, or no memory and pids controllers)")
    group.close()
    # a group a killed run left (its maker's pid is gone) is removed by the next one made
    stale = [os.path.join(os.path.dirname(d), "ratchet-box-999999999-0a0a0a0a0a0a") for d in group.dirs]
    for d in stale:
        os.mkdir(d)
    RunGroup.swept.clear()
    RunGroup.make(limits).close()
    assert not any(os.path.exists(d) for d in stale)
    hog = ("import os, sys\nkids = [os.fork() for _ in range(2)]\n"  # 4 processes
           "x = bytearray(150 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\n"
           "sys.stdout.write('held\\n')\nsys.stdout.flush()\nfor k in kids:\n    if k:\n        os.waitpid(k, 0)")
    held = lambda: run({"hog.py": hog}, ["python3", "{box}/hog.py"], "", limits, "bwrap").stdout.count("held")  # noqa: E731
    assert held() < 4
    assert leftovers() == []
    parents = {os.path.dirname(d) for d in group.dirs}
    assert not any(n.startswith(f"ratchet-box-{os.getpid()}-") for p in parents for n in os.listdir(p))
    monkeypatch.setattr(sandbox.RunGroup, "make", classmethod(lambda cls, limits: None))
    assert held() == 4
