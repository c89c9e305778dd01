"""gyre's weight-transfer engine for vLLM (`--weight-transfer-config '{"backend": "gyre"}'`),
registered in vLLM's own framework (`vllm.distributed.weight_transfer`).

vLLM's workers run it; importing this module registers it with
`WeightTransferEngineFactory`, and the server imports it in every worker through
`--worker-extension-cls gyre_slurm.engines.vllm_wsync.GyreWorkerExtension` (the module
is imported when the worker is made, before the model loads and the engine is
created). The server's own RL routes drive it, as they drive vLLM's NCCL engine:

    POST /init_weight_transfer_engine  {"init_info": see gyre_slurm.train.wsync.endpoint}
    POST /start_weight_update          layerwise reload begins (vLLM's own lifecycle)
    POST /update_weights               {"update_info": {"generation", "version"}}: every
                                       bucket of the plan is received from the training
                                       ranks that hold its pieces and handed to
                                       model.load_weights (vLLM reshards it to this
                                       server's TP layout)
    POST /finish_weight_update         {"weight_version": "N"}: layerwise reload ends
    POST /shutdown_weight_transfer_engine

Why not vLLM's NCCL engine (or its nccl_m2n reshard) here: its trainer side is a single
sender (rank 0 broadcasts every tensor, so every stage's shards funnel through one rank)
built on vLLM's PyNccl and StatelessProcessGroup, which the training ranks cannot
import (Megatron runs on Python 3.12 without vLLM); nccl_m2n needs NVIDIA's
nccl-extensions. This engine takes each piece from the rank that holds it, over a torch
process group: gloo on CPU (CI), NCCL on GPUs (`init_info["backend"]`), and uses vLLM's
layerwise reload exactly as the NCCL engine does.

A round that failed half-way leaves some layers reloaded: the next start_weight_update
finishes the old reload before it begins a new one, and the coordinator keeps such a
server out of service until a round succeeds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from gyre_slurm.engines import vllm_cpu_moe  # noqa: F401  (installs its fix)
from gyre_slurm.engines import vllm_cpu_tied  # noqa: F401  (installs its fix)
from gyre_slurm.train.wsync import stream
from gyre_slurm.train.wsync.endpoint import Endpoint, wire_device

log = logging.getLogger(__name__)

BACKEND = "gyre"


@dataclass
class GyreInitInfo(WeightTransferInitInfo):
    generation: int
    world_size: int
    store_host: str
    store_port: int
    rank_offset: int
    plan: dict = field(repr=False)
    backend: str = "gloo"
    timeout_s: float = 60.0
    host: str | None = None


@dataclass
class GyreUpdateInfo(WeightTransferUpdateInfo):
    generation: int
    version: int | None = None


class GyreWeightTransferEngine(WeightTransferEngine[GyreInitInfo, GyreUpdateInfo]):
    init_info_cls = GyreInitInfo
    update_info_cls = GyreUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint = Endpoint()
        self._reloading = False  # a layerwise reload begun and not finished
        self.last: dict[str, Any] = {}

    def _worker_rank(self) -> int:
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: GyreInitInfo) -> None:
        rank = init_info.rank_offset + self._worker_rank()
        self.endpoint.join(vars(init_info), rank=rank, host=init_info.host)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload, initialize_layerwise_reload)

        if self._reloading:  # the last round failed half-way
            log.warning("a weight update was left unfinished: finishing it first")
            finalize_layerwise_reload(self.model, self.model_config)
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GyreUpdateInfo) -> None:
        group, plan = self.endpoint.check(update_info.generation)
        self.last = stream.receive(group, plan, load=self.model.load_weights,
                                   device=wire_device(group, self.device))
        log.info("received policy version %s: %d buckets, %.1f MB in %.3f s",
                 update_info.version, self.last["buckets"], self.last["bytes"] / 1e6,
                 self.last["seconds"])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False

    def shutdown(self) -> None:
        self.endpoint.leave()


class GyreWorkerExtension:
    """Named by `--worker-extension-cls` so that vLLM imports this module in each worker
    (which registers the engine); it adds no method to the worker."""


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GyreWeightTransferEngine)


register()
