"""Hugging Face models without the hub: ``llama:LxD`` builds a Llama-shaped ``LlamaForCausalLM`` from
a transformers config with random weights and a byte vocabulary (256), so CI and offline users run the
same transformers/peft/bitsandbytes code path as a pretrained ``hf:<id>`` model;
:func:`load_hf_4bit` loads a hub model straight into 4-bit NF4 on a GPU (``BitsAndBytesConfig``); and
:func:`offline_stand_in` puts a hub model's shipped config with random weights into the Hugging Face cache,
so ``from_pretrained`` works on a machine without the hub (:func:`is_stand_in` tells that it did).

It sits with the models (imports go down only); :mod:`colabkit.hf`, the user-facing integration with
transformers' Trainer, re-exports it.

>>> cfg = llama_config("llama:2x128")
>>> cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size
(2, 512, 256)
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from .models import dtype_kwarg, register_family  # noqa: F401  (dtype_kwarg: re-exported)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("llama:LxD and hf:<id> models need transformers: pip install 'colabkit[hf]'") from e
    return transformers


def llama_intermediate(d: int, multiple_of: int = 256) -> int:
    """Llama's MLP width: 2/3 of 4·D (SwiGLU keeps the parameter count of a 4·D GELU MLP), rounded up
    to a multiple of 256 as in Meta's reference code (D=4096 -> 11008). >>> llama_intermediate(4096)
    11008"""
    hidden = int(2 * 4 * d / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def llama_config(name: str, seq: int | None = None, dropout: float = 0.0, **overrides: Any):
    """``llama:LxD`` -> a ``LlamaConfig``: L layers of width D, 64-wide heads (D//64, at least 1),
    SwiGLU MLP, RMSNorm, RoPE, byte vocabulary 256 and tied input/output embeddings (like the small
    Llama-3.2 / Qwen2.5 models people fine-tune on a T4). ``:vN`` sets the vocabulary."""
    m = re.fullmatch(r"llama:(\d+)x(\d+)(?::v(\d+))?", name)
    if not m:
        raise ValueError(f"{name!r}: use llama:LxD, e.g. llama:4x256 (optionally :vN for a vocabulary of N)")
    L, D = int(m[1]), int(m[2])
    if L < 1 or D < 64 or D % 64:
        raise ValueError(f"{name!r}: need at least 1 layer and a width that is a multiple of 64")
    tf = _transformers()
    kw = dict(vocab_size=int(m[3] or 256), hidden_size=D, intermediate_size=llama_intermediate(D),
              num_hidden_layers=L, num_attention_heads=D // 64, num_key_value_heads=D // 64,
              max_position_embeddings=max(1024, seq or 0), tie_word_embeddings=True,
              attention_dropout=dropout, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False)
    kw.update(overrides)
    return tf.LlamaConfig(**kw)


def build_llama(name: str, seq: int | None = None, dropout: float = 0.0) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` for ``llama:LxD`` (SDPA attention).

    >>> m = build_llama("llama:1x64")
    >>> m(torch.zeros(1, 8, dtype=torch.long)).logits.shape
    torch.Size([1, 8, 256])
    """
    tf = _transformers()
    cfg = llama_config(name, seq=seq, dropout=dropout)
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg)


register_family("llama:", build_llama)


def single_device_map() -> dict[str, int]:
    """Every module on the current CUDA device: the one :class:`colabkit.MemoryTracker` measures. (``"auto"``
    would split a model across both T4s of a Kaggle machine while the tracker watches one; a model that
    fits one T4 only when split is a job for ``zero:3`` -- sharded, each rank measured on its own GPU --
    not for a tracker that would have to add up devices it does not drive.)"""
    return {"": torch.cuda.current_device()}


def load_hf_4bit(model_id: str, compute_dtype: torch.dtype = torch.float16, device_map: Any = None) -> torch.nn.Module:
    """Load a hub model with its linear layers in 4-bit NF4 with double quantization, straight onto the
    GPU (``BitsAndBytesConfig``): the 16-bit weights never sit in GPU memory. Needs CUDA. The whole model
    goes to the current device (:func:`single_device_map`) unless ``device_map`` says otherwise.

    >>> model = load_hf_4bit("Qwen/Qwen2.5-0.5B-Instruct")  # doctest: +SKIP
    """
    if not torch.cuda.is_available():
        raise RuntimeError("load_hf_4bit needs a CUDA GPU; on the CPU build the model normally and use the "
                           "qlora:R plan token, which quantizes its linear layers with bitsandbytes' CPU kernels")
    tf = _transformers()
    bnb_config = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=compute_dtype)
    model = tf.AutoModelForCausalLM.from_pretrained(
        model_id, quantization_config=bnb_config, device_map=single_device_map() if device_map is None else device_map,
        **{dtype_kwarg(tf): compute_dtype})
    model._colabkit_placed = True  # placed by accelerate; .to() is refused on 4-bit HF models
    return model


def _byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast``: id b is byte b (as :class:`colabkit.ByteTokenizer`), no merges,
    ``<|endoftext|>`` (id 256) as eos and pad; what a stand-in ships in place of the hub's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 bytes (what ByteLevel pre-tokenizers map bytes to)
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b if b in keep else 256 + sum(1 for c in range(b) if c not in keep)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return _transformers().PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                   pad_token="<|endoftext|>")


def offline_stand_in(model_id: str, cache_dir: str | None = None, config: Any = None, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> str:
    """Put a stand-in for hub model ``model_id`` into the Hugging Face cache (``cache_dir``, default the hub
    cache): its config (shipped with colabkit, or ``config``), random weights (``seed``; ``dtype`` as the hub
    stores them) and a byte-level tokenizer. ``from_pretrained(model_id)`` then loads it with
    ``HF_HUB_OFFLINE=1`` on the same code path as the real weights (4-bit loading included), for a machine
    with no network; the model has learned nothing, so only claims a random model can make true hold.
    Returns the snapshot folder.

    >>> folder = offline_stand_in("Qwen/Qwen2.5-0.5B")  # doctest: +SKIP
    """
    tf = _transformers()
    from huggingface_hub import constants

    from .models import hub_config

    cfg = config if config is not None else hub_config(model_id)
    cache_dir = cache_dir or constants.HF_HUB_CACHE
    repo = os.path.join(cache_dir, "models--" + model_id.replace("/", "--"))
    revision = "0" * 32 + "c01abc17"  # a fixed commit name: the stand-in, not a hub revision
    folder = os.path.join(repo, "snapshots", revision)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder)
    _byte_tokenizer().save_pretrained(folder)
    with open(os.path.join(folder, "COLABKIT_STAND_IN.txt"), "w") as f:
        f.write(f"{model_id}: config only, random weights (seed {seed}), byte-level tokenizer; made by "
                "colabkit.hf_models.offline_stand_in for a machine without the hub\n")
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    return folder


def is_stand_in(model_id: str, cache_dir: str | None = None) -> bool:
    """Whether ``from_pretrained(model_id)`` would load an :func:`offline_stand_in` (random weights) from the
    cache rather than the hub's weights: a notebook asserts a pretrained model's claims only when this is False.

    >>> is_stand_in("someone/not-cached-anywhere")
    False
    """
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(model_id, "COLABKIT_STAND_IN.txt", cache_dir=cache_dir)
    except ValueError:  # not a valid repo id
        return False
    return isinstance(path, str)
