"""The Tinker API's sampling side: samplers (an adapter's frozen snapshot, or the bare base) and `asample`
(which `compute_logprobs` is too). A training model's samples are kept as its run's samples, decoded
with the base's `tokenizer.json` (the `tokenizers` library: no torch in the API)."""

from __future__ import annotations

import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from service.tinker_checkpoints import resolve_state
from service.tinker_requests import CreateSamplingSession, Sample, SamplingParams
from service.tinker_service import TinkerError, TinkerService
from service.tinker_sessions import Sampler
from service.tinker_wire import write_sample_response
from workers.session_host import SessionWorker

UNSUPPORTED_SAMPLE_FIELDS = {
    "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "target_prompt_logprobs": None,
    "prompt_alt_tokens_k": 0, "prompt_logprobs_last_n": None,
}  # fmt: skip


def create_sampling_session(svc: TinkerService, owner: str, req: CreateSamplingSession) -> dict[str, Any]:
    session = svc.records.sessions.find(req.session_id, owner)
    sampler_id = f"{session.id}:sample:{req.sampling_session_seq_id}:{uuid.uuid4().hex[:6]}"
    path = req.model_path
    if path:
        job, folder = resolve_state(svc.store, path, owner, "model_path", "sampler_weights")
        base = job.spec["model"]["builtin"]
        svc.host(base, "model_path")
        sampler = Sampler(sampler_id, owner, base, (folder / "SOURCE").read_text(), path, job.id)
    else:
        base = svc.host(req.base_model or "", "base_model").base_model
        sampler = Sampler(sampler_id, owner, base, None, None, None)
    svc.drop_snapshots(svc.records.add_sampler(sampler))
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def sampler_view(svc: TinkerService, owner: str | None, sampler_id: str) -> dict[str, Any]:
    sampler = svc.records.samplers.find(sampler_id, owner, "sampler_id")
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.tinker_path}


def _sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The engine's sampling settings; types, finiteness and the seed's range are the model's."""
    out = params.model_dump()
    out["max_tokens"] = params.max_tokens or 16
    if out["top_k"] == 0:
        raise TinkerError(400, "sampling_params.top_k: 0 must be -1 or >= 1", "sampling_params.top_k")
    if isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    return out


def asample(svc: TinkerService, owner: str, req: Sample) -> dict[str, Any]:
    for name, default in UNSUPPORTED_SAMPLE_FIELDS.items():
        if getattr(req, name) not in (default, None, False):
            raise TinkerError(400, f"unsupported feature: {name} (Tandem serves tokens, their log-probs and "
                              "prompt_logprobs)", name)  # fmt: skip
    sampler_id = req.sampling_session_id
    if not sampler_id:
        raise TinkerError(
            400, "sampling_session_id: required (create a sampling client first)", "sampling_session_id"
        )
    sampler = svc.records.samplers.find(sampler_id, owner)
    host = svc.hosts[sampler.base_model]
    prompt = req.prompt.tokens("prompt")
    if not prompt:
        raise TinkerError(400, "prompt: must hold at least one token", "prompt")
    svc.check_tokens(host, prompt, "prompt.chunks")
    num = req.num_samples
    params = _sampling_params(req.sampling_params)
    kwargs = {"sampler": sampler.path, "prompt": prompt, "num_samples": num, "sampling_params": params,
              "prompt_logprobs": bool(req.prompt_logprobs)}  # fmt: skip
    sequence_ids = [f"{sampler_id}:{uuid.uuid4().hex[:10]}" for _ in range(num)]

    def done(ok: dict[str, Any]) -> bytes:
        if req.record_stability_info:
            svc.records.record(owner, sequence_ids, prompt, ok["sequences"])
        # scoring (compute_logprobs) is not sampling: no sample rows
        if not req.prompt_logprobs and sampler.job_id is not None and svc.store.get_job(sampler.job_id):
            model = svc.records.model_of_job(sampler.job_id)
            decode = _decoder((host.info or {}).get("model_path"))
            rows = [{"index": i, "uid": sid, "prompt": decode(prompt),
                     "turns": [{"role": "assistant", "content": decode(seq["tokens"])}],
                     "finish_reason": seq.get("stop_reason"), "sampler": sampler_id,
                     "tokens": {"prompt": len(prompt), "response": len(seq["tokens"])}}
                    for i, (sid, seq) in enumerate(zip(sequence_ids, ok["sequences"], strict=False))]  # fmt: skip
            svc.store.add_samples(sampler.job_id, model.step if model is not None else 0, rows)
        return write_sample_response(ok["sequences"], ok.get("prompt_logprobs"))

    return {
        "request_id": svc.submit(host, owner, sampler_id, SessionWorker.sample, kwargs, done).id,
        "sample_sequence_ids": sequence_ids,
    }


@lru_cache(maxsize=16)
def _decoder(folder: str | None) -> Any:
    if folder and (Path(folder) / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)[:2000]
    return lambda ids: " ".join(map(str, ids))[:2000]
