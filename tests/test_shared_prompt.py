"""A group's prompt packed once (engines/kernels/shared_prompt.py) gives the numbers of the unshared batch.

References, computed another way: an unsharded Hugging Face model on the padded batch (log-probs
and gradients), and the same engine with share_prompts off (entropy, values, metrics).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from engines.kernels.shared_prompt import pack_shared, prompt_groups
from engines.training.fsdp.engine import FSDPEngine
from engines.training.microbatch import PromptGroups, dynamic_micro_batches
from schema.engine import EngineConfig, MicroBatchConfig
from tests.engine_util import MODES, full_grads, max_rel_diff, pg_loss, reference_log_probs, reference_loss

PROMPT_WIDTH, RESPONSE_WIDTH = 5, 6


def group_batch(seed: int = 0) -> TensorDict:
    """Three prompts (3, 5 and 4 tokens, left-padded) with 3 responses each (1 to 6 tokens), the
    groups' rows interleaved with each other."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    prompts = [torch.randint(4, 99, (n,), generator=g) for n in (3, 5, 4)]
    for i in range(9):
        prompt, length = prompts[i % 3], 1 + (i * 5) % RESPONSE_WIDTH
        ids = torch.zeros(PROMPT_WIDTH + RESPONSE_WIDTH, dtype=torch.long)
        mask = torch.zeros_like(ids)
        ids[PROMPT_WIDTH - len(prompt) : PROMPT_WIDTH] = prompt
        ids[PROMPT_WIDTH : PROMPT_WIDTH + length] = torch.randint(4, 99, (length,), generator=g)
        mask[PROMPT_WIDTH - len(prompt) : PROMPT_WIDTH + length] = 1
        rows.append(ids)
        masks.append(mask)
    ids, mask = torch.stack(rows), torch.stack(masks)
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, PROMPT_WIDTH:],
            "response_mask": mask[:, PROMPT_WIDTH:].clone(),
            "advantages": torch.randn(9, RESPONSE_WIDTH, generator=g),
        },
        batch_size=[9],
    )


def make_engine(model_dir, share: bool, **overrides) -> FSDPEngine:
    engine = FSDPEngine(EngineConfig(model_path=str(model_dir), share_prompts=share, **overrides))
    engine.initialize()
    return engine


class PackedTokens:
    """The length of every packed row the policy model runs (a forward pre-hook)."""

    def __init__(self, engine: FSDPEngine) -> None:
        self.lengths: list[int] = []
        engine.model.register_forward_pre_hook(lambda m, args: self.lengths.append(args[0].shape[1]))


def test_groups_and_layout():
    batch = group_batch()
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], RESPONSE_WIDTH)
    assert groups == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    packed = pack_shared(batch["input_ids"], batch["attention_mask"], RESPONSE_WIDTH, groups)
    responses = int(batch["response_mask"].sum())
    assert packed.input_ids.shape[1] == 3 + 5 + 4 + responses
    assert len(packed.select) == responses == len(packed.targets)
    # Right padding inside the prompt columns, or a response with a hole, cannot be shared.
    broken = batch["attention_mask"].clone()
    broken[0, PROMPT_WIDTH + 1] = 0
    broken[0, PROMPT_WIDTH + 2] = 1
    assert prompt_groups(batch["input_ids"], broken, RESPONSE_WIDTH) is None


