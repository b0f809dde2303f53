"""The project's error hierarchy: one base, then a class per kind of failure."""

from __future__ import annotations

from pathlib import Path


class RatchetError(Exception):
    """Base of every error Ratchet raises on purpose."""


class ConfigError(RatchetError):
    """One or more config problems, all reported at once.

    Each problem names the field, the bad value and the fix.
    """

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


class ProblemReport:
    """Problems found in user data, grouped by kind: the first few places of each kind,
    with a count, and the fix. Raised all at once as one ConfigError.

        report.add("prompts.jsonl", "malformed JSON", "line 4", "Expecting ',' delimiter", "fix the line")
    """

    def __init__(self, examples: int = 3):
        self.examples = examples
        self._groups: dict[tuple[str, str], dict] = {}

    def add(self, source: str, kind: str, where: str, detail: str, fix: str) -> None:
        g = self._groups.setdefault((source, kind), {"places": [], "count": 0, "fix": fix})
        g["count"] += 1
        if len(g["places"]) < self.examples:
            g["places"].append(f"{where}: {detail}" if detail else where)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def about(self, source: str) -> bool:
        """Whether any problem was reported in `source`."""
        return any(s == source for s, _ in self._groups)

    def lines(self) -> list[str]:
        out = []
        for (source, kind), g in self._groups.items():
            more = g["count"] - len(g["places"])
            places = "; ".join(g["places"]) + (f"; and {more} more" if more else "")
            out.append(f"{source}: {kind} ({g['count']}): {places}. Fix: {g['fix']}")
        return out

    def raise_if_any(self, source: str = "data") -> None:
        if self:
            raise ConfigError(self.lines(), source=source)


def show(value, limit: int = 60) -> str:
    """A value as it appears in an error message: repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ArtifactError(RatchetError):
    """An artifact is missing, unreadable or malformed."""


class TamperedArtifactError(ArtifactError):
    """A file's sha256 no longer matches the digest its manifest recorded."""


class EmptyStageError(RatchetError):
    """A stage produced too little to continue; the message names the knob to turn."""


def out_of_space(e: BaseException, where: Path) -> str | None:
    """The message for a write that ran out of room (a full disk, a quota, a file-size limit),
    naming the file (or, where the error names none, the directory being written) and what is
    free there; None for any other error."""
    import errno
    import shutil

    if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    path = e.filename or where
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:,.0f} MiB free there now"
    except OSError:
        free = "its free space unknown"
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file too large for this process's file-size limit (no space left for it)"}[e.errno]
    return (f"{what} writing {path} ({free}). Everything finished is kept; free space (or raise the quota or "
            "limit) and re-run the same command to resume")


class StageFailedError(RatchetError):
    """A stage running in a worker process failed; carries the worker's error. `clear`: the worker
    raised one of Ratchet's own errors, whose message says all (no log tail needed)."""

    def __init__(self, message: str, clear: bool = False):
        super().__init__(message)
        self.clear = clear


class Terminated(KeyboardInterrupt):
    """The run was asked to stop by SIGTERM (systemd, `docker stop`, Kubernetes, a Prefect cancel):
    an interrupt like Ctrl-C, which the same command resumes."""
