"""The work of bench/soak.py: each owner's two lanes, and the checks on what they left behind.

Lane "rl" runs RL jobs one after another (sync, async with split placement, LoRA; tiny-qwen2, a few
steps, one CPU a worker). Lane "mixed" alternates a Tinker loop (the official SDK: a LoRA training
client, forward_backward + optim_step + sample three times, save_state) and an external job fed by
agent trajectories (the `openai` SDK: two chat calls, then a reward) until the job ends. A lane starts
nothing after `stop_at` and waits for what it started until `hard_end`.

Calls go through `Api.call`, retried through a service restart (connection refused, 502-504) with an
Idempotency-Key on submissions, so a retried POST makes one job. Every Tinker call runs on its own
daemon thread and is waited for `TINKER_BOUND_S` at most: past that it counts as hung.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.api_util import tiny_job

TERMINAL = ("succeeded", "failed", "cancelled")
RL_KINDS = ("sync", "async", "lora")
TINKER_BOUND_S = 300.0
TOKENS = [[5, 17, 33, 40, 41, 42, 60, 7], [9, 10, 11, 12], [70, 71, 72, 73, 20]]
UPLOAD = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+3=", "answer": "5"}\n'


class Api:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}

    def call(self, method: str, path: str, within_s: float = 300.0, **kwargs: Any) -> httpx.Response:
        """The first answer that is not a restart's (transport error, 502-504), within `within_s`."""
        deadline = time.monotonic() + within_s
        headers = {**self.headers, **kwargs.pop("headers", {})}
        while True:
            try:
                answer = httpx.request(method, self.url + path, headers=headers, timeout=60, **kwargs)
                if answer.status_code not in (502, 503, 504):
                    return answer
                why = f"HTTP {answer.status_code}"
            except httpx.TransportError as err:
                why = type(err).__name__
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method} {path}: no answer within {within_s:.0f} s ({why})")
            time.sleep(1.0)


class Hung(Exception):
    pass


def job_spec(kind: str, owner: str) -> dict[str, Any]:
    spec = tiny_job(
        reward={"function": "builtin:arithmetic_partial"},
        trainer={"total_steps": 6},
        checkpoint={"every": 2, "keep_last": 2},
        resources={"workers": 1, "cpus_per_worker": 1},
        metadata={"suite": "soak", "kind": kind, "owner": owner},
    )
    if kind == "async":  # CPUs set by hand: a default split job asks for more than 2 cores hold
        spec["trainer"] |= {"mode": "async", "max_staleness": 1}
        spec["resources"] |= {"placement": "split", "rollout": {"workers": 1, "cpus_per_worker": 1}}
    elif kind == "lora":
        spec["model"]["lora"] = {"rank": 4, "alpha": 8.0}
    elif kind == "agent":
        spec["model"] = {"builtin": "tiny-qwen2-chat"}
        spec["rollout"] = {"source": "external", "free_cache_after_generate": False,
                           "external": {"group_size": 2, "trajectories_per_step": 4}}  # fmt: skip
        spec["trainer"] = {"total_steps": 2, "val_every": 0, "samples_per_step": 2}
        spec["checkpoint"] = {"every": 1, "keep_last": 2, "export_hf": False}
    return spec


