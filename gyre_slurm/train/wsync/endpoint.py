"""A member's side of the weight-transfer group, across rounds: its group and plan.

Every member (a training rank, a rollout server's worker) is told, at each new
generation, the same `init_info` (JSON, from the coordinator):

    {"generation", "world_size", "store_host", "store_port", "backend", "timeout_s",
     "plan": Plan.to_json(), "rank" (a training rank) | "rank_offset" (a server: its
     workers are rank_offset + their rank inside the server), "host" (where gloo binds)}

and, per round, `{"generation", "version", ...}`: a round of another generation than
the member's is refused (`StaleGeneration`), as is joining a generation that is not the
store's current one.
"""

from __future__ import annotations

import logging
from typing import Any

from gyre_slurm.train.dist import StaleGeneration, TransferGroup, TransferSpec, \
    join_transfer_group
from gyre_slurm.train.wsync import plan as planlib
from gyre_slurm.train.wsync import stream

log = logging.getLogger(__name__)

__all__ = ["Endpoint", "StaleGeneration", "StreamSender"]


def wire_device(group: TransferGroup, device):
    """Where pieces travel from: the member's device over NCCL, host memory over gloo
    (a GPU member staging through the host: a trainer and a server sharing GPUs)."""
    import torch

    return device if group.spec.backend == "nccl" else torch.device("cpu")


class Endpoint:
    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.plan: planlib.Plan | None = None

    @property
    def generation(self) -> int | None:
        return None if self.group is None else self.group.generation

    def join(self, info: dict[str, Any], *, rank: int, host: str | None = None) -> dict:
        """Leave the current generation (if any) and join `info`'s as `rank`."""
        generation = int(info["generation"])
        if self.group is not None and generation <= self.group.generation:
            raise StaleGeneration(f"transfer generation {generation} refused: this member "
                                  f"is in generation {self.group.generation} already")
        plan = planlib.from_json(info["plan"])
        self.leave()
        spec = TransferSpec(generation=generation, world_size=int(info["world_size"]),
                            store_host=str(info["store_host"]),
                            store_port=int(info["store_port"]),
                            backend=str(info.get("backend", "gloo")),
                            timeout_s=float(info.get("timeout_s", 60.0)))
        self.group = join_transfer_group(spec, rank, host=host or info.get("host"))
        self.plan = plan
        return {"generation": generation, "rank": rank, "fingerprint": plan.fingerprint}

    def check(self, generation: int) -> tuple[TransferGroup, planlib.Plan]:
        if self.group is None or self.plan is None:
            raise StaleGeneration(f"transfer generation {generation} refused: this member "
                                  "is in no transfer group (init it first)")
        self.group.check(int(generation))
        return self.group, self.plan

    def leave(self) -> None:
        group, self.group, self.plan = self.group, None, None
        if group is not None:
            group.close()


class StreamSender:
    """The training rank's side, mixed into both trainer workers. A worker provides
    `hf_pieces()` ({hf name: (tensor, TP concat dim or None)}: its shard, in Hugging
    Face names, views where possible), `wsync_layout()` (the plan layout it holds) and
    `rank`, `device`; a rebuild of its training world calls `wsync_leave()`."""

    _wsync: Endpoint | None = None

    def wsync_join(self, *, transfer: dict, rank: int, host: str | None = None) -> dict:
        """Join a transfer generation as `rank` (this rank's world rank)."""
        if self.model is None or self.rank is None:
            raise RuntimeError("wsync_join: this rank is in no training world")
        if rank != self.rank:
            raise ValueError(f"wsync_join: transfer rank {rank} for world rank {self.rank} "
                             "(training ranks keep their world rank)")
        want = self.wsync_layout()
        got = planlib.from_json(transfer["plan"]).layout
        if got != want:
            raise ValueError(f"wsync_join: the plan is for trainer layout {got}, this rank "
                             f"is in {want}")
        if self._wsync is None:
            self._wsync = Endpoint()
        return self._wsync.join(transfer, rank=rank, host=host)

    def wsync_send(self, *, generation: int, targets: list[int]) -> dict:
        """Send this rank's pieces of the policy to transfer ranks `targets`."""
        if self._wsync is None:
            raise StaleGeneration(f"transfer generation {generation} refused: this rank is "
                                  "in no transfer group")
        group, plan = self._wsync.check(generation)
        try:
            out = stream.send(group, plan, self.hf_pieces(),
                              targets=[int(t) for t in targets], device=wire_device(group,
                                                                                   self.device))
        except stream.TransferTimeout as exc:  # a hung target: the group is closed
            self._wsync.leave()
            return {"timed_out_target": exc.target, "error": str(exc)[:300],
                    "bytes": exc.sent, "version": self.version, "rank": self.rank}
        return {**out, "version": self.version, "rank": self.rank}

    def wsync_leave(self) -> dict:
        if self._wsync is not None:
            self._wsync.leave()
        return {}
