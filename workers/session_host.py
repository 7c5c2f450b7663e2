"""One process serving one base model to many Tinker training sessions (issue 30, TINKER_CONTRACT §2).

The base weights are read once (`BASE_LOADS`) and shared; every session ("model") is a LoRA adapter
of its own rank and layer set with its own AdamW state (`engines/lora_sessions.Session`) attached to
the multi-LoRA layers (`engines/multi_lora.py`). `run_batch(ops)` is the only entry point: ops of one
model run in the order given, ops of different models commute, so the batch runs in rounds, each
round taking the next op of every model; a round's forwards (any mix of sessions, with or without
backward) are one multi-adapter forward, its samples one decode batch, its `compute_logprobs` one
forward. A group that fails as a whole is retried op by op, so one op's error never fails another.
Beyond `max_resident_adapters`, the least recently used adapters leave: a session's adapter,
gradients and optimizer state go to host memory or disk and come back on its next op; a sampler
snapshot is dropped and re-read from its folder. Single rank (world size 1): no FSDP wrapping, as
FSDPEngine itself leaves one fp32 rank unwrapped.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from engines.fsdp.lora import peft_config
from engines.lora_sessions import Session, SessionSpec, read_pack, read_spec
from engines.multi_lora import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    attach,
    detach,
    from_peft_tensors,
    init_adapter,
    inject,
    linear_modules,
    rows,
)
from engines.multi_lora_sample import sample
from engines.threads import limit_threads_for_model
from schema.tinker_losses import LossInputError
from workers.losses.tinker import compute_loss
from workers.session_inputs import (
    HostError,
    forward_data,
    name_of,
    sample_request,
    tokens_of,
    user,
    wire_tensor,
)

BASE_LOADS = 0  # reads of base weights in this process: the API's tests assert it stays 1
BATCHED = {"forward", "sample", "compute_logprobs"}


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it is not readable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _load_base(model_path: str, device: torch.device) -> torch.nn.Module:
    global BASE_LOADS
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    BASE_LOADS += 1
    model.to(device).eval().requires_grad_(False)  # eval: no dropout; the base stays frozen
    return model


class SessionHost:
    def __init__(self, base_model: str, model_path: str, workdir: str, options: dict | None = None) -> None:
        from transformers import AutoTokenizer

        from engines.rollout.hf import read_special_token_ids

        opts = options or {}
        self.base_model, self.model_path, self.workdir = base_model, str(model_path), Path(workdir)
        self.max_rank = int(opts.get("max_rank", 64))
        self.max_resident = max(1, int(opts.get("max_resident_adapters", 8)))
        self.alpha = float(opts.get("lora_alpha", 32))
        self.seed = int(opts.get("seed", 0))
        self.max_batch_tokens = int(opts.get("max_batch_tokens", 16384))
        if opts.get("sampler_engine", "hf") != "hf":
            raise ValueError(
                f"options.sampler_engine: only 'hf' is implemented, not {opts['sampler_engine']!r}"
            )
        if opts.get("threads"):
            torch.set_num_threads(int(opts["threads"]))
        else:
            limit_threads_for_model(model_path)  # a small model computes faster on one thread
        self.device = torch.device(opts.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        offload = opts.get("offload", "disk" if self.device.type == "cpu" else "memory")
        self.offload_dir = self.workdir / "offload" if offload == "disk" else None
        self.model = _load_base(self.model_path, self.device)
        self.layers = inject(
            self.model, linear_modules(self.model, ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES)
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_ids, self.pad_id = read_special_token_ids(self.model_path)
        self.vocab = int(self.model.config.vocab_size)
        self.max_seq_len = int(self.model.config.max_position_embeddings)
        self.sessions: dict[str, Session] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # resident adapter keys, oldest first
        self.lock = threading.Lock()  # one run_batch at a time: the layers' row segments are shared

    # ---- introspection ---------------------------------------------------------------------

    def describe(self) -> dict:
        return {
            "base_model": self.base_model,
            "model_path": self.model_path,
            "vocab_size": self.vocab,
            "max_rank": self.max_rank,
            "max_seq_len": self.max_seq_len,
            "pid": os.getpid(),
            "base_loads": BASE_LOADS,
            "resident": [k.removeprefix("m:") for k in self.lru if k.startswith("m:")],
            "resident_samplers": [k.removeprefix("s:") for k in self.lru if k.startswith("s:")],
            "offloaded": [m for m, s in self.sessions.items() if not s.resident],
            "rss_bytes": _rss_bytes(),
        }

    # ---- the entry point --------------------------------------------------------------------

    def run_batch(self, ops: list[dict]) -> list[dict]:
        with self.lock:
            results: list[dict | None] = [None] * len(ops)
            queues: OrderedDict[str, list[int]] = OrderedDict()
            for i, op in enumerate(ops):
                key = f"m:{op.get('model_id')}" if isinstance(op, dict) and "model_id" in op else f"op:{i}"
                queues.setdefault(key, []).append(i)
            while queues:
                heads = [q.pop(0) for q in queues.values()]
                queues = OrderedDict((k, q) for k, q in queues.items() if q)
                groups: dict[str, list[int]] = {}
                for i in heads:
                    kind = ops[i].get("op") if isinstance(ops[i], dict) else None
                    groups.setdefault(kind if kind in BATCHED else f"single:{i}", []).append(i)
                for kind, members in groups.items():
                    self._run_group(kind, [ops[i] for i in members], members, results)
            return results  # type: ignore[return-value]

    def _run_group(self, kind: str, ops: list[dict], where: list[int], results: list) -> None:
        for start in range(0, len(ops), self.max_resident):
            chunk, idx = ops[start : start + self.max_resident], where[start : start + self.max_resident]
            if kind not in BATCHED:
                out = [self._single(chunk[0])]
            else:
                try:
                    out = self._group(kind, chunk)
                except Exception as err:  # noqa: BLE001 - the group failed as a whole: each op alone
                    if len(chunk) == 1:
                        out = [HostError("server", None, f"{type(err).__name__}: {err}").as_result()]
                    else:
                        out = [self._guard(lambda op=op: self._group(kind, [op])[0]) for op in chunk]
            for i, result in zip(idx, out, strict=True):
                results[i] = result

    @staticmethod
    def _guard(fn) -> dict:
        try:
            return fn()
        except HostError as err:
            return err.as_result()
        except Exception as err:  # noqa: BLE001 - reported as the op's server error, the host lives on
            return HostError("server", None, f"{type(err).__name__}: {err}").as_result()

    def _group(self, kind: str, ops: list[dict]) -> list[dict]:
        """A batched kind: inputs checked op by op (a bad one answers alone), the rest computed together."""
        prepared: list[tuple[int, Any]] = []
        results: list[dict] = [{}] * len(ops)
        prepare = {
            "forward": self._prep_forward,
            "sample": self._prep_sample,
            "compute_logprobs": self._prep_logprobs,
        }
        for i, op in enumerate(ops):
            try:
                prepared.append((i, prepare[kind](op)))
            except HostError as err:
                results[i] = err.as_result()
        if prepared:
            self._make_resident({p.key for _, p in prepared if p.key is not None})
            run = {"forward": self._forward, "sample": self._sample, "compute_logprobs": self._logprobs}[kind]
            for part in self._by_tokens(prepared) if kind == "forward" else [prepared]:
                for (i, _), res in zip(part, run([p for _, p in part]), strict=True):
                    results[i] = res
        return results

    def _by_tokens(self, prepared: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
        """Forwards in consecutive parts of at most `max_batch_tokens` (padded) tokens, each op whole:
        peak activation memory stays bounded however many sessions share the round."""
        parts: list[list[tuple[int, Any]]] = [[]]
        rows, width = 0, 0
        for item in prepared:
            data = item[1].data
            r, w = rows + len(data), max(width, *(len(d.tokens) for d in data))
            if parts[-1] and r * w > self.max_batch_tokens:
                parts.append([])
                r, w = len(data), max(len(d.tokens) for d in data)
            parts[-1].append(item)
            rows, width = r, w
        return parts

    def _single(self, op: dict) -> dict:
        return self._guard(lambda: {"ok": self._dispatch(op)})

    def _dispatch(self, op: dict) -> dict:
        if not isinstance(op, dict):
            raise user("op", f"an op is a dict with 'op' and its arguments, not {type(op).__name__}")
        handlers = {
            "create_model": self._create_model,
            "drop_model": self._drop_model,
            "optim_step": self._optim_step,
            "save_for_sampler": self._save_for_sampler,
            "save_state": self._save_state,
            "load_state": self._load_state,
        }
        handler = handlers.get(op.get("op"))
        if handler is None:
            raise user("op", f"unknown op {op.get('op')!r}; ops: {sorted(handlers) + sorted(BATCHED)}")
        return handler(op)

    # ---- residency --------------------------------------------------------------------------

    def _session(self, op: dict) -> Session:
        model_id = op.get("model_id")
        if model_id not in self.sessions:
            raise user("model_id", f"no model {model_id!r} on this host")
        return self.sessions[model_id]

    def _make_resident(self, keys: set[str]) -> None:
        for key in sorted(keys):
            if key not in self.lru:
                self._bring_in(key)
            self.lru.move_to_end(key)
        for key in [k for k in self.lru if k not in keys][: max(0, len(self.lru) - self.max_resident)]:
            self._evict(key)

    def _bring_in(self, key: str) -> None:
        if key.startswith("m:"):
            session = self.sessions[key[2:]]
            if not session.resident:
                session.restore()
            attach(self.layers, key, session.weights, session.spec.scaling)
        else:
            from safetensors.torch import load_file

            folder = Path(key[2:])
            spec = read_spec(folder)
            weights = from_peft_tensors(load_file(str(folder / "adapter_model.safetensors")))
            attach(
                self.layers,
                key,
                {p: (a.to(self.device), b.to(self.device)) for p, (a, b) in weights.items()},
                spec.scaling,
            )
        self.lru[key] = None

    def _evict(self, key: str) -> None:
        detach(self.layers, key)
        self.lru.pop(key, None)
        if key.startswith("m:") and key[2:] in self.sessions:
            self.sessions[key[2:]].offload(self.offload_dir)

    def _resident(self, session: Session) -> Session:
        self._make_resident({f"m:{session.model_id}"})
        return session

    # ---- sessions ---------------------------------------------------------------------------

    def _spec(self, op: dict) -> SessionSpec:
        rank = op.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_rank:
            raise user(
                "rank", f"must be an integer in [1, {self.max_rank}] (this host's max_rank), got {rank!r}"
            )
        flags = {f: bool(op.get(f, True)) for f in ("train_attn", "train_mlp", "train_unembed")}
        names = (ATTN_MODULES if flags["train_attn"] else ()) + (MLP_MODULES if flags["train_mlp"] else ())
        names += UNEMBED_MODULES if flags["train_unembed"] else ()
        if not names:
            raise user("train_mlp", "at least one of train_attn, train_mlp, train_unembed must be true")
        seed = op.get("seed")
        seed = self.seed if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise user("seed", "must be an integer")
        paths = tuple(linear_modules(self.model, names))
        return SessionSpec(rank, self.alpha, seed, paths, **flags)

    def _create_model(self, op: dict) -> dict:
        model_id = name_of(op.get("model_id"), "model_id")
        if model_id in self.sessions:
            raise user("model_id", f"model {model_id!r} exists on this host")
        spec = self._spec(op)
        session = Session(
            model_id,
            spec,
            init_adapter(self.layers, list(spec.paths), spec.rank, spec.seed, self.device),
            self.device,
        )
        self.sessions[model_id] = session
        self._make_resident({f"m:{model_id}"})
        return {"trainable_params": session.numel(), "adapter_bytes": session.numel() * 4}

    def _drop_model(self, op: dict) -> dict:
        session = self._session(op)
        key = f"m:{session.model_id}"
        detach(self.layers, key)
        self.lru.pop(key, None)
        if session.packed_file is not None:
            session.packed_file.unlink(missing_ok=True)
        del self.sessions[session.model_id]
        return {}

    def _optim_step(self, op: dict) -> dict:
        session = self._session(op)
        adam = op.get("adam") or {}
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = adam.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise user(f"adam.{name}", f"must be a non-negative number, got {value!r}")
        for name in ("beta1", "beta2"):
            if adam.get(name, 0.9) >= 1:
                raise user(f"adam.{name}", "must be below 1")
        return {"metrics": self._resident(session).optim_step(adam)}

    def _adapter_config(self, spec: SessionSpec) -> dict:
        from schema.engine import LoraConfig

        cfg = peft_config(
            LoraConfig(rank=spec.rank, alpha=spec.alpha, dropout=0.0), self.model_path
        ).to_dict()
        cfg["target_modules"] = sorted({p.rsplit(".", 1)[-1] for p in spec.paths})
        return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}

    def _save_for_sampler(self, op: dict) -> dict:
        session = self._resident(self._session(op))
        folder = self.workdir / "samplers" / session.model_id / name_of(op.get("name"), "name")
        session.save(folder, self._adapter_config(session.spec), optimizer=False)
        detach(self.layers, f"s:{folder}")  # a snapshot of the same name taken again replaces the old one
        self.lru.pop(f"s:{folder}", None)
        return {"path": str(folder)}

    def _save_state(self, op: dict) -> dict:
        session = self._resident(self._session(op))
        folder = Path(op.get("path") or "")
        if not op.get("path"):
            raise user("path", "a folder to save into is required")
        session.save(folder, self._adapter_config(session.spec), optimizer=bool(op.get("optimizer", True)))
        return {"path": str(folder)}

    def _load_state(self, op: dict) -> dict:
        model_id = name_of(op.get("model_id"), "model_id")
        folder = Path(op.get("path") or "")
        if not (folder / "session.json").is_file():
            raise user("path", f"'{folder}' holds no saved session state")
        spec = read_spec(folder)
        if spec.rank > self.max_rank:
            raise user(
                "path", f"the saved adapter's rank {spec.rank} exceeds this host's max_rank {self.max_rank}"
            )
        optimizer = bool(op.get("optimizer", True))
        try:
            packed = read_pack(folder, optimizer)
        except FileNotFoundError as err:
            raise user("optimizer", str(err)) from err
        session = self.sessions.get(model_id)
        if session is not None and (session.spec.rank, session.spec.paths) != (spec.rank, spec.paths):
            raise user(
                "path",
                f"the saved adapter (rank {spec.rank}) does not match model {model_id!r} (rank {session.spec.rank}, or other layers)",
            )
        if session is None:
            session = Session(
                model_id,
                spec,
                init_adapter(self.layers, list(spec.paths), spec.rank, 0, self.device),
                self.device,
            )
            self.sessions[model_id] = session
        self._resident(session).unpack(packed, optimizer=optimizer)
        attach(self.layers, f"m:{model_id}", session.weights, session.spec.scaling)  # new leaves
        return {"path": str(folder)}

    # ---- batched kinds ----------------------------------------------------------------------

    def _prep_forward(self, op: dict):
        session = self._session(op)
        return _Prepared(f"m:{session.model_id}", op, forward_data(op, self.vocab, self.max_seq_len))

    def _forward(self, preps: list[_Prepared]) -> list[dict]:
        backward = any(p.op.get("backward") for p in preps)
        with torch.set_grad_enabled(backward):
            per_op = self._token_logprobs(
                [(p.key, [(d.tokens, d.inputs["target_tokens"]) for d in p.data]) for p in preps]
            )
            results, total = [], None
            for p, lps in zip(preps, per_op, strict=True):
                inputs = [{k: v.to(self.device) for k, v in d.inputs.items()} for d in p.data]
                try:
                    loss, outputs, metrics = compute_loss(
                        p.op["loss_fn"], lps, inputs, p.op.get("loss_fn_config")
                    )
                except LossInputError as err:
                    results.append(user(err.field, str(err)).as_result())
                    continue
                if p.op.get("backward"):
                    total = loss if total is None else total + loss
                outs = [{name: wire_tensor(t) for name, t in o.items()} for o in outputs]
                results.append({"ok": {"loss_fn_outputs": outs, "metrics": metrics}})
            if total is not None:
                total.backward()  # each adapter's rows feed only its own loss: one backward for all
        return results

    def _token_logprobs(
        self, groups: list[tuple[str | None, list[tuple[list[int], torch.Tensor]]]]
    ) -> list[list[torch.Tensor]]:
        """log p(target[t] | tokens[:t+1]) per datum, every group's rows in one right-padded forward."""
        rows_ = [(tokens, targets) for _, data in groups for tokens, targets in data]
        width = max(len(t) for t, _ in rows_)
        ids = torch.full((len(rows_), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows_), width), dtype=torch.long)
        for j, (tokens, _) in enumerate(rows_):
            ids[j, : len(tokens)] = torch.tensor(tokens)
            mask[j, : len(tokens)] = 1
        with rows(self.layers, [(key, len(data)) for key, data in groups]):
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        out, j = [], 0
        for _, data in groups:
            per = []
            for tokens, targets in data:
                logp = logits[j, : len(tokens)].float().log_softmax(-1)
                t = targets.to(self.device).long()
                per.append(logp.gather(-1, t.reshape(len(tokens), -1)).reshape(t.shape))
                j += 1
            out.append(per)
        return out

    def _sampler_key(self, op: dict) -> str | None:
        sampler = op.get("sampler")
        if sampler is None:
            return None
        if not isinstance(sampler, str) or not (Path(sampler) / "session.json").is_file():
            raise user("sampler", f"{sampler!r} is not a sampler snapshot saved by this service")
        return f"s:{sampler}"

    def _prep_sample(self, op: dict):
        key = self._sampler_key(op)
        return _Prepared(key, op, sample_request(op, key, self.vocab, self.max_seq_len, self.eos_ids))

    def _sample(self, preps: list[_Prepared]) -> list[dict]:
        seqs = sample(self.model, self.layers, [p.data for p in preps], self.pad_id, self.tokenizer)
        prompt_lps = [p for p in preps if p.op.get("prompt_logprobs")]
        lps = iter(self._logprob_lists([(p.key, p.data.prompt) for p in prompt_lps]))
        results = []
        for p, block in zip(preps, seqs, strict=True):
            prompt = next(lps) if p.op.get("prompt_logprobs") else None
            sequences = [
                {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in block
            ]
            results.append({"ok": {"sequences": sequences, "prompt_logprobs": prompt}})
        return results

    def _prep_logprobs(self, op: dict):
        key = self._sampler_key(op)
        return _Prepared(key, op, tokens_of(op.get("tokens"), "tokens", self.vocab, self.max_seq_len))

    def _logprobs(self, preps: list[_Prepared]) -> list[dict]:
        return [{"ok": {"logprobs": lp}} for lp in self._logprob_lists([(p.key, p.data) for p in preps])]

    @torch.no_grad()
    def _logprob_lists(self, items: list[tuple[str | None, list[int]]]) -> list[list[float | None]]:
        """[None, log p(t1 | t0), log p(t2 | t0 t1), ...] per token list."""
        if not items:
            return []
        groups = [
            (key, [(tokens[:-1] or tokens[:1], torch.tensor(tokens[1:] or [0]))]) for key, tokens in items
        ]
        per = self._token_logprobs(groups)
        return [
            [None] + (lps[0].tolist() if len(tokens) > 1 else [])
            for (_, tokens), lps in zip(items, per, strict=True)
        ]


class _Prepared:
    def __init__(self, key: str | None, op: dict, data: Any) -> None:
        self.key, self.op, self.data = key, op, data
