"""The work ledger: what rollout has finished and training has not, in tokens, per step
and group. Pure: no I/O, no clock, no payloads.

The runtime (`runtime.book.StepBook`, which also holds the trajectories themselves) and
the simulator keep one each, fed the same events, so the policy observes the same
quantities in both (`sched.observe`):

- a run finishes (`run_finished`): its tokens are *done*; when the last run of its group
  has finished, the group's tokens become *ready* (the group baseline of the advantage
  needs every reward);
- training takes ready tokens (`hand_out`: now *in progress*) and finishes them
  (`train_done`: *trained*); a step whose gradients were lost (`rewind`) has its trained
  tokens in progress again, to be trained again;
- *trainable* tokens of a step are its ready ones when streaming; without streaming,
  only once the whole batch has finished and nothing of it is in progress;
- *waiting* tokens are done but neither trained, in progress nor trainable: open groups
  of the step being trained, and every finished run of a later step.

Groups are numbered globally: group g of step s is `s * groups_per_step + g`.
"""

from __future__ import annotations

import numpy as np


class WorkLedger:
    def __init__(self, *, num_steps: int, groups_per_step: int, group_size: int):
        self.num_steps, self.groups_per_step, self.group_size = \
            num_steps, groups_per_step, group_size
        steps = np.zeros(num_steps, dtype=np.int64)
        self.runs_left = steps + groups_per_step * group_size  # runs not finished
        self.done = steps.copy()  # tokens of finished runs
        self.ready = steps.copy()  # trainable (groups complete), not handed out
        self.in_progress = steps.copy()  # handed out to training, not trained
        self.trained = steps.copy()
        self.runs_ready = steps.copy()  # runs of complete groups
        self.group_left = np.full(num_steps * groups_per_step, group_size, dtype=np.int64)
        self.group_tokens = np.zeros(num_steps * groups_per_step, dtype=np.int64)
        self.done_total = 0
        self.trained_total = 0
        self.in_progress_total = 0

    # -- events ------------------------------------------------------------------------
    def run_finished(self, *, step: int, group: int, tokens: int) -> bool:
        """A run of `step` in global group `group` finished with `tokens` to train (0:
        failed); True when its group became ready."""
        self.runs_left[step] -= 1
        self.done[step] += tokens
        self.done_total += tokens
        self.group_left[group] -= 1
        self.group_tokens[group] += tokens
        if self.group_left[group] == 0:
            self.ready[step] += self.group_tokens[group]
            self.runs_ready[step] += self.group_size
            return True
        return False

    def hand_out(self, step: int, tokens: int) -> None:
        self.ready[step] -= tokens
        self.in_progress[step] += tokens
        self.in_progress_total += tokens

    def train_done(self, step: int, tokens: int) -> None:
        self.in_progress[step] -= tokens
        self.in_progress_total -= tokens
        self.trained[step] += tokens
        self.trained_total += tokens

    def rewind(self, step: int) -> None:
        """The step's accumulated gradients were lost: what it trained is in progress
        again (trained again, in the same order)."""
        again = int(self.trained[step])
        self.trained[step] = 0
        self.trained_total -= again
        self.in_progress[step] += again
        self.in_progress_total += again

    def trained_before(self, version: int) -> None:
        """Resume: the steps a checkpoint holds are trained; their runs are over."""
        self.runs_left[:version] = 0

    # -- questions -----------------------------------------------------------------------
    def trainable(self, step: int, *, streaming: bool) -> int:
        if step >= self.num_steps:
            return 0
        whole = self.runs_left[step] == 0 and \
            self.ready[step] + self.trained[step] == self.done[step]
        return int(self.ready[step]) if streaming or whole else 0

    def waiting(self, step: int, *, streaming: bool) -> int:
        """Tokens of finished runs that cannot be trained yet (module docstring)."""
        return int(self.done_total - self.trained_total - self.in_progress_total
                   - self.trainable(step, streaming=streaming))

    def step_runs_left(self, step: int) -> int:
        return int(self.runs_left[step]) if step < self.num_steps else 0

    def step_trained(self, step: int) -> bool:
        """Every run of the step finished and every token of it trained."""
        return bool(self.runs_left[step] == 0 and self.trained[step] == self.done[step])
