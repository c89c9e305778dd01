"""The test runner the `shell` environment puts next to a task's tests, as
`.gyre_tests/gyre_runner.py`: it runs every `test_*` function of every `test_*.py`
file in its own directory (files sorted by name, functions in definition order) and
prints one line per test, `PASS <name>` or `FAIL <name>: <why>` (`ERROR <file>: <why>`
when a file cannot be imported), and writes the same lines to the descriptor named by
$GYRE_RESULTS_FD, which is what the environment scores (the output is shared with the
code under test, which could print anything). The task directory (the working directory) is on
`sys.path` after the standard library, so tests import the task's modules by name."""

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _results():
    """Where verdicts go: the private descriptor the environment gave ($GYRE_RESULTS_FD),
    else stdout (a person running the tests by hand)."""
    fd = os.environ.pop("GYRE_RESULTS_FD", None)
    return os.fdopen(int(fd), "w", buffering=1) if fd else sys.stdout


def main() -> None:
    results = _results()

    def verdict(line: str) -> None:
        print(line, flush=True)  # for the person reading the log
        if results is not sys.stdout:
            results.write(line + "\n")
    sys.path.append(os.getcwd())
    for path in sorted(HERE.glob("test_*.py")):
        try:
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 - the code under test may do anything
            verdict(f"ERROR {path.name}: {type(exc).__name__}: {exc}")
            continue
        for name, fn in list(vars(module).items()):
            if name.startswith("test_") and callable(fn):
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001
                    verdict(f"FAIL {name}: {type(exc).__name__}: {exc}")
                else:
                    verdict(f"PASS {name}")


if __name__ == "__main__":
    main()