def test_shared_prompts_give_the_padded_reference_log_probs(tiny_model_dir):
    batch = group_batch(seed=1)
    engine = make_engine(tiny_model_dir, share=True)
    seen = PackedTokens(engine)
    with engine.eval_mode():
        out = engine.forward_backward_batch(batch, None, forward_only=True, compute_entropy=True)
    assert seen.lengths == [3 + 5 + 4 + int(batch["response_mask"].sum())]  # each prompt once
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    with torch.no_grad():
        ref = reference_log_probs(reference, batch)
    assert (out.outputs["log_probs"] - ref).abs().max() <= 1e-5
    unshared = make_engine(tiny_model_dir, share=False)
    with unshared.eval_mode():
        plain = unshared.forward_backward_batch(batch, None, forward_only=True, compute_entropy=True)
    assert (out.outputs["entropy"] - plain.outputs["entropy"]).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_shared_prompts_give_the_reference_gradients(tiny_model_dir, mode):
    batch = group_batch(seed=2)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    model = copy.deepcopy(reference)
    ref_loss = reference_loss(model, batch, mode)
    ref_loss.backward()
    ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for split in (
        MicroBatchConfig(),
        MicroBatchConfig(micro_batch_size=4),
        MicroBatchConfig(max_tokens_per_micro_batch=25),
    ):
        engine = make_engine(tiny_model_dir, share=True, micro_batch=split)
        with engine.train_mode():
            out = engine.forward_backward_batch(batch, pg_loss(mode))
            grads = full_grads(engine)
        assert max_rel_diff(grads, ref) <= 1e-5, split
        assert out.metrics["loss"] == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)


def test_a_value_model_reads_the_same_values(tiny_model_dir):
    batch = group_batch(seed=3)
    values = []
    for share in (True, False):
        engine = make_engine(tiny_model_dir, share=share, role="value")
        with engine.eval_mode():
            values.append(engine.forward_backward_batch(batch, None, forward_only=True).outputs["values"])
    assert (values[0] - values[1]).abs().max() <= 1e-5
    assert bool((values[0] != 0).any())


def test_dynamic_batching_keeps_a_group_that_fits_together():
    lengths = [6, 9, 7] * 4  # rows i, i + 3, i + 6, i + 9 share a prompt of 4, 5, 3 tokens
    groups = PromptGroups([[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]], [4, 5, 3] * 4)
    packed = [groups.packed_tokens(lengths, g) for g in groups.rows]
    assert packed == [4 + 4 * 2, 5 + 4 * 4, 3 + 4 * 4]  # each prompt once
    plan = dynamic_micro_batches(lengths, 40, groups=groups)
    # 52 packed tokens fit two micro-batches of 40; counted unshared (88) they would need three.
    assert len(plan) == 2 and max(groups.packed_tokens(lengths, mb) for mb in plan) <= 40
    assert sorted(i for mb in plan for i in mb) == list(range(12))
    assert all(set(g) <= set(mb) for g in groups.rows for mb in plan if set(g) & set(mb))  # kept whole
    # A group over the budget is planned row by row; the budget always holds.
    plan = dynamic_micro_batches(lengths, 15, groups=groups)
    assert max(groups.packed_tokens(lengths, mb) for mb in plan) <= 15
    assert sorted(i for mb in plan for i in mb) == list(range(12))


def test_the_budget_counts_what_pack_shared_packs():
    """The planner's packed-token count of any subset of rows equals the length of the row that
    pack_shared builds for it."""
    batch = group_batch(seed=4)
    mask = batch["attention_mask"]
    lengths = mask.sum(1).tolist()
    rows = prompt_groups(batch["input_ids"], mask, RESPONSE_WIDTH)
    groups = PromptGroups(rows, mask[:, :PROMPT_WIDTH].sum(1).tolist())
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        subset = sorted(
            torch.randperm(9, generator=g)[: int(torch.randint(1, 10, (1,), generator=g))].tolist()
        )
        micro = batch[torch.tensor(subset)]
        within = prompt_groups(micro["input_ids"], micro["attention_mask"], RESPONSE_WIDTH)
        built = pack_shared(
            micro["input_ids"], micro["attention_mask"], RESPONSE_WIDTH, within
        ).input_ids.shape[1]
        assert groups.packed_tokens(lengths, subset) == built, subset


def test_an_engine_budget_counts_each_prompt_once(tiny_model_dir):
    """Budget 25 on a batch of 45 packed tokens (69 unshared): two micro-batches, each within it."""
    batch = group_batch()
    engine = make_engine(
        tiny_model_dir, share=True, micro_batch=MicroBatchConfig(max_tokens_per_micro_batch=25)
    )
    seen = PackedTokens(engine)
    with engine.eval_mode():
        engine.forward_backward_batch(batch, None, forward_only=True)
    assert int(batch["attention_mask"].sum()) == 69
    assert sorted(seen.lengths) == [20, 25]
