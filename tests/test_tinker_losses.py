"""The Tinker built-in losses against per-token Python references and closed-form gradients,
the request checks, and the official SDK's client-side custom-loss path through cross_entropy."""

from __future__ import annotations

import math
import random

import pytest
import torch

from schema.tinker_losses import (
    LOSS_NAMES,
    SPECS,
    LossInputError,
    check_request,
    config_defaults,
)
from workers.losses.tinker import compute_loss

TOL = 1e-9  # float64 throughout: references agree to rounding


def _datum(n: int, rng: random.Random, mask: bool = True) -> dict[str, list[float]]:
    q = [math.log(rng.uniform(0.05, 0.95)) for _ in range(n)]
    # lp spread around q so that ratios land both inside and outside [0.8, 1.2]
    lp = [qi + rng.uniform(-0.5, 0.5) for qi in q]
    return {
        "lp": lp,
        "logprobs": q,
        "advantages": [rng.uniform(-2, 2) for _ in range(n)],
        "weights": [rng.choice([0.0, 1.0, 0.5]) for _ in range(n)],
        "sequence_ratio_mask": [float(mask and i >= 1) for i in range(n)],
        "target_tokens": [rng.randrange(100) for _ in range(n)],
    }


def _run(loss_fn: str, data: list[dict], config: dict | None = None):
    lps = [torch.tensor(d["lp"], dtype=torch.float64, requires_grad=True) for d in data]
    inputs = []
    for d in data:
        inp = {"target_tokens": torch.tensor(d["target_tokens"], dtype=torch.int64)}
        for name in SPECS[loss_fn].required:
            if name != "target_tokens":
                inp[name] = torch.tensor(d[name], dtype=torch.float64)
        inputs.append(inp)
    loss, outs, metrics = compute_loss(loss_fn, lps, inputs, config)
    loss.backward()
    return loss, outs, metrics, [lp.grad.tolist() for lp in lps]


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _reference(loss_fn: str, d: dict, cfg: dict) -> tuple[float, list[float]]:
    """Per-token loss and dL/dlp, by hand."""
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    loss, grad = 0.0, []
    n = len(d["lp"])
    if loss_fn == "gspo":
        m = [t for t in range(n) if d["sequence_ratio_mask"][t]]
        s = math.exp(sum(d["lp"][t] - d["logprobs"][t] for t in m) / len(m)) if m else 1.0
    for t in range(n):
        lp, q, a, w = d["lp"][t], d["logprobs"][t], d["advantages"][t], d["weights"][t]
        r = math.exp(lp - q)
        if loss_fn == "cross_entropy":
            loss, g = loss - lp * w, -w
        elif loss_fn == "importance_sampling":
            loss, g = loss - r * a, -r * a
        elif loss_fn in ("ppo", "gspo"):
            rr = s if loss_fn == "gspo" else r
            un, cl = rr * a, _clip(rr, lo, hi) * a
            loss -= min(un, cl)
            # the clipped branch is constant in lp unless the ratio is inside the range
            g = -rr * a if (un <= cl or lo <= rr <= hi) else 0.0
        elif loss_fn == "cispo":
            c = _clip(r, lo, hi)
            loss, g = loss - c * lp * a, -c * a
        elif loss_fn == "dro":
            b = cfg["beta"]
            loss -= lp * a - 0.5 * b * (lp - q) ** 2
            g = -(a - b * (lp - q))
        elif loss_fn == "stable_reinforce":
            c, k = min(r, hi), cfg["kl_coeff"]
            loss += -c * lp * a + 0.5 * k * (lp - q) ** 2
            g = -c * a + k * (lp - q)
        grad.append(g)
    return loss, grad


CONFIGS = {
    "cross_entropy": [None],
    "importance_sampling": [None],
    "ppo": [None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}],
    "cispo": [None, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}],
    "dro": [None, {"beta": 0.3}],
    "gspo": [None, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}],
    "stable_reinforce": [None, {"kl_coeff": 0.01, "clip_high_threshold": 1.1}],
}


