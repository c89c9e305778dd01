"""The run dir on the shared filesystem and the writers of its live files.

```
RUN_DIR/
  config.yaml           the resolved config, as run
  secret                the job secret (mode 0600): control channel, engines (never the gateway)
  external_key          with gateway.external on: the key of external runs (mode 0600)
  external/calls/       external runs' calls (never trained)
  status.json           current state, rewritten atomically about once a second
  events.jsonl          append-only: decisions, handoff phases, steps, failures
  calls/ runs/          the gateway's call store; run records (runs/runs.jsonl)
  stream/               micro-batches handed to the training ranks (those of the newest
                        training.keep_microbatch_steps steps stay)
  checkpoints/step_NNNNNN/  complete checkpoints (written as .tmp-*, renamed); `latest` names the newest
  weights/vNNNNNN/      the policy versions rollout servers load
  trainer_state/        the trainer's state handed from one training world to the next
  model/                the model's config and tokenizer
  logs/                 one file per node agent and per engine process
  coordinator.lock      who runs the job now (host, pid, Slurm job): one coordinator per
                        run dir (runtime.runlock); removed when the job ends
```

Access: the secret is 0600 and the model's state (`checkpoints/`, `weights/`,
`trainer_state/`) lives in 0700 directories, set explicitly whatever the umask, so
only the run's user reads them. Other files are made 0644 (status, events, logs, the
call store): as readable as the run dir itself, which is the user's to share (e.g. with
`gyre status` for a group) or not. No file of the run dir holds the secret but `secret`;
a run's own gateway key lives only in the coordinator and that run's agent.
Nothing here is unpickled: records are JSON, tensors safetensors (or `torch.load` with
`weights_only=True`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from pathlib import Path

from gyre_slurm.common.fsio import (append_jsonl, make_folder, write_bytes_atomic,
                                   write_json_atomic)
from gyre_slurm.config.loader import dump_yaml
from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.errors import UserError


PRIVATE_DIRS = ("checkpoints", "weights", "trainer_state")  # the model's state: owner only
# RunDir.stream_file's names (.json: a run dir from before the safetensors files)
STREAM_NAME = re.compile(r"step(\d{6})_mb(\d{5})\.(?:safetensors|json)")


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    # -- layout ----------------------------------------------------------------------
    @property
    def secret_file(self) -> Path:
        return self.path / "secret"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def runs_file(self) -> Path:
        return self.path / "runs" / "runs.jsonl"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def log(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"

    def stream_file(self, step: int, index: int) -> Path:
        return self.path / "stream" / f"step{step:06d}_mb{index:05d}.safetensors"

    def stream_files(self) -> list[tuple[int, int, Path]]:
        """(step, index, path) of every micro-batch file in stream/ (other names skipped)."""
        out = []
        for path in (self.path / "stream").glob("step*_mb*"):
            if m := STREAM_NAME.fullmatch(path.name):
                out.append((int(m[1]), int(m[2]), path))
        return out

    def prune_stream(self, *, before_step: int) -> int:
        """Remove the micro-batch files of the steps before `before_step` (trained: no
        rank reads them again, and a resume trains its uncommitted steps from the call
        store); how many went."""
        doomed = [path for step, _, path in self.stream_files() if step < before_step]
        for path in doomed:
            path.unlink(missing_ok=True)
        return len(doomed)

    # -- creation --------------------------------------------------------------------
    def create(self, cfg: GyreConfig, *, config: bool = True) -> None:
        """The run dir's folders, secret and modes; and config.yaml unless `config` is
        False (the coordinator writes it with `write_config` once the model and its
        first weights are made: config.yaml is what makes a folder a run to resume)."""
        make_folder(self.path, what="the run dir")
        for sub in ("calls", "runs", "stream", "logs") + PRIVATE_DIRS:
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        if config:
            self.write_config(cfg)
        self.ensure_secret()
        self.make_private()

    def write_config(self, cfg: GyreConfig) -> None:
        write_bytes_atomic(self.path / "config.yaml", dump_yaml(cfg).encode())

    def ensure_secret(self) -> None:
        """The job's secret (0600), made anew where the file is missing or empty (a run
        dir copied without it, or cleaned): every process that holds it starts with the
        job, so a resumed job may have a new one, and an empty secret would let any
        `Authorization: Bearer ` through."""
        try:
            have = bool(self.secret_file.read_text().strip())
        except FileNotFoundError:
            have = False
        if not have:
            write_bytes_atomic(self.secret_file, secrets.token_hex(32).encode(), mode=0o600)

    def clear(self) -> None:
        """Remove what a run refused as it was being made left in the run dir, keeping
        the folder and its logs (the batch job's own output, which says why); links are
        removed, never followed."""
        for child in self.path.iterdir():
            if child.name == "logs":
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def make_private(self) -> None:
        """Owner-only modes on the secret (0600) and the model's state directories (0700),
        whatever the umask; idempotent (also for a run dir made by an older gyre)."""
        for sub in PRIVATE_DIRS:
            path = self.path / sub
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        if self.secret_file.exists():
            os.chmod(self.secret_file, 0o600)

    def secret(self) -> str:
        secret = self.secret_file.read_text().strip()
        if not secret:  # `ensure_secret` ran as the job started: someone emptied it since
            raise UserError(f"{self.secret_file} is empty: the job's processes cannot "
                            f"authenticate; stop the job and resume it (a new one is made)")
        return secret

    @property
    def external_key_file(self) -> Path:
        return self.path / "external_key"

    def external_key(self) -> str:
        """The key of external runs (`gateway.external`), made on first use (0600);
        never the job secret, and it opens only external runs on the gateway."""
        if not self.external_key_file.exists():
            write_bytes_atomic(self.external_key_file,
                               ("gyre-ext-" + secrets.token_urlsafe(32)).encode(), mode=0o600)
        os.chmod(self.external_key_file, 0o600)
        return self.external_key_file.read_text().strip()

    # -- live files ------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        record = {"t": time.time(), "kind": kind, **fields}
        append_jsonl(self.events_file, record)
        return record

    def write_status(self, status: dict) -> None:
        write_json_atomic(self.status_file, status)

    def latest_checkpoint(self) -> Path | None:
        latest = self.checkpoints / "latest"
        if not latest.exists():
            return None
        target = self.checkpoints / latest.read_text().strip()
        return target if target.is_dir() else None

    def set_latest(self, name: str) -> None:
        write_bytes_atomic(self.checkpoints / "latest", name.encode())
