"""Small models and batches shared by tests/test_own_model.py and tests/test_hf_trainer.py: GPT-2, Llama
and BERT from tiny transformers configs, a small conv net, transformers-style batch dicts, and the
checks that a plan's model-side tokens did something."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers

from colabkit import IGNORE_INDEX

B, S, V = 8, 32, 512  # effective batch, sequence, vocabulary: tiny, so the matrix runs in seconds
PLANS = ["baseline", "checkpoint", "accum:4", "adamw8bit", "lora:8", "qlora:8", "compress:int8",
         "checkpoint+adamw4bit+fused-step"]


# ----- models and batches ---------------------------------------------------------------------------
def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def bert() -> nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=V,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class ConvNet(nn.Module):
    """A small image classifier (torchvision does not install here): (B, 3, 16, 16) -> (B, 10)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, pixel_values):
        return self.head(self.features(pixel_values).flatten(1))


def lm_batch(seed: int = 0, padded: bool = True) -> dict:
    """Right-padded sequences of very different lengths: attention_mask 0 and labels -100 past each end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, S), generator=g)
    lengths = torch.tensor([32, 3, 20, 5, 32, 2, 12, 7]) if padded else torch.full((B,), S)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def cls_batch(seed: int = 0) -> dict:
    b = lm_batch(seed)
    return {**b, "labels": torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed))}


def img_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g), "labels": torch.randint(0, 10, (B,), generator=g)}


MODELS = {"gpt2": (gpt2, lm_batch), "llama": (llama, lm_batch), "bert": (bert, cls_batch), "convnet": (ConvNet, img_batch)}


def _quantized_share(model: nn.Module) -> float:
    """Share of the weights of linear and Conv1D layers (the head excepted) stored in 4 bits."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    q = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))  # packed: 2 per byte
    full = sum(m.weight.numel() for n, m in model.named_modules()
               if type(m) in (nn.Linear, Conv1D) and "lora_" not in n
               and not n.endswith(("lm_head", "classifier", "head", "score")))
    return q / max(q + full, 1)


def _head_trains(model: nn.Module) -> bool:
    """The task head's own weights train (not only adapters on it): peft's modules_to_save."""
    return any(p.requires_grad for n, p in model.named_parameters()
               if "classifier" in n and "lora_" not in n)


def _check_model_side(plan: str, name: str, m: nn.Module) -> None:
    if plan in ("lora:8", "qlora:8"):
        trainable = [n for n, p in m.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n or "classifier" in n or "head" in n for n in trainable)
        if name == "bert":
            assert _head_trains(m), "the classification head stays frozen"
    if plan == "qlora:8":
        assert _quantized_share(m) >= 0.9, f"qlora quantized {_quantized_share(m):.0%} of the base's linear weights"


def _cells(names=tuple(MODELS)):
    for name in names:
        for plan in PLANS:
            yield pytest.param(name, plan, id=f"{name}-{plan}")
