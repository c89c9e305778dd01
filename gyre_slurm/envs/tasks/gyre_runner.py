"""The test runner the `shell` environment puts next to a task's tests, as
`.gyre_tests/gyre_runner.py`: it runs every `test_*` function of every `test_*.py`
file in its own directory (files sorted by name, functions in definition order) and
prints one line per test, `PASS <name>` or `FAIL <name>: <why>` (`ERROR <file>: <why>`
when a file cannot be imported). The task directory (the working directory) is on
`sys.path` after the standard library, so tests import the task's modules by name."""

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    sys.path.append(os.getcwd())
    for path in sorted(HERE.glob("test_*.py")):
        try:
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 - the code under test may do anything
            print(f"ERROR {path.name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        for name, fn in list(vars(module).items()):
            if name.startswith("test_") and callable(fn):
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001
                    print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                else:
                    print(f"PASS {name}", flush=True)


if __name__ == "__main__":
    main()
