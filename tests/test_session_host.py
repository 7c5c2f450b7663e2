"""SessionWorker (workers/session_host.py, engines/training/adapter_engine.py): many LoRA adapters on one base
model, called in process through the worker's operations.

References computed another way: each call made alone (one adapter per forward) for the batched path,
PEFT's own LoRA layers (`PeftModel.from_pretrained` on the saved snapshot) and torch.optim.AdamW for
the gradients and the optimizer, the trainer's forward for sampled log-probs, a host that never
evicts for eviction, a second worker reading the folder for save/load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engines.training.adapter_engine as adapter_engine
from workers.session_host import SessionWorker

TOL = 1e-5
ADAM = {
    "learning_rate": 0.02,
    "beta1": 0.8,
    "beta2": 0.9,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "grad_clip_norm": 0.5,
}


def datum(seq: list[int]) -> dict:
    n = len(seq) - 1
    weights = [1.0 + 0.1 * i for i in range(n)]
    return {
        "tokens": seq[:-1],
        "loss_fn_inputs": {
            "target_tokens": {"data": seq[1:], "dtype": "int64", "shape": [n]},
            "weights": {"data": weights, "dtype": "float32", "shape": [n]},
        },
    }


DATA = {
    "a": [datum([5, 17, 33, 40, 41, 42, 60, 7]), datum([9, 10, 11])],
    "b": [datum([70, 71, 72, 73, 20])],
}
CREATE = {
    "a": {"adapter": "a", "rank": 4, "seed": 1},
    # another rank and another layer set on the same base
    "b": {"adapter": "b", "rank": 8, "seed": 2, "train_mlp": False, "train_unembed": False},
}


def create(host: SessionWorker, *keys: str) -> None:
    for key in keys:
        ok(host.create_adapter(**CREATE[key]))


def fwd(adapter: str, backward: bool = True) -> dict:
    return {"adapter": adapter, "data": DATA[adapter], "loss_fn": "cross_entropy", "backward": backward}


def step(host: SessionWorker, adapter: str) -> dict:
    return ok(host.optim_step(ADAM, adapter))


def ok(result: dict) -> dict:
    assert "ok" in result, result
    return result["ok"]


def logprobs(result: dict) -> list[torch.Tensor]:
    return [torch.tensor(o["logprobs"]["data"]) for o in ok(result)["loss_fn_outputs"]]


def weights(host: SessionWorker, adapter: str) -> dict[str, torch.Tensor]:
    session = host.engine.sessions[adapter]
    if not session.resident:
        host.engine.make_resident({f"m:{adapter}"})
    return {
        f"{p}.{part}": t.detach().clone()
        for p, ab in session.weights.items()
        for part, t in zip("AB", ab, strict=True)
    }


def close(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert x.keys() == y.keys()
    for k in x:
        assert torch.allclose(x[k], y[k], atol=tol, rtol=0), (k, (x[k] - y[k]).abs().max())


@pytest.fixture
def make_host(tiny_model_dir, tmp_path):
    def make(**options) -> SessionWorker:
        return SessionWorker(
            str(tiny_model_dir), str(tmp_path / f"host{len(list(tmp_path.iterdir()))}"), options
        )

    return make


def count_forwards(host: SessionWorker) -> list[int]:
    calls = [0]
    host.engine.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def rounds(host: SessionWorker) -> list[dict]:
    """Two rounds of both adapters: forward_backward, optim_step; the forwards' results."""
    first = host.forward_backward_calls([fwd("a"), fwd("b")])
    step(host, "a"), step(host, "b")
    return first + host.forward_backward_calls([fwd("a"), fwd("b")])


