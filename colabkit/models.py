"""Reference models: a small readable GPT (one dataclass config, nanoGPT-style) with presets from
``gpt-tiny`` to tens of billions of parameters, ``gpt:LxD`` shapes, and ``hf:<id>`` Hugging Face
causal LMs. Every model maps token ids (B, S) to logits (B, S, V).

>>> model = build_model("gpt-tiny")
>>> model(torch.zeros(2, 16, dtype=torch.long)).shape
torch.Size([2, 16, 256])
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    vocab_size: int = 256  # byte-level: the shipped corpus and tokenizer
    block_size: int = 1024  # longest sequence (learned position embeddings)
    dropout: float = 0.0
    bias: bool = True

    @property
    def n_params(self) -> int:
        """Parameter count without building the model (tied input/output embeddings, like GPT-2)."""
        d, L = self.n_embd, self.n_layer
        b = 1 if self.bias else 0
        per_block = 2 * 2 * d + (3 * d * d + 3 * d * b) + (d * d + d * b) + (4 * d * d + 4 * d * b) + (4 * d * d + d * b)
        return self.vocab_size * d + self.block_size * d + L * per_block + 2 * d


GPT2_VOCAB = 50257
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=256),
    "gpt-small": GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab_size=256, block_size=512),
    "gpt2-124m": GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=GPT2_VOCAB),
    "gpt2-350m": GPTConfig(n_layer=24, n_embd=1024, n_head=16, vocab_size=GPT2_VOCAB),
    "gpt2-774m": GPTConfig(n_layer=36, n_embd=1280, n_head=20, vocab_size=GPT2_VOCAB),
    "gpt2-1.5b": GPTConfig(n_layer=48, n_embd=1600, n_head=25, vocab_size=GPT2_VOCAB),
    # Larger GPT shapes (GPT-3 paper table 2.1 widths/depths) for the estimator and large-model runs.
    "gpt-2.7b": GPTConfig(n_layer=32, n_embd=2560, n_head=32, vocab_size=GPT2_VOCAB, block_size=2048),
    "gpt-6.7b": GPTConfig(n_layer=32, n_embd=4096, n_head=32, vocab_size=GPT2_VOCAB, block_size=2048),
    "gpt-13b": GPTConfig(n_layer=40, n_embd=5120, n_head=40, vocab_size=GPT2_VOCAB, block_size=2048),
    "gpt-20b": GPTConfig(n_layer=44, n_embd=6144, n_head=48, vocab_size=GPT2_VOCAB, block_size=2048),
}


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """Config for a preset or ``gpt:LxD`` (L layers of width D, 64-wide heads, byte vocab) with an
    optional ``:vN`` vocabulary, e.g. ``gpt:12x768:v50257``."""
    if name in PRESETS:
        return replace(PRESETS[name], **overrides)
    m = re.fullmatch(r"gpt:(\d+)x(\d+)(?::v(\d+))?", name)
    if not m:
        raise ValueError(
            f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}), gpt:LxD such as gpt:8x256, "
            "llama:LxD, or hf:<hub id>"
        )
    L, D = int(m[1]), int(m[2])
    if L < 1 or D < 8:
        raise ValueError(f"{name!r}: need at least 1 layer and width 8")
    n_head = max(1, D // 64)
    while D % n_head:
        n_head -= 1
    cfg = GPTConfig(n_layer=L, n_embd=D, n_head=n_head, vocab_size=int(m[3] or 256))
    return replace(cfg, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        # (B, S, 3D) -> 3 x (B, H, S, D/H)
        q, k, v = self.qkv(x).view(B, S, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        # The backend (math / memory-efficient / flash) is chosen around the call: attention:* tokens.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, S, D)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias), nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    """GPT-2-shaped decoder: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("proj.weight", "fc_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    def init_module(self, name: str, m: nn.Module) -> None:
        """Initialise one module's own weights as ``__init__`` does (same distributions), for models
        built on the meta device and materialised module by module (:func:`materialize`)."""
        self._init(m)
        if isinstance(m, nn.Linear) and name.endswith("proj"):  # attn.proj, fc_proj: GPT-2's scaled init
            nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer))
        elif isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token table (transformers' name for it): what token ids index."""
        return self.wte

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape  # (B, S) token ids -> (B, S, V) logits
        if S > self.config.block_size:
            raise ValueError(f"sequence {S} is longer than the model's block_size {self.config.block_size}")
        pos = torch.arange(S, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----- model names -> builders ---------------------------------------------------------------
# Other modules register families (e.g. "llama:" in lora.py) with register_family.
_FAMILIES: dict[str, Callable[..., nn.Module]] = {}


def register_family(prefix: str, builder: Callable[..., nn.Module]) -> None:
    """Make ``build_model('<prefix>...')`` call ``builder(name, seq=..., dropout=...)``."""
    _FAMILIES[prefix] = builder


def build_model(name: str, seq: int | None = None, dropout: float = 0.0, device: str | torch.device | None = None) -> nn.Module:
    """Build a model by name: a GPT preset, ``gpt:LxD``, ``hf:<id>`` or a registered family.

    ``seq`` widens the GPT position table when a longer sequence is asked for.
    >>> build_model("gpt:2x64").config.n_head
    1
    """
    for prefix, builder in _FAMILIES.items():
        if name.startswith(prefix):
            model = builder(name, seq=seq, dropout=dropout)
            return model.to(device) if device is not None else model
    cfg = gpt_config(name, dropout=dropout)
    if seq is not None and seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    if device is not None:
        with torch.device(device):
            return GPT(cfg)
    return GPT(cfg)


def model_params(name: str, seq: int | None = None) -> int | None:
    """Parameter count of a GPT name without building it (None for other families)."""
    try:
        cfg = gpt_config(name)
    except ValueError:
        return None
    if seq is not None and seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    return cfg.n_params


HUB_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "hub_configs")
HUB_ALIASES = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
               "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl"}


