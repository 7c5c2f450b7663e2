"""The job's OpenAI-compatible endpoint, inside the job: `ExternalServer`, an async Ray actor named
`tandem-openai-<job id>` that the API process (api/routes/openai_endpoint.py) forwards checked requests to.
It templates in threads (a long prompt never stalls the event loop), bounds the call (`n` choices within
`CALL_TOKEN_BUDGET`: no call holds a replica for long), batches onto the rollout replicas and records
every call token-exact. Errors come back as {"error": {...}}, so the API answers them in its own shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError  # a real model's chat template raises it on a conversation it refuses
from pydantic import BaseModel, ValidationError

from controller.external_batcher import ReplicaBatcher
from controller.external_store import (
    Segment,
    TrajectoryError,
    TrajectoryStore,
    canonical_message,
    readable_message,
    tools_key,
    trajectory_view,
)
from controller.models import context_length
from engines.rollout.constrained import Constraint, ConstraintError, build_constraint
from schema.external import ExternalSpec
from schema.openai_bodies import ChatCompletionRequest, CompletionRequest, RewardRequest
from schema.section import error_message
from workers.chat_serving import TOOL_CALL_END, cut_at_stop, strip_stop

TEMPLATING_THREADS = 4
DEFAULT_MAX_TOKENS = 256
CALL_TOKEN_BUDGET = 1 << 19  # n x (prompt + new tokens): what one call may put on a replica
# A grammar's compile time on the replica grows faster than its size; these bound it to seconds.
MAX_TOOLS_CHARS = 1 << 18
MAX_GRAMMAR_CHARS = 1 << 20
BODIES = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


class ExternalServer:
    """Ray actor body (async: one event loop, many calls at once)."""

    def __init__(
        self, job_id: str, model_path: str, config: ExternalSpec, buffer: tuple[int, int, int] | None = None
    ) -> None:
        from transformers import AutoTokenizer

        from workers.chat_serving import ChatRenderer

        self.job_id, self.config = job_id, config
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = ChatRenderer(self.tokenizer)
        self.context = context_length(model_path)
        # The tokenizer is only read here (its truncation and padding never change): threads may share it.
        self._templating = ThreadPoolExecutor(TEMPLATING_THREADS, thread_name_prefix="templating")
        self.store = TrajectoryStore(self.config)
        if buffer is not None:  # trainer.mode async: (max_staleness, capacity, version) of its buffer
            self.store.use_buffer(*buffer)
        self._locks: dict[str, asyncio.Lock] = {}
        self.batcher = ReplicaBatcher(self.config.batch_window_ms)
        self.requests = 0

    async def attach(self, hosts: list[Any], version: int = 0) -> None:
        """The rollout replicas to serve from (again after a restart); `version`: the trainer's version
        of the weights they hold now, which every call then records."""
        if self.store.buffer is not None:  # a buffer that outlived the workers (a restart from a checkpoint)
            self.store.rewind(version)
        await self.batcher.attach(hosts, version)

    async def set_version(self, version: int) -> None:
        self.store.buffer.set_version(version)

    async def replicas(self) -> list[Any]:
        """The rollout worker actors served from (a benchmark calls them directly for its baseline)."""
        return list(self.batcher.hosts)

    async def answer(self, kind: str, tid: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """The answer of a `kind` (chat | completion) call; a refused or failed call leaves its trajectory
        as it was."""
        self.requests += 1
        try:
            body = _checked(BODIES[kind], body)
        except TrajectoryError as err:
            return {"error": err.as_dict()}
        tid = tid or f"traj-{uuid.uuid4().hex[:16]}"
        forks = [
            f"{tid}.{k}" for k in range(1, body.get("n") or 1) if f"{tid}.{k}" in self.store.trajectories
        ]
        if kind == "chat" and forks:  # choice k of n records trajectory '<id>.<k>': never another's
            return {"error": TrajectoryError(409, f"n: choice {forks[0].rsplit('.', 1)[1]} would be recorded "
                    f"as trajectory '{forks[0]}', which already exists: ask for n = 1 here, or name the "
                    "trajectory so that '<id>.<k>' is free", "n", "trajectory_exists").as_dict()}  # fmt: skip
        known = self.store.trajectories.get(tid)
        segments = None if known is None else [s.copy() for s in known.segments]
        try:
            constraint = await self._constraint(body) if kind == "chat" else None
            traj = self.store.open(tid)
            async with self._locks.setdefault(tid, asyncio.Lock()):  # one trajectory's calls in order
                if kind == "chat":
                    return await self._chat(traj, body, constraint)
                return await self._completion(traj, body)
        except (TrajectoryError, ValueError, TemplateError) as err:
            traj = self.store.trajectories.get(tid)
            if traj is not None and traj is not known:
                self.store.forget(tid)
            elif traj is not None and traj.state == "open":
                traj.segments = segments
            if not isinstance(err, TrajectoryError):  # the chat template refused the messages
                err = TrajectoryError(422, str(err), "messages", "invalid_value")
            return {"error": err.as_dict()}

    async def reward(self, tid: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            body = _checked(RewardRequest, body)
            t = self.store.reward(
                tid, body["reward"], body.get("task_id"), body.get("turn_rewards"), body.get("metadata") or {}
            )
        except TrajectoryError as err:
            return {"error": err.as_dict()}
        return trajectory_view(t)

    async def trajectory(self, tid: str) -> dict[str, Any]:
        try:
            return trajectory_view(self.store.get(tid), tokens=True)
        except TrajectoryError as err:
            return {"error": err.as_dict()}

    async def take(self) -> list[Segment] | None:
        return self.store.take()

    async def take_step(self, version: int) -> dict[str, Any] | None:
        return self.store.take_step(version, f"endpoint of job {self.job_id}")

    async def stats(self) -> dict[str, float]:
        out = {**self.store.stats(), "external/requests_total": float(self.requests),
               "external/engine_calls_total": float(self.batcher.engine_calls)}  # fmt: skip
        if self.store.buffer is not None:
            out["external/admitted_running"] = float(self.store.buffer.running)
        return out

    async def _chat(self, traj: Any, body: dict[str, Any], constraint: Constraint | None) -> dict[str, Any]:
        messages, tools = body["messages"], body.get("tools") or None
        use_tools = tools is not None and body.get("tool_choice") != "none"
        shown_tools = tools if use_tools else None
        segment, delta, reason = await self._place_chat(traj, messages, shown_tools)
        before = [s.copy() for s in traj.segments]
        # parallel_tool_calls false: the turn ends with its first call
        single = use_tools and body.get("parallel_tool_calls") is False
        prompt, completions, stops = await self._generate(
            segment, delta, body, "messages", {"constraint": constraint}
        )
        choices, forks, sampled = [], [], 0
        added = messages[len(segment.history) :]  # what this call adds to the readable conversation
        for k, comp in enumerate(completions):
            target, seg = traj, segment
            if k > 0:  # choice k of n: a trajectory of its own, `<id>.<k>`
                target = self.store.fork(f"{traj.id}.{k}", before)
                seg = target.segments[-1]
                forks.append(target.id)
            ids, lps, ended = self._record(target, seg, delta, comp, stops + [TOOL_CALL_END] * single)
            reply = self.renderer.reply(ids, f"call_{uuid.uuid4().hex[:12]}", use_tools)
            reply["content"] = strip_stop(reply["content"], stops)
            if constraint is not None:  # the record states the mask its tokens were drawn under
                seg.constraints.append({"call": len(seg.weight_versions) - 1, **constraint.record()})
            seg.history = [canonical_message(m) for m in messages] + [canonical_message(reply)]
            seg.tools_key = tools_key(shown_tools)
            seg.messages += [readable_message(m) for m in added] + [readable_message(reply)]
            seg.tool_calls += len(reply["tool_calls"])
            seg.finish_reason = "done" if ended else "budget"
            calls = reply["tool_calls"]
            message = {
                "role": "assistant",
                "content": reply["content"] if not calls or reply["content"] else None,
            }
            finish = "tool_calls" if calls else "stop" if ended else "length"
            choice = {"index": k, "message": message | ({"tool_calls": calls} if calls else {}),
                      "finish_reason": finish, "logprobs": self._logprobs(ids, lps) if body.get("logprobs") else None}  # fmt: skip
            choices.append(choice)
            sampled += len(ids)
        if reason is not None and len(traj.segments) > 1:
            self.store.new_segments += 1
        tandem = {"trajectory_id": traj.id, "forks": forks, "segment": len(traj.segments) - 1,
                  "new_segment": reason, "weight_version": completions[0].weight_version}  # fmt: skip
        return _answer("chatcmpl", "chat.completion", body, choices, len(prompt), sampled, tandem)

    async def _constraint(self, body: dict[str, Any]) -> Constraint | None:
        """The grammar the call's output must follow, built off the event loop; a 422 naming the field."""
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        param = "tools" if tools else "response_format"
        if tools and len(json.dumps(tools)) > MAX_TOOLS_CHARS:  # each schema is bounded, their sum here
            raise TrajectoryError(422, f"tools: the tools' JSON has more than {MAX_TOOLS_CHARS} characters, "
                                  "too many to constrain decoding by", param, "unsupported_value")  # fmt: skip
        try:
            made = await self._template(
                build_constraint, body.get("response_format"), tools, body.get("tool_choice")
            )
        except ConstraintError as err:
            raise TrajectoryError(422, str(err), err.param, "unsupported_value") from None
        if made is not None and len(made.grammar) > MAX_GRAMMAR_CHARS:  # its compile would hold a replica
            raise TrajectoryError(422, f"{param}: the grammar they make has {len(made.grammar)} characters; "
                                  f"at most {MAX_GRAMMAR_CHARS}: offer fewer or smaller schemas", param,
                                  "unsupported_value")  # fmt: skip
        return made

    async def _template(self, work: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._templating, work, *args)

    async def _place_chat(
        self, traj: Any, messages: list[dict], tools: list[dict] | None
    ) -> tuple[Segment, list[int], str | None]:
        """(the segment this call adds to, the prompt delta, why a new segment started or None)."""
        last = traj.segments[-1] if traj.segments else None
        canon = [canonical_message(m) for m in messages]
        if last is not None and last.kind == "chat" and last.tools_key == tools_key(tools):
            n = len(last.history)
            if canon[:n] == last.history:
                end = last.tokens[-1] if last.tokens else None
                return last, await self._template(self.renderer.delta_ids, messages[n:], end), None
            reason = "the messages rewrite the history of the earlier calls"
        elif last is not None:
            reason = "the tools changed" if last.kind == "chat" else "a chat call after completions"
        else:
            reason = "first call"
        segment = Segment(
            prompt_ids=await self._template(self.renderer.prompt_ids, messages, tools), reason=reason
        )
        traj.segments.append(segment)
        return segment, [], reason

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict[str, Any]:
        end = self.renderer.turn_end_id
        pairs = [(i, lp) for i, lp in zip(ids, lps, strict=True) if i != end]
        return {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for (i, lp), t in zip(pairs, self.renderer.token_texts([i for i, _ in pairs]), strict=True)
        ]}  # fmt: skip

    async def _completion(self, traj: Any, body: dict[str, Any]) -> dict[str, Any]:
        text = body["prompt"]
        last = traj.segments[-1] if traj.segments else None
        encode = self.renderer.encode
        if last is not None and last.kind == "completion" and text.startswith(last.text):
            segment, delta = last, await self._template(encode, text[len(last.text) :])
        else:
            reason = "first call" if last is None else "the prompt does not extend the earlier calls"
            segment = Segment(
                prompt_ids=await self._template(encode, text),
                kind="completion",
                reason=reason,
                text=text,
                messages=[{"role": "user", "content": text}],
            )
            traj.segments.append(segment)
            delta = []
        prompt, comps, stops = await self._generate(segment, delta, body, "prompt", {"n": 1})
        ids, lps, ended = self._record(traj, segment, delta, comps[0], stops)
        out = self.tokenizer.decode(ids, skip_special_tokens=True)
        segment.text = text + out
        segment.messages.append({"role": "assistant", "content": out})
        logprobs = None
        if body.get("logprobs"):
            logprobs = {"tokens": self.renderer.token_texts(ids), "token_logprobs": lps,
                        "top_logprobs": None, "text_offset": []}  # fmt: skip
        choice = {"index": 0, "text": strip_stop(out, stops), "finish_reason": "stop" if ended else "length",
                  "logprobs": logprobs}  # fmt: skip
        tandem = {"trajectory_id": traj.id, "weight_version": comps[0].weight_version}
        return _answer("cmpl", "text_completion", body, [choice], len(prompt), len(ids), tandem)

    async def _generate(
        self, segment: Segment, delta: list[int], body: dict[str, Any], field: str, update: dict[str, Any]
    ) -> tuple[list[int], list[Any], list[str]]:
        """(the call's prompt, its completions, its stop strings): `segment`'s tokens + `delta`, bounded
        (a 400 naming `field`), sampled on a replica with `update`'s sampling settings."""
        from engines.rollout import SamplingParams

        prompt = segment.sequence + delta
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        end = self.renderer.turn_end_id
        params = SamplingParams(
            temperature=body.get("temperature") if body.get("temperature") is not None else 1.0,
            top_p=body.get("top_p") if body.get("top_p") is not None else 1.0,
            max_new_tokens=new_tokens(len(prompt), body, self.context, field),
            stop_token_ids=[] if end is None else [end],
            n=body.get("n") or 1,
            seed=body.get("seed"),
        )
        return prompt, await self.batcher.generate(prompt, params.model_copy(update=update)), stops

    def _record(self, traj: Any, seg: Segment, delta: list[int], comp: Any, stops: list[str]) -> tuple:
        """(the sampled ids up to a stop, their log-probs, whether it stopped), recorded in `seg`."""
        text_of = lambda x: self.tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
        ids, stopped = cut_at_stop(text_of, list(comp.token_ids), stops)
        lps = list(comp.log_probs[: len(ids)])
        seg.add_call(delta, ids, lps, comp.weight_version)
        traj.calls += 1
        traj.last_call = time.time()
        return ids, lps, stopped or comp.finish_reason == "stop"


