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
"""

if __name__ == "__main__":
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