def shipped_hub_ids() -> list[str]:
    """Hub ids whose config.json ships with colabkit (no weights): estimates of them work offline."""
    return sorted(f[:-5].replace("__", "/") for f in os.listdir(HUB_CONFIG_DIR) if f.endswith(".json"))


class HubError(OSError, ValueError):
    """An ``hf:<id>`` that cannot be resolved; the message says what to do. An OSError (what the hub
    raises) and a ValueError (a user mistake: the CLI prints it in one line)."""


HUB_TIMEOUT_S = 3.0  # how long the hub gets to answer before colabkit treats this machine as offline
_HUB_STATUS: dict[str, str | None] = {}


def hub_unreachable(timeout: float = HUB_TIMEOUT_S) -> str | None:
    """None when the Hugging Face hub answers within ``timeout`` seconds, else why not (HF_HUB_OFFLINE
    set, no route, a timeout). Asked once per process: without it an offline lookup retries for minutes."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.ENDPOINT not in _HUB_STATUS:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            _HUB_STATUS[constants.ENDPOINT] = None
        except Exception as e:  # noqa: BLE001  (any failure to connect means: work offline)
            _HUB_STATUS[constants.ENDPOINT] = f"{constants.ENDPOINT} did not answer within {timeout:g} s: {type(e).__name__}: {e}"
    return _HUB_STATUS[constants.ENDPOINT]


def local_folder(model_id: str) -> str | None:
    """``model_id`` when it names a local folder holding a ``config.json`` (``from_pretrained``'s
    convention: a saved or downloaded model), else None. Such a folder is read before any hub lookup.

    >>> local_folder("gpt2") is None
    True
    """
    path = os.path.expanduser(model_id)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if model_id.startswith(("/", "./", "../", "~")) or os.path.isdir(path):  # a path, not a hub id: say what is wrong
        why = "has no config.json (from_pretrained's folders hold one)" if os.path.isdir(path) else "does not exist"
        raise HubError(f"hf:{model_id}: the folder {why}: give a folder a model or its config was saved to "
                       "(model.save_pretrained(folder) or config.save_pretrained(folder)), or a hub id such as "
                       "hf:Qwen/Qwen2.5-0.5B")
    return None


def _has_weights(folder: str) -> bool:
    """True when ``folder`` holds a checkpoint ``from_pretrained`` loads (safetensors or PyTorch bins)."""
    return any(f.endswith((".safetensors", ".bin")) or f.endswith(".index.json") for f in os.listdir(folder))


def _cached_snapshot(model_id: str) -> str | None:
    """The local folder of ``model_id`` in the Hugging Face cache (its config.json is there), or None.
    Loading from that folder never asks the hub (transformers' adapter lookup would, even offline)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(model_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return os.path.dirname(path) if isinstance(path, str) else None


def _unresolved(model_id: str, why: str) -> HubError:
    shipped = shipped_hub_ids()
    return HubError(
        f"hf:{model_id} is not in this machine's Hugging Face cache, no config of it ships with colabkit, and the hub "
        f"cannot be reached ({why}). Online: check the id and the connection (a slow one: raise HF_HUB_ETAG_TIMEOUT "
        "and HF_HUB_DOWNLOAD_TIMEOUT, in seconds); offline: download it once where there is a connection (it is then "
        "cached), and set HF_HUB_OFFLINE=1 to skip the hub; estimates work offline for the configs colabkit ships "
        f"(e.g. hf:{shipped[0]}; all: colabkit.models.shipped_hub_ids()), and gpt:LxD / llama:LxD need no hub")


def hub_config(model_id: str) -> Any:
    """The transformers config of a hub model: a local folder's own ``config.json`` when ``model_id`` is one,
    else the shipped copy (offline) when there is one, else the local cache, else the hub; when the hub cannot be reached a :class:`HubError` says so within
    seconds. Never loads weights.

    >>> hub_config("gpt2").n_embd, hub_config("meta-llama/Llama-3.1-8B").num_key_value_heads
    (768, 8)
    """
    try:
        from transformers import AutoConfig, CONFIG_MAPPING
    except ImportError as e:
        raise ImportError("hf:<id> models need transformers: pip install 'colabkit[hf]'") from e
    folder = local_folder(model_id)
    if folder:  # a local folder (from_pretrained's convention): its own config, no hub lookup
        return AutoConfig.from_pretrained(folder)
    model_id = HUB_ALIASES.get(model_id, model_id)
    path = os.path.join(HUB_CONFIG_DIR, model_id.replace("/", "__") + ".json")
    if os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
        return CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    local = _cached_snapshot(model_id)
    if local:
        return AutoConfig.from_pretrained(local)
    why = hub_unreachable()
    if why:
        raise _unresolved(model_id, why)
    try:
        return AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise HubError(f"no config for hf:{model_id} on the hub ({err}): check the id (e.g. hf:Qwen/Qwen2.5-0.5B); a gated "
                       "model needs `huggingface-cli login` first") from err


def auto_class(config: Any) -> Any:
    """The transformers class a config is built as: the class its ``architectures`` names when transformers has
    it (e.g. ``BertForSequenceClassification``), else ``AutoModelForSeq2SeqLM`` for an encoder-decoder (T5,
    BART), else ``AutoModelForCausalLM``.

    >>> import transformers
    >>> auto_class(transformers.T5Config()).__name__, auto_class(transformers.LlamaConfig()).__name__
    ('AutoModelForSeq2SeqLM', 'AutoModelForCausalLM')
    """
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch and hasattr(transformers, arch):
        return getattr(transformers, arch)
    return (transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM)


def model_from_config(config: Any) -> nn.Module:
    """The model a config is built as (:func:`auto_class`), with random weights."""
    cls = auto_class(config)
    return cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)


