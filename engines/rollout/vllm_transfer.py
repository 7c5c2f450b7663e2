"""vLLM weight-transfer backend "tandem-inproc": the update info is the bucket itself.

With the engine core in this process the (HF name, tensor) pairs reach vLLM's worker as they are and
load through the model's own `load_weights`, inside vLLM's layerwise-reload lifecycle like its nccl
and ipc backends. Imported by vLLM (by name) only after vllm is known to be installed.
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
    pass


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
            # vLLM ends the session on a failed chunk without finishing it: the layers would stay on meta.
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
