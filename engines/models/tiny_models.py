"""Small causal language models that Tandem builds itself, in Hugging Face format.

No model can be downloaded here, so tests, benchmarks and the demo build their own: a character-level
tokenizer and a randomly initialised Qwen2 or Llama (a causal LM, or a one-label reward model).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engines.models.model_folder import build_atomically

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TinyModelSpec(BaseModel):
    """Shape of a built-in model; the defaults give a tiny Qwen2 for unit tests."""

    model_config = ConfigDict(extra="forbid")

    arch: str = Field("qwen2", description="'qwen2' or 'llama'")
    hidden_size: int = Field(64, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(128, gt=0)
    max_position_embeddings: int = Field(512, gt=0)
    tie_word_embeddings: bool = False
    vocab_size: int | None = Field(
        None,
        gt=0,
        description="the model's vocabulary; None: the tokenizer's (a larger one pads it with unused rows)",
    )
    chat_template: bool = Field(False, description="give the tokenizer a Qwen-style chat template")
    seed: int = 0


BUILTIN_MODELS: dict[str, TinyModelSpec] = {
    "tiny-qwen2": TinyModelSpec(),
    "tiny-llama": TinyModelSpec(arch="llama"),
    "tiny-qwen2-chat": TinyModelSpec(chat_template=True),
    # big enough to learn the built-in arithmetic task on a CPU
    "qwen2-1m": TinyModelSpec(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384
    ),
    "qwen2-1m-chat": TinyModelSpec(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, chat_template=True
    ),
    "qwen2-20m": TinyModelSpec(
        hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1536
    ),
    # Qwen2-0.5B's shapes with random weights: the GPU benchmarks' real-size model.
    "qwen2-0.5b": TinyModelSpec(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}


def _gpt2_bytes() -> list[str]:
    """GPT-2's byte-to-character table: printable bytes as themselves, the others from 256 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tokenizer(chat_template: bool = False):  # -> PreTrainedTokenizerFast
    """A character-level tokenizer (printable ASCII and newline): a byte-level BPE with no merges, Qwen2's
    family, so transformers loads it alike whichever tokenizer class it picks."""
    from transformers import PreTrainedTokenizerFast

    alphabet = _gpt2_bytes()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte in list(range(32, 127)) + [ord("\n")]:
        vocab[alphabet[byte]] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model_config(spec: TinyModelSpec, vocab_size: int, pad_id: int, eos_id: int):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    if spec.arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny-model arch '{spec.arch}': use 'qwen2' or 'llama'")


def build_tiny_model(
    path: str | Path, spec: TinyModelSpec | None = None, overwrite: bool = False, reward: bool = False
) -> Path:
    """Write a random model (`reward`: a one-label sequence classifier) and its tokenizer to `path` (HF
    format), unless already built from `spec`."""
    spec = spec or TinyModelSpec()
    # The causal-LM marker is the bare spec without None fields: older folders keep matching.
    wanted = spec.model_dump(exclude_none=True) | ({"head": "reward"} if reward else {})
    build = partial(_write_model, spec=spec, reward=reward)
    return build_atomically(Path(path), "tandem_spec.json", wanted, build, overwrite)


def _write_model(path: Path, spec: TinyModelSpec, reward: bool) -> None:
    # Imported here: the service lists the built-in names without torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tokenizer = build_tokenizer(spec.chat_template)
    vocab = spec.vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = _model_config(spec, vocab, tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(spec.seed)
    if reward:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def builtin_or_folder(name: str, root: str | Path) -> Path:
    """A model folder as given (one holding config.json), else the built-in model `name` under `root`."""
    if (Path(name) / "config.json").is_file():
        return Path(name)
    return build_builtin_model(name, root)


def build_builtin_model(name: str, root: str | Path, overwrite: bool = False) -> Path:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model '{name}'; choose one of {sorted(BUILTIN_MODELS)}")
    return build_tiny_model(Path(root) / name, BUILTIN_MODELS[name], overwrite=overwrite)
