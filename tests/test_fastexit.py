"""`common.fastexit.exit_now` ends a process without the interpreter's teardown, and
loses nothing a normal exit keeps: its exit code, what a non-daemon thread and a thread
pool were still doing, the atexit handlers (weakref finalizers among them), logging's
and stdout's buffers."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys, tempfile, threading, time, weakref
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    import torch  # what makes the teardown long

    out = Path(sys.argv[1])
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.getLogger("p").info("logged before the exit")
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    class Held:
        pass
    held = Held()
    weakref.finalize(held, lambda: (out / "finalizer.txt").write_text("ran"))
    temp = tempfile.TemporaryDirectory(dir=out)  # removed by its finalizer at exit
    (Path(temp.name) / "x").write_text("x")
    def later():
        time.sleep(0.3)
        (out / "thread.txt").write_text("done")
    threading.Thread(target=later).start()  # not a daemon: the exit waits for it
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.3), (out / "pool.txt").write_text("done")))
    sys.stdout.write("buffered, no newline")
    from gyre_slurm.common.fastexit import exit_now
    exit_now(3)
""")


def test_exit_now_keeps_what_a_normal_exit_keeps(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert "logged before the exit" in (tmp_path / "log.txt").read_text()
    for name in ("atexit.txt", "finalizer.txt"):
        assert (tmp_path / name).read_text() == "ran", name
    for name in ("thread.txt", "pool.txt"):
        assert (tmp_path / name).read_text() == "done", name
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # the temp dir went
