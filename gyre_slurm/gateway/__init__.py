"""The OpenAI-compatible gateway in front of every rollout server.

It lives in the coordinator process: an aiohttp app started and controlled from the
coordinator's event loop.

    gateway = Gateway(model_dir=..., call_writer=CallStoreWriter(run_dir, "gateway"))
    port = await gateway.start("127.0.0.1", 0)
    gateway.add_server("cell0", EngineClient(url, secret), capacity=32)
    key = gateway.open_run("s0000-p000-g00")       # the run's own key, until end_run

An agent run `<run_id>` uses an unmodified OpenAI client with
`base_url=http://HOST:PORT/runs/<run_id>/v1` and `api_key=` its run's key:

    POST /runs/{run_id}/v1/chat/completions   messages -> chat template -> token ids
    POST /runs/{run_id}/v1/completions        prompt: a string or a list of token ids
    GET  /runs/{run_id}/v1/models
    POST /runs/{run_id}/end                   an external run is done (`gateway.runs`)

Requests need `Authorization: Bearer <the run's key>` (else 401): a key opens its own
run's URL only, while the run lives; the job secret opens nothing here (`gateway.app`).
Answers have the OpenAI shape plus a `gyre` object {run_id, call, server, policy_version, calls (one call number per
choice)}; request fields: see `gateway.openai`. Output text is decoded with special
tokens skipped; generation stops at `<|im_end|>` or eos, and that stop token is part of
the recorded output ids. Errors: `{"error": {message, type, code}}` with 400 (malformed
JSON or fields, n over 16, prompt too long, ...), 401, 404, 413 (body over 4 MiB), 502
(the engine failed; the message names the server), 503 (no server within
`wait_for_server_s`); also 409 (a call to a run that ended meanwhile, or an ended
external run) and 429 (too many external runs, or a run past the model calls
`open_run(max_calls=)` gave it: `gateway.max_calls_per_run` for scaffolds and verifiers
environments).

- Streaming (`stream: true`): Server-Sent Events in OpenAI's chunk format (chat: a
  role chunk, one content chunk per token, or with tool calls one content chunk and one
  chunk per call, a finish chunk carrying `gyre`; completions: one text chunk per
  token, the last with finish_reason); `stream_options.include_usage` adds a usage chunk
  with `choices: []`; then `data: [DONE]`. The engines answer whole generations, so
  the stream is sent at once, after the generation: it is OpenAI's format, not earlier
  tokens. The call is recorded exactly as without streaming.
- `n` (1..16): n generations of the same prompt, run concurrently on the run's server
  (choice i gets seed + i when a seed is given); each is its own call, with
  consecutive call numbers in choice order. If one fails the request fails, with nothing
  recorded. usage counts the prompt once and every choice's tokens.
- `stop` (a string or up to 4): the answer text is cut before the first stop string
  found (finish_reason "stop"); the recorded output is the shortest token prefix whose
  text contains that stop string (its logprobs likewise): the tokens generated after it
  are dropped, since the agent never sees them and they cannot be trained. The answer's
  logprobs and usage cover the recorded tokens.
- Tools (`tools`, `tool_choice` auto/none/required/named): rendered into the prompt and
  parsed out of the text Hermes style (`gateway.tools`); a parsed call gives
  `message.tool_calls` [{id, type "function", function {name, arguments (JSON
  text)}}], finish_reason "tool_calls", content the rest of the text or null. "required"
  and a named choice are instructions in the prompt only (decoding is not constrained);
  "none" renders no tools and parses nothing. The record keeps the engine's finish
  ("stop"/"length").
- Token-exact history (`gateway.history`): for a chat prompt the gateway renders the
  messages to text, finds the longest earlier anchor of the run whose text is a prefix
  (a call's prompt, or a call's prompt + its answer as returned + the end of turn), and
  uses that anchor's ids + the tokenized rest. So an agent that re-sends the assistant
  messages it got (tool calls included) gets prompts that continue the previous call's
  prompt + output ids exactly (the run is one chain of the prefix tree); an edited or
  compacted history falls back to the longest unchanged anchor (a new branch from
  there) or, with none, is tokenized whole. Completions with a text prompt use the same
  rule (anchors: prompt, prompt + returned text); token-id prompts are taken as given.
  The anchors of a run's last `history_calls_per_run` (16) calls are kept until
  `end_run`.

Every answered call is appended to the call store BEFORE the HTTP answer is sent:
{"run_id", "call" (per run, from 0), "prompt_ids", "output_ids", "output_logprobs",
"policy_version" (from the engine's answer), "t_start", "t_end" (wall clock, s),
"finish_reason"}. A failed call records nothing and takes no call number.

Routing (`gateway.router`): a run keeps its server until that server drains (then it
leaves at its next call: `runs="move"`; at its next call to a free slot: "free", the
`migrate` drain; when it ends: "keep", the `wait` drain); a new or migrating run goes to
the non-draining server with the fewest runs (ties: lowest id).
Coordinator controls: `add_server(server_id, client, capacity)`,
`drain_server(id, runs="move")`, `free_slots()`,
`remove_server(id)` (after draining, with no call in flight), `server_load()`,
`open_run(run_id) -> key`, `end_run(run_id)` (revokes the key, frees the run's state),
`calls_of(run_id)`, `run_stats()`. The engine clients stay the coordinator's: the
gateway never closes them.
"""

from gyre_slurm.gateway.app import Gateway
from gyre_slurm.gateway.router import NoServer, Router

__all__ = ["Gateway", "NoServer", "Router"]
