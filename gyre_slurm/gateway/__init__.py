"""The OpenAI-compatible gateway in front of every rollout server.

It lives in the coordinator process: an aiohttp app started and controlled from the
coordinator's event loop.

    gateway = Gateway(model_dir=..., call_writer=CallStoreWriter(run_dir, "gateway"),
                      api_key=KEY)
    port = await gateway.start("127.0.0.1", 0)
    gateway.add_server("cell0", EngineClient(url, secret), capacity=32)

An agent run `<run_id>` uses an unmodified OpenAI client with
`base_url=http://HOST:PORT/runs/<run_id>/v1` and `api_key=KEY`:

    POST /runs/{run_id}/v1/chat/completions   messages -> chat template -> token ids
    POST /runs/{run_id}/v1/completions        prompt: a string or a list of token ids
    GET  /runs/{run_id}/v1/models, GET /v1/models

Requests need `Authorization: Bearer KEY` (else 401). Answers have the OpenAI shape
(chat: choices[0].message {role, content}, finish_reason "stop"|"length", logprobs
when asked: {"content": [{token, logprob, bytes, top_logprobs: []}]}, usage) plus a
`gyre` object {run_id, call, server, policy_version}. Output text is decoded with
special tokens skipped; generation stops at `<|im_end|>` or eos, and that stop token is
part of the recorded output ids. Request fields: see `gateway.openai`. Re-sent assistant
text is re-tokenized through the chat template (token-exactness of re-sent text is a
later issue). Errors: `{"error": {message, type, code}}` with 400 (malformed JSON,
missing messages, bad fields, prompt too long), 401, 404, 413 (body over 4 MiB),
502 (the engine failed; the message names the server), 503 (no server within
`wait_for_server_s`).

Every answered call is appended to the call store BEFORE the HTTP answer is sent:
{"run_id", "call" (per run, from 0), "prompt_ids", "output_ids", "output_logprobs",
"policy_version" (from the engine's answer), "t_start", "t_end" (wall clock, s),
"finish_reason"}. A failed call records nothing and takes no call number.

Routing (`gateway.router`): a run keeps its server until that server drains; a new or
migrating run goes to the non-draining server with the fewest runs (ties: lowest id).
Coordinator controls: `add_server(server_id, client, capacity)`, `drain_server(id)`,
`remove_server(id)` (after draining, with no call in flight), `server_load()`,
`end_run(run_id)`, `calls_of(run_id)`. The engine clients stay the coordinator's: the
gateway never closes them.
"""

from gyre_slurm.gateway.app import Gateway
from gyre_slurm.gateway.router import NoServer, Router

__all__ = ["Gateway", "NoServer", "Router"]
