"""The Trainer: a model with a plan applied, taking optimizer steps on an effective batch.

A :class:`Trainer` applies a plan to a model (model transforms, forward contexts, optimizer) and runs
optimizer steps on an effective batch, split into ``accum:K`` micro-batches, with the loss
normalised by the token (or example) count of the whole window. A batch is colabkit's ``(x, y)`` or a
dict in transformers' convention (``input_ids``, ``attention_mask``, unshifted ``labels``; see
:mod:`colabkit.batches`). It sits below the train loop (:mod:`colabkit.train`), the OOM guard and the
estimator, which all drive it; techniques never import it.

>>> t = Trainer(build_model("gpt-tiny"), "baseline", device="cpu")
>>> x, y = TextData().batch(2, 16, step=0)
>>> isinstance(t.step(x, y), float), isinstance(t.step({"input_ids": x, "labels": x}), float)
(True, True)
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Iterable

import torch

from .batches import (Batch, LossFn, check_ids, check_labels, count, head_of, learn_classes, lookup_tables,
                      lookups_checked, make_batch, micro_loss)
from .env import default_device, env
from .data import TextData
from .device import host_unscaling
from .memory import MemoryTracker
from .models import build_model, count_params
from .plan import Context, Plan, PlanError, param_groups, REGISTRY

ModelFn = Callable[[], torch.nn.Module]


def _device(device: str | torch.device | None) -> torch.device:
    d = torch.device(device or default_device())
    if d.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' asked for but no GPU is attached: use device='cpu', or in Colab "
                           "Runtime -> Change runtime type -> T4 GPU")
    return d


def load_model(name: str, plan: Plan | str = "baseline", seq: int | None = None,
               device: str | torch.device | None = None) -> torch.nn.Module:
    """Build a model by name for a plan: a technique may load it its own way (``qlora`` loads an
    ``hf:<id>`` model straight into 4-bit on a GPU); otherwise :func:`colabkit.build_model` on ``device``.

    >>> load_model("gpt-tiny", "baseline").config.n_layer
    2
    """
    plan, dev = Plan.parse(plan), _device(device)
    ctx = Context(device=dev)
    for t in plan.techniques():
        if t.load_model is not None:
            model = t.load_model(name, plan, ctx, seq)
            if model is not None:
                return model
    return build_model(name, seq=seq, device=dev)


# plan="auto": the planner (colabkit.estimate, above the Trainer) registers what picks the plan for a model
_AUTO_PLAN: Callable[..., str] | None = None


def register_auto_plan(fn: Callable[..., str] | None) -> None:
    """Install ``fn(model, device=..., model_name=...) -> plan`` for ``Trainer(model, "auto")``
    (:func:`colabkit.estimate.auto.auto_plan` registers itself: the Trainer never imports the planner)."""
    global _AUTO_PLAN
    _AUTO_PLAN = fn


def auto_plan(model: torch.nn.Module | ModelFn, device: str | torch.device | None = None, model_name: str | None = None) -> str:
    """The plan ``"auto"`` stands for on ``model`` (the registered planner's choice)."""
    if _AUTO_PLAN is None:
        raise PlanError("plan='auto' needs the planner: import colabkit (colabkit.estimate registers it)")
    return _AUTO_PLAN(model, device=device, model_name=model_name)


class Trainer:
    """A model with a plan applied, ready to take optimizer steps.

    >>> t = Trainer(build_model("gpt-tiny"), "baseline", device="cpu")
    >>> x, y = TextData().batch(2, 16, step=0)
    >>> isinstance(t.step(x, y), float)
    True
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: Plan | str = "baseline",
        device: str | torch.device | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        max_grad_norm: float | None = None,
        model_name: str | None = None,
        tracker: MemoryTracker | None = None,
        offload_sim: bool = False,
        loss_fn: LossFn | None = None,
        task: str | None = None,
    ):
        self.plan = Plan.parse(auto_plan(model, device, model_name) if str(plan).strip() == "auto" else plan)
        model = model() if callable(model) and not isinstance(model, torch.nn.Module) else model  # a factory
        # loss_fn(outputs, labels, num_items_in_batch) -> loss / num_items_in_batch (transformers' compute_loss_func);
        # task: the head's loss convention when it cannot be told from the model (colabkit.batches.HEADS)
        self.loss_fn, self.task = loss_fn, task
        # offload_sim: offload tokens on a CPU run with a simulated host side (techniques/offload.py)
        self.ctx = Context(device=_device(device), env=env(), model_name=model_name, lr=lr,
                           weight_decay=weight_decay, max_grad_norm=max_grad_norm, offload_sim=offload_sim)
        self.plan.check(self.ctx)
        techs = self.plan.techniques()
        for t in techs:  # order < 50: before the move to the device (e.g. quantize, stream params)
            if t.prepare_model is not None and t.order < 50:
                model = t.prepare_model(model, self.plan, self.ctx)
        places = any(t.places_model is not None and t.places_model(self.plan) for t in techs)
        if not places and not getattr(model, "_colabkit_placed", False):  # zero:2/3 shard before placing
            model = model.to(self.ctx.device)
        for t in techs:
            if t.prepare_model is not None and t.order >= 50:
                model = t.prepare_model(model, self.plan, self.ctx)
        self.model = self.ctx.model = model
        self._tables = lookup_tables(model)  # a plain module's embeddings: checked as each step looks ids up
        if loss_fn is not None and self.ctx.loss_from_head:
            raise PlanError(f"{self.ctx.loss_from_head} computes the cross-entropy of the labels itself, from the LM head's "
                            "input (the model returns no logits): drop loss_fn=, or drop "
                            f"{self.ctx.loss_from_head} to compute your own loss")
        opt_tech = REGISTRY[self.plan.optimizer]
        self.optimizer = opt_tech.make_optimizer(param_groups(model, weight_decay), self.plan, self.ctx)
        for t in techs:
            if t.wrap_optimizer is not None:
                self.optimizer = t.wrap_optimizer(self.optimizer, model, self.plan, self.ctx)
        self._contexts = [t.forward_context for t in techs if t.forward_context is not None]
        self._witnesses = [t.witness for t in techs if t.witness is not None]  # checked in the first forward
        # fp16 compute needs loss scaling (techniques set ctx.loss_scaling); otherwise a no-op (scale 1.0).
        # host_unscaling: gradients offloaded to host memory are unscaled there with a blocking read of the scale
        self.scaler = host_unscaling((self.ctx.make_scaler or torch.amp.GradScaler)(self.ctx.device.type,
                                                                                enabled=self.ctx.loss_scaling))
        self.accum = self.plan.get("accum", 1)
        self.tracker = tracker
        self.step_count = 0
        if tracker is not None:
            tracker.watch(model, self.optimizer)

    def _phase(self, name: str):
        return self.tracker.phase(name, self.step_count) if self.tracker is not None else contextlib.nullcontext()

    def forward_context(self) -> contextlib.ExitStack:
        """All forward contexts of the plan (autocast, saved-tensor hooks, attention backend), and a plain module's
        embeddings refusing ids they have no row for (:func:`~colabkit.batches.lookups_checked`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(lookups_checked(self._tables))
        for make in self._contexts:
            stack.enter_context(make(self.plan, self.ctx))
        return stack

    def loss(self, x: torch.Tensor, y: torch.Tensor, n_tokens: torch.Tensor | int) -> torch.Tensor:
        """Summed token cross-entropy of (x, y) divided by the window's token count ``n_tokens``."""
        b = Batch((x,), {}, y, aligned=True)
        return micro_loss(self.model(x), b, head_of(self.model, b, self.task), n_tokens, 0, 1, self.loss_fn)

    def _batch(self, batch: Any, y: torch.Tensor | None) -> tuple[Batch, str]:
        b = make_batch(self.model, batch, y, labels_to_model=self.loss_fn is None and not self.ctx.loss_from_head)
        head = head_of(self.model, b, self.task)
        check_ids(self.model, b)
        if self.loss_fn is None:  # a loss_fn= takes labels of its own kind
            check_labels(self.model, b, head)  # where the batch came from (the host): no device sync
        return b.to(self.ctx.device), head

    def _micro(self, b: Batch, head: str, n_window: torch.Tensor | int, n_micro: int) -> torch.Tensor:
        """One micro-batch's forward and its share of the window's mean loss."""
        out = self.model(*b.args, **b.kwargs)
        if self.loss_fn is None:
            learn_classes(self.model, out, b, head)  # a plain classifier's class count, once: its ids checked
        problem = getattr(getattr(self.model, "config", None), "problem_type", None)
        return micro_loss(out, b, head, n_window, n_micro, self.accum, self.loss_fn, problem)

    def step(self, batch: Any, y: torch.Tensor | None = None) -> float:
        """One optimizer step on the effective batch -- ``step(x, y)`` or ``step({"input_ids": ...,
        "labels": ...})`` -- split into ``accum:K`` micro-batches; returns its mean loss over the window."""
        self.model.train()
        b, head = self._batch(batch, y)
        micro = b.split(self.accum)
        # items (tokens, examples) of the whole window, not of each micro-batch; one sync for the list
        counts = torch.stack([torch.as_tensor(count(m.labels, head, m.size), device=self.ctx.device) for m in micro])
        n_window, n_micro = counts.sum().clamp(min=1), counts.tolist()
        total = torch.zeros((), device=self.ctx.device)
        for i, (mb, n) in enumerate(zip(micro, n_micro)):
            checks = [w(self.plan, self.ctx) for w in self._witnesses] if self.step_count == 0 and i == 0 else []
            with self._phase("forward"), self.forward_context(), contextlib.ExitStack() as seen:
                for context, _ in checks:
                    seen.enter_context(context)
                loss = self._micro(mb, head, n_window, n)
            for why in (w() for _, w in checks):
                if why:
                    raise PlanError(why)
            if n == 0 and "labels" in mb.kwargs and self.loss_fn is None:
                del loss  # the model's own mean over no tokens is NaN and adds nothing to the window
                continue
            with self._phase("backward"):
                self.scaler.scale(loss).backward()
            total += loss.detach()
            del loss
        with self._phase("optimizer"):
            if self.ctx.max_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ctx.max_grad_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return float(total)

    @torch.no_grad()
    def evaluate(self, batch: Any, y: torch.Tensor | None = None) -> float:
        """The mean loss of a batch (``(x, y)`` or a dict), without a step."""
        self.model.eval()
        b, head = self._batch(batch, y)
        n = max(int(count(b.labels, head, b.size)), 1)
        with self.forward_context():
            return float(self._micro(b, head, n, n))

    # ----- checkpoints: everything needed for an exact resume --------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "plan": str(self.plan),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["plan"] != str(self.plan):
            raise PlanError(f"checkpoint was written with plan {state['plan']!r}, this run uses {str(self.plan)!r}: "
                            "resume with the same plan or start a fresh checkpoint directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"][:torch.cuda.device_count()])  # 2xT4 state, one T4
        self.step_count = state["step"]


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of every tensor in the state dict (names, dtypes, shapes, bytes): equal iff weights are equal."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