def _answer(
    prefix: str, kind: str, body: dict, choices: list, prompt: int, sampled: int, tandem: dict
) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled}
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
            "model": body["model"], "choices": choices, "usage": usage, "tandem": tandem}  # fmt: skip


def new_tokens(prompt_len: int, body: dict[str, Any], context: int | None, prompt_field: str) -> int:
    """The number of tokens the call may generate, or a TrajectoryError (400) naming the field."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    asked = body.get(name)
    room = None if context is None else context - prompt_len
    if room is not None and room < 1:
        raise _refused(prompt_field, f"the prompt is {prompt_len} tokens; the model's context is {context} "
                       "tokens, which leaves no room for a reply: shorten it")  # fmt: skip
    if asked is None:
        asked = DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
    elif room is not None and asked > room:
        raise _refused(name, f"{asked} new tokens after a prompt of {prompt_len} exceed the model's context "
                       f"of {context} tokens: at most {room} fit")  # fmt: skip
    n = body.get("n") or 1
    if n * (prompt_len + asked) > CALL_TOKEN_BUDGET:
        raise _refused("n", f"{n} choices of {prompt_len} + {asked} tokens exceed the {CALL_TOKEN_BUDGET} "
                       "tokens one call may ask for: ask for fewer choices or tokens", "invalid_value")  # fmt: skip
    return asked


def _refused(field: str, message: str, code: str = "context_length_exceeded") -> TrajectoryError:
    return TrajectoryError(400, f"{field}: {message}", field, code)


def _checked(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """The body as the API checks it (an agent the job runs reaches here without the API); a 422 naming
    the field otherwise."""
    try:
        return model.model_validate(body).model_dump(exclude_none=True)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise TrajectoryError(422, error_message(first["msg"], param), param, "invalid_value") from None