def test_two_sessions_batched_equal_each_alone_and_peft(make_host, tmp_path):
    before = adapter_engine.BASE_LOADS
    batched, alone, parts = make_host(), make_host(), make_host(max_batch_tokens=8)
    assert adapter_engine.BASE_LOADS == before + 3  # one read per host, none per session
    for host in (batched, alone, parts):
        create(host, "a", "b")
    assert batched.describe()["base_loads"] == before + 3
    calls, part_calls = count_forwards(batched), count_forwards(parts)
    got = rounds(batched)  # both adapters' forwards in one call: one forward per round
    assert calls[0] == 2
    # a token budget below a round's batch: one forward per session, the same results
    for g, w in zip(got, rounds(parts), strict=True):
        assert abs(ok(g)["metrics"]["loss:sum"] - ok(w)["metrics"]["loss:sum"]) <= TOL
    assert part_calls[0] == 4
    want = alone.forward_backward_calls([fwd("a")]) + alone.forward_backward_calls([fwd("b")])
    step(alone, "a"), step(alone, "b")
    want += alone.forward_backward_calls([fwd("a")]) + alone.forward_backward_calls([fwd("b")])
    for g, w in zip(got, want, strict=True):
        assert abs(ok(g)["metrics"]["loss:sum"] - ok(w)["metrics"]["loss:sum"]) <= TOL
        for x, y in zip(logprobs(g), logprobs(w), strict=True):
            assert torch.allclose(x, y, atol=TOL, rtol=0)
    for model_id in ("a", "b"):  # the second forward_backward's gradients, then the step they feed
        sessions = [host.engine.sessions[model_id] for host in (batched, alone)]
        pairs = zip(sessions[0].params(), sessions[1].params(), strict=True)
        for x, y in pairs:
            # fp32 sums in another order (one forward of both sessions' rows against one each), at
            # weights the first step left up to ~4e-6 apart: ~1.3e-5 of a tensor's largest entry seen
            assert torch.allclose(x.grad, y.grad, atol=1e-4 * float(y.grad.abs().max()), rtol=0)
        for host in (batched, alone):
            step(host, model_id)
        # Adam divides by sqrt(v): an entry whose gradient is float noise moves by up to lr either
        # way, so the weights after the step agree less closely than the gradients (2.7e-5 seen).
        close(weights(batched, model_id), weights(alone, model_id), tol=1e-4)
    assert any(t.abs().sum() > 0 for k, t in weights(batched, "b").items() if k.endswith(".B"))

    # PEFT's own layers on the saved snapshot give the same log-probs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = ok(batched.save_for_sampler("b", "s"))["path"]
    model_path = batched.engine.model_path
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), path).eval()
    mine = logprobs(batched.forward_backward_calls([fwd("b", backward=False)])[0])
    for d, lp in zip(DATA["b"], mine, strict=True):
        logits = peft(input_ids=torch.tensor([d["tokens"]])).logits[0].log_softmax(-1)
        target = torch.tensor(d["loss_fn_inputs"]["target_tokens"]["data"])
        assert torch.allclose(logits.gather(-1, target[:, None]).squeeze(-1).detach(), lp, atol=TOL, rtol=0)


def test_optim_step_matches_torch_adamw_on_peft(make_host):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    host = make_host()
    create(host, "a")
    path = ok(host.save_for_sampler("a", "init"))["path"]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(host.engine.model_path), path, is_trainable=True
    )
    params = {n: p for n, p in peft.named_parameters() if p.requires_grad}
    adam = torch.optim.AdamW(
        list(params.values()),
        lr=ADAM["learning_rate"],
        betas=(ADAM["beta1"], ADAM["beta2"]),
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
    )
    for _ in range(2):
        ok(host.forward_backward_calls([fwd("a")])[0])
        step(host, "a")
        loss = 0
        for d in DATA["a"]:
            logits = peft(input_ids=torch.tensor([d["tokens"]])).logits[0].log_softmax(-1)
            target = torch.tensor(d["loss_fn_inputs"]["target_tokens"]["data"])
            w = torch.tensor(d["loss_fn_inputs"]["weights"]["data"])
            loss = loss - (logits.gather(-1, target[:, None]).squeeze(-1) * w).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), ADAM["grad_clip_norm"])
        adam.step()
        adam.zero_grad()
    theirs = {
        n.removeprefix("base_model.model.")
        .replace(".lora_A.default.weight", ".A")
        .replace(".lora_B.default.weight", ".B"): p.detach()
        for n, p in params.items()
    }
    close(weights(host, "a"), theirs)
    assert any(t.abs().sum() > 0 for k, t in theirs.items() if k.endswith(".B"))  # it moved


