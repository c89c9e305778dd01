"""The gateway's pure parts with the real tiny tokenizer: tool calls, rendering, text
pieces and stop strings, token-exact anchors, and answer shapes checked against the
official `openai` package's types."""

import json
import re

import pytest

from gyre_slurm.gateway import openai as oai
from gyre_slurm.gateway import tools
from gyre_slurm.gateway.history import Anchor, History, Served, turn_anchor
from gyre_slurm.gateway.text import cut_at_stop, find_stop, raw_prefix_len, token_pieces
from gyre_slurm.models import tiny

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny.load_tokenizer(tiny.make_model_dir(tmp_path_factory.mktemp("m") / "model"))


def encode(tok):
    return lambda s: tok.encode(s, add_special_tokens=False) if s else []


# -- tool calls out of text ----------------------------------------------------------
def test_parse_one_tool_call():
    content, calls = tools.parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>')
    assert content == "Let me look."
    [c] = calls
    assert c["name"] == "get_weather" and json.loads(c["arguments"]) == {"city": "Paris"}
    assert c["id"].startswith("call_") and len(c["id"]) > 10


def test_parse_several_tool_calls_and_only_calls():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b"}</tool_call>')
    content, calls = tools.parse_tool_calls(text)
    assert content is None
    assert [(c["name"], c["arguments"]) for c in calls] == [("a", "{}"), ("b", "{}")]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>',  # arguments not an object
    '<tool_call>["a"]</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}',  # never closed
])
def test_malformed_tool_call_stays_text(block):
    text = f"before {block} after"
    assert tools.parse_tool_calls(text) == (text, [])


def test_malformed_block_kept_valid_one_taken():
    text = ('x <tool_call>{bad}</tool_call> y '
            '<tool_call>{"name": "f", "arguments": {"k": [1, 2]}}</tool_call>')
    content, calls = tools.parse_tool_calls(text)
    assert content == "x <tool_call>{bad}</tool_call> y"
    assert [c["name"] for c in calls] == ["f"] and json.loads(calls[0]["arguments"]) == \
        {"k": [1, 2]}


# -- tools into the prompt -----------------------------------------------------------
def test_parse_tools_choices_and_errors():
    assert tools.parse_tools({}) == tools.NO_TOOLS
    assert tools.parse_tools({"tools": [WEATHER]}).choice == "auto"
    spec = tools.parse_tools({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert (spec.choice, spec.name, spec.active) == ("named", "get_weather", True)
    assert not tools.parse_tools({"tools": [WEATHER], "tool_choice": "none"}).active
    bad = [({"tools": [{"type": "function"}]}, "tools[0]"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                  "function": {"name": "nope"}}}, "nope"),
           ({"tool_choice": "required"}, "required"),
           ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
           ({"functions": []}, "use 'tools'")]
    for body, word in bad:
        with pytest.raises(oai.RequestError, match=re.escape(word)):
            tools.parse_tools(body)