@pytest.mark.parametrize("loss_fn,config", [(name, c) for name in LOSS_NAMES for c in CONFIGS[name]])
def test_loss_and_gradient_match_per_token_reference(loss_fn, config):
    rng = random.Random(hash((loss_fn, str(config))) % 1000)
    data = [_datum(n, rng) for n in (5, 9, 1 + 1)]
    loss, outs, metrics, grads = _run(loss_fn, data, config)
    cfg = {**config_defaults(loss_fn), **(config or {})}
    ref_total = 0.0
    for d, g in zip(data, grads, strict=True):
        ref_loss, ref_grad = _reference(loss_fn, d, cfg)
        ref_total += ref_loss
        assert g == pytest.approx(ref_grad, abs=TOL)
    # Reduction is a sum over tokens and data: scaling the batch up scales the loss up.
    assert float(loss.detach()) == pytest.approx(ref_total, abs=TOL)
    assert set(metrics) == {"loss:sum"}
    assert metrics["loss:sum"] == pytest.approx(ref_total, abs=TOL)
    for o, d in zip(outs, data, strict=True):
        assert set(o) == {"logprobs"} and not o["logprobs"].requires_grad
        assert o["logprobs"].tolist() == pytest.approx(d["lp"])


def test_clipping_is_active_in_the_reference_data():
    """Guard: the random data above exercises both sides of the PPO clip, or the test proves little."""
    rng = random.Random(0)
    ratios = [
        math.exp(a - b) for d in (_datum(50, rng),) for a, b in zip(d["lp"], d["logprobs"], strict=True)
    ]
    assert any(r < 0.8 for r in ratios) and any(r > 1.2 for r in ratios)
    assert any(0.8 <= r <= 1.2 for r in ratios)


def test_gradient_matches_finite_differences():
    """Independent of the closed forms: central differences of the loss itself."""
    rng = random.Random(3)
    for loss_fn in ("importance_sampling", "dro", "cross_entropy"):
        d = _datum(6, rng)
        _, _, _, grads = _run(loss_fn, [d])
        cfg = config_defaults(loss_fn)
        eps = 1e-6
        for t in range(6):
            up, down = dict(d, lp=list(d["lp"])), dict(d, lp=list(d["lp"]))
            up["lp"][t] += eps
            down["lp"][t] -= eps
            fd = (_reference(loss_fn, up, cfg)[0] - _reference(loss_fn, down, cfg)[0]) / (2 * eps)
            assert grads[0][t] == pytest.approx(fd, abs=1e-5)


def test_gspo_with_empty_mask_uses_ratio_one():
    rng = random.Random(5)
    d = _datum(4, rng, mask=False)
    loss, _, _, grads = _run("gspo", [d])
    # s = 1 is inside the clip range: L = -sum A, dL/dlp_t = -A_t
    assert float(loss.detach()) == pytest.approx(-sum(d["advantages"]), abs=TOL)
    assert grads[0] == pytest.approx([-a for a in d["advantages"]], abs=TOL)


def test_per_token_clip_inputs_override_config():
    rng = random.Random(7)
    d = _datum(5, rng)
    lp = torch.tensor(d["lp"], dtype=torch.float64, requires_grad=True)
    inp = {k: torch.tensor(d[k], dtype=torch.float64) for k in ("logprobs", "advantages")}
    inp["target_tokens"] = torch.tensor(d["target_tokens"])
    inp["clip_low_threshold"] = torch.full((5,), 0.99, dtype=torch.float64)
    inp["clip_high_threshold"] = torch.full((5,), 1.01, dtype=torch.float64)
    loss, _, _ = compute_loss("cispo", [lp], [inp], None)
    ref, _ = _reference("cispo", d, {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})
    assert float(loss.detach()) == pytest.approx(ref, abs=TOL)


