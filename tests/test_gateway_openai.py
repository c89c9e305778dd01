"""The official `openai` client, unmodified, against the gateway in front of real engine
processes: streaming, n > 1, stop strings, tools, and token-exact multi-turn history
(checked in the call store and through the run's prefix tree)."""

import json

import openai
import pytest
from engine_helpers import tiny_engines
from test_gateway import HELLO, HOST, key_of, records, run_gateway

from gyre_slurm.engines import EngineClient
from gyre_slurm.models import tiny
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.store import load_store

MODEL = "gyre-policy"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def client(gw, base, run_id):
    return openai.AsyncOpenAI(base_url=f"{base}/runs/{run_id}/v1", api_key=key_of(gw, run_id),
                              max_retries=0)


def gyre(obj):
    return obj.to_dict()["gyre"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One engine process; 2048 positions (the tools block is long in a 512-token vocab)."""
    with tiny_engines(tmp_path_factory.mktemp("gw-oai"), max_positions=2048) as e:
        yield e


@pytest.fixture(scope="module")
def tok(engines):
    return tiny.load_tokenizer(engines["model_dir"])


def text_of(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=True)


def test_streaming_chat_and_completions(engines, tok, tmp_path):
    async def go(gw, http, base):
        c = client(gw, base, "s1")
        kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logprobs=True)
        stream = await c.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        plain = await c.chat.completions.create(**kw)
        stream = await c.completions.create(model=MODEL, prompt="the quick brown", max_tokens=10,
                                            temperature=0, logprobs=0, stream=True,
                                            stream_options={"include_usage": True})
        cchunks = [ch async for ch in stream]
        async with http.post(f"{base}/runs/s1/v1/chat/completions",
                             json={**kw, "stream": True}) as r:
            raw = (r.headers["Content-Type"], await r.text())
        await c.close()
        return chunks, plain, cchunks, raw
    chunks, plain, cchunks, raw = run_gateway(engines, tmp_path, go)
    recs = records(tmp_path, "s1")
    assert [r.call for r in recs] == [0, 1, 2, 3]
    # recorded exactly as the non-streamed call of the same (greedy) request
    assert recs[0].prompt_ids.tolist() == recs[1].prompt_ids.tolist()
    assert recs[0].output_ids.tolist() == recs[1].output_ids.tolist()
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == text_of(tok, recs[0].output_ids) == plain.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[:-1] == [None] * (len(finals) - 1)
    assert finals[-1] == plain.choices[0].finish_reason == recs[0].finish_reason
    lps = [x.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
           for x in ch.choices[0].logprobs.content]
    assert lps == pytest.approx(recs[0].output_logprobs.tolist(), abs=1e-6)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(recs[0].output_ids)
    assert usage.usage.prompt_tokens == len(recs[0].prompt_ids)
    # completions
    ctext = "".join(ch.choices[0].text for ch in cchunks if ch.choices)
    assert ctext == text_of(tok, recs[2].output_ids)
    assert cchunks[-1].usage.completion_tokens == len(recs[2].output_ids)
    assert [ch.choices[0].finish_reason for ch in cchunks if ch.choices][-1] == \
        recs[2].finish_reason
    # the wire: an event stream ending with [DONE]
    ctype, body = raw
    assert ctype.startswith("text/event-stream")
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {")
                                                      for e in events[:-2])


def test_n_choices_are_separate_calls(engines, tok, tmp_path):
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]

    async def go(gw, http, base):
        c = client(gw, base, "n1")
        many = await c.chat.completions.create(model=MODEL, messages=HELLO, n=3, seed=5,
                                               temperature=1.0, max_tokens=6, logprobs=True)
        stream = await c.chat.completions.create(model=MODEL, messages=HELLO, n=2,
                                                 max_tokens=4, stream=True)
        streamed = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError) as too_many:
            await c.chat.completions.create(model=MODEL, messages=HELLO, n=17)
        await c.close()
        async with EngineClient(engines["urls"][0], engines["secret"]) as direct:
            ref = await direct.generate(tiny.chat_prompt_ids(tok, HELLO), max_tokens=6,
                                        temperature=1.0, stop_token_ids=stop_ids, seed=6)
        return many, streamed, too_many.value, ref
    many, streamed, too_many, ref = run_gateway(engines, tmp_path, go)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    recs = records(tmp_path, "n1")
    assert [r.call for r in recs] == [0, 1, 2, 3, 4] and gyre(many)["calls"] == [0, 1, 2]
    for choice, rec in zip(many.choices, recs):
        assert rec.prompt_ids.tolist() == recs[0].prompt_ids.tolist()
        assert choice.message.content == text_of(tok, rec.output_ids)
        assert [x.logprob for x in choice.logprobs.content] == pytest.approx(
            rec.output_logprobs.tolist(), abs=1e-6)
    assert recs[1].output_ids.tolist() == ref["output_ids"]  # choice 1 ran with seed 5 + 1
    assert many.usage.completion_tokens == sum(len(r.output_ids) for r in recs[:3])
    texts = {0: "", 1: ""}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: text_of(tok, recs[3].output_ids), 1: text_of(tok, recs[4].output_ids)}
    assert too_many.status_code == 400 and "n must be an integer from 1 to 16" in str(too_many)


def test_stop_string_cuts_text_and_recorded_ids(engines, tok, tmp_path):
    async def go(gw, http, base):
        c = client(gw, base, "st")
        kw = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
        first = await c.chat.completions.create(**kw)
        text = first.choices[0].message.content
        assert len(text) >= 4, text
        stop = text[2:4]
        cut = await c.chat.completions.create(**kw, stop=[stop, "never-in-output-zz"])
        stream = await c.chat.completions.create(**kw, stop=stop, stream=True)
        streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream])
        await c.close()
        return text, stop, cut, streamed
    text, stop, cut, streamed = run_gateway(engines, tmp_path, go)
    expected = text[:text.find(stop)]
    assert cut.choices[0].message.content == streamed == expected
    assert cut.choices[0].finish_reason == "stop"
    recs = records(tmp_path, "st")
    full = recs[0].output_ids.tolist()
    k = next(k for k in range(1, len(full) + 1) if stop in text_of(tok, full[:k]))
    assert recs[1].output_ids.tolist() == recs[2].output_ids.tolist() == full[:k]
    assert recs[1].output_logprobs.tolist() == pytest.approx(
        recs[0].output_logprobs.tolist()[:k], abs=1e-6)
    assert recs[1].finish_reason == "stop" and cut.usage.completion_tokens == k


def test_tools_round_trip(engines, tok, tmp_path):
    sent = [{"role": "system", "content": "you are a test"},
            {"role": "user", "content": "weather in Paris?"}]
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    follow = sent + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}]

    async def go(gw, http, base):
        c = client(gw, base, "t1")
        first = await c.chat.completions.create(model=MODEL, messages=sent, tools=[WEATHER],
                                                tool_choice="auto", max_tokens=8)
        second = await c.chat.completions.create(
            model=MODEL, messages=follow, tools=[WEATHER], max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        stream = await c.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=4,
                                                 stream=True)
        chunks = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError) as unknown:
            await c.chat.completions.create(
                model=MODEL, messages=sent, tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "nope"}})
        await c.close()
        return first, second, chunks, unknown.value
    first, second, chunks, unknown = run_gateway(engines, tmp_path, go)
    for reply in (first, second):
        choice = reply.choices[0]
        assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        if choice.finish_reason != "tool_calls":  # a tiny random model: plain text
            assert choice.message.tool_calls is None
            assert isinstance(choice.message.content, str)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert unknown.status_code == 400 and "'nope'" in str(unknown)
    recs = records(tmp_path, "t1")
    prompts = [tok.decode(r.prompt_ids.tolist()) for r in recs]
    assert prompts[0].startswith("<|im_start|>system\nyou are a test\n\n# Tools\n")
    assert json.dumps(WEATHER) in prompts[0]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n'
            'sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in prompts[1]
    assert "You must call the function get_weather." in prompts[1]
    assert "You must call at least one function." in prompts[2]


def _chain_tokens(recs):
    return [(r.prompt_ids.tolist(), r.output_ids.tolist()) for r in recs]


def test_resent_history_is_token_exact_one_chain(engines, tok, tmp_path):
    async def go(gw, http, base):
        c = client(gw, base, "chain")
        messages = list(HELLO)
        for turn in range(4):
            reply = await c.chat.completions.create(model=MODEL, messages=messages,
                                                    temperature=1.0, seed=turn, max_tokens=8)
            # what agents do: append the message object they got, then the next user turn
            messages += [reply.choices[0].message, {"role": "user", "content": f"go {turn}"}]
        edited = messages[:4] + [{"role": "assistant", "content": "an edited answer"},
                                 {"role": "user", "content": "go 1"}]
        await c.chat.completions.create(model=MODEL, messages=edited, temperature=1.0,
                                        seed=9, max_tokens=8)
        await c.close()
    run_gateway(engines, tmp_path, go)
    recs = records(tmp_path, "chain")
    seqs = _chain_tokens(recs)
    for (p0, o0), (p1, _) in zip(seqs[:3], seqs[1:4]):
        assert p1[:len(p0) + len(o0)] == p0 + o0  # previous prompt + output, exactly
    deltas = load_store(tmp_path).runs["chain"]
    chain = process_run(deltas[:4], max_per_run=5)
    [traj] = chain.trajectories
    assert traj.token_ids.tolist() == seqs[3][0] + seqs[3][1]
    assert int(traj.loss_mask.sum()) == sum(len(o) for _, o in seqs[:4])
    # the edited answer (call 1's) starts a branch right after call 1's prompt
    p1, o1 = seqs[1]
    p4, _ = seqs[4]
    assert p4[:len(p1)] == p1 and p4[len(p1):len(p1) + len(o1)] != o1
    both = process_run(deltas, max_per_run=5)
    assert len(both.trajectories) == 2
    assert sum(int(t.loss_mask.sum()) for t in both.trajectories) == \
        sum(len(o) for _, o in seqs)


class ScriptedEngine:
    """A stand-in for the model on the engine protocol (loopback HTTP): answers each
    /generate with the next scripted text's tokens + `<|im_end|>`. A tiny random model
    never writes a well-formed tool call; this makes the gateway's tool-call path run
    end to end through the official client."""

    def __init__(self, tok, script):
        self.tok, self.script, self.prompts = tok, list(script), []

    async def generate(self, request):
        from aiohttp import web
        body = await request.json()
        self.prompts.append(body["prompt_ids"])
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False)
        ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
        return web.json_response({"output_ids": ids, "output_logprobs": [-0.5] * len(ids),
                                  "finish_reason": "stop", "policy_version": 0})

    async def start(self):
        from aiohttp import web
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, HOST, 0)
        await site.start()
        return f"http://{HOST}:{self.runner.addresses[0][1]}"


def test_tool_calls_answered_and_resent_token_exact(engines, tok, tmp_path):
    # compact JSON, no newlines: not how the gateway renders a call it did not answer
    said = 'Checking. <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'

    script = [said, said, "<tool_call>{broken</tool_call>", "It is sunny."]
    engine = ScriptedEngine(tok, script)

    async def go(gw, http, base):
        url = await engine.start()
        gw.add_server("scripted", EngineClient(url, "unused"), capacity=4)
        gw.drain_server("s0")
        c = client(gw, base, "tc")
        messages = [{"role": "user", "content": "weather in Paris?"}]
        kw = dict(model=MODEL, tools=[WEATHER], max_tokens=64)
        first = await c.chat.completions.create(messages=messages, **kw)
        stream = await c.chat.completions.create(messages=messages, stream=True, **kw)
        chunks = [ch async for ch in stream]
        broken = await c.chat.completions.create(messages=messages, **kw)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message,
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        last = await c.chat.completions.create(messages=messages, **kw)
        await c.close()
        await gw.router.servers["scripted"].client.close()
        await engine.runner.cleanup()
        return first, chunks, broken, last
    first, chunks, broken, last = run_gateway(engines, tmp_path, go)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the content, then the call as one delta, then finish_reason tool_calls
    deltas = [c.delta for ch in chunks for c in ch.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    [[streamed_call]] = [d.tool_calls for d in deltas if d.tool_calls]
    assert streamed_call.function.name == "get_weather" and streamed_call.index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a malformed block stays text
    assert broken.choices[0].finish_reason == "stop"
    assert broken.choices[0].message.content == "<tool_call>{broken</tool_call>"
    assert broken.choices[0].message.tool_calls is None
    # the re-sent message with its tool call is the generated tokens, exactly
    recs = records(tmp_path, "tc")
    p0, o0 = recs[0].prompt_ids.tolist(), recs[0].output_ids.tolist()
    assert recs[3].prompt_ids.tolist()[:len(p0) + len(o0)] == p0 + o0
    assert tok.decode(recs[3].prompt_ids.tolist()).endswith(
        "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert last.choices[0].message.content == "It is sunny."
    assert engine.prompts == [r.prompt_ids.tolist() for r in recs]
