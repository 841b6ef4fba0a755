"""A tiny instruction dataset shipped with colabkit (48 prompt/response pairs about training memory),
formatted for causal-LM fine-tuning: labels are IGNORE_INDEX on the prompt and the padding, so the
loss is the response's alone; plus greedy generation to compare a model before and after.

Byte-level models (``llama:LxD``, ``gpt:LxD``) use the :class:`~colabkit.data.ByteTokenizer` and the
template ``"Q: ...\\nA: ...\\x03"`` (ETX ends a response); a Hugging Face tokenizer with a chat
template uses that template and its EOS token.

>>> data = InstructData()
>>> x, y = data.batch(2, 96, step=0)
>>> x.shape, bool((y[:, :3] == IGNORE_INDEX).all())  # the prompt is not trained on
(torch.Size([2, 96]), True)
"""
from __future__ import annotations

from typing import Any

import torch

from .data import IGNORE_INDEX, ByteTokenizer
from .models import logits_of

EXAMPLES: list[tuple[str, str]] = [
    ("What uses memory during training?", "Weights, gradients, optimizer state and activations."),
    ("How many bytes does AdamW keep per parameter?", "Eight: two fp32 moments."),
    ("What does LoRA train?", "Two small matrices per layer; the base stays frozen."),
    ("What is QLoRA?", "LoRA on a base stored in 4-bit NF4."),
    ("Why use 4-bit weights?", "They take an eighth of the fp32 bytes."),
    ("What does checkpointing save?", "Activations, by recomputing them in backward."),
    ("What does checkpointing cost?", "About one extra forward pass."),
    ("What is gradient accumulation?", "Summing gradients over micro-batches before a step."),
    ("Why accumulate gradients?", "A large batch fits as several small ones."),
    ("What does fp16 autocast do?", "Runs matmuls in half precision."),
    ("Why a grad scaler with fp16?", "Small gradients would underflow to zero."),
    ("Can a T4 run bf16?", "Not natively: use fp16 on a T4."),
    ("How much memory has a T4?", "About 15 GiB, 14.5 usable."),
    ("What is an 8-bit optimizer?", "Adam with its moments stored in 8 bits."),
    ("What does offloading do?", "Keeps state in host RAM and moves it in."),
    ("What is the rank of LoRA?", "The inner size of the two adapter matrices."),
    ("Does a higher rank cost much?", "Little: adapters grow linearly with rank."),
    ("Which layers get adapters?", "The attention and MLP projections."),
    ("What is NF4?", "A 4-bit format with levels for normal weights."),
    ("What is double quantization?", "Quantizing the scales themselves to 8 bits."),
    ("What is a paged optimizer?", "Optimizer state that can spill to host RAM."),
    ("Why merge adapters?", "To serve one plain model with no extra step."),
    ("What do saved adapters weigh?", "A few megabytes, not the whole model."),
    ("What is the peak memory?", "The most bytes held at any one time."),
    ("When do activations peak?", "At the end of the forward pass."),
    ("When does optimizer state appear?", "At the first optimizer step."),
    ("How do I see the breakdown?", "Run the step under a MemoryTracker."),
    ("What does an OOM mean?", "The GPU had no room for a new tensor."),
    ("What to try first on OOM?", "A smaller batch with accumulation."),
    ("Why is attention memory heavy?", "Scores grow with the square of length."),
    ("What does flash attention save?", "It never stores the full score matrix."),
    ("Does LoRA change the output at start?", "No: B starts at zero."),
    ("What is alpha in LoRA?", "A scale: the update is alpha over rank."),
    ("Why freeze the base model?", "No gradients or optimizer state for it."),
    ("What does fine-tuning need?", "Data, a base model and a loss."),
    ("What is a prompt?", "The text the model continues."),
    ("What is a response?", "The text the model should learn to write."),
    ("Why mask the prompt in the loss?", "To train only on the answer."),
    ("What is a token?", "A piece of text the model reads."),
    ("What is a byte tokenizer?", "One token per byte of UTF-8."),
    ("How do I pick a learning rate?", "Try a few and watch the loss."),
    ("What is a step?", "One update of the weights."),
    ("What is a batch?", "The examples used for one step."),
    ("Why does Colab disconnect?", "Idle or long sessions are stopped."),
    ("How do I survive a disconnect?", "Save checkpoints and resume."),
    ("What is smoke mode?", "Tiny sizes so tests run fast."),
    ("Name a small instruct model.", "Qwen2.5-0.5B-Instruct."),
    ("Is the saving always as claimed?", "Measure it: small models save less."),
]
ETX = "\x03"  # ends a response in the byte-level template


