"""Engines by name: each name maps to a builder that imports its engine lazily, so the name lists stay
importable without torch, sglang or vllm. An entry states what its engine cannot run, checked at
submission, and an optional `probe` says why it cannot run here (a missing package, no GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from engines.training.base import TrainEngine
    from schema.engine import EngineConfig

T = TypeVar("T")
Builder = TypeVar("Builder", bound=Callable[..., Any])
Probe = Callable[[], "str | None"]


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine: its builder, availability probe and capabilities."""

    name: str
    build: Callable[..., Any]
    probe: Probe | None = None
    tensor_parallel: bool = False  # can one replica span several devices (rollout engines)
    max_lora_rank: int | None = None  # the largest LoRA rank it serves adapters of (None: any)

    def check_lora_rank(self, rank: int) -> None:
        """Refuse (ValueError) adapters of a rank this engine cannot serve."""
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise ValueError(
                f"rollout backend '{self.name}' serves LoRA adapters up to rank {self.max_lora_rank}, not "
                f"{rank}: choose a rank of at most {self.max_lora_rank}, or another rollout.backend"
            )


class Registry(Generic[T]):
    """name -> builder. `kind` names the setting in error messages, e.g. 'rollout backend'."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, EngineEntry] = {}

    def register(
        self,
        name: str,
        *,
        probe: Probe | None = None,
        tensor_parallel: bool = False,
        max_lora_rank: int | None = None,
    ) -> Callable[[Builder], Builder]:
        """Decorator: `@REGISTRY.register("name")` over a function that builds the engine."""

        def decorate(builder: Builder) -> Builder:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._entries[name] = EngineEntry(name, builder, probe, tensor_parallel, max_lora_rank)
            return builder

        return decorate

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> EngineEntry:
        """The entry of `name`; an unknown name raises ValueError listing the choices."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} '{name}': choose one of {self.names()}")
        return self._entries[name]

    def check(self, name: str) -> str:
        """`name` when registered (a validator's body); else the ValueError of `entry`."""
        self.entry(name)
        return name

    def available(self) -> dict[str, str | None]:
        """Each name mapped to None when usable here, or to the reason it is not."""
        return {name: entry.probe() if entry.probe else None for name, entry in self._entries.items()}

    def build(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Probe, then build the named engine; a failed probe raises ImportError with its reason."""
        entry = self.entry(name)
        problem = entry.probe() if entry.probe else None
        if problem is not None:
            raise ImportError(problem)
        return entry.build(*args, **kwargs)


TRAIN_ENGINES: Registry[TrainEngine] = Registry("training engine")


@TRAIN_ENGINES.register("fsdp")
def _build_fsdp(config: EngineConfig) -> TrainEngine:
    from engines.training.fsdp.engine import FSDPEngine

    return FSDPEngine(config)


def build_train_engine(config: EngineConfig) -> TrainEngine:
    """The training engine `config.engine` names, constructed (call `initialize()` next)."""
    return TRAIN_ENGINES.build(config.engine, config)
