"""One base model and many LoRA adapters on it, each with its own gradients and AdamW state: a training
engine whose every operation names its adapter. The base is read once (`BASE_LOADS`) and frozen;
adapters live in the multi-LoRA layers' tables, many adapters' calls run as one right-padded forward
and one backward in parts of at most `max_batch_tokens`, and beyond `max_resident` the least recently
used adapters are offloaded (lora_sessions.py). Single rank, no FSDP.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tensordict import TensorDict

from engines.training.adamw import AdamWSettings
from engines.training.base import EngineOutput, GlobalCounts, LossFn
from engines.training.fsdp.lora import adapter_config_dict
from engines.training.lora_sessions import Session, SessionSpec, read_pack, read_spec
from engines.training.multi_lora import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    attach,
    detach,
    from_peft_tensors,
    init_adapter,
    inject,
    linear_modules,
)
from engines.training.multi_lora import rows as rows_of
from engines.training.multi_lora_sample import SampleRequest, Sequence, sample
from schema.engine import LoraConfig, OptimizerConfig

BASE_LOADS = 0  # reads of base weights in this process: the API's tests assert it stays 1


class InputError(ValueError):
    """A caller's input the engine cannot take; `field` names it."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class EngineOptions:
    max_rank: int = 64
    max_resident: int = 8  # adapters attached at once (sessions and sampler snapshots)
    lora_alpha: float = 32.0
    seed: int = 0  # an adapter's initialisation seed when its creation names none
    max_batch_tokens: int = 16384  # padded tokens of one forward part
    device: str | None = None  # None: cuda when there is one
    offload: str | None = None  # "memory" or "disk"; None: disk on CPU, memory on a GPU

    @classmethod
    def of(cls, raw: dict) -> EngineOptions:
        """From a host's options (`max_resident_adapters` for `max_resident`; unknown keys ignored)."""
        names = {"max_resident_adapters": "max_resident"}
        known = {names.get(k, k): v for k, v in raw.items() if names.get(k, k) in cls.__dataclass_fields__}
        options = cls(**known)
        return replace(options, max_resident=max(1, options.max_resident))


def _load_base(model_path: str, device: torch.device) -> torch.nn.Module:
    global BASE_LOADS
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    BASE_LOADS += 1
    model.to(device).eval().requires_grad_(False)  # eval: no dropout; the base stays frozen
    return model


