"""A disk that fills mid-stage: the user reads "no space" and the path, nothing finished is lost,
and the same stage finishes once there is room. The full disk is a file-size limit
(RLIMIT_FSIZE) on the process, which needs no mount: a write past it fails as one past the
end of a full disk does."""

import json
import subprocess
import sys
import textwrap

from pydantic import BaseModel

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.tasks.runner.stage import StageRequest


def test_a_full_disk_mid_stage_names_the_path_loses_nothing_and_resumes(tmp_path):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(20)))
    big.write_text("".join(json.dumps({"prompt": f"Repeat: {'word ' * 200} {i}", "answer": str(i)}) + "\n"
                           for i in range(400)))  # ~400 KB of prompts, past the 200 KB limit below
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from ratchet.data.prompts import FileSource, load_split
        from ratchet.data.store import ArtifactStore
        from ratchet.tasks import prepare

        store = ArtifactStore(Path({str(tmp_path / 'w')!r}))

        def prompts(path):
            src = FileSource(path=path, eval_size=2)
            return prepare.prompts(store, src, 0, load_split(src, 0).digests)[0]

        print(prompts({str(small)!r}).dir, flush=True)  # finished before the disk fills
        if sys.argv[1] == "full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with an error instead of a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            print(prompts({str(big)!r}).dir)
        except Exception as e:
            print(f"{{type(e).__name__}}: {{e}}")
            sys.exit(3)
    """)
    full = subprocess.run([sys.executable, "-c", script, "full"], capture_output=True, text=True, timeout=120)
    assert full.returncode == 3, full.stderr[-2000:]
    first, error = full.stdout.strip().splitlines()
    assert error.startswith("StageFailedError: prompts stage (round 0): file too large")
    assert "(no space left for it) writing " + str(tmp_path / "w" / "stages" / "prompts-") in error
    assert "Everything finished is kept; free space (or raise the quota or limit) and re-run the same command" in error
    finished = (tmp_path / "w" / first / "manifest.json").read_bytes()
    room = subprocess.run([sys.executable, "-c", script, "room"], capture_output=True, text=True, timeout=120)
    assert room.returncode == 0, room.stderr[-2000:]
    again, done = room.stdout.strip().splitlines()
    assert again == first and (tmp_path / "w" / first / "manifest.json").read_bytes() == finished  # reused as it was
    rows = (tmp_path / "w" / done / "train.jsonl").read_text().splitlines()
    assert len(rows) == 398 and (tmp_path / "w" / done / "manifest.json").exists()


class Rows(BaseModel):
    n: int


def rows_body(req: StageRequest[Rows], store: ArtifactStore) -> StageManifest:
    """A stage that writes `n` rows of 1 KB, a unit at a time, as a worker stage does."""
    d = store.stage_dir(req.stage, req.key)
    with open(d / "rows.txt", "w") as f:
        for i in range(req.config.n):
            f.write(f"{i:08d}" + "x" * 1015 + "\n")
    return req.finish(store, outputs={"rows.txt": req.config.n})


def test_a_full_disk_in_a_worker_stage_is_reported_from_the_worker_and_resumes(tmp_path):
    """The same through a stage worker (the sample, label, train and evaluate stages' way): the
    worker hits the limit it inherited, the orchestrator reports it with the path, and the stage
    finishes in a worker once there is room."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from ratchet.data.store import ArtifactStore
        from ratchet.tasks.runner.stage import run_stage
        from tests.tasks.test_disk_full import Rows, rows_body

        store = ArtifactStore(Path({str(tmp_path / 'w')!r}))
        stage = lambda n: run_stage(store, stage="rows", round=1, body=rows_body, code="c", config=Rows(n=n),
                                    parents=[], isolate=True, keep_partial=True)[0]
        print(store.dir_of(stage(20)), flush=True)  # finished before the disk fills
        if sys.argv[1] == "full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # inherited by the worker
        try:
            print(store.dir_of(stage(400)))
        except Exception as e:
            print(f"{{type(e).__name__}}: {{e}}".replace("\\n", " "))
            sys.exit(3)
    """)
    full = subprocess.run([sys.executable, "-c", script, "full"], capture_output=True, text=True, timeout=120)
    assert full.returncode == 3, full.stderr[-2000:]
    first, error = full.stdout.strip().splitlines()
    assert error.startswith("StageFailedError: rows stage (round 1) failed in its worker: OSError: file too large"), error
    assert "(no space left for it) writing " + str(tmp_path / "w" / "stages" / "rows-") in error, error
    assert "MiB free there now). Everything finished is kept" in error and "re-run the same command" in error, error
    finished = (tmp_path / "w" / first / "manifest.json").read_bytes()
    room = subprocess.run([sys.executable, "-c", script, "room"], capture_output=True, text=True, timeout=120)
    assert room.returncode == 0, room.stderr[-2000:]
    again, done = room.stdout.strip().splitlines()
    assert again == first and (tmp_path / "w" / first / "manifest.json").read_bytes() == finished
    assert len((tmp_path / "w" / done / "rows.txt").read_text().splitlines()) == 400
