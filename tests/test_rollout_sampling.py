"""engines/rollout/sampling.py: the inverse-CDF draw samples the contract's distribution (checked
against softmax probabilities by counting), and its log-probs equal a full log-softmax's."""

from __future__ import annotations

import pytest
import torch

from engines.rollout.base import SamplingParams
from engines.rollout.sampling import BLOCK, filter_logits, sample_next

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])  # index 6: filtered


def counts(logits: torch.Tensor, params: SamplingParams, draws: int, seed: int = 0) -> torch.Tensor:
    """How often each token is drawn in `draws` rows of `logits`, 5000 rows a call (memory)."""
    generator = torch.Generator().manual_seed(seed)
    seen = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for start in range(0, draws, 5000):
        tokens, _ = sample_next(logits.expand(min(5000, draws - start), -1), params, generator)
        seen += torch.bincount(tokens, minlength=logits.shape[-1])
    return seen


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
    ],
    ids=["t1", "t0.7", "topk4", "topp0.8"],
)
def test_draws_follow_the_renormalised_distribution(params):
    draws = 200_000
    seen = counts(LOGITS, params, draws)
    expected = filter_logits(LOGITS[None] / params.temperature, params.top_k, params.top_p)[0].softmax(-1)
    expected = expected.double() * draws
    # Every token within 5 standard deviations of its binomial count; tokens of probability 0 never.
    sigma = (expected * (1 - expected / draws)).sqrt()
    assert ((seen - expected).abs() <= 5 * sigma + 1e-9).all(), (seen, expected)
    assert (seen[expected == 0] == 0).all()
    # Pearson's chi-square over the tokens with mass: below the 0.999 quantile for 7 degrees of freedom.
    mass = expected > 0
    assert float(((seen[mass] - expected[mass]) ** 2 / expected[mass]).sum()) < 24.3


def test_log_probs_equal_a_full_log_softmax_at_a_real_vocabulary():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 49152, generator=generator) * 4
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0),
    ):
        tokens, log_probs = sample_next(logits, params, generator)
        temperature = params.temperature if params.temperature > 0 else 1.0
        # The kept set from the float32 logits (as the engine filters), the log-softmax in float64.
        kept = filter_logits(logits / temperature, params.top_k, params.top_p).double()
        reference = kept.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.allclose(log_probs.double(), reference, atol=1e-5, rtol=0)
        assert (kept.gather(-1, tokens[:, None]) > float("-inf")).all()
        if params.temperature == 0:
            assert torch.equal(tokens, logits.argmax(-1))


def test_a_row_with_one_kept_token_always_draws_it_with_log_prob_zero():
    logits = torch.full((64, 10), float("-inf"))
    logits[:, 3] = 5.0
    tokens, log_probs = sample_next(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert (tokens == 3).all() and (log_probs == 0).all()


def test_the_same_seed_draws_the_same_tokens_and_leaves_the_logits_alone():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(temperature=1.0)
    first = sample_next(logits, params, torch.Generator().manual_seed(5))
    second = sample_next(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(logits, before)


def test_draws_across_blocks_of_the_two_level_search():
    """The tokens of LOGITS placed at block edges of a 2100-token vocabulary (blocks of BLOCK
    entries, the last one padded), every other token filtered: the same counts as the softmax."""
    places = torch.tensor([0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, 2099, 1500, 700])
    logits = torch.full((2100,), float("-inf"))
    logits[places] = LOGITS
    draws = 60_000
    seen = counts(logits, SamplingParams(temperature=1.0), draws, seed=3)
    expected = LOGITS.softmax(-1).double() * draws
    sigma = (expected * (1 - expected / draws)).sqrt()
    assert ((seen[places] - expected).abs() <= 5 * sigma + 1e-9).all(), (seen[places], expected)
    assert seen.sum() == seen[places].sum() == draws  # nothing outside the kept tokens


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8])
def test_a_tiny_temperature_draws_the_top_token_with_a_finite_log_prob(temperature):
    """Logits over a tiny temperature overflow float32: the top one became inf, its shift NaN, and the draw
    read past the vocabulary (an out-of-bounds index on a GPU)."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 5
    tokens, log_probs = sample_next(logits, SamplingParams(temperature=temperature), torch.Generator())
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.isfinite(log_probs).all() and log_probs.abs().max() < 1e-6


def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token_alone():
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1))
    kept = filter_logits(logits, top_k=0, top_p=1e-300)  # a valid probability, but 0.0 in float32
    assert torch.isfinite(kept).sum(-1).tolist() == [1] * 4
    assert kept.argmax(-1).tolist() == logits.argmax(-1).tolist()
