"""The run dir made for a fresh start, or checked for `--resume`, before any process of
the job starts (`RunDirSetup.prepare`, called by the coordinator).

Fresh: the folders, secret and modes, then the model (a Hugging Face model dir linked,
or the tiny model made) and its version-0 weights, then config.yaml last: config.yaml is
what makes a folder a run to resume, so a job stopped while it made the model starts
afresh when run (or requeued) again.

Resume: what `--set` changes is checked (what the run dir's state was made of cannot
change) and written to config.yaml, which every process reads; the model files and the
weights the run needs are checked, naming the file and how to restore it; the secret and
the owner-only modes are put back where a copy lost them.
"""

from __future__ import annotations

from gyre_slurm.config.schema import GyreConfig, load_config
from gyre_slurm.errors import UserError
from gyre_slurm.models import tiny
from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.runtime.runlock import LOCK_FILE


class RunDirSetup:
    def __init__(self, cfg: GyreConfig, rd: RunDir, *, resume: bool):
        self.cfg, self.rd, self.resume = cfg, rd, resume
        self.made_fresh = False  # this job made the run dir's contents (`prepare`)

    def prepare(self) -> checkpoint.Resume:
        """Create the run dir (or check it for --resume); where the job starts."""
        if self.resume:
            changes = self._resume_changes()
            self._check_model_files()  # before load_for_resume logs anything
            start = checkpoint.load_for_resume(self.rd)
            if "workload.num_steps" in changes and start.version > self.cfg.workload.num_steps:
                raise UserError(f"--set workload.num_steps={self.cfg.workload.num_steps}: "
                                f"the run has trained {start.version} steps; give at least "
                                f"that many (or leave it as it was)")
            self._check_weights_file(start.version)
            self.rd.ensure_secret()  # a run dir copied or cleaned without it
            self.rd.make_private()  # and the owner-only modes, whatever the copy kept
            if changes:  # every process of the job reads config.yaml: one config for all
                self.rd.write_config(self.cfg)
                self.rd.event("config_changed", changes={
                    k: [old, new] for k, (old, new) in changes.items()})
            return start
        # Fresh: nothing there but the logs the batch script or `gyre submit` made.
        self.made_fresh = not self.rd.path.exists() or all(
            (p.name == "logs" and p.is_dir()) or p.name == LOCK_FILE
            for p in self.rd.path.iterdir())
        # config.yaml last: a job stopped while it made the model (preempted in its first
        # seconds) left a config.yaml and no model, and its requeue's --resume was
        # refused; without config.yaml the same command (or the requeue) starts afresh.
        self.rd.create(self.cfg, config=False)
        self._make_model()
        self.rd.write_config(self.cfg)
        return checkpoint.Resume(0, None)

    def _make_model(self) -> None:
        """The run's model dir and its version-0 weights: the Hugging Face model of
        `model.path` (linked), or the tiny model the config describes."""
        model = self.cfg.model
        if model.path is not None:  # a Hugging Face model dir: linked, not copied
            from gyre_slurm.models.weights import import_model_dir

            tr, agent = self.cfg.trainer, self.cfg.agent
            # every agent but a scaffold of type command (which may call /v1/completions)
            # calls /chat/completions: the model needs a chat template that renders
            chat = any(s.type != "command"
                       for s in (agent.scaffold, *agent.scaffold_per_task.values()))
            try:
                import_model_dir(model.path, self.rd.model_dir, tiny.weights_dir(self.rd.path, 0),
                                 layout=(tr.tensor_parallel, tr.pipeline_parallel,
                                         tr.expert_parallel)
                                 if tr.backend == "megatron" else None, chat=chat,
                                 max_model_len=self.cfg.rollout.max_model_len
                                 if self.cfg.rollout.engine == "vllm" else None)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            return
        tiny.make_model_dir(self.rd.model_dir, hidden_size=model.hidden_size,
                            num_layers=model.layers, num_heads=model.heads,
                            family=model.family, num_experts=model.experts,
                            experts_per_token=model.experts_per_token,
                            max_positions=max(4096, self.cfg.rollout.max_model_len))
        tiny.save_weights(tiny.new_model(self.rd.model_dir, seed=self.cfg.seed),
                          tiny.weights_dir(self.rd.path, 0))

    def _resume_changes(self) -> dict:
        """What `--set` changes in the run dir's config.yaml on resume (key -> (old,
        new)); a change to what the run dir's state was made of is refused. The node
        agents, ranks and engines read config.yaml: the changes are written there before
        any starts (before, they reached the coordinator alone: a resumed
        `--set optimizer.lr=...` never reached the trainer)."""
        from gyre_slurm.config.schema import changed_keys, check_resume_changes

        changes = changed_keys(load_config(self.rd.path / "config.yaml"), self.cfg)
        check_resume_changes(changes)
        return changes

    def _check_model_files(self) -> None:
        """Resuming needs the run dir's model (config and tokenizer: every engine, rank
        and the gateway read them) and the policy's version 0 (the ranks' initial
        weights, and the servers' until the first sync), checked before anything starts:
        a run dir copied without them, or with a file garbled, failed deep in a process
        with a traceback."""
        from gyre_slurm.models.weights import check_model_files

        restore = ("restore it from the run dir's copy or backup (the run made it at its "
                   "start" + (f", linking model.path {self.cfg.model.path}"
                              if self.cfg.model.path else "") + ")")
        try:
            check_model_files(self.rd.model_dir, what="--resume: the run's model")
        except ValueError as exc:
            raise UserError(f"{exc}; {restore}") from None
        try:
            tiny.verify_weights(tiny.weights_dir(self.rd.path, 0))
        except tiny.CorruptWeights as exc:
            raise UserError(f"--resume: the policy's version 0 (the training ranks' "
                            f"initial weights): {exc}; {restore}") from None

    def _check_weights_file(self, version: int) -> None:
        """Resuming with rollout.weight_sync: file needs the weights file of `version`
        (a streamed run writes none)."""
        if self.cfg.rollout.weight_sync != "file":
            return
        try:
            tiny.verify_weights(tiny.weights_dir(self.rd.path, version))
        except tiny.CorruptWeights as exc:
            raise UserError(f"--resume with rollout.weight_sync: file needs the weights of "
                            f"policy version {version}: {exc}. A run that streamed its "
                            f"weights writes none: resume it with --set "
                            f"rollout.weight_sync=stream") from None
