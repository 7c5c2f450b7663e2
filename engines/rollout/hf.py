"""The embedded rollout engine: a transformers causal LM with our own batched decode loop.

Prompts are left-padded into one batch with positions restarting at each row's first real token, so
greedy batched output equals one-by-one output. Each distinct prompt is prefilled once into a
preallocated KV cache; a decode step runs fused where it can (both in fused_decode.py). On CUDA the
decode step is a CUDA graph over a static cache instead (graph_decode.py), one launch per token.
Sampling (sampling.py) follows the `Completion` contract, from a private `torch.Generator`. A LoRA
adapter is merged into the weights (adapter_merge.py).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Cache, DynamicCache

from engines.distributed import resolve_dtype
from engines.rollout.adapter_merge import AdapterMerger
from engines.rollout.base import Completion, RolloutEngine, SamplingParams
from engines.rollout.constrained import GrammarCompilers, GrammarMask
from engines.rollout.fused_decode import FusedDecoder, full_attention_only, preallocated_cache
from engines.rollout.graph_decode import StaticDecoder, capacity_for, rows_for
from engines.rollout.sampling import sample_next


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, P], attention_mask [B, P]) with every row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


# Finished rows are dropped from the batch once they are at least 1 / DROP_FINISHED_AT of it: each
# drop copies the KV cache, so dropping every row the moment it stops would cost more than it saves.
DROP_FINISHED_AT = 4
KEPT_DECODERS = 4  # static decoders (each a KV cache and a graph) kept for later calls of their shapes
DONE_CHECK_EVERY = 8  # static decode: steps between reading back whether every row has stopped
SHORT_OF_MEMORY = 0.25  # free share of the device under which memory_is_short


class DecodeMask:
    """The attention mask of each decode step (the first P + t + 1 positions at step t).

    `plain`: the 2D mask, the model builds its own (sliding windows need that). Otherwise the 4D
    [B, 1, 1, P + t + 1] mask transformers would build, or None when no row is padded.
    """

    def __init__(self, prompt_mask: torch.Tensor, steps: int, plain: bool) -> None:
        ones = torch.ones((prompt_mask.shape[0], steps), dtype=prompt_mask.dtype, device=prompt_mask.device)
        self.plain = plain
        self._set(torch.cat([prompt_mask, ones], 1))

    def _set(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.padded = not bool(mask.all())
        self.mask_4d = mask.bool()[:, None, None, :]

    def select(self, rows: torch.Tensor) -> None:
        self._set(self.mask[rows])

    def at(self, length: int) -> torch.Tensor | None:
        if self.plain:
            return self.mask[:, :length]
        return self.mask_4d[..., :length] if self.padded else None


class HFRolloutEngine(RolloutEngine):
    backend = "hf"

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: str | torch.dtype | None = "auto",
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        max_lora_rank: int | None = None,  # merged adapters need no bound (load_adapter)
        graph_decode: bool | None = None,
    ) -> None:
        """`graph_decode`: decode through `StaticDecoder`, captured as a CUDA graph on CUDA (None: on
        CUDA, for the models it supports; True on a CPU runs its step eagerly, for tests)."""
        super().__init__(model_path, eos_token_ids, pad_token_id)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=self.dtype, attn_implementation="sdpa"
        ).to(self.device)
        if self.device.type == "cpu":
            # Own aligned storage: on CPU from_pretrained leaves views into a misaligned mmap of the file,
            # which slows every weight sync's copy (tied weights stay tied).
            with torch.no_grad():
                for param in self.model.parameters():
                    param.data = param.data.clone()
        self.model.eval().requires_grad_(False)
        # Sliding-window (or other non-full) attention keeps transformers' own cache and masks.
        self._plain_mask = not full_attention_only(self.model.config)
        if graph_decode is None:
            graph_decode = self.device.type == "cuda"
        fusable = FusedDecoder.fusable(self.model)
        # One set of fused weights (their parameters become views of it): the fp32 step's and the graph's.
        self._weights = (
            FusedDecoder(self.model) if fusable and (graph_decode or self.dtype == torch.float32) else None
        )
        self._fused = self._weights if self.dtype == torch.float32 else None
        self._graph_decode = self._weights is not None and graph_decode
        self._decoders: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()  # by (rows, capacity)
        self._targets = self._update_targets()
        self._merger = AdapterMerger()
        self._grammars = GrammarCompilers(model_path, self.model.config.vocab_size)

    def _update_targets(self) -> dict[str, torch.Tensor]:
        # Both names of a tied weight (embed_tokens / lm_head): a stream may carry either.
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        return targets

    @torch.inference_mode()
    def _generate(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        if (
            self._graph_decode and params.constraint is None and params.max_new_tokens > 1
        ):  # else no step to replay
            tokens, log_probs, lengths, stopped = self._decode_static(rows, params, generator)
        else:
            tokens, log_probs, lengths, stopped = self._decode(rows, params, generator)
        # Whole tensors to lists once: a slice and a .tolist() per row cost far more.
        tokens_rows, log_prob_rows = tokens.tolist(), log_probs.tolist()
        return [
            Completion(
                token_ids=tokens_rows[i][: lengths[i]],
                log_probs=log_prob_rows[i][: lengths[i]],
                finish_reason="stop" if stopped[i] else "length",
            )
            for i in range(len(rows))
        ]

    def _decode(
        self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[bool]]:
        """([B, N] tokens, [B, N] log-probs, lengths, stopped flags)."""
        batch, steps = len(rows), params.max_new_tokens
        stop_ids = torch.tensor(self.stop_ids(params), device=self.device)
        out_tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        out_log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)

        logits, cache, prompt_mask, positions = self._prefill(rows, steps)
        grammar = None
        if params.constraint is not None:
            compiled = self._grammars.compiled(params.constraint, stop_ids.tolist())
            grammar = GrammarMask(
                compiled, batch, logits.shape[-1], self._grammars.banned_ids(stop_ids.tolist())
            )
        width = prompt_mask.shape[1]
        steps_mask = DecodeMask(prompt_mask, steps, self._plain_mask)
        live = torch.arange(batch, device=self.device)  # the original row of each row still in the batch
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)  # finished, not yet dropped
        next_position = positions[:, -1:] + 1
        for step in range(steps):
            if grammar is not None:
                logits = logits.float()
                grammar.apply(logits, live, done)
            token, log_prob = sample_next(logits, params, generator)
            if grammar is not None:
                grammar.accept(token, live, done)
            active = live[~done]
            out_tokens[active, step] = token[~done]
            out_log_probs[active, step] = log_prob[~done]
            lengths[active] += 1
            hit_stop = torch.isin(token, stop_ids) & ~done
            stopped[live[hit_stop]] = True
            done |= hit_stop
            if step == steps - 1 or bool(done.all()):
                break
            if int(done.sum()) * DROP_FINISHED_AT >= len(done):  # drop the finished rows
                keep = (~done).nonzero().squeeze(1)
                live, token, next_position, done = live[keep], token[keep], next_position[keep], done[keep]
                steps_mask.select(keep)
                cache.batch_select_indices(keep)
            token = token.masked_fill(done, self.pad_token_id)
            logits = self._step(token[:, None], steps_mask.at(width + step + 1), next_position, cache)
            next_position = next_position + 1
        del cache
        return out_tokens.cpu(), out_log_probs.cpu(), lengths.tolist(), stopped.tolist()

    def _decode_static(
        self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[bool]]:
        """`_decode`'s results through a `StaticDecoder`: the batch keeps its rows (a finished row feeds
        padding, as in `_decode`) and the loop reads nothing back but, every few steps, whether all
        rows have stopped."""
        real, steps, pad = len(rows), params.max_new_tokens, self.pad_token_id
        # Rows up to a power of two, so calls of near sizes share a graph: the added rows repeat the
        # first prompt (prefilled once with it) and count as stopped from the start.
        rows = rows + [rows[0]] * (rows_for(real) - real)
        batch = len(rows)
        stop_ids = torch.tensor(self.stop_ids(params), device=self.device)
        out_tokens = torch.full((batch, steps), pad, dtype=torch.long, device=self.device)
        out_log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped[real:] = True
        logits, cache, prompt_mask, positions = self._prefill(rows, steps)
        width = prompt_mask.shape[1]
        decoder = self._static_decoder(batch, capacity_for(width + steps))
        decoder.start(cache, prompt_mask)
        del cache
        next_position = positions[:, -1:] + 1
        for step in range(steps):
            token, log_prob = sample_next(logits, params, generator)
            live = ~stopped
            out_tokens[:, step] = token.masked_fill(stopped, pad)
            out_log_probs[:, step] = log_prob.masked_fill(stopped, 0.0)
            lengths += live.long()
            stopped |= torch.isin(token, stop_ids) & live
            if step == steps - 1 or (step % DONE_CHECK_EVERY == DONE_CHECK_EVERY - 1 and bool(stopped.all())):
                break
            logits = decoder.step(token.masked_fill(stopped, pad)[:, None], next_position, width + step)
            next_position = next_position + 1
        return (
            out_tokens[:real].cpu(),
            out_log_probs[:real].cpu(),
            lengths[:real].tolist(),
            stopped[:real].tolist(),
        )

    def _static_decoder(self, rows: int, capacity: int) -> StaticDecoder:
        """The kept decoder of this shape, or a new one (the least recently used of `KEPT_DECODERS`
        goes; all others go first when the device is short of memory)."""
        key = (rows, capacity)
        if key in self._decoders:
            self._decoders.move_to_end(key)
            return self._decoders[key]
        if self.memory_is_short():
            self._decoders.clear()
        while len(self._decoders) >= KEPT_DECODERS:
            self._decoders.popitem(last=False)
        decoder = StaticDecoder(self._weights, rows, capacity, capture=self.device.type == "cuda")
        self._decoders[key] = decoder
        return decoder

    def _prefill(
        self, rows: list[list[int]], steps: int
    ) -> tuple[torch.Tensor, Cache, torch.Tensor, torch.Tensor]:
        """(last logits [B, V], cache, prompt mask [B, P], positions [B, P]); a prompt repeated in several
        rows is run once and its keys, values and logits copied to its rows."""
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(row), len(distinct)) for row in rows]
        input_ids, prompt_mask = left_pad([list(p) for p in distinct], self.pad_token_id, self.device)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        capacity = input_ids.shape[1] + steps
        if self._plain_mask:
            cache: Cache = DynamicCache(config=self.model.config)
        else:
            cache = preallocated_cache(self.model.config, capacity)
        logits = self._forward(input_ids, prompt_mask, positions, cache)
        if len(distinct) < len(rows):
            index = torch.tensor(row_of, device=self.device)
            cache.batch_select_indices(index)
            logits, prompt_mask, positions = logits[index], prompt_mask[index], positions[index]
        return logits, cache, prompt_mask, positions

    def _step(
        self, tokens: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        """One decode step (one token per row), fused where it can be."""
        if self._fused is not None:
            return self._fused.step(tokens, positions, cache, mask)
        return self._forward(tokens, mask, positions, cache)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: Cache,
    ) -> torch.Tensor:
        """Logits [B, V] of the last position; appends the new keys/values to `cache`."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits are needed
        )
        return out.logits[:, -1, :]

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (HF name, full tensor) into the live parameter or buffer, in place; a bad one raises
        with those before it loaded (the caller re-syncs the whole model)."""
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                raise KeyError(
                    f"weight '{name}' is not a parameter or buffer of the rollout model "
                    f"({type(self.model).__name__}); expected HF state-dict names such as "
                    f"'{next(iter(self._targets))}'"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight '{name}' has shape {tuple(tensor.shape)} but the rollout model's is "
                    f"{tuple(target.shape)}"
                )
            target.data.copy_(tensor)

    def load_adapter(self, config: dict, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Merged into the weights (`AdapterMerger`)."""
        self._merger.merge(self._targets, config, named_tensors)

    def memory_is_short(self) -> bool:
        """Between calls the engine keeps its weights and, on CUDA, the static decoder's KV cache and
        graph for the next call of that shape; a release moves the weights out and back (two copies
        of the model and a gc pass per call) and drops the decoder, worth it only when the device is
        nearly full."""
        if self.device.type != "cuda":
            return False
        free, total = torch.cuda.mem_get_info(self.device)
        return free < SHORT_OF_MEMORY * total

    def release_memory(self) -> None:
        """On CUDA the weights move to host memory and the static decoder (cache and graph) goes."""
        if not self.is_released and self.device.type == "cuda":
            self._decoders.clear()
            self.model.to("cpu")
            self._refresh_after_move()
            gc.collect()  # drop the last references before the cache is emptied (slow: CUDA only)
            torch.cuda.empty_cache()
        super().release_memory()

    def resume_memory(self) -> None:
        if self.is_released and self.device.type == "cuda":
            self.model.to(self.device)
            self._refresh_after_move()
        super().resume_memory()

    def _refresh_after_move(self) -> None:
        """.to() gave the parameters new tensors: point the targets at them and fuse again."""
        self._targets = self._update_targets()
        self._decoders.clear()  # their graphs read the old tensors
        self._merger.to(next(self.model.parameters()).device)
        if self._weights is not None:
            self._weights.fuse()