def test_sampled_logprobs_match_trainer_and_batching(make_host):
    host = make_host()
    create(host, "a", "b")
    host.forward_backward_calls([fwd("a"), fwd("b")])
    step(host, "a"), step(host, "b")
    paths = [ok(host.save_for_sampler(m, "s"))["path"] for m in "ab"]

    def sample(path, prompt, seed):
        params = {"max_tokens": 6, "temperature": 1.0, "seed": seed, "stop": []}
        return {
            "sampler": path,
            "prompt": prompt,
            "num_samples": 3,
            "sampling_params": params,
            "prompt_logprobs": True,
        }

    ops = [sample(paths[0], [5, 6, 7, 8], 11), sample(paths[1], [40], 12), sample(None, [9, 9], 13)]
    together = host.sample(ops)
    for op, got in zip(ops, together, strict=True):
        alone = ok(host.sample([op])[0])
        for s, t in zip(ok(got)["sequences"], alone["sequences"], strict=True):
            assert s["tokens"] == t["tokens"] and len(s["tokens"]) == 6 and s["stop_reason"] == "length"
            assert max(abs(x - y) for x, y in zip(s["logprobs"], t["logprobs"], strict=True)) <= TOL
    # the trainer's log-probs of the sampled tokens (session a's adapter = its snapshot, unchanged since)
    prompt = ops[0]["prompt"]
    for seq in ok(together[0])["sequences"]:
        full = prompt + seq["tokens"]
        trainer = logprobs(
            host.forward_backward_calls(
                [{"adapter": "a", "data": [datum(full)], "loss_fn": "cross_entropy"}]
            )[0]
        )[0]
        assert torch.allclose(trainer[len(prompt) - 1 :], torch.tensor(seq["logprobs"]), atol=1e-4, rtol=0)
        scored = {
            "sampler": paths[0],
            "prompt": full,
            "sampling_params": {"max_tokens": 1},
            "prompt_logprobs": True,
        }
        lps = ok(host.sample([scored])[0])["prompt_logprobs"]  # the SDK's compute_logprobs
        assert lps[0] is None and torch.allclose(torch.tensor(lps[1:]), trainer, atol=1e-4, rtol=0)
        assert torch.allclose(
            torch.tensor(ok(together[0])["prompt_logprobs"][1:]), trainer[: len(prompt) - 1], atol=1e-4
        )


def _evicting_script(host: SessionWorker) -> list[dict]:
    """Every call alone, so that a host holding one adapter evicts at each switch."""
    create(host, "a", "b")
    got = [host.forward_backward_calls([fwd(m)])[0] for m in "ab"]
    step(host, "a")
    got += [host.forward_backward_calls([fwd(m)])[0] for m in "ba"]
    step(host, "b"), step(host, "a")
    return got + [host.save_for_sampler(m, "s") for m in "ab"]


@pytest.mark.parametrize("offload", ["disk", "memory"])
def test_eviction_round_trip_is_exact(make_host, offload):
    evicting = make_host(max_resident_adapters=1, offload=offload)
    keeping = make_host(max_resident_adapters=8)
    got, want = _evicting_script(evicting), _evicting_script(keeping)
    assert evicting.describe()["offloaded"] == ["a"]  # b was used last
    for g, w in zip(got[:4], want[:4], strict=True):
        assert ok(g)["metrics"] == ok(w)["metrics"]
    for model_id in "ab":
        close(weights(evicting, model_id), weights(keeping, model_id), tol=0.0)
    prompt = {"prompt": [3, 4], "num_samples": 2, "sampling_params": {"max_tokens": 4, "seed": 5}}
    for i in (-2, -1):  # one sampler per call on both hosts: the same batch shapes, so bit for bit
        mine = evicting.sample([{"sampler": ok(got[i])["path"], **prompt}])[0]
        assert ok(mine) == ok(keeping.sample([{"sampler": ok(want[i])["path"], **prompt}])[0])


