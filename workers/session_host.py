"""The Tinker API's training role: one base and many LoRA adapters (engines/training/adapter_engine.py), a
one-rank worker group (service/tinker_hosts.py) serving RL's training operations with an adapter key,
plus adapters made and dropped, sampler snapshots, and batched forms: many adapters' calls in one
engine call. A call answers `{"ok": ...}` or `{"error": {"category", "field", "message"}}`, a bad one
a "user" error naming its field that fails no other call. No torch at import: the API binds it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.base import Dispatch, Reduce, register
from workers.operations import TrainingOperations

Result = dict[str, Any]  # {"ok": ...} or {"error": {"category", "field", "message"}}
Call = dict[str, Any]  # one request of a batched form, as service/tinker_service.py builds it
# the single operations: they raise, the API reads their answers
GUARDED = ("optim_step", "save_state", "load_state", "create_adapter", "drop_adapter", "save_for_sampler",
           "drop_sampler")  # fmt: skip


def error(category: str, field: str | None, message: str) -> Result:
    return {"error": {"category": category, "field": field, "message": message}}


class SessionWorker(TrainingOperations):
    checkpoint_name = "adapter"

    def __init__(self, base_model: str, workdir: str, options: dict[str, Any]) -> None:
        super().__init__()
        import torch
        from transformers import AutoTokenizer

        from engines.host_memory import keep_freed_memory
        from engines.models.tiny_models import builtin_or_folder
        from engines.threads import limit_threads_for_model
        from engines.training.adapter_engine import AdapterEngine, EngineOptions
        from workers import session_inputs
        from workers.operations import TrainOps

        self.keeps_freed_memory = keep_freed_memory()  # this process is the host's alone
        model_path = str(builtin_or_folder(base_model, Path(workdir) / "models"))
        if options.get("threads"):
            torch.set_num_threads(int(options["threads"]))
        else:
            limit_threads_for_model(model_path)  # a small model computes faster on one thread
        self.base_model, self.inputs = base_model, session_inputs
        self.engine = AdapterEngine(model_path, Path(workdir), EngineOptions.of(options))
        self.ops = TrainOps(self.engine)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.register_mesh("actor", 0, True)  # the MESH operations: one rank, one dp rank
        for name in GUARDED:
            operation = getattr(self, name)
            setattr(self, name, lambda *a, op=operation, **kw: self._guard(lambda: op(*a, **kw)))

    def _guard(self, fn: Callable[[], Any]) -> Result:
        """`fn`'s answer as {"ok"}; its input error as a user error, anything else a server error."""
        from engines.training.adapter_engine import InputError
        from schema.tinker_losses import LossInputError

        try:
            return {"ok": fn()}
        except (InputError, LossInputError) as err:
            return error("user", err.field, str(err))
        except Exception as err:  # noqa: BLE001 - reported as the call's server error, the host lives on
            return error("server", None, f"{type(err).__name__}: {err}")

    def _together(self, items: list, prepare: Callable, run: Callable) -> list[Result]:
        """Each item prepared alone (a bad one answers alone), the rest run together in chunks that
        fit the resident adapters; a chunk that fails as a whole runs again item by item."""
        results: list[Result] = [{}] * len(items)
        ready: list[tuple[int, Any]] = []
        for i, item in enumerate(items):
            prepared = self._guard(lambda item=item: prepare(item))
            if "ok" in prepared:
                ready.append((i, prepared["ok"]))
            else:
                results[i] = prepared
        size = self.engine.options.max_resident
        for start in range(0, len(ready), size):
            chunk = ready[start : start + size]
            answers = self._guard(lambda chunk=chunk: run([p for _, p in chunk]))
            if "ok" not in answers and len(chunk) > 1:
                answers = {"ok": [self._together([p], lambda p: p, run)[0] for _, p in chunk]}
            elif "ok" not in answers:
                answers = {"ok": [answers]}
            for (i, _), answer in zip(chunk, answers["ok"], strict=True):
                results[i] = answer
        return results

    @register(Dispatch.RANK_ZERO)
    def describe(self) -> dict[str, Any]:
        """The base model and what the host holds now."""
        from engines.training import adapter_engine

        engine = self.engine
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return {
            "base_model": self.base_model,
            "model_path": engine.model_path,
            "vocab_size": engine.vocab,
            "max_seq_len": engine.max_seq_len,
            "base_loads": adapter_engine.BASE_LOADS,
            "resident": [k.removeprefix("m:") for k in engine.lru if k.startswith("m:")],
            "offloaded": [m for m, s in engine.sessions.items() if not s.resident],
            "rss_bytes": pages * os.sysconf("SC_PAGE_SIZE"),
            "malloc": {
                "keeps_freed_memory": self.keeps_freed_memory,
                "tunables": os.getenv("GLIBC_TUNABLES", ""),
            },
        }

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def create_adapter(
        self,
        adapter: str,
        rank: int,
        seed: int | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
    ) -> dict[str, Any]:
        """A fresh LoRA adapter (B = 0: it starts as the base) with its own AdamW state."""
        spec = self.engine.adapter_spec(rank, seed, train_attn, train_mlp, train_unembed)
        numel = self.engine.create_adapter(adapter, spec).numel()
        return {"trainable_params": numel, "adapter_bytes": numel * 4}

    @register(Dispatch.ONE_TO_ALL, reduce=Reduce.GLOBAL)
    def optim_step(self, params: dict[str, Any] | None = None, adapter: str | None = None) -> float:
        """The step of `TrainingOperations`; one on a gradient that is not finite was skipped (and the
        gradient dropped): a user error, not a NaN norm the API cannot write as JSON."""
        from engines.training.adapter_engine import InputError

        norm = super().optim_step(params, adapter)
        if not math.isfinite(norm):
            raise InputError("loss_fn_inputs", f"the gradient since the last step is not finite (norm {norm}): "
                             "the step was skipped and the gradient dropped; the inputs overflow float32")  # fmt: skip
        return norm

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def drop_adapter(self, adapter: str) -> dict[str, Any]:
        """The adapter, its gradients and optimizer state leave the host (its saved folders stay)."""
        return self.engine.drop_adapter(adapter) or {}

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def save_for_sampler(self, adapter: str, name: str, path: str | None = None) -> dict[str, Any]:
        """A frozen snapshot of the adapter (no optimizer state) that `sample` can name: in `path` (a named
        one's checkpoint folder, so that it counts in its owner's stored bytes), else the host's own."""
        folder = path or str(self.engine.workdir / "samplers" / adapter / name)
        return self.ops.save_state(folder, 0, adapter, False) or {"path": folder}

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def drop_sampler(self, path: str) -> dict[str, Any]:
        """A snapshot whose sampler is gone leaves the disk (only a folder save_for_sampler made)."""
        import shutil

        folder, root = Path(path).resolve(), (self.engine.workdir / "samplers").resolve()
        if folder.is_relative_to(root) and folder != root:
            shutil.rmtree(folder, ignore_errors=True)
        return {}

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def forward_backward_calls(self, calls: list[Call]) -> list[Result]:
        """Each call's loss on its adapter (gradients added unless `backward` is false), one forward."""
        return self._together(calls, self._prepare_forward, self._forward)

    def _prepare_forward(self, call: Call) -> tuple[Call, list, Any]:
        """The call's data checked against the model and laid out once as RL rows (session_inputs)."""
        self.engine.session(call.get("adapter"))
        data = self.inputs.forward_data(call["data"], self.engine.vocab, self.engine.max_seq_len)
        return call, data, self.inputs.rl_rows(data)

    def _forward(self, prepared: list[tuple[Call, list, Any]]) -> list[Result]:
        from workers.losses.tinker import compute_loss

        def loss(i: int, log_probs: Any) -> tuple[Any, Result]:
            call, data, _ = prepared[i]
            logprobs = self.inputs.per_datum(log_probs, data)
            inputs = [{k: v.to(log_probs.device) for k, v in d.inputs.items()} for d in data]
            config = call.get("loss_fn_config")
            answer = self._guard(lambda: compute_loss(call["loss_fn"], logprobs, inputs, config))
            if "ok" not in answer:
                return None, answer
            value, outputs, metrics = answer["ok"]
            outs = [{name: self.inputs.wire_tensor(t) for name, t in o.items()} for o in outputs]
            return value, {"ok": {"loss_fn_outputs": outs, "metrics": metrics}}

        calls = [(call["adapter"], rows) for call, _, rows in prepared]
        return self.engine.forward_backward(calls, loss, [bool(c.get("backward")) for c, _, _ in prepared])

    @register(Dispatch.RANK_ZERO, reduce=Reduce.RANK_ZERO)
    def sample(self, calls: list[Call]) -> list[Result]:
        """Each call's `num_samples` sequences (and its prompt's log-probs when asked), one decode batch."""
        return self._together(calls, self._prepare_sample, self._sample)

    def _prepare_sample(self, call: Call) -> tuple[Call, Any]:
        engine = self.engine
        key = engine.snapshot_key(call.get("sampler"))
        return call, self.inputs.sample_request(call, key, engine.vocab, engine.max_seq_len, engine.eos_ids)

    def _sample(self, prepared: list[tuple[Call, Any]]) -> list[Result]:
        seqs = self.engine.sample([request for _, request in prepared], self.tokenizer)
        asked = [(r.adapter, r.prompt) for call, r in prepared if call.get("prompt_logprobs")]
        prompt_lps = iter(self.engine.logprobs(asked))
        results = []
        for (call, _), block in zip(prepared, seqs, strict=True):
            prompt = next(prompt_lps) if call.get("prompt_logprobs") else None
            sequences = [
                {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in block
            ]
            results.append({"ok": {"sequences": sequences, "prompt_logprobs": prompt}})
        return results
