"""A verifiers environment made for gyre's tests (loaded with
`verifiers.load_environment("gyre-vf-sums")` with this folder on PYTHONPATH): a
multi-turn conversation where the environment asks one sum per turn (`env_response`
asks the next) and the rubric pays the share of sums answered right, plus a little for
answering in digits at all (so a random model's runs differ in reward)."""

import re

import verifiers as vf
from datasets import Dataset

NUMBER = re.compile(r"-?\d+")


def _pairs(row: int, turns: int) -> list[list[int]]:
    """Row 0 is [[1, 2], [3, 4], [9, 1], ...]; the others vary."""
    fixed = [[1, 2], [3, 4], [9, 1], [2, 2], [5, 3]]
    if row == 0:
        return fixed[:turns]
    return [[(row * 7 + t * 3) % 9, (row + t * 5) % 9] for t in range(turns)]


def _ask(pair) -> str:
    return f"Add {pair[0]} and {pair[1]}. Answer with the number only."


def _text(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else str(content or "")


class SumsEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        pairs = state["info"]["pairs"]
        asked = len(state["trajectory"])  # turns answered so far
        return [vf.UserMessage(content=_ask(pairs[asked]))]


def sums_right(completion, info, parser, **kwargs) -> float:
    answers = [_text(m) for m in parser.get_assistant_messages(completion)]
    right = 0
    for pair, answer in zip(info["pairs"], answers):
        found = NUMBER.findall(answer)
        right += bool(found) and int(found[0]) == sum(pair)
    return right / len(info["pairs"])


def in_digits(completion, parser, **kwargs) -> float:
    answers = [_text(m) for m in parser.get_assistant_messages(completion)]
    chars = "".join(answers)
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def load_environment(turns: int = 3, rows: int = 8) -> vf.Environment:
    data = [{"question": _ask(_pairs(i, turns)[0]), "answer": "",
             "info": {"pairs": _pairs(i, turns)}} for i in range(rows)]
    rubric = vf.Rubric(funcs=[sums_right, in_digits], weights=[1.0, 0.1])
    return SumsEnv(dataset=Dataset.from_list(data), rubric=rubric, max_turns=turns,
                   system_prompt="You add numbers.")