def test_compute_loss_refuses_inputs_that_do_not_match_the_log_probs():
    lp = torch.zeros(4, requires_grad=True)
    inp = {
        "target_tokens": torch.zeros(4, dtype=torch.int64),
        "logprobs": torch.zeros(4),
        "advantages": torch.zeros(4),
        "clip_high_threshold": torch.ones(3),
    }
    with pytest.raises(LossInputError) as err:
        compute_loss("ppo", [lp], [inp], None)
    assert err.value.field == "data[0].loss_fn_inputs.clip_high_threshold"
    del inp["advantages"]
    with pytest.raises(LossInputError) as err:
        compute_loss("ppo", [lp], [inp], None)
    assert err.value.field == "data[0].loss_fn_inputs.advantages"


def test_top_k_cross_entropy_sums_over_candidates():
    lp = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.6], [0.3, 0.3]], dtype=torch.float64))
    lp.requires_grad_(True)
    w = torch.tensor([[0.7, 0.3], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    inp = {"target_tokens": torch.zeros(3, 2, dtype=torch.int64), "weights": w}
    loss, _, _ = compute_loss("cross_entropy", [lp], [inp], None)
    ref = -sum(w[i, k].item() * lp[i, k].item() for i in range(3) for k in range(2))
    assert float(loss.detach()) == pytest.approx(ref, abs=TOL)


def test_sdk_forward_backward_custom_round_trip_through_cross_entropy():
    """The SDK differentiates a custom loss C client-side and sends weights = -dC/dlp to
    cross_entropy; the backward of our cross_entropy must then equal dC/dlp exactly."""
    tinker = pytest.importorskip("tinker")
    from tinker import types
    from tinker.lib.public_interfaces.training_client import TrainingClient

    rng = random.Random(11)
    lps = [[math.log(rng.uniform(0.05, 0.95)) for _ in range(n)] for n in (4, 7)]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1] * len(lp)),
            loss_fn_inputs={"target_tokens": [2] * len(lp), "weights": [1.0] * len(lp)},
        )
        for lp in lps
    ]
    forward = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {"logprobs": tinker.TensorData(data=lp, dtype="float32", shape=[len(lp)])} for lp in lps
        ],
    )

    def custom(_data, logprobs):  # a nonlinear loss: sum of squares weighted by position
        loss = sum(((torch.arange(len(x)) + 1.0) * x**2).sum() for x in logprobs)
        return loss, {"custom": float(loss.detach())}

    result = TrainingClient._compute_custom_loss(data, custom, forward)
    lp_t = [torch.tensor(lp, dtype=torch.float32, requires_grad=True) for lp in lps]
    inputs = [{k: v.to_torch() for k, v in d.loss_fn_inputs.items()} for d in result.data]
    assert all(i["weights"].dtype == torch.float32 for i in inputs)
    loss, _, _ = compute_loss("cross_entropy", lp_t, inputs, None)
    loss.backward()
    for x, g in zip(lps, lp_t, strict=True):
        expected = [2 * (i + 1) * v for i, v in enumerate(torch.tensor(x).tolist())]
        assert g.grad.tolist() == pytest.approx(expected, rel=1e-5)


# ---- check_request: each error names its field --------------------------------------------


def _req(n: int = 3, **override):
    inputs = {"target_tokens": ("int64", [n]), "logprobs": ("float32", [n]), "advantages": ("float32", [n])}
    inputs.update(override)
    return [(n, {k: v for k, v in inputs.items() if v is not None})]


