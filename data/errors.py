"""The project's error hierarchy: one base, then a class per kind of failure."""

from __future__ import annotations


class RatchetError(Exception):
    """Base of every error Ratchet raises on purpose."""


class ConfigError(RatchetError):
    """One or more config problems, all reported at once.

    Each problem names the field, the bad value and the fix.
    """

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


class ArtifactError(RatchetError):
    """An artifact is missing, unreadable or malformed."""


class TamperedArtifactError(ArtifactError):
    """A file's sha256 no longer matches the digest its manifest recorded."""


class EmptyStageError(RatchetError):
    """A stage produced too little to continue; the message names the knob to turn."""


class StageFailedError(RatchetError):
    """A stage running in a worker process failed; carries the worker's error."""