def hf_from_config(model_id: str, seq: int | None = None, config: Any = None) -> nn.Module:
    """A hub model's architecture with random weights, from :func:`hub_config` (how the estimator
    builds ``hf:<id>``: it needs shapes, never weights); ``config``: that config changed (fewer layers)."""
    return model_from_config(config if config is not None else hub_config(model_id))


def dtype_kwarg(tf: Any = None) -> str:
    """The ``from_pretrained`` keyword for the weights' dtype in the installed transformers: ``dtype`` from
    4.56 on, ``torch_dtype`` before (which 4.45-4.55 need: they ignore or reject ``dtype``). Every
    ``from_pretrained`` of colabkit passes one: without it transformers 5.x loads the checkpoint's own
    dtype (``"auto"``: bf16 for most hub models), not the fp32 weights a plan starts from.

    >>> dtype_kwarg(type("tf", (), {"__version__": "4.45.2"}))
    'torch_dtype'
    """
    from packaging.version import Version

    if tf is None:
        import transformers as tf
    return "dtype" if Version(tf.__version__).release >= (4, 56) else "torch_dtype"


def _hf_builder(name: str, seq: int | None = None, dropout: float = 0.0) -> nn.Module:
    """``hf:<id>``: a local folder's model (its weights, or its config with random weights); else the pretrained
    model from the hub when it can be reached, else from the local cache;
    otherwise the model built from its config (shipped or cached) with random weights, saying so."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("hf:<id> models need transformers: pip install 'colabkit[hf]'") from e
    model_id = name[3:]
    folder = local_folder(model_id)
    if folder:  # a local folder: its weights when it holds them, else its config with random weights
        if _has_weights(folder):
            return auto_class(hub_config(folder)).from_pretrained(folder, **{dtype_kwarg(): torch.float32})
        print(f"colabkit: no weights in {folder}; building it from its config.json with random weights")
        return model_from_config(hub_config(folder))
    why = hub_unreachable()
    source = model_id if why is None else _cached_snapshot(model_id)
    try:
        if source is None:
            raise OSError("not in the local cache")
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        try:
            return AutoModelForCausalLM.from_pretrained(source, **{dtype_kwarg(): torch.float32})  # fp32: the plan decides
        except ValueError as err:  # "Unrecognized configuration class": an encoder-decoder (T5, BART)
            if "Unrecognized configuration class" not in str(err):
                raise
            return AutoModelForSeq2SeqLM.from_pretrained(source, **{dtype_kwarg(): torch.float32})
    except (OSError, ValueError) as err:
        why = f"{why}; {err}" if why else f"{type(err).__name__}: {err}"
    cfg = hub_config(model_id)  # a HubError saying what to do when there is none
    print(f"colabkit: no weights for {model_id} ({why}); building it from its config with random weights")
    return model_from_config(cfg)


register_family("hf:", _hf_builder)


# ----- meta build: a model that never exists in full precision ------------------------------------
def module_initializer(model: nn.Module) -> Callable[[str, nn.Module], None]:
    """``init(name, module)`` giving one module the weights its model's own init gives it: the GPT's
    init, or a Hugging Face model's ``_init_weights`` (what ``post_init`` applies module by module)."""
    if isinstance(model, GPT):
        return model.init_module
    if hasattr(model, "_init_weights"):
        return lambda name, m: model._init_weights(m)
    raise ValueError(f"no per-module initialiser known for {type(model).__name__}: build it normally")


