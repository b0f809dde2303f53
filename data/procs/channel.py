"""The channel: how Ratchet talks to a child it started, one JSON object a line.

A child that answers calls (a scorer host, an environment host and each episode's process, the
fork server) reads calls on its standard input and writes its answers on a descriptor of its
own (`FD`), so what the code it runs prints goes to its log (its standard output is pointed at
its standard error) and never into the protocol. Each call carries a number (`#`) and each
answer the number of the call it answers: an answer is never taken for another call, and a line
that is not a JSON object answers nothing (`{"#": None}`).

JSON, not pickle, because these children run the user's code (a reward function, an
environment) or Ratchet's own code on the model's text: what comes back is data, checked where
it is read, and never code that runs in the stage's process when it is decoded.

A failure the child reports is its exception with the user's frames (`user_traceback`): the
engine room's and the host's own frames are left out, from the top, down to the first frame of
the code the child was asked to run.
"""

from __future__ import annotations

import json
import os
import select
import time
import traceback
from pathlib import Path

FD = "RATCHET_CHANNEL_FD"  # in the child: the descriptor its answers go to
ENGINE_ROOM = Path(__file__).resolve().parent


class Channel:
    """One end of a child's protocol: JSON lines in on `read_fd`, out on `write_fd`."""

    def __init__(self, read_fd: int | None, write_fd: int | None, owns_write: bool = True):
        self.read_fd, self.write_fd, self._buf = read_fd, write_fd, b""
        self.owns_write = owns_write  # False: the write end is a file object's (a child's stdin), closed with it

    def fileno(self) -> int:
        return self.read_fd

    def send(self, obj: dict) -> bool:
        """Write one message; False when the other end is gone."""
        data = (json.dumps(obj) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
            return True
        except (BrokenPipeError, OSError, TypeError):
            return False

    def recv(self, end: float | None = None, chunk: int = 1 << 20, limit: int | None = None) -> dict | None:
        """The next message: None past the monotonic time `end` (None: wait as long as it takes; a
        time already past: only what can be read without waiting); {} when the writer is gone;
        `{"#": None}` for a line that is not a JSON object, and `{"#": None, "!": "too long"}` for
        one that runs past `limit` bytes (the rest of it is not read)."""
        while b"\n" not in self._buf:
            if limit is not None and len(self._buf) > limit:
                return {"#": None, "!": "too long"}
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                ready, _, _ = select.select([self.read_fd], [], [], left)
            except (OSError, ValueError, TypeError):  # closed meanwhile
                return {}
            if not ready:
                return None
            try:
                got = os.read(self.read_fd, chunk)
            except OSError:
                got = b""
            if not got:
                return {}
            self._buf += got
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line)

    def pending(self) -> bool:
        """Whether a whole message is already read and waiting."""
        return b"\n" in self._buf

    def close(self) -> None:
        for fd in {self.read_fd, self.write_fd if self.owns_write else None} - {None}:
            try:
                os.close(fd)
            except OSError:
                pass
        self.read_fd = self.write_fd = None


def decode(line: bytes) -> dict:
    try:
        msg = json.loads(line)
    except ValueError:
        return {"#": None}
    return msg if isinstance(msg, dict) else {"#": None}


def to_parent() -> Channel:
    """In a child started with a channel: its end (calls on standard input, answers on `FD`), with
    its standard output pointed at its standard error from now on."""
    out = int(os.environ.pop(FD))
    os.dup2(2, 1)
    return Channel(0, out)


def user_traceback(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """The exception's traceback from the code the child was asked to run down: leading frames of
    the engine room and of the files in `skip` (the host's own module) are left out."""
    own = {str(ENGINE_ROOM)} | {str(Path(s).resolve()) for s in skip}
    tb = exc.__traceback__
    while tb is not None and _is_own(tb.tb_frame.f_code.co_filename, own):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def _is_own(filename: str, own: set[str]) -> bool:
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return path in own or any(path.startswith(o + os.sep) for o in own)