def test_save_and_load_state_in_a_new_host(make_host, tmp_path):
    host = make_host()
    create(host, "a")
    host.forward_backward_calls([fwd("a")])
    step(host, "a")
    full, bare = str(tmp_path / "full"), str(tmp_path / "bare")
    ok(host.save_state(full, adapter="a", optimizer=True))
    ok(host.save_state(bare, adapter="a", optimizer=False))
    saved = weights(host, "a")
    host.forward_backward_calls([fwd("a")])
    step(host, "a")
    after = weights(host, "a")

    fresh = make_host()  # another host: nothing but the folder carries the state
    ok(fresh.load_state(full, True, "r"))
    close(weights(fresh, "r"), saved, tol=0.0)
    fresh.forward_backward_calls([{**fwd("a"), "adapter": "r"}])
    step(fresh, "r")
    close(weights(fresh, "r"), after)
    ok(fresh.load_state(bare, False, "w"))
    close(weights(fresh, "w"), saved, tol=0.0)
    fresh.forward_backward_calls([{**fwd("a"), "adapter": "w"}])
    step(fresh, "w")  # a fresh Adam takes another step
    assert max((weights(fresh, "w")[k] - after[k]).abs().max() for k in after) > 1e-4
    err = fresh.load_state(bare, True, "x")["error"]
    assert (err["category"], err["field"]) == ("user", "optimizer")


def test_bad_inputs_are_user_errors_naming_the_field(make_host):
    host = make_host(max_rank=16)
    bad_token = {**datum([1, 2, 3]), "tokens": [1, 100]}
    short = datum([1, 2, 3])
    short["loss_fn_inputs"]["weights"] = {"data": [1.0], "dtype": "float32", "shape": [1]}
    forwards = [
        ({"adapter": "a", "data": [bad_token], "loss_fn": "cross_entropy"}, "data[0].tokens"),
        (
            {"adapter": "a", "data": [datum([1, 2, 999])], "loss_fn": "cross_entropy"},
            "data[0].loss_fn_inputs.target_tokens",
        ),
        ({"adapter": "a", "data": [short], "loss_fn": "cross_entropy"}, "data[0].loss_fn_inputs.weights"),
        ({"adapter": "a", "data": DATA["a"], "loss_fn": "no_such_loss"}, "loss_fn"),
        ({"adapter": "nobody", "data": DATA["a"], "loss_fn": "cross_entropy"}, "model_id"),
    ]
    samples = [
        ({"sampler": None, "prompt": [5, 100]}, "prompt"),
        ({"sampler": "/nowhere", "prompt": [5]}, "sampler"),
        (
            {"sampler": None, "prompt": [5], "sampling_params": {"max_tokens": 10**6}},
            "sampling_params.max_tokens",
        ),
    ]
    create(host, "a", "b")
    # the bad calls share their forward with a good one of another adapter: it is unaffected
    results = host.forward_backward_calls([fwd("b")] + [call for call, _ in forwards])
    results += host.sample([call for call, _ in samples])
    # the types and ranges of the API's typed requests are the API's (tests/test_tinker_bad_input.py);
    # the host checks what only it knows: its adapters, snapshots, vocabulary, context and max_rank
    results += [host.create_adapter("big", 17), host.optim_step(ADAM, "nobody")]
    fields = [f for _, f in forwards + samples] + ["rank", "model_id"]
    for field, res in zip(fields, results[1:], strict=True):
        assert res["error"]["category"] == "user" and res["error"]["field"] == field, res
    alone = make_host(max_rank=16)
    create(alone, "b")
    assert ok(results[0])["metrics"] == ok(alone.forward_backward_calls([fwd("b")])[0])["metrics"]
    assert host.describe()["resident"] == ["a", "b"]  # nothing else was created


def test_drop_model_and_top_k_targets(make_host):
    host = make_host()
    create(host, "a", "b")
    # (N, K) targets: the log-prob of each of K candidates per position, each equal to its (N,) run
    seq = [5, 17, 33, 40]
    k2 = [[t, (t + 7) % 100] for t in seq[1:]]
    top_k = {
        "tokens": seq[:-1],
        "loss_fn_inputs": {
            "target_tokens": {"data": sum(k2, []), "dtype": "int64", "shape": [3, 2]},
            "weights": {"data": [1.0] * 6, "dtype": "float32", "shape": [3, 2]},
        },
    }
    got = logprobs(
        host.forward_backward_calls([{"adapter": "a", "data": [top_k], "loss_fn": "cross_entropy"}])[0]
    )[0]
    assert got.shape == (6,)  # flattened on the wire
    first = logprobs(host.forward_backward_calls([{**fwd("a", backward=False), "data": [datum(seq)]}])[0])[0]
    assert torch.allclose(got.reshape(3, 2)[:, 0], first, atol=TOL, rtol=0)
    assert ok(host.drop_adapter("a")) == {}
    err = host.forward_backward_calls([fwd("a")])[0]["error"]
    assert (err["category"], err["field"]) == ("user", "model_id")
    assert host.describe()["resident"] == ["b"]


