"""`python -m gyre_slurm.engines.vllm_serve` picks vLLM's server entry: the launchers'
`main()` where the installed vLLM has it, else the server module run as `__main__`;
anything else missing is the error it is. The vLLM here is a package of a few files
written by the test (the real server starts in test_engine_vllm.py and every vLLM run);
what is checked is the choice, the arguments passed through, and that the module imports
nothing at its top (a spawned engine core re-runs it as `__mp_main__`)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = "import sys; print({!r}, __name__, sys.argv[1:])\n"


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def serve(tmp_path: Path, *args: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "gyre_slurm.engines.vllm_serve", *args], env=env,
                          capture_output=True, text=True, timeout=60)


PACKAGE = {"vllm/__init__.py": "", "vllm/entrypoints/__init__.py": "",
           "vllm/entrypoints/openai/__init__.py": "",
           "vllm/entrypoints/openai/api_server.py": REPORT.format("module")}


def test_the_launchers_entry_is_called_where_vllm_has_it(tmp_path):
    write(tmp_path, PACKAGE | {
        "vllm/entrypoints/launchers/__init__.py": "",
        "vllm/entrypoints/launchers/api_server/__init__.py": "",
        "vllm/entrypoints/launchers/api_server/entry.py":
            "import sys\ndef main():\n    print('entry', sys.argv[1:])\n"})
    proc = serve(tmp_path, "--model", "/m", "--port", "8000")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "entry ['--model', '/m', '--port', '8000']"


def test_an_older_vllm_runs_its_server_module_as_main(tmp_path):
    write(tmp_path, PACKAGE)
    proc = serve(tmp_path, "--model", "/m")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "module __main__ ['--model', '/m']"


def test_a_missing_vllm_or_dependency_is_not_taken_for_an_older_layout(tmp_path):
    proc = serve(tmp_path / "empty", "--model", "/m")  # no vllm on the path at all
    assert proc.returncode != 0 and "No module named 'vllm'" in proc.stderr
    write(tmp_path, PACKAGE | {
        "vllm/entrypoints/launchers/__init__.py": "",
        "vllm/entrypoints/launchers/api_server/__init__.py": "",
        "vllm/entrypoints/launchers/api_server/entry.py": "import fastapi_missing_here\n"})
    proc = serve(tmp_path, "--model", "/m")
    assert proc.returncode != 0 and "fastapi_missing_here" in proc.stderr
    assert "module" not in proc.stdout  # not run as the older layout


def test_its_top_imports_nothing():
    """As `__mp_main__` (what a spawned child runs) it loads nothing beyond its package,
    which the engine core imports anyway (gyre's worker extension lives there)."""
    code = ("import sys, runpy, gyre_slurm.engines; before = set(sys.modules); "
            "runpy.run_module('gyre_slurm.engines.vllm_serve', run_name='__mp_main__'); "
            "print(sorted(set(sys.modules) - before))")
    proc = subprocess.run([sys.executable, "-c", code],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
