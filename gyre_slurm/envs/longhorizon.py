"""`longhorizon`: a synthetic many-turn agent task, shaped like hour-long agent work
(SWE / terminal tasks) but scaled to seconds.

Per task (all drawn from the task seed, so deterministic except for the actions):
- the number of turns: lognormal with median `median_turns` and shape `turns_sigma`,
  rounded, clipped to 1..`max_turns`;
- each turn's tool time: lognormal with mean `tool_mean_s` (so mu = ln(mean) -
  sigma^2/2) and shape `tool_sigma`, capped at `tool_max_s`; `step` sleeps it with
  `asyncio.sleep` before answering (the tool "runs");
- each turn's tool result: `result_tokens` words on average (lognormal, shape
  `result_sigma`, at least 1), each word one of the tiny model's corpus words (about
  one token each), so contexts grow turn by turn and a context budget forces the
  agent to compact;
- each turn's key: a word; the result text says "key: WORD" on its first line.

Observations: `reset` returns the instruction ("Task <id>: for each tool result, reply
with its key word. Turn 1/N key: WORD."); each `step` returns the next tool result,
"turn k/N key: WORD\n<words...>". The episode ends after N steps.

Reward (paid on the last step, 0.0 before): the fraction of the N actions that contain
the key of the observation they answered (a whole-word, case-insensitive match).
`info` per step: {"turn", "num_turns", "tool_s", "hit"}.
"""

from __future__ import annotations

import asyncio
import math
import random

from gyre_slurm.envs.base import StepResult, register_env
from gyre_slurm.errors import UserError

SYSTEM_PROMPT = "You are an agent. Use the tools; answer each tool result with its key."
WORDS = ("the quick brown fox jumps over lazy dog agent tool call result file test "
         "pass fail error run build repo answer yes no red green blue left right up "
         "down").split()
KEYS = ("red", "green", "blue", "left", "right", "up", "down", "yes", "no", "pass",
        "fail", "build")


def lognormal_mean(rng: random.Random, *, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean (not median)."""
    if mean <= 0:
        return 0.0
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


class LongHorizonEnv:
    name = "longhorizon"

    def __init__(self, *, median_turns: float = 20.0, turns_sigma: float = 0.8,
                 max_turns: int = 200, tool_mean_s: float = 0.5, tool_sigma: float = 1.0,
                 tool_max_s: float = 10.0, result_tokens: float = 200.0,
                 result_sigma: float = 0.5):
        _check(median_turns > 0 and max_turns >= 1, "median_turns > 0 and max_turns >= 1")
        _check(min(turns_sigma, tool_sigma, result_sigma) >= 0, "sigmas >= 0")
        _check(tool_mean_s >= 0 and tool_max_s >= 0, "tool_mean_s, tool_max_s >= 0")
        _check(result_tokens >= 1, "result_tokens >= 1")
        self.median_turns, self.turns_sigma, self.max_turns = median_turns, turns_sigma, max_turns
        self.tool_mean_s, self.tool_sigma, self.tool_max_s = tool_mean_s, tool_sigma, tool_max_s
        self.result_tokens, self.result_sigma = result_tokens, result_sigma
        self.system_prompt = SYSTEM_PROMPT
        self._task_id, self._seed = "", 0
        self.num_turns = 0
        self._turn = 0
        self._hits = 0
        self._key = ""
        self._done = True

    def draw_num_turns(self, seed: int) -> int:
        rng = random.Random(f"turns/{seed}")
        n = round(rng.lognormvariate(math.log(self.median_turns), self.turns_sigma))
        return max(1, min(self.max_turns, n))

    def draw_tool_s(self, seed: int, turn: int) -> float:
        rng = random.Random(f"tool/{seed}/{turn}")
        return min(self.tool_max_s, lognormal_mean(rng, mean=self.tool_mean_s,
                                                   sigma=self.tool_sigma))

    def key(self, seed: int, turn: int) -> str:
        return random.Random(f"key/{seed}/{turn}").choice(KEYS)

    def result_text(self, seed: int, turn: int) -> str:
        """The tool result answering action `turn` (1-based): its key line, then words."""
        rng = random.Random(f"result/{seed}/{turn}")
        n = max(1, round(lognormal_mean(rng, mean=self.result_tokens, sigma=self.result_sigma)))
        body = " ".join(rng.choice(WORDS) for _ in range(n))
        return f"turn {turn + 1}/{self.num_turns} key: {self.key(seed, turn)}\n{body}"

    async def reset(self, *, task_id: str, seed: int, run_seed: int | None = None) -> str:
        self._task_id, self._seed = task_id, seed
        self.num_turns = self.draw_num_turns(seed)
        self._turn, self._hits, self._done = 0, 0, False
        self._key = self.key(seed, 0)
        return (f"Task {task_id}: for each tool result, reply with its key word. "
                f"Turn 1/{self.num_turns} key: {self._key}.")

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("longhorizon: step() after the episode ended; call reset()")
        hit = self._key in action.lower().split()
        self._hits += hit
        self._turn += 1
        tool_s = self.draw_tool_s(self._seed, self._turn)
        await asyncio.sleep(tool_s)
        info = {"turn": self._turn, "num_turns": self.num_turns, "tool_s": tool_s, "hit": hit}
        if self._turn >= self.num_turns:
            self._done = True
            return StepResult("", self._hits / self.num_turns, True, info)
        self._key = self.key(self._seed, self._turn)
        return StepResult(self.result_text(self._seed, self._turn), 0.0, False, info)

    async def close(self) -> None:
        self._done = True


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise UserError(f"longhorizon: parameters must satisfy {what}")


register_env("longhorizon", LongHorizonEnv)