def _is_bytes(tokenizer: Any) -> bool:
    return isinstance(tokenizer, ByteTokenizer)


def encode_example(prompt: str, response: str | None, tokenizer: Any = None) -> tuple[list[int], list[int]]:
    """Token ids of (prompt part, response part); ``response=None`` gives the prompt for generation."""
    tokenizer = tokenizer or ByteTokenizer()
    if _is_bytes(tokenizer):
        p = tokenizer.encode(f"Q: {prompt}\nA: ")
        return p, ([] if response is None else tokenizer.encode(response + ETX))
    msgs = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        p = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(p, dict) or hasattr(p, "input_ids"):  # BatchEncoding in newer transformers
            p = p["input_ids"]
    else:
        p = tokenizer.encode(f"Q: {prompt}\nA: ")
    r = [] if response is None else tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return list(p), r


class InstructData:
    """The shipped examples as (x, y) batches for ``Trainer.step`` / ``train(data=...)``: x (B, S)
    token ids right-padded, y (B, S) next-token labels with IGNORE_INDEX on the prompt and padding.
    Batches depend only on (seed, step), like :class:`~colabkit.data.TextData`."""

    def __init__(self, tokenizer: Any = None, examples: list[tuple[str, str]] | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.examples = examples or EXAMPLES
        self.encoded = [encode_example(p, r, self.tokenizer) for p, r in self.examples]
        self.pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0

    def __len__(self) -> int:
        return len(self.examples)

    def max_len(self) -> int:
        return max(len(p) + len(r) for p, r in self.encoded)

    def batch(self, batch: int, seq: int, step: int, seed: int = 0, device: str | torch.device = "cpu"):
        """(x, y) for one optimizer step; examples longer than seq+1 are cut (the cut part is lost)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(self.encoded), (batch,), generator=g).tolist()
        x = torch.full((batch, seq), self.pad_id, dtype=torch.long)
        y = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(idx):
            p, r = self.encoded[i]
            ids = (p + r)[: seq + 1]
            labels = ([IGNORE_INDEX] * len(p) + r)[: seq + 1]
            n = len(ids) - 1
            x[row, :n] = torch.tensor(ids[:-1])
            y[row, :n] = torch.tensor(labels[1:])  # position t predicts token t+1
        return x.to(device), y.to(device)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: str, tokenizer: Any = None, max_new_tokens: int = 48) -> str:
    """Greedy answer of ``model`` to ``prompt`` in the training template (no sampling: repeatable).

    >>> from colabkit.models import build_model
    >>> isinstance(generate(build_model("gpt-tiny"), "What is LoRA?", max_new_tokens=4), str)
    True
    """
    tokenizer = tokenizer or ByteTokenizer()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids, _ = encode_example(prompt, None, tokenizer)
    x = torch.tensor([ids], device=device)
    eos = ord(ETX) if _is_bytes(tokenizer) else tokenizer.eos_token_id
    out: list[int] = []
    for _ in range(max_new_tokens):  # no KV cache: short answers, any model that maps ids -> logits
        nxt = int(logits_of(model(x))[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return tokenizer.decode(out) if _is_bytes(tokenizer) else tokenizer.decode(out, skip_special_tokens=True)