@torch.no_grad()
def materialize(model: nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                convert: Callable[[str, nn.Module], nn.Module | None] | None = None) -> nn.Module:
    """Give a model built on the meta device real weights one module at a time, in place: each module's
    own tensors are allocated on ``device`` and initialised by the model's init; ``convert(name, module)``
    may then replace the module (never one holding a tied weight) (e.g. by a 4-bit layer), else its floating parameters are cast to
    ``dtype``. Peak extra memory is one module in fp32; tied parameters stay tied.

    >>> with torch.device("meta"):
    ...     m = build_model("gpt-tiny")
    >>> m = materialize(m, dtype=torch.bfloat16)
    >>> m.lm_head.weight is m.wte.weight, m.blocks[0].fc.weight.dtype, round(float(m.wpe.weight.std()), 2)
    (True, torch.bfloat16, 0.02)
    """
    init = module_initializer(model)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tied: dict[int, nn.Parameter] = {}  # id(shared meta parameter) -> its real parameter
    for name in [n for n, _ in model.named_modules()]:  # names only: a replaced module must be freed
        m = model.get_submodule(name)
        new = shared = False
        for key, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            shared = shared or uses[id(p)] > 1
            real = tied.get(id(p))
            if real is None:
                real, new = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad), True
                if uses[id(p)] > 1:
                    tied[id(p)] = real
            m._parameters[key] = real
        for key, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[key], new = torch.empty_like(b, device=device), True
        if not new:
            continue
        init(name, m)
        replaced = convert(name, m) if convert is not None and not shared else None  # tied: never converted
        if replaced is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, replaced)
            del m, replaced  # the fp32 layer goes now
        elif dtype is not None:
            for p in m.parameters(recurse=False):  # buffers (RoPE's inv_freq) keep their precision
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"materialize left {left[:3]} on the meta device")
    return model


def build_meta(name: str, seq: int | None = None) -> nn.Module:
    """``build_model(name)`` on the meta device: shapes only, no memory, no RNG drawn."""
    with torch.device("meta"):
        return build_model(name, seq=seq)


def logits_of(out: Any) -> torch.Tensor:
    """Logits from a model's output: a tensor, a Hugging Face ``ModelOutput`` (or dict) with ``logits``, or
    a tuple whose first non-scalar tensor they are (nanoGPT's ``(logits, loss)``, ``return_dict=False``).

    >>> logits_of((torch.zeros(2, 3), None)).shape
    torch.Size([2, 3])
    """
    if isinstance(out, torch.Tensor) or hasattr(out, "cross_entropy_sum"):  # (or chunked-ce's ChunkedLogits)
        return out
    logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor) or hasattr(logits, "cross_entropy_sum"):
        return logits
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor) and t.ndim >= 1:
                return t
    raise TypeError(f"no logits in the model's {type(out).__name__} output")


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks (GPT ``blocks``; HF ``model.layers``, ``transformer.h``, ...)."""
    for path in ("blocks", "model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
                 "base_model.model.model.layers", "base_model.model.blocks"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}")
    return max(lists, key=len)


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Unique parameters (tied weights once), optionally only the trainable ones."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        n += p.numel()
    return n