def test_a_state_in_peft_layer_names_loads_to_the_same_weights(make_host, tmp_path):
    from safetensors.torch import load_file, save_file

    host = make_host()
    create(host, "a")
    host.forward_backward_calls([fwd("a")])
    step(host, "a")
    folder = tmp_path / "state"
    ok(host.save_state(str(folder), adapter="a"))
    file = str(folder / "adapter_model.safetensors")  # as PEFT's layers named them: adapter 'default'
    save_file({k.replace(".weight", ".default.weight"): v for k, v in load_file(file).items()}, file)
    fresh = make_host()
    ok(fresh.load_state(str(folder), True, "r"))
    close(weights(fresh, "r"), weights(host, "a"), tol=0.0)


def test_a_batch_that_fails_as_a_whole_runs_again_call_by_call(make_host):
    host = make_host()
    create(host, "a")
    good, gone = (ok(host.save_for_sampler("a", name))["path"] for name in ("good", "gone"))
    (Path(gone) / "adapter_model.safetensors").unlink()  # found at prepare, unreadable when it runs
    params = {"max_tokens": 3, "seed": 1}
    calls = [{"sampler": s, "prompt": [3, 4], "sampling_params": params} for s in (good, gone)]
    got = host.sample(calls)
    assert (
        got[1]["error"]["category"] == "server" and "adapter_model.safetensors" in got[1]["error"]["message"]
    )
    assert ok(got[0]) == ok(host.sample(calls[:1])[0])


def test_a_gradient_that_is_not_finite_is_a_user_error_not_a_nan_step(make_host):
    """Advantages near float32's largest make a finite loss whose backward overflows: the step is skipped
    (the weights stay finite) and answered as a user error naming the inputs, not a NaN grad norm (which
    the API could not even write as JSON)."""
    host = make_host()
    create(host, "a")
    before = weights(host, "a")
    n = 3
    huge = {
        "tokens": [5, 6, 7],
        "loss_fn_inputs": {
            "target_tokens": {"data": [6, 7, 8], "dtype": "int64", "shape": [n]},
            "logprobs": {"data": [-1.0] * n, "dtype": "float32", "shape": [n]},
            "advantages": {"data": [3e38] * n, "dtype": "float32", "shape": [n]},
        },
    }
    call = {"adapter": "a", "data": [huge], "loss_fn": "importance_sampling", "backward": True}
    ok(host.forward_backward_calls([call])[0])
    err = host.optim_step(ADAM, "a")["error"]
    assert (err["category"], err["field"]) == ("user", "loss_fn_inputs") and "finite" in err["message"], err
    close(weights(host, "a"), before, tol=0.0)
    ok(host.forward_backward_calls([fwd("a")])[0])  # the bad gradient was dropped: the next step trains
    assert torch.isfinite(torch.tensor(step(host, "a")))
    assert any((weights(host, "a")[k] - before[k]).abs().max() > 0 for k in before)


def test_a_top_p_or_temperature_past_float32s_range_samples_the_top_token(make_host):
    """top_p 1e-300 is a valid probability, but 0 in float32: the filter dropped every token; logits over
    temperature 1e-40 overflow float32. Either way the draw read past the vocabulary (a server error; an
    out-of-bounds index on a GPU). Both now keep the top token alone, as top_p 1e-3 and greedy do."""
    host = make_host()
    params = [{"top_p": 1e-300}, {"top_p": 1e-3}, {"temperature": 1e-40}, {"temperature": 0.0}]
    calls = [{"sampler": None, "prompt": [5, 6], "num_samples": 2,
              "sampling_params": {"max_tokens": 4, "seed": 1, **p}} for p in params]  # fmt: skip
    tiny_p, small_p, tiny_t, greedy = ([s["tokens"] for s in ok(r)["sequences"]] for r in host.sample(calls))
    assert tiny_p == small_p and tiny_t == greedy