def test_render_messages_tools_calls_and_results():
    msgs = oai.parse_messages({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    spec = tools.parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    out = tools.render_messages(msgs, spec, lambda key: None)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("be brief\n\n# Tools\n")
    assert json.dumps(WEATHER) in out[0]["content"]
    assert out[0]["content"].endswith("You must call at least one function.")
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Paris"}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    # a message the gateway answered renders as the text the model generated
    key = tools.message_key(None, msgs[2]["tool_calls"])
    raw = ' <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    again = tools.render_messages(msgs, spec, {key: raw}.get)
    assert again[2]["content"] == raw
    # no system message: the tools block comes first; tool_choice none: no block
    out = tools.render_messages(msgs[1:], tools.parse_tools({"tools": [WEATHER]}), dict().get)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    out = tools.render_messages(msgs[1:2], tools.parse_tools(
        {"tools": [WEATHER], "tool_choice": "none"}), dict().get)
    assert out == [{"role": "user", "content": "weather?"}]


def test_request_errors():
    cases = [({"n": 17}, "n must be an integer from 1 to 16"), ({"n": 0}, "n must"),
             ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
             ({"stream": "yes"}, "stream"), ({"top_logprobs": 30}, "top_logprobs"),
             ({"stream_options": 1}, "stream_options"), ({"echo": True}, "echo")]
    for body, word in cases:
        with pytest.raises(oai.RequestError, match=word):
            oai.parse_sampling(body, chat=True)
    s = oai.parse_sampling({"stop": "x", "n": 3, "stream": True, "top_logprobs": 2,
                            "stream_options": {"include_usage": True}}, chat=True)
    assert (s.stop, s.n, s.stream, s.include_usage) == (("x",), 3, True, True)
    assert s.max_tokens is None  # named none: the gateway gives the context's room
    with pytest.raises(oai.RequestError, match="role"):
        oai.parse_messages({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(oai.RequestError, match="tool_calls"):
        oai.parse_messages({"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]})


# Every sampling field's range, with hostile values: each a RequestError (a 400), never
# an exception of another kind (a 500) or a value that reaches the engine unchecked.
BAD_SAMPLING = [
    ("temperature", v) for v in (-1, -1e-300, 10 ** 400, 1e7, "hot", True, [1], {"a": 1})
] + [
    ("max_tokens", v) for v in (-1, 1.5, "5", True, 10 ** 400 * 1.0 if False else -10 ** 30)
] + [
    ("top_p", v) for v in (0, -0.1, 1.5, 10 ** 400, "x", False)
] + [
    ("min_p", v) for v in (-0.5, 2, "x")
] + [
    (name, v) for name in ("presence_penalty", "frequency_penalty") for v in (2.5, -3, 10 ** 400)
] + [
    ("repetition_penalty", v) for v in (0, -1, 10 ** 400)
] + [
    ("top_k", v) for v in (-2, 1.5, "3", True)
] + [
    ("logit_bias", v) for v in ([1], {"x": 1}, {"5": 101}, {"5": "high"}, {"5": 10 ** 400},
                                {"-1": 1}, {str(i): 1 for i in range(1100)})
] + [
    ("seed", v) for v in (2 ** 64, -2 ** 64, 1.0, "7")
] + [("n", v) for v in (17, 0, 1.0, True, 10 ** 400)]


@pytest.mark.parametrize("name, value", BAD_SAMPLING)
def test_sampling_ranges_are_request_errors(name, value):
    for chat in (True, False):
        with pytest.raises(oai.RequestError, match=name):
            oai.parse_sampling({name: value}, chat=chat)


@pytest.mark.parametrize("body, temperature", [
    ({"temperature": 1e-38}, 1e-38), ({"temperature": 5e-324}, 5e-324),
    ({"temperature": 0}, 0.0), ({"temperature": 2}, 2.0), ({}, 1.0),
    ({"temperature": 1e6, "top_p": 1, "min_p": 0, "presence_penalty": -2, "top_k": -1,
      "logit_bias": {"5": -100, "7": 100.0}, "repetition_penalty": 1.2}, 1e6),
])
def test_sampling_values_in_range_are_taken(body, temperature):
    assert oai.parse_sampling(body, chat=True).temperature == temperature


# -- text pieces and stop strings ----------------------------------------------------
def test_token_pieces_concatenate_across_multibyte(tok):
    text = "héllo ☃ wörld fox"
    ids = tok.encode(text, add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    pieces = token_pieces(tok, ids + [im_end], skip_special=True)
    assert "".join(pieces) == text and pieces[-1] == "" and "\ufffd" not in "".join(pieces)
    raw = token_pieces(tok, ids + [im_end], skip_special=False)
    assert "".join(raw) == text + "<|im_end|>"


def test_cut_at_stop_keeps_shortest_prefix(tok):
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    pieces = token_pieces(tok, ids, skip_special=True)
    text, k = cut_at_stop(pieces, ["fox", "quick"])
    assert text == "the "  # the earliest stop string wins
    assert "quick" in "".join(pieces[:k]) and "quick" not in "".join(pieces[:k - 1])
    assert cut_at_stop(pieces, ["zebra"]) is None
    assert find_stop("a b a", ["b", "a"]) == (0, "a")
    assert raw_prefix_len(["ab", "", "c", "d"], "abcx") == (3, 3)


# -- token-exact anchors -------------------------------------------------------------
def _turn(tok, prompt, rendered, answer_ids, *, answer=None):
    pieces = token_pieces(tok, answer_ids, skip_special=True)
    answer = "".join(pieces) if answer is None else answer
    full = tok.apply_chat_template(rendered + [{"role": "assistant", "content": answer}],
                                   tokenize=False)
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    return turn_anchor(prompt=prompt, full_text=full, answer=answer, output_ids=answer_ids,
                       pieces=pieces, end_texts=tok.convert_ids_to_tokens(stops),
                       stop_ids=stops, encode=encode(tok)), answer


@pytest.mark.parametrize("ending", ["im_end", "eos", "length"])
def test_resent_answer_continues_the_generated_ids(tok, ending):
    msgs = [{"role": "user", "content": "hi fox"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = Anchor.extend(None, text, encode(tok)(text))
    pad = tok.convert_tokens_to_ids("<|pad|>")
    # a non-canonical split of "the fox" and a special token the answer text skips
    out = tok.encode("the f", add_special_tokens=False) + [pad] + \
        tok.encode("ox", add_special_tokens=False)
    out += {"im_end": [tok.convert_tokens_to_ids("<|im_end|>")], "eos": [tok.eos_token_id],
            "length": []}[ending]
    turn, answer = _turn(tok, prompt, msgs, out)
    assert answer == "the fox"
    hist = History(calls_per_run=4)
    hist.add("r", Served(0, prompt, turn))
    follow = msgs + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "and?"}]
    new_text = tok.apply_chat_template(follow, add_generation_prompt=True, tokenize=False)
    anchor, ids, used = hist.prompt("r", new_text, encode(tok))
    assert used == (0, "turn")
    assert anchor.full_text == new_text and anchor.full_ids() == ids
    assert anchor.parent is turn and turn.parent is prompt  # segments, not copies
    assert ids[:len(prompt.full_ids()) + len(out)] == prompt.full_ids() + out
    tail = "\n" if ending != "length" else "<|im_end|>\n"
    assert ids[len(prompt.full_ids()) + len(out):] == encode(tok)(
        tail + "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n")
    # an edited answer: back to the prompt anchor (a new branch at the answer)
    edited = msgs + [{"role": "assistant", "content": "the dog"},
                     {"role": "user", "content": "and?"}]
    _, ids, used = hist.prompt("r", tok.apply_chat_template(
        edited, add_generation_prompt=True, tokenize=False), encode(tok))
    assert used == (0, "prompt") and ids[:len(prompt.full_ids())] == prompt.full_ids()
    assert hist.prompt("other", new_text, encode(tok))[2] is None
    hist.forget("r")
    assert hist.prompt("r", new_text, encode(tok))[1:] == (encode(tok)(new_text), None)


def test_stop_cut_answer_keeps_tokens_inside_the_text(tok):
    msgs = [{"role": "user", "content": "go"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = Anchor.extend(None, text, encode(tok)(text))
    out = tok.encode("left right up down", add_special_tokens=False)
    pieces = token_pieces(tok, out, skip_special=True)
    answer, k = cut_at_stop(pieces, [" up"])
    turn, _ = _turn(tok, prompt, msgs, out[:k], answer=answer)
    assert answer == "left right"
    inside = raw_prefix_len(pieces[:k], answer)[0]
    assert inside >= 2 and turn.full_ids()[:len(prompt.full_ids()) + inside] == \
        prompt.full_ids() + out[:inside]
    assert tok.decode(turn.full_ids()) == turn.full_text


def test_history_is_bounded_and_takes_longest_anchor():
    hist = History(calls_per_run=2)
    for call, text in enumerate(["ab", "abcd", "abc"]):
        hist.add("r", Served(call, Anchor.extend(None, text, [call]), None))
    assert hist.match("r", "abcdef")[1:] == (1, "prompt")
    hist.add("r", Served(3, Anchor.extend(None, "a", [3]), None))  # call 1 falls out
    assert hist.match("r", "abcdef")[1] == 2
    assert hist.stats()["calls"] == 2
    hist.add("s", Served(0, Anchor.extend(None, "x", [0]), None))
    assert hist.num_runs() == hist.stats()["runs"] == 2
    hist.forget("r")
    assert hist.num_runs() == hist.stats()["runs"] == 1
    with pytest.raises(ValueError):
        History(calls_per_run=0)


# -- answers in the shapes of the official client ------------------------------------
def test_answer_shapes_validate_with_openai_types(tok):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = ('ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call>')
    ids = tok.encode(body, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    pieces = token_pieces(tok, ids, skip_special=True)
    content, calls = tools.parse_tool_calls("".join(pieces))
    gyre = {"run_id": "r", "call": 0, "server": "s", "policy_version": 0}
    with_tools = oai.Choice(0, ids, [-1.0] * len(ids), pieces, "".join(pieces), "tool_calls",
                            content, calls, gyre)
    plain = oai.Choice(1, ids, [-0.5] * len(ids), pieces, "".join(pieces), "stop",
                       "".join(pieces), [], {**gyre, "call": 1})
    strings = lambda xs: [tok.decode([t]) for t in xs]  # noqa: E731
    kw = dict(model="m", prompt_ids=[1, 2], choices=[with_tools, plain],
              token_strings=strings, want_logprobs=True)
    full = ChatCompletion.model_validate(oai.chat_response(**kw))
    msg = full.choices[0].message
    assert msg.content == "ok" and full.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert full.usage.completion_tokens == 2 * len(ids) and full.usage.prompt_tokens == 2
    events = oai.chat_stream(**kw, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-2]]
    text = {0: "", 1: ""}
    lps = {0: 0, 1: 0}
    for ch in chunks[:-1]:
        [c] = ch.choices
        text[c.index] += c.delta.content or ""
        lps[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert text == {0: "ok", 1: "".join(pieces)} and lps == {0: len(ids), 1: len(ids)}
    tc = [c.delta.tool_calls for ch in chunks for c in ch.choices if c.delta.tool_calls]
    assert tc[0][0].function.name == "get_weather" and tc[0][0].id == calls[0]["id"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 2 + 2 * len(ids)
    kw["choices"] = [plain]
    comp = Completion.model_validate(oai.completion_response(**kw))
    assert comp.choices[0].text == "".join(pieces)
    events = oai.completion_stream(**kw, include_usage=False).decode().split("\n\n")[:-2]
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events)


# -- control tokens in content, tool-call keys ------------------------------------------
def test_content_spans_locate_each_content_exactly(tok):
    from gyre_slurm.gateway.text import (content_spans, control_strings, encode_plain_spans)

    controls = control_strings(tok)
    assert "<|im_start|>" in controls and "<|im_end|>" in controls

    def render(ms):
        return tok.apply_chat_template(ms, add_generation_prompt=True, tokenize=False)
    msgs = [{"role": "user", "content": "<|im_end|>"},  # equal to the template's marker
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "x\ue000n0\ue001<|im_start|>user\nhi"}]
    text, spans = content_spans(render, msgs, controls, "n")
    assert text == render(msgs)
    assert [text[a:b] for a, b in spans] == ["<|im_end|>", "<|im_start|>"]
    # the first user content, not the template's <|im_end|> before or after it
    assert spans[0][0] == text.index("user\n") + len("user\n")
    ids = encode_plain_spans(tok, text, spans)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 4  # 3 turns + prompt
    assert content_spans(render, [{"role": "user", "content": "plain"}], controls, "n")[1] == []
    with pytest.raises(ValueError, match="verbatim"):
        content_spans(lambda ms: render([{**m, "content": m["content"].strip()} for m in ms]),
                      [{"role": "user", "content": " <|im_end|> "}], controls, "n")


def test_tool_call_key_compares_arguments_as_json():
    a = tools.message_key("Checking.", [{"id": "1", "name": "f", "arguments": '{"a": 1, "b": [2]}'}])
    b = tools.message_key(" Checking.\n", [{"id": "x", "name": "f",
                                            "arguments": '{"b":[2],"a":1}'}])
    c = tools.message_key("Checking.", [{"id": "1", "name": "f", "arguments": '{"a": 2, "b": [2]}'}])
    assert a == b != c
    assert tools.canonical_arguments("not json") == "not json"
    assert tools.canonical_arguments("[" * 100_000) == "[" * 100_000
    # nested past Python's recursion limit: the text as it came, not an exception (a
    # client's tool call arguments rendered into the prompt; the model's own output)
    deep = "[" * 100_000 + "]" * 100_000
    assert deep in tools.call_block("f", deep)
    assert tools.parse_tool_calls(f"<tool_call>\n{{\"name\": \"f\", \"arguments\": {deep}}}\n"
                                  f"</tool_call>")[1] == []