class Lanes:
    def __init__(self, url: str, home: Path, keys: dict[str, str], stop_at: float, hard_end: float) -> None:
        self.url, self.home, self.keys = url, home, keys
        self.stop_at, self.hard_end = stop_at, hard_end
        self.api = {owner: Api(url, key) for owner, key in keys.items()}
        self.jobs: list[dict[str, str]] = []  # {owner, kind, id}
        self.files: dict[str, str] = {}  # owner -> file id
        self.tinker: list[dict[str, str]] = []  # {call, outcome, error?}
        self.tinker_loops: list[dict[str, Any]] = []  # {started: time, completed}
        self.agent: Counter = Counter()
        self.agent_errors: dict[str, str] = {}  # the first message of each kind of error
        self.errors: list[str] = []
        self._threads: list[threading.Thread] = []

    # ---- the lanes ----------------------------------------------------------------------------

    def upload_files(self) -> None:
        for owner, api in self.api.items():
            made = api.call("POST", "/v1/files", params={"filename": f"{owner}.jsonl"}, content=UPLOAD,
                            headers={"content-type": "application/octet-stream"})  # fmt: skip
            assert made.status_code == 201, made.text
            self.files[owner] = made.json()["id"]

    def threads(self) -> list[threading.Thread]:
        for i, owner in enumerate(self.keys):
            self._threads.append(
                threading.Thread(target=self._guard, args=(self.rl_lane, owner, i), daemon=True)
            )
            self._threads.append(
                threading.Thread(target=self._guard, args=(self.mixed_lane, owner, i), daemon=True)
            )
        return self._threads

    def join(self, hard_end: float) -> None:
        for thread in self._threads:
            thread.join(timeout=max(1.0, hard_end - time.time()))
        self.errors += [f"a lane still ran at the end ({t.name})" for t in self._threads if t.is_alive()]

    def _guard(self, lane, owner: str, i: int) -> None:
        try:
            lane(owner, i)
        except Exception as err:  # noqa: BLE001 - a lane's own failure is a finding of the soak
            self.errors.append(f"{lane.__name__} of {owner}: {type(err).__name__}: {err}"[:500])

    def rl_lane(self, owner: str, i: int) -> None:
        n = i
        while time.time() < self.stop_at:
            job = self.submit(owner, RL_KINDS[n % len(RL_KINDS)])
            self.wait_end(owner, job)
            n += 1

    def mixed_lane(self, owner: str, i: int) -> None:
        n = i
        while time.time() < self.stop_at:
            self.tinker_loop(owner, n) if n % 2 == 0 else self.agent_round(owner)
            n += 1

    def submit(self, owner: str, kind: str) -> str:
        made = self.api[owner].call("POST", "/v1/jobs", json=job_spec(kind, owner),
                                    headers={"Idempotency-Key": uuid.uuid4().hex})  # fmt: skip
        if made.status_code != 201:
            raise RuntimeError(f"{owner}'s {kind} job was refused: {made.status_code} {made.text[:300]}")
        self.jobs.append({"owner": owner, "kind": kind, "id": made.json()["id"]})
        return made.json()["id"]

    def status(self, owner: str, job: str) -> str:
        return self.api[owner].call("GET", f"/v1/jobs/{job}").json()["status"]

    def wait_end(self, owner: str, job: str) -> str:
        while (status := self.status(owner, job)) not in TERMINAL and time.time() < self.hard_end:
            time.sleep(3)
        return status

    # ---- Tinker ---------------------------------------------------------------------------------

    def bounded(self, call: str, fn):
        """fn() on a daemon thread, waited for TINKER_BOUND_S; its outcome recorded either way."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except Exception as err:  # noqa: BLE001 - recorded, then raised in the lane
                box["error"] = err

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(TINKER_BOUND_S)
        if thread.is_alive():
            self.tinker.append({"call": call, "outcome": "hung"})
            raise Hung(call)
        if "error" in box:
            err = box["error"]
            message = str(err).strip()
            clear = bool(message) and message not in ("Internal Server Error", "None")
            self.tinker.append({"call": call, "outcome": "error" if clear else "unclear",
                                "error": f"{type(err).__name__}: {message}"[:300]})  # fmt: skip
            raise err
        self.tinker.append({"call": call, "outcome": "ok"})
        return box["value"]

    def tinker_loop(self, owner: str, n: int) -> None:
        import tinker
        from tinker import types

        data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
                for t in TOKENS]  # fmt: skip
        prompt = types.ModelInput.from_ints(TOKENS[0][:4])
        loop = {"started": time.time(), "completed": False}
        self.tinker_loops.append(loop)
        try:
            sc = self.bounded(
                "create_session", lambda: tinker.ServiceClient(base_url=self.url, api_key=self.keys[owner])
            )
        except Exception:  # noqa: BLE001 - recorded by bounded
            return
        try:
            tc = self.bounded(
                "create_model",
                lambda: sc.create_lora_training_client(base_model="tiny-qwen2", rank=4, seed=n).result(),
            )
            for _ in range(3):
                self.bounded("forward_backward", lambda: tc.forward_backward(data, "cross_entropy").result())
                self.bounded(
                    "optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                )
                sampler = self.bounded("sampler", lambda: tc.save_weights_and_get_sampling_client().result())
                params = types.SamplingParams(max_tokens=4, temperature=1.0)
                self.bounded("sample", lambda s=sampler, p=params: s.sample(prompt, 2, p).result())
            self.bounded("save_state", lambda: tc.save_state(f"soak-{owner}-{n}").result())
            loop["completed"] = True
        except Exception:  # noqa: BLE001 - recorded by bounded; the next loop starts afresh
            pass
        finally:
            try:
                self.bounded("close", lambda: sc.close("success").result(timeout=60))
            except Exception:  # noqa: BLE001 - recorded by bounded
                pass

    # ---- agents on an external job ----------------------------------------------------------------

    def agent_round(self, owner: str) -> None:
        job = self.submit(owner, "agent")
        api, group = self.api[owner], 0
        while time.time() < self.hard_end:
            status = self.status(owner, job)
            if status in TERMINAL:
                return
            if (
                status != "running"
                or api.call("GET", f"/v1/jobs/{job}/trajectories/probe").status_code != 404
            ):
                time.sleep(2)  # its endpoint is not up yet
                continue
            for k in range(2):
                self.trajectory(owner, job, f"{job[-6:]}-{group}-{k}", f"g{group}")
            group += 1

    def trajectory(self, owner: str, job: str, trajectory: str, task: str) -> None:
        from openai import OpenAI, OpenAIError

        base = f"{self.url}/v1/jobs/{job}/openai/trajectories/{trajectory}/v1"
        client = OpenAI(base_url=base, api_key=self.keys[owner], max_retries=1, timeout=120)
        messages: list[dict[str, str]] = [{"role": "user", "content": "What is 12+30?"}]
        try:
            for _ in range(2):
                reply = client.chat.completions.create(model=job, messages=messages, max_tokens=8)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": "Only the number, please."}]  # fmt: skip
                self.agent["chat_calls"] += 1
        except OpenAIError as err:
            self.agent[f"chat_error {type(err).__name__}"] += 1
            self.agent_errors.setdefault(type(err).__name__, str(err)[:300])
            return
        answer = messages[-2]["content"]
        reward = sum(ch.isdigit() for ch in answer) / max(len(answer), 1)
        try:
            posted = httpx.post(f"{self.url}/v1/jobs/{job}/trajectories/{trajectory}/reward", timeout=60,
                                headers={"Authorization": f"Bearer {self.keys[owner]}"},
                                json={"reward": reward, "task_id": task})  # fmt: skip
            self.agent["rewarded" if posted.status_code == 200 else f"reward HTTP {posted.status_code}"] += 1
        except httpx.HTTPError as err:
            self.agent[f"reward_error {type(err).__name__}"] += 1

    # ---- what is left at the end ----------------------------------------------------------------

    def job_counts(self, admin: Api) -> dict[str, int]:
        counts = Counter(f"{j['kind']}_{self._view(admin, j)['status']}" for j in self.jobs)
        return {"submitted": len(self.jobs), **dict(sorted(counts.items()))}

    def _view(self, admin: Api, job: dict) -> dict:
        return admin.call("GET", f"/v1/jobs/{job['id']}").json()

    def tinker_counts(self, host_killed_at: float | None) -> dict[str, int]:
        """Calls by outcome; loops started and completed (and those after the first session host kill)."""
        after = [loop for loop in self.tinker_loops if host_killed_at and loop["started"] > host_killed_at]
        return {
            "calls": len(self.tinker),
            **Counter(t["outcome"] for t in self.tinker),
            "loops": len(self.tinker_loops),
            "loops_completed": sum(loop["completed"] for loop in self.tinker_loops),
            "loops_after_a_host_kill": len(after),
            "loops_after_a_host_kill_completed": sum(loop["completed"] for loop in after),
        }

    def agent_counts(self) -> dict[str, int]:
        return dict(self.agent)

    def checks(self, admin: Api) -> list[tuple[str, bool, Any]]:
        ended, steps, lost = [], [], []
        for job in self.jobs:
            view = self._view(admin, job)
            ended += self._ended(admin, job, view)
            steps += self._steps_once(admin, job, view)
            lost += self._checkpoints_kept(admin, job)
        files = [f"{owner}: {fid}" for owner, fid in self.files.items() if not self._file_kept(owner, fid)]
        stuck = [t for t in self.tinker if t["outcome"] in ("hung", "unclear")]
        return [
            ("lanes_ran_without_error", not self.errors, self.errors[:5]),
            ("every_job_ended_with_a_stated_reason", not ended, ended[:10]),
            ("every_step_stored_once", not steps, steps[:10]),
            ("no_checkpoint_lost", not lost, lost[:10]),
            ("no_upload_lost", not files, files),
            ("every_tinker_call_resolved_or_errored_clearly", not stuck, stuck[:10]),
        ]

    def _ended(self, admin: Api, job: dict, view: dict) -> list[str]:
        if view["status"] not in TERMINAL:
            return [f"{job['kind']} {job['id']}: still {view['status']} at step {view['step']}"]
        if view["status"] == "failed":
            print(json.dumps({"note": "a job failed", "kind": job["kind"], "id": job["id"],
                              "error": (view.get("error") or "")[:400]}), flush=True)  # fmt: skip
            events = admin.call("GET", f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
            if not view.get("error") or not any(e["kind"] == "failed" and e["message"] for e in events):
                return [f"{job['kind']} {job['id']}: failed without a stated reason"]
        return []

    def _steps_once(self, admin: Api, job: dict, view: dict) -> list[str]:
        rows = admin.call("GET", f"/v1/jobs/{job['id']}/metrics", params={"limit": 100_000}).json()["data"]
        got = [r["step"] for r in rows]
        want = list(range(1, (max(got) if got else 0) + 1))
        if got != want:
            return [f"{job['kind']} {job['id']}: steps {got} (duplicates or gaps)"]
        total = job_spec(job["kind"], job["owner"])["trainer"]["total_steps"]
        if view["status"] == "succeeded" and len(got) != total:
            return [f"{job['kind']} {job['id']}: succeeded with {len(got)} of {total} steps stored"]
        return []

    def _checkpoints_kept(self, admin: Api, job: dict) -> list[str]:
        rows = admin.call("GET", f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        return [f"{job['id']} step {r['step']}: {r['path']}" for r in rows
                if not any(p.name != "trainer_state.json" for p in Path(r["path"]).glob("*"))]  # fmt: skip

    def _file_kept(self, owner: str, file_id: str) -> bool:
        listed = self.api[owner].call("GET", "/v1/files").json()["data"]
        on_disk = self.home / "files" / file_id / f"{owner}.jsonl"
        return (
            any(f["id"] == file_id for f in listed) and on_disk.is_file() and on_disk.read_bytes() == UPLOAD
        )
