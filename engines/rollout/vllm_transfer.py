"""vLLM weight-transfer backend "tandem-inproc": weights handed over inside one process.

vLLM's RL weight-update session (start_weight_update / update_weights / finish_weight_update)
delegates transport to a WeightTransferEngine chosen by `weight_transfer_config.backend`. Its
built-in backends ship tensors between processes (NCCL broadcasts, CUDA IPC handles). With the
engine core in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the update info reaches
the worker as the Python object it was, so this backend's update info is the bucket itself:
(HF name, tensor) pairs, loaded with the model's own `load_weights`. Like vLLM's nccl and ipc
backends it loads inside the layerwise-reload lifecycle (vllm/model_executor/model_loader/reload),
which re-runs each layer's post-load processing once all of its weights have arrived.

Imported only by engines/rollout/vllm.py, after vllm is known to be installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload


@dataclass
class InProcessInitInfo(WeightTransferInitInfo):
    """Nothing to set up: there is no connection."""


@dataclass
class InProcessUpdateInfo(WeightTransferUpdateInfo):
    named_tensors: list[tuple[str, torch.Tensor]]


class InProcessWeightTransferEngine(WeightTransferEngine[InProcessInitInfo, InProcessUpdateInfo]):
    init_info_cls = InProcessInitInfo
    update_info_cls = InProcessUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: InProcessInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: InProcessUpdateInfo) -> None:
        try:
            self.model.load_weights(update_info.named_tensors)
        except BaseException:
            # vLLM's worker ends the session on a failed chunk without finishing it, which would
            # leave the layers still waiting for weights on the meta device: put them back.
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