@pytest.mark.parametrize(
    "loss_fn,data,config,field",
    [
        ("nope", _req(), None, "loss_fn"),
        ("custom", _req(), None, "loss_fn"),
        ("ppo", _req(advantages=None), None, "data[0].loss_fn_inputs.advantages"),
        ("ppo", _req(advantages=("float32", [4])), None, "data[0].loss_fn_inputs.advantages"),
        ("ppo", _req(target_tokens=("float32", [3])), None, "data[0].loss_fn_inputs.target_tokens"),
        ("ppo", _req(logprobs=("int64", [3])), None, "data[0].loss_fn_inputs.logprobs"),
        ("ppo", _req(mask=("float32", [3])), None, "data[0].loss_fn_inputs.mask"),
        ("ppo", _req(), {"clip_eps": 0.2}, "loss_fn_config.clip_eps"),
        ("ppo", _req(), {"clip_low_threshold": 1.5}, "loss_fn_config.clip_low_threshold"),
        ("ppo", _req(), {"clip_high_threshold": 0.5}, "loss_fn_config.clip_high_threshold"),
        ("ppo", _req(), {"clip_high_threshold": "big"}, "loss_fn_config.clip_high_threshold"),
        ("dro", _req(), {"beta": -1.0}, "loss_fn_config.beta"),
        ("dro", _req(), {"beta": float("nan")}, "loss_fn_config.beta"),
        ("importance_sampling", _req(), {"beta": 0.1}, "loss_fn_config.beta"),
        ("gspo", _req(), None, "data[0].loss_fn_inputs.sequence_ratio_mask"),
        (
            "importance_sampling",
            _req(advantages=("float32", [3, 2])),
            None,
            "data[0].loss_fn_inputs.advantages",
        ),
        ("cross_entropy", [(2, {"target_tokens": ("int64", [2])})], None, "data[0].loss_fn_inputs.weights"),
        ("cross_entropy", [], None, "data"),
    ],
)
def test_check_request_names_the_field(loss_fn, data, config, field):
    with pytest.raises(LossInputError) as err:
        check_request(loss_fn, data, config)
    assert err.value.field == field
    assert field in str(err.value)


def test_check_request_accepts_valid_requests():
    check_request("ppo", _req(weights=("float32", [3])), {"clip_low_threshold": 0.9})
    check_request("gspo", _req(sequence_ratio_mask=("float32", [3])), None)
    check_request("stable_reinforce", _req(), {"kl_coeff": 0.01})
    check_request(
        "cross_entropy",
        [(3, {"target_tokens": ("int64", [3, 4]), "weights": ("float32", [3, 4])})],
        None,
    )
    # the second datum's error carries its index
    data = _req() + [(2, {"target_tokens": ("int64", [2]), "logprobs": ("float32", [3])})]
    with pytest.raises(LossInputError) as err:
        check_request("importance_sampling", data, None)
    assert err.value.field.startswith("data[1].")


def test_spec_module_is_torch_free():
    import subprocess
    import sys

    code = "import sys, schema.tinker_losses; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_datum_whose_loss_overflows_float32_is_refused_naming_it():
    """Finite inputs can still make an infinite loss in float32 (a logprob of -1e30 makes the ratio
    exp(1e30); weights of 1e38 over two tokens): its backward would add NaN to the adapter's gradient."""
    lp = [torch.full((2,), -2.0, requires_grad=True) for _ in range(2)]
    rl = {"target_tokens": torch.zeros(2, dtype=torch.int64), "advantages": torch.ones(2)}
    cases = [("importance_sampling", {**rl, "logprobs": torch.tensor([-1.0, -1e30])}),
             ("ppo", {**rl, "logprobs": torch.tensor([-1.0, -1e30]), "advantages": -torch.ones(2)}),
             ("cross_entropy", {"target_tokens": rl["target_tokens"], "weights": torch.full((2,), 1e38)})]  # fmt: skip
    for loss_fn, bad in cases:
        good = {k: torch.ones(2) if k == "logprobs" else v for k, v in bad.items()}
        good = {**good, "weights": torch.ones(2)} if loss_fn == "cross_entropy" else good
        with pytest.raises(LossInputError) as err:
            compute_loss(loss_fn, lp, [good, bad], None)
        assert err.value.field == "data[1].loss_fn_inputs" and "finite" in err.value.message, loss_fn
