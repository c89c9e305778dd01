"""`learnable`: a one- or two-turn task the tiny local model can learn by RL in minutes.

Task (from the task seed): `num_digits` distinct digits (default 5), named in the
instruction "Use only the digits 1 3 5 7 8." (sorted, space separated). An action's
score is the fraction of its non-whitespace characters that are among those digits
(0.0 for an action with none); for the digits 3 5 7: "357 53" -> 1.0, "3a" -> 0.5,
"42" -> 0.0, "" -> 0.0. With `turns=2` the first reply is answered "Score: 0.50.
Again: use only the digits 3 5 7." and the run's reward is the mean of the two
scores. The reward is paid on the last step (earlier steps pay 0.0), in [0, 1]. With
`tool_mean_s > 0` each step first waits a log-normal "tool" time (heavy-tailed, capped
at `tool_max_s`), so a batch's runs end at very different times, as long tasks do;
the draws follow `reset(run_seed=)` when given (the runtime gives one per run), so the
same run waits the same in every layout.

Why it is learnable: the tiny model's 512-token vocabulary holds 159 number tokens
(" 1" .. " 99", digit pairs), so a random policy already emits the allowed digits
now and then; moving mass onto number tokens alone roughly doubles the reward, and
copying the named digits from the prompt takes it towards 1 (a policy that ignores
the prompt can reach at most num_digits/10).

Chance level (`turns=1`): the mean reward of `new_model(make_model_dir(...), seed=0)`
sampling at temperature 1 (top_k off), at most 16 new tokens, special tokens skipped
on decoding, over 4096 samples from 64 tasks (`tools/check_learnable.py --chance`):
0.198 for the default `num_digits=5`; 0.114 for 3; 0.397 for 10 (any digit).

Learnability (`tools/check_learnable.py`, GRPO in plain torch, one thread: 4 tasks x
8 samples per update, max 16 tokens, temperature 1, Adam lr 5e-3): the mean reward
goes from 0.21 (first 5 updates) to 0.51 (last 5 of 40; rise +0.30, seeds 1 and 2:
+0.28, +0.27) in about 5-7 s, and to 0.75 after 60 updates (above the 0.5 that a
prompt-blind policy can get).
"""

from __future__ import annotations

import asyncio
import math
import random

from gyre_slurm.envs.base import StepResult, register_env
from gyre_slurm.errors import UserError

SYSTEM_PROMPT = "Reply with a short string."
CHANCE_LEVEL = 0.198  # num_digits=5, turns=1; see the module docstring


def score(action: str, allowed: str) -> float:
    """Fraction of the non-whitespace characters of `action` that are in `allowed`."""
    chars = [c for c in action if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in allowed for c in chars) / len(chars)


def task_digits(seed: int, num_digits: int) -> str:
    """The allowed digits of a task, sorted (deterministic for the seed)."""
    rng = random.Random(seed)
    return "".join(sorted(rng.sample("0123456789", num_digits)))


def instruction(digits: str) -> str:
    return "Use only the digits " + " ".join(digits) + "."


class LearnableEnv:
    name = "learnable"

    def __init__(self, *, num_digits: int = 5, turns: int = 1, tool_mean_s: float = 0.0,
                 tool_sigma: float = 1.0, tool_max_s: float = 60.0):
        if not (0 <= tool_mean_s < math.inf and 0 <= tool_sigma < math.inf
                and 0 < tool_max_s < math.inf):  # (NaN fails each)
            raise UserError(f"learnable: tool_mean_s and tool_sigma must be finite and >= 0, "
                            f"tool_max_s finite and > 0; got tool_mean_s={tool_mean_s}, "
                            f"tool_sigma={tool_sigma}, tool_max_s={tool_max_s}")
        self.tool_mean_s, self.tool_sigma, self.tool_max_s = tool_mean_s, tool_sigma, tool_max_s
        self._rng = random.Random()  # tool latency; `reset(run_seed=)` makes it replayable
        if not 1 <= num_digits <= 10:
            raise UserError("learnable: num_digits must be in 1..10")
        if turns not in (1, 2):
            raise UserError("learnable: turns must be 1 or 2")
        self.num_digits = num_digits
        self.turns = turns
        self.system_prompt = SYSTEM_PROMPT
        self._digits = ""
        self._scores: list[float] = []
        self._done = True

    async def reset(self, *, task_id: str, seed: int, run_seed: int | None = None) -> str:
        self._digits = task_digits(seed, self.num_digits)
        # The tool times replay exactly for a run seed (the same run in every layout).
        self._rng = random.Random(run_seed) if run_seed is not None else random.Random()
        self._scores = []
        self._done = False
        return instruction(self._digits)

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("learnable: step() after the episode ended; call reset()")
        await self._tool_time()
        s = score(action, self._digits)
        self._scores.append(s)
        info = {"turn": len(self._scores), "score": s}
        if len(self._scores) < self.turns:
            obs = f"Score: {s:.2f}. Again: u{instruction(self._digits)[1:]}"
            return StepResult(obs, 0.0, False, info)
        self._done = True
        reward = sum(self._scores) / len(self._scores)
        return StepResult("", reward, True, info)

    async def _tool_time(self) -> None:
        """Checking an action takes heavy-tailed wall time (log-normal with mean
        `tool_mean_s`, capped at `tool_max_s`): the shape of long agent tasks, scaled
        down, so that runs of a batch end at very different times."""
        if self.tool_mean_s <= 0:
            return
        mu = math.log(self.tool_mean_s) - self.tool_sigma ** 2 / 2
        await asyncio.sleep(min(self.tool_max_s, self._rng.lognormvariate(mu, self.tool_sigma)))

    async def close(self) -> None:
        self._done = True


register_env("learnable", LearnableEnv)
