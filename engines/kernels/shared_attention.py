"""Shared-prompt attention on a CPU as row gathers and batched matrix products, one autograd Function.

At RL shapes the SDPA path is tiny work spread over many small calls; here q, k and v are gathered
once into the layout the products want, and the backward is written out:

    forward:   S = Q K^T * scale + bias,  P = softmax(S),  O = P V
    backward:  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)) * scale,
               dQ = dS K,  dK = dS^T Q.

A KV head's g query heads are adjacent, so one product per KV head serves them all (GQA without
copies). Padded queries' dO rows are zeroed; padded keys get bias -inf, so neither adds gradient.
The probabilities are kept for the backward, so only rows with few keys (MAX_KEYS, KEYS_PER_DIM)
take this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.kernels.shared_prompt import AttentionLayout

MAX_KEYS = 192  # keys a query may read (prompt + response) for the batched-product path
KEYS_PER_DIM = 3  # ... and at most this many per head dimension


@dataclass
class GridPlan:
    """Row indices (into the flattened [tokens * heads, dim]) of one layout: the query grid is [G, H, P]
    then [S, H, R]; the key grid [G, Hkv, P] then [S, Hkv, P + R] (group prompt, then own keys)."""

    query_rows: torch.Tensor  # source row (token * H + head) of every query-grid row
    query_pad: torch.Tensor  # query-grid rows that are padding
    output_rows: torch.Tensor  # [tokens * H]: the query-grid row of each (token, head)
    key_rows: torch.Tensor  # source row (token * Hkv + head) of every key-grid row
    prompt_bias: torch.Tensor  # [P, P]: 0 where a prompt query may attend, else -inf
    response_bias: torch.Tensor  # [S, 1, 1, R, P + R]
    sizes: tuple[int, int, int, int, int, int]  # G, S, P, R, H, Hkv


def fits(query: torch.Tensor, layout: AttentionLayout, dropout: float) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64)
        and dropout == 0.0
        and layout.prompt_len + layout.response_len <= min(MAX_KEYS, KEYS_PER_DIM * query.shape[-1])
    )


def grid_plan(
    layout: AttentionLayout, tokens: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> GridPlan:
    """The plan for this layout and shape, built once per micro-batch."""
    key = (tokens, heads, kv_heads, dtype)
    if key in layout.plans:
        return layout.plans[key]
    g, p, r = layout.groups, layout.prompt_len, layout.response_len
    s = layout.response_group.shape[0]
    device = layout.slot.device
    cell_token = torch.full((g * p + s * r,), -1, dtype=torch.long, device=device)
    cell_token[layout.slot] = torch.arange(tokens, device=device)
    pad, source = cell_token < 0, cell_token.clamp(min=0)
    positions = torch.arange(max(p, r), device=device)
    prompt_cells = (torch.arange(g, device=device)[:, None] * p + positions[:p])[:, None]  # [G, 1, P]
    response_cells = g * p + torch.arange(s, device=device)[:, None] * r + positions[:r]  # [S, R]
    head = torch.arange(heads, device=device)[:, None]
    query_rows = torch.cat([
        (source[prompt_cells] * heads + head).flatten(),
        (source[response_cells[:, None]] * heads + head).flatten(),
    ])  # fmt: skip
    query_pad = torch.cat([
        pad[prompt_cells].expand(g, heads, p).flatten(),
        pad[response_cells[:, None]].expand(s, heads, r).flatten(),
    ])  # fmt: skip
    output_rows = torch.empty(tokens * heads, dtype=torch.long, device=device)
    real = (~query_pad).nonzero().flatten()
    output_rows[query_rows[real]] = real
    kv_head = torch.arange(kv_heads, device=device)[:, None]
    group_prompt = layout.response_group[:, None] * p + positions[:p]  # [S, P]
    key_cells = torch.cat([group_prompt, response_cells], dim=1)[:, None]  # [S, 1, P + R]
    key_rows = torch.cat([
        (source[prompt_cells] * kv_heads + kv_head).flatten(),
        (source[key_cells] * kv_heads + kv_head).flatten(),
    ])  # fmt: skip
    causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
    prompt_bias = torch.zeros(p, p, dtype=dtype, device=device).masked_fill_(~causal, float("-inf"))
    response_bias = torch.zeros(layout.response_mask.shape, dtype=dtype, device=device)
    response_bias.masked_fill_(~layout.response_mask, float("-inf"))
    layout.plans[key] = GridPlan(
        query_rows=query_rows,
        query_pad=query_pad.nonzero().flatten(),
        output_rows=output_rows,
        key_rows=key_rows,
        prompt_bias=prompt_bias,
        response_bias=response_bias[:, :, None],
        sizes=(g, s, p, r, heads, kv_heads),
    )
    return layout.plans[key]


def _grids(rows: torch.Tensor, plan: GridPlan, queries: bool, dim: int):
    """(prompt grid, response grid) views of a query-grid or key-grid tensor."""
    g, s, p, r, h, kv = plan.sizes
    if queries:
        split = g * h * p
        return rows[:split].view(g * kv, h // kv * p, dim), rows[split:].view(s * kv, h // kv * r, dim)
    split = g * kv * p
    return rows[:split].view(g * kv, p, dim), rows[split:].view(s * kv, p + r, dim)


def _probabilities(q, k, bias, scale, shape) -> torch.Tensor:
    scores = torch.bmm(q, k.transpose(1, 2)).view(shape)
    return torch.add(bias, scores, alpha=scale).softmax(-1).view(q.shape[0], q.shape[1], k.shape[1])


class SharedPromptProducts(torch.autograd.Function):
    """Attention output [1, N, H, Dv] of query [1, H, N, D], key [1, Hkv, N, D], value [1, Hkv, N, Dv]."""

    @staticmethod
    def forward(ctx, query, key, value, plan: GridPlan, scale: float):  # type: ignore[override]
        g, s, p, r, h, kv = plan.sizes
        tokens, dim, dim_v = query.shape[2], query.shape[3], value.shape[3]
        qg = query[0].transpose(0, 1).reshape(tokens * h, dim).index_select(0, plan.query_rows)
        kg = key[0].transpose(0, 1).reshape(tokens * kv, dim).index_select(0, plan.key_rows)
        vg = value[0].transpose(0, 1).reshape(tokens * kv, dim_v).index_select(0, plan.key_rows)
        (qp, qr), (kp, kr), (vp, vr) = (
            _grids(qg, plan, True, dim),
            _grids(kg, plan, False, dim),
            _grids(vg, plan, False, dim_v),
        )
        probs_p = _probabilities(qp, kp, plan.prompt_bias, scale, (g * kv, h // kv, p, p))
        probs_r = _probabilities(qr, kr, plan.response_bias, scale, (s, kv, h // kv, r, p + r))
        out = qg.new_empty(qg.shape[0], dim_v)
        out_p, out_r = _grids(out, plan, True, dim_v)
        torch.bmm(probs_p, vp, out=out_p)
        torch.bmm(probs_r, vr, out=out_r)
        ctx.save_for_backward(qg, kg, vg, probs_p, probs_r)
        ctx.plan, ctx.scale, ctx.tokens = plan, scale, tokens
        return out.index_select(0, plan.output_rows).view(1, tokens, h, dim_v)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        qg, kg, vg, probs_p, probs_r = ctx.saved_tensors
        plan, scale, tokens = ctx.plan, ctx.scale, ctx.tokens
        h, kv = plan.sizes[4], plan.sizes[5]
        dim, dim_v = qg.shape[1], vg.shape[1]
        dog = grad_out.reshape(tokens * h, dim_v).index_select(0, plan.query_rows)
        dog.index_fill_(0, plan.query_pad, 0)  # padded queries' outputs were never read
        dqg, dkg, dvg = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
        pieces = zip(
            (probs_p, probs_r), _grids(dog, plan, True, dim_v), _grids(qg, plan, True, dim),
            _grids(kg, plan, False, dim), _grids(vg, plan, False, dim_v), _grids(dqg, plan, True, dim),
            _grids(dkg, plan, False, dim), _grids(dvg, plan, False, dim_v), strict=True,
        )  # fmt: skip
        for probs, do, q, k, v, dq, dk, dv in pieces:
            torch.bmm(probs.transpose(1, 2), do, out=dv)
            dp = torch.bmm(do, v.transpose(1, 2))
            row = torch.linalg.vecdot(probs, dp).unsqueeze_(-1)
            ds = dp.sub_(row).mul_(probs).mul_(scale)
            torch.bmm(ds, k, out=dq)
            torch.bmm(ds.transpose(1, 2), q, out=dk)
        grad_q = dqg.index_select(0, plan.output_rows).view(tokens, h, dim).transpose(0, 1)[None]
        grad_k = kg.new_zeros(tokens * kv, dim).index_add_(0, plan.key_rows, dkg)
        grad_v = vg.new_zeros(tokens * kv, dim_v).index_add_(0, plan.key_rows, dvg)
        return (
            grad_q,
            grad_k.view(tokens, kv, dim).transpose(0, 1)[None],
            grad_v.view(tokens, kv, dim_v).transpose(0, 1)[None],
            None,
            None,
        )


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: AttentionLayout, scale: float
) -> torch.Tensor:
    """[1, N, H, Dv] attention output over `layout`'s grids (call only where `fits`)."""
    plan = grid_plan(layout, query.shape[2], query.shape[1], key.shape[1], query.dtype)
    return SharedPromptProducts.apply(query, key, value, plan, scale)
