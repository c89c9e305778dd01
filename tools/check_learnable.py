#!/usr/bin/env python
"""Prove that the `learnable` environment is learnable by the tiny local model.

A self-contained GRPO loop in plain torch (not the project's trainer): per update,
`--prompts` tasks from `tasks_for_step("learnable", ...)`, `--group` samples each at
`--temperature` (top_k off), at most `--max-tokens` new tokens; rewards from the real
environment (reset + step); advantages normalised within each group (reward minus the
group mean, over the group std + 1e-6); loss = -mean over samples of advantage x the
sum of the sampled tokens' log-probabilities (the eos token included) / max tokens;
Adam. Prints the mean reward per update, then the mean of the first and last
`--window` updates; exits 1 when the rise is below `--min-rise`.

    tools/gyre-env python tools/check_learnable.py            # the learning curve
    tools/gyre-env python tools/check_learnable.py --chance   # chance level only
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.envs import make_env, tasks_for_step  # noqa: E402
from gyre_slurm.models.tiny import (  # noqa: E402
    chat_prompt_ids, load_tokenizer, make_model_dir, new_model)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--prompts", type=int, default=4, help="tasks per update")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-digits", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--min-rise", type=float, default=0.2)
    p.add_argument("--chance", action="store_true", help="measure the chance level only")
    p.add_argument("--chance-tasks", type=int, default=64)
    p.add_argument("--chance-samples", type=int, default=64, help="per task")
    return p.parse_args(argv)


@torch.no_grad()
def sample(model, prompt_ids, *, n, max_tokens, temperature, eos_id):
    """n sampled continuations of one prompt: (tokens [n, T], mask [n, T])."""
    x = torch.tensor([prompt_ids] * n)
    out = model(input_ids=x, use_cache=True)
    past, logits = out.cache, out.logits[:, -1]
    toks, alive, mask = [], torch.ones(n, dtype=torch.bool), []
    for _ in range(max_tokens):
        probs = torch.softmax(logits / temperature, dim=-1)
        t = torch.multinomial(probs, 1).squeeze(1)
        toks.append(t)
        mask.append(alive.clone())
        alive &= t != eos_id
        if not alive.any():
            break
        out = model(input_ids=t[:, None], cache=past, use_cache=True)
        past, logits = out.cache, out.logits[:, -1]
    return torch.stack(toks, 1), torch.stack(mask, 1)


def seq_logprob(model, prompt_ids, toks, mask, temperature):
    """Sum over the sampled tokens of log p (at the sampling temperature), per sample."""
    n, t = toks.shape
    x = torch.cat([torch.tensor([prompt_ids] * n), toks], 1)
    logits = model(input_ids=x).logits[:, len(prompt_ids) - 1:-1] / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, toks[..., None]).squeeze(-1)
    return (lp * mask).sum(1)


def rewards_for(env_params, task, texts) -> list[float]:
    async def one(text):
        env = make_env("learnable", **env_params)
        await env.reset(task_id=task.task_id, seed=task.seed)
        res = await env.step(text)
        while not res.done:  # turns=2: the same reply again
            res = await env.step(text)
        await env.close()
        return res.reward

    async def all_():
        return [await one(t) for t in texts]
    return asyncio.run(all_())


def decode(tok, toks, mask):
    return [tok.decode([int(i) for i, m in zip(row, mrow) if m], skip_special_tokens=True)
            for row, mrow in zip(toks, mask)]


def group(model, tok, task, args, env_params):
    msgs = [{"role": "system", "content": make_env("learnable").system_prompt},
            {"role": "user", "content": _instruction(task, env_params)}]
    prompt = chat_prompt_ids(tok, msgs)
    toks, mask = sample(model, prompt, n=args.group, max_tokens=args.max_tokens,
                        temperature=args.temperature, eos_id=tok.eos_token_id)
    return prompt, toks, mask, rewards_for(env_params, task, decode(tok, toks, mask))


def _instruction(task, env_params) -> str:
    async def first():
        return await make_env("learnable", **env_params).reset(task_id=task.task_id,
                                                              seed=task.seed)
    return asyncio.run(first())


def chance(model, tok, args, env_params) -> float:
    tasks = tasks_for_step("learnable", step=10**6, num_prompts=args.chance_tasks,
                           seed=args.seed)
    args.group = args.chance_samples
    rewards = []
    for task in tasks:
        rewards += group(model, tok, task, args, env_params)[3]
    return sum(rewards) / len(rewards)


def train(model, tok, args, env_params) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    curve = []
    for update in range(args.updates):
        t0 = time.monotonic()
        tasks = tasks_for_step("learnable", step=update, num_prompts=args.prompts,
                               seed=args.seed)
        loss, all_r = 0.0, []
        for task in tasks:
            prompt, toks, mask, r = group(model, tok, task, args, env_params)
            rt = torch.tensor(r)
            adv = (rt - rt.mean()) / (rt.std() + 1e-6)
            lp = seq_logprob(model, prompt, toks, mask.float(), args.temperature)
            loss = loss - (adv * lp).mean() / args.max_tokens / len(tasks)
            all_r += r
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(sum(all_r) / len(all_r))
        print(f"update {update:3d}  mean reward {curve[-1]:.3f}  "
              f"({time.monotonic() - t0:.2f}s)", flush=True)
    return curve


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env_params = {"num_digits": args.num_digits}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model")
        tok = load_tokenizer(model_dir)
        model = new_model(model_dir, seed=args.seed)
    if args.chance:
        print(f"chance level: {chance(model, tok, args, env_params):.4f} "
              f"({args.chance_tasks} tasks x {args.chance_samples} samples)")
        return 0
    t0 = time.monotonic()
    curve = train(model, tok, args, env_params)
    w = min(args.window, len(curve))
    first, last = sum(curve[:w]) / w, sum(curve[-w:]) / w
    rise = last - first
    print(f"first {w}: {first:.3f}  last {w}: {last:.3f}  rise {rise:+.3f}  "
          f"({time.monotonic() - t0:.0f}s, lr {args.lr}, group {args.group}, "
          f"prompts {args.prompts}, max tokens {args.max_tokens}, "
          f"temperature {args.temperature})")
    return 0 if rise >= args.min_rise else 1


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