class AdapterEngine:
    def __init__(self, model_path: str, workdir: Path, options: EngineOptions) -> None:
        from engines.rollout.base import read_special_token_ids

        self.model_path, self.workdir, self.options = str(model_path), Path(workdir), options
        self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        offload = options.offload or ("disk" if self.device.type == "cpu" else "memory")
        self.offload_dir = self.workdir / "offload" if offload == "disk" else None
        self.model = _load_base(self.model_path, self.device)
        targets = linear_modules(self.model, ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES)
        self.layers = inject(self.model, targets)
        self.eos_ids, self.pad_id = read_special_token_ids(self.model_path)
        self.vocab = int(self.model.config.vocab_size)
        self.max_seq_len = int(self.model.config.max_position_embeddings)
        self.sessions: dict[str, Session] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # attached keys ("m:" session, "s:" snapshot)

    def adapter_spec(self, rank: int, seed: int | None, attn: bool, mlp: bool, unembed: bool) -> SessionSpec:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.options.max_rank:
            raise InputError(
                "rank",
                f"must be an integer in [1, {self.options.max_rank}] (this host's max_rank), got {rank!r}",
            )
        chosen = ((ATTN_MODULES, attn), (MLP_MODULES, mlp), (UNEMBED_MODULES, unembed))
        names = tuple(name for modules, on in chosen if on for name in modules)
        if not names:
            raise InputError("train_mlp", "at least one of train_attn, train_mlp, train_unembed must be true")
        seed = self.options.seed if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InputError("seed", "must be an integer")
        paths = tuple(linear_modules(self.model, names))
        return SessionSpec(rank, self.options.lora_alpha, seed, paths, attn, mlp, unembed)

    def create_adapter(self, key: str, spec: SessionSpec) -> Session:
        if key in self.sessions:
            raise InputError("model_id", f"model {key!r} exists on this host")
        weights = init_adapter(self.layers, list(spec.paths), spec.rank, spec.seed, self.device)
        self.sessions[key] = Session(key, spec, weights, self.device)
        return self._adapter(key)

    def session(self, key: str) -> Session:
        if key not in self.sessions:
            raise InputError("model_id", f"no model {key!r} on this host")
        return self.sessions[key]

    def drop_adapter(self, key: str) -> None:
        self.session(key)
        self._forget(f"m:{key}")
        self.sessions.pop(key).discard()

    def _forget(self, key: str) -> None:
        detach(self.layers, key)
        self.lru.pop(key, None)

    def make_resident(self, keys: set[str]) -> None:
        for key in sorted(keys):
            if key not in self.lru:
                self._bring_in(key)
            self.lru.move_to_end(key)
        for key in [k for k in self.lru if k not in keys][
            : max(0, len(self.lru) - self.options.max_resident)
        ]:
            self._forget(key)
            if key.startswith("m:") and key[2:] in self.sessions:
                self.sessions[key[2:]].offload(self.offload_dir)

    def _bring_in(self, key: str) -> None:
        if key.startswith("m:"):
            session = self.sessions[key[2:]]
            if not session.resident:
                session.restore()
            attach(self.layers, key, session.weights, session.spec.scaling)
        else:
            folder = Path(key[2:])
            weights = from_peft_tensors(read_pack(folder, optimizer=False)["weights"])
            on_device = {p: (a.to(self.device), b.to(self.device)) for p, (a, b) in weights.items()}
            attach(self.layers, key, on_device, read_spec(folder).scaling)
        self.lru[key] = None

    def forward_backward_batch(
        self,
        batch: TensorDict,
        loss_fn: LossFn | None,
        forward_only: bool = False,
        compute_entropy: bool = False,
        temperature: float = 1.0,
        counts: GlobalCounts | None = None,
        adapter: str | None = None,
    ) -> EngineOutput:
        """`TrainEngine.forward_backward_batch` on `adapter` (None: the frozen base, forward only), the
        batch as one micro-batch, without entropy."""
        if compute_entropy:
            raise ValueError("the adapter engine does not compute entropy")
        out: dict = {}

        def loss(_: int, log_probs: torch.Tensor) -> tuple[torch.Tensor | None, None]:
            out["log_probs"] = log_probs.detach()
            if loss_fn is None:
                return None, None
            value, out["metrics"] = loss_fn(
                batch, {"log_probs": log_probs}, counts or GlobalCounts.of([batch])
            )
            return value, None

        backward = not forward_only and adapter is not None
        self.forward_backward([(adapter, batch)], loss, [backward], temperature)
        return EngineOutput({"log_probs": out["log_probs"]}, out.get("metrics", {}))

    def forward_backward(
        self,
        calls: list[tuple[str | None, TensorDict]],
        loss: callable,
        backward: list[bool],
        temperature: float = 1.0,
    ) -> list[object]:
        """`loss(i, log_probs)` -> (scalar or None, result) of each call i on its rows' response log-probs,
        one forward per `max_batch_tokens` part and one backward through the losses where `backward[i]`."""
        self.make_resident({f"m:{key}" for key, _ in calls if key is not None})
        results: list[object] = [None] * len(calls)
        for part in self._by_tokens(calls):
            with torch.set_grad_enabled(any(backward[i] for i in part)):
                groups = [(None if calls[i][0] is None else f"m:{calls[i][0]}", calls[i][1]) for i in part]
                total = None
                for i, lps in zip(part, self.response_logprobs(groups, temperature), strict=True):
                    value, results[i] = loss(i, lps)
                    if backward[i] and value is not None:
                        total = value if total is None else total + value
                if total is not None:
                    total.backward()  # each adapter's rows feed only its own loss: one backward for all
        return results

    def _by_tokens(self, calls: list[tuple[str | None, TensorDict]]) -> list[list[int]]:
        """Consecutive parts of at most `max_batch_tokens` padded tokens (each call whole), so that peak
        activation memory stays bounded however many adapters share the forward."""
        parts: list[list[int]] = [[]]
        n_rows, width = 0, 0
        for i, (_, rows) in enumerate(calls):
            n, w = rows["input_ids"].shape
            if parts[-1] and (n_rows + n) * max(width, w) > self.options.max_batch_tokens:
                parts.append([])
                n_rows, width = 0, 0
            parts[-1].append(i)
            n_rows, width = n_rows + n, max(width, w)
        return parts

    def response_logprobs(
        self, groups: list[tuple[str | None, TensorDict]], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per group, the log-probs of `target_tokens` ([n, R] or [n, R, K]; else `responses`) at each
        response column, every group's rows right-padded into one forward through its adapter."""
        width = max(rows["input_ids"].shape[1] for _, rows in groups)
        ids = torch.cat([_pad(rows["input_ids"], width, self.pad_id) for _, rows in groups])
        mask = torch.cat([_pad(rows["attention_mask"], width, 0) for _, rows in groups])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with rows_of(self.layers, [(key, len(rows)) for key, rows in groups]):
            logits = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
            ).logits
        out, start = [], 0
        for _, rows in groups:
            n, t, r = len(rows), rows["input_ids"].shape[1], rows["responses"].shape[1]
            scores = logits[start : start + n, t - r - 1 : t - 1].float()
            logp = (scores if temperature == 1.0 else scores / temperature).log_softmax(-1)
            target = rows["target_tokens"] if "target_tokens" in rows.keys() else rows["responses"]
            target = target.to(self.device).long()
            flat = target if target.dim() == 3 else target[..., None]
            picked = logp.gather(-1, flat)
            out.append(picked if target.dim() == 3 else picked.squeeze(-1))
            start += n
        return out

    def optimizer_step(
        self, params: dict | OptimizerConfig | None = None, adapter: str | None = None
    ) -> float:
        """One AdamW step of `adapter` with this call's settings (the SDK's AdamParams, or an RL job's
        OptimizerConfig); its grad norm before clipping."""
        if isinstance(params, OptimizerConfig):
            return self._adapter(adapter).optim_step(AdamWSettings.of(params))
        return self._adapter(adapter).optim_step(AdamWSettings.from_adam_params(params or {}))

    def optimizer_zero_grad(self, adapter: str | None = None) -> None:
        for param in self._adapter(adapter).params():
            param.grad = None

    def train_mode(self) -> AbstractContextManager[None]:
        """Nothing to onload; the base stays in eval mode (no dropout), adapters have no modes."""
        return nullcontext()

    eval_mode = train_mode

    def _adapter(self, key: str | None) -> Session:
        """The adapter's session, made resident."""
        if key is None:
            raise InputError("model_id", "the base model is frozen: name an adapter")
        session = self.session(key)
        self.make_resident({f"m:{key}"})
        return session

    def adapter_config(self, spec: SessionSpec) -> dict:
        lora = LoraConfig(rank=spec.rank, alpha=spec.alpha, dropout=0.0)
        return adapter_config_dict(lora, self.model_path, list(spec.paths))

    def save_checkpoint(
        self, folder: Path, step: int = 0, adapter: str | None = None, optimizer: bool = True
    ) -> None:
        """`adapter` as a PEFT folder with session.json (and optimizer.pt); an adapter has no step."""
        session = self._adapter(adapter)
        folder = Path(folder)
        session.save(folder, self.adapter_config(session.spec), optimizer=optimizer)
        self._forget(f"s:{folder}")  # a snapshot of the same folder taken again replaces the old one

    def load_checkpoint(self, folder: Path, optimizer: bool = True, adapter: str | None = None) -> int:
        """Into `adapter` (made when absent, else of the same rank and layers) what a save wrote."""
        key, folder = adapter, Path(folder)
        if key is None:
            raise InputError("model_id", "the base model is frozen: name an adapter")
        if not (folder / "session.json").is_file():
            raise InputError("path", f"'{folder}' holds no saved session state")
        spec = read_spec(folder)
        if spec.rank > self.options.max_rank:
            raise InputError(
                "path",
                f"the saved adapter's rank {spec.rank} exceeds this host's max_rank {self.options.max_rank}",
            )
        try:
            packed = read_pack(folder, optimizer)
        except FileNotFoundError as err:
            raise InputError("optimizer", str(err)) from err
        session = self.sessions.get(key)
        if session is not None and (session.spec.rank, session.spec.paths) != (spec.rank, spec.paths):
            raise InputError(
                "path",
                f"the saved adapter (rank {spec.rank}) does not match model {key!r} "
                f"(rank {session.spec.rank}, or other layers)",
            )
        if session is not None:
            self.drop_adapter(key)  # the saved adapter replaces it, its alpha too
        self.sessions[key] = Session(key, spec, None, self.device, offloaded=packed)
        self.make_resident({f"m:{key}"})
        return 0

    def snapshot_key(self, folder: str | None) -> str | None:
        """The adapter key of a sampler snapshot folder (None: the base model)."""
        if folder is None:
            return None
        if not isinstance(folder, str) or not (Path(folder) / "session.json").is_file():
            raise InputError("sampler", f"{folder!r} is not a sampler snapshot saved by this service")
        return f"s:{folder}"

    def sample(self, requests: list[SampleRequest], tokenizer: object = None) -> list[list[Sequence]]:
        self.make_resident({r.adapter for r in requests if r.adapter is not None})
        return sample(self.model, self.layers, requests, self.pad_id, tokenizer)

    @torch.no_grad()
    def logprobs(self, items: list[tuple[str | None, list[int]]]) -> list[list[float | None]]:
        """[None, log p(t1 | t0), log p(t2 | t0 t1), ...] per token list, all in one forward."""
        if not items:
            return []
        self.make_resident({key for key, _ in items if key is not None})
        groups = [(key, score_rows(tokens)) for key, tokens in items]
        per = self.response_logprobs(groups)
        return [
            [None] + lps[0, : len(tokens) - 1].tolist() for (_, tokens), lps in zip(items, per, strict=True)
        ]


def score_rows(tokens: list[int]) -> TensorDict:
    """One token list as an RL row whose responses are all its tokens after the first."""
    ids = torch.tensor([tokens + [0]])
    responses = ids[:, 1:]
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    return TensorDict({"input_ids": ids, "attention_mask": mask, "responses": responses}, batch_size=[1])


def _pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Right-padded to `width` columns."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
