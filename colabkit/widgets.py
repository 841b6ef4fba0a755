"""Notebook widgets: thin layers over plain functions. Each widget's callback is a function that a
notebook also calls once with the default choice, so CI runs the same code path.

>>> plan_from_choices(["checkpoint", "accum:4"]), plan_from_choices([])
('checkpoint+accum:4', 'baseline')
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from .env import GPU_PROFILES, t4_rules
from .estimate import check_as_gpu
from .plan import Context, Plan, PlanError, available_tokens, compatible, plain_words  # noqa: F401 (re-exported)


def plan_from_choices(tokens: Sequence[str]) -> str:
    """Join chosen tokens into a plan string ('baseline' when none)."""
    return "+".join(t for t in tokens if t != "baseline") or "baseline"


def plan_reason(plan: str, token: str, ctx: Context | None = None, gpu: str | None = None) -> str | None:
    """Why ``token`` cannot join ``plan`` (None when it can): colabkit's own plan check, either in
    ``ctx`` (the device this notebook runs on) or, with ``gpu="t4"``, as it would run on that GPU
    profile: the check the estimator makes before it predicts for a T4 (no bf16, no flash attention).

    >>> plan_reason("baseline", "bf16", gpu="t4") is not None, plan_reason("baseline", "fp16", gpu="t4")
    (True, None)
    """
    if gpu is None:
        why = compatible(plan, token, ctx)
        return None if why is None else plain_words(why)
    if gpu.lower() not in GPU_PROFILES:
        raise ValueError(f"unknown GPU profile {gpu!r}: use one of {', '.join(GPU_PROFILES)}")
    try:
        p = Plan.parse(plan).with_tokens(token) if token != "baseline" else Plan.parse(plan)
        with t4_rules(not GPU_PROFILES[gpu.lower()]["native_bf16"]):
            check_as_gpu(p)
    except PlanError as e:
        return plain_words(str(e))
    return None


def disabled_tokens(chosen: Sequence[str], ctx: Context | None = None, gpu: str | None = None) -> dict[str, str]:
    """Tokens that cannot be added to the current choice, with the reason (shown as a tooltip);
    ``gpu="t4"`` checks as on a T4 (see :func:`plan_reason`)."""
    plan = plan_from_choices(chosen)
    out = {}
    for tok, _ in available_tokens():
        if tok in chosen:
            continue
        reason = plan_reason(plan, tok, ctx, gpu)
        if reason:
            out[tok] = reason
    return out


def reasons_html(off: dict[str, str]) -> str:
    """The greyed-out tokens and why, as a collapsible list (checkbox tooltips do not show in
    JupyterLab 4 with ipywidgets 8, so the reasons are written out).

    >>> "nothing to offload" in reasons_html({"offload:params": "nothing to offload to"})
    True
    """
    import html

    items = "".join(f"<li><code>{html.escape(t)}</code>: {html.escape(r)}</li>" for t, r in sorted(off.items()))
    return (f"<details><summary>Why {len(off)} are greyed out</summary><ul>{items}</ul></details>" if off
            else "<i>every technique can be added</i>")


def plan_picker(on_run: Callable[[str], Any], ctx: Context | None = None, exclude: Sequence[str] = ("adamw",),
                gpu: str | None = None):
    """A checkbox per registered token (conflicting ones disabled, each reason listed below them) and a
    Run button that calls ``on_run(plan_string)`` and shows what it returns/prints below. ``ctx`` is
    the device the run happens on; ``gpu="t4"`` disables what a T4 would refuse instead."""
    import ipywidgets as W
    from IPython.display import display

    boxes = {tok: W.Checkbox(value=False, description=tok, tooltip=help_, indent=False,
                             layout=W.Layout(width="190px"))
             for tok, help_ in available_tokens() if tok not in exclude}
    out = W.Output()
    why = W.HTML()
    button = W.Button(description="Run against baseline", button_style="primary")

    def chosen() -> list[str]:
        return [t for t, b in boxes.items() if b.value]

    def refresh(_=None) -> None:
        off = disabled_tokens(chosen(), ctx, gpu)
        for tok, box in boxes.items():
            box.disabled = tok in off
            box.tooltip = off.get(tok, box.tooltip)
        why.value = reasons_html({t: r for t, r in off.items() if t in boxes})

    def run(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            result = on_run(plan_from_choices(chosen()))
            if result is not None:
                display(result)

    for b in boxes.values():
        b.observe(refresh, names="value")
    button.on_click(run)
    refresh()
    ui = W.VBox([W.HTML("<b>Pick techniques</b> (greyed out: conflicts with your choice or this device)"),
                 W.GridBox(list(boxes.values()), layout=W.Layout(grid_template_columns="repeat(4, 200px)")),
                 why, button, out])
    display(ui)
    return ui


class OptionPicker:
    """One row of toggle buttons per group, one choice per group, and a Run button that calls
    ``on_run(**choice)``. Options that are plan tokens are checked together with the other groups'
    choices by colabkit's own plan check (:func:`plan_reason`, in ``ctx`` or as on ``gpu``): a choice
    that would be refused is disabled, its reason written under the buttons (checkbox tooltips do not
    show in JupyterLab 4). ``"baseline"`` means no token from that group; non-string options (a
    sequence length) are passed through unchecked. ``choice`` is the current choice: a notebook calls
    ``on_run(**picker.choice)`` once itself, so CI runs what the button runs.

    >>> p = OptionPicker({"precision": ["baseline", "fp16", "bf16"]}, lambda precision: precision, gpu="t4")
    >>> p.choice, sorted(p.reasons)
    ({'precision': 'baseline'}, ['bf16'])
    """

    def __init__(self, groups: Mapping[str, Sequence[Any]], on_run: Callable[..., Any], ctx: Context | None = None,
                 gpu: str | None = None, default: Mapping[str, Any] | None = None, title: str = "Pick a strategy"):
        self.groups = {g: list(opts) for g, opts in groups.items()}
        self.on_run, self.ctx, self.gpu, self.title = on_run, ctx, gpu, title
        self.choice = {g: (default or {}).get(g, opts[0]) for g, opts in self.groups.items()}
        self.reasons: dict[Any, str] = {}
        self.ui = None
        self.refresh()

    def _reason(self, group: str, option: Any) -> str | None:
        if not isinstance(option, str) or option == "baseline":
            return None
        others = [v for g, v in self.choice.items() if g != group and isinstance(v, str)]
        return plan_reason(plan_from_choices(others), option, self.ctx, self.gpu)

    def refresh(self) -> None:
        """Recheck every option against the other groups' choices; a chosen option that became refused
        falls back to the first allowed one of its group."""
        self.reasons = {}
        for g, opts in self.groups.items():
            for o in opts:
                why = self._reason(g, o)
                if why:
                    self.reasons[o] = why
            if self.choice[g] in self.reasons:
                self.choice[g] = next(o for o in opts if o not in self.reasons)
        self._sync()

    def _sync(self) -> None:
        if self.ui is None:
            return
        for g, buttons in self._buttons.items():
            for o, b in buttons.items():
                b.value, b.disabled = self.choice[g] == o, o in self.reasons
                b.tooltip = self.reasons.get(o, str(o))
        self._why.value = reasons_html({str(o): r for o, r in self.reasons.items()})

    def display(self):
        """Show the buttons, the reasons and the Run button with its output area; returns the widget."""
        import ipywidgets as W
        from IPython.display import display

        self._buttons = {g: {o: W.ToggleButton(description=str(o), layout=W.Layout(width="auto")) for o in opts}
                         for g, opts in self.groups.items()}
        for g, buttons in self._buttons.items():
            for o, b in buttons.items():
                b.observe(lambda ch, g=g, o=o: self._pick(g, o) if ch["new"] else None, names="value")
        self._why, out = W.HTML(), W.Output()
        run = W.Button(description="Run", button_style="primary")

        def on_click(_):
            with out:
                out.clear_output(wait=True)
                self.on_run(**self.choice)

        run.on_click(on_click)
        rows = [W.HBox([W.Label(g, layout=W.Layout(width="90px"))] + list(b.values())) for g, b in self._buttons.items()]
        self.ui = W.VBox([W.HTML(f"<b>{self.title}</b> (greyed out: refused by the plan check)")] + rows
                         + [self._why, run, out])
        self._sync()
        display(self.ui)
        return self.ui

    def _pick(self, group: str, option: Any) -> None:
        if self.choice[group] != option:
            self.choice[group] = option
            self.refresh()


def explore(fn: Callable[..., Any], controls: Mapping[str, Any]):
    """Show ``controls`` (ipywidgets with a ``value``, by keyword) above an output area; whenever one
    changes, ``fn(**values)`` runs again into that area. The notebook calls ``fn`` once itself with the
    default values, which is what CI executes. Returns the widget.

    >>> import ipywidgets as W
    >>> calls = []; ui = explore(lambda k: calls.append(k), {"k": W.IntSlider(value=2)})
    VBox(children=(IntSlider(value=2), Output()))
    >>> import contextlib, io
    >>> with contextlib.redirect_stdout(io.StringIO()):  # (outside a notebook clear_output prints escapes)
    ...     ui.children[0].value = 3
    >>> calls
    [3]
    """
    import ipywidgets as W
    from IPython.display import display

    out = W.Output()

    def on_change(_=None):
        with out:
            out.clear_output(wait=True)
            fn(**{k: c.value for k, c in controls.items()})

    for c in controls.values():
        c.observe(on_change, names="value")
    ui = W.VBox(list(controls.values()) + [out])
    display(ui)
    return ui


# ---- notebooks 07-13 ----
# Widgets the later notebooks share. Each one is wiring only: it calls a plain function the notebook
# also calls once with the default choice, so CI runs the code path a click runs.
def compatible_for(plan: str, token: str, where: Context | str | None = None) -> str | None:
    """:func:`colabkit.compatible` in the context the run will happen in: a :class:`Context` (this
    machine's device, ``offload_sim``), or a GPU profile name such as ``"t4"``: every technique's check
    as a T4 run applies it (no bf16, fp16 with a GradScaler, CUDA-only offload rules), from any machine.
    None when ``token`` can be added to ``plan``, else the reason.

    >>> compatible_for("fused-step", "fp16", "t4")[:28]
    "'fused-step' with 'fp16': th"
    >>> compatible_for("baseline", "bf16", "t4") is not None, compatible_for("baseline", "adamw8bit", "t4")
    (True, None)
    """
    if isinstance(where, str):
        return plan_reason(plan, token, gpu=where)
    return plan_reason(plan, token, ctx=where)


def _run_into(out, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with its prints and charts going to the ``Output`` ``out`` (cleared first)."""
    with out:
        out.clear_output(wait=True)
        return fn()


def choices_widget(fn: Callable[..., Any], choices: dict[str, Sequence[Any]], button: str | None = None,
                   defaults: dict[str, Any] | None = None, title: str = ""):
    """A dropdown per argument of ``fn`` (``choices``: name -> options; ``defaults`` or the first option
    preselected; an option listed twice is shown once) above an ``Output``: ``fn(**chosen)`` runs there when a choice changes, or only when the
    ``button`` is pressed if one is named (for choices that take seconds to run). Returns the widget box.
    The notebook calls ``fn`` with the defaults itself: that is what CI runs."""
    import ipywidgets as W
    from IPython.display import display

    defaults = defaults or {}
    drops = {k: W.Dropdown(options=list(dict.fromkeys(v)), value=defaults.get(k, list(v)[0]), description=k,
                           style={"description_width": "initial"}) for k, v in choices.items()}
    out = W.Output()

    def run(_=None) -> None:
        _run_into(out, lambda: fn(**{k: d.value for k, d in drops.items()}))

    row: list[Any] = list(drops.values())
    if button:
        b = W.Button(description=button, button_style="primary")
        b.on_click(run)
        row.append(b)
    else:
        for d in drops.values():
            d.observe(run, names="value")
    ui = W.VBox(([W.HTML(f"<b>{title}</b>")] if title else []) + [W.HBox(row), out])
    display(ui)
    return ui


def token_picker(tokens: Sequence[str], on_run: Callable[[str], Any], where: Context | str | None = None,
                 chosen: Sequence[str] = (), button: str = "Run", title: str = "Pick techniques"):
    """A checkbox per token; a token that cannot join the ticked ones in ``where`` (see
    :func:`compatible_for`) is disabled and its reason listed; the button calls ``on_run(plan)`` with
    prints and charts below it. Returns the widget box."""
    import ipywidgets as W
    from IPython.display import display

    boxes = {t: W.Checkbox(value=t in chosen, description=t, indent=False, layout=W.Layout(width="190px"))
             for t in tokens}
    why, out = W.HTML(), W.Output()
    run_b = W.Button(description=button, button_style="primary")

    def ticked() -> list[str]:
        return [t for t, b in boxes.items() if b.value]

    def refresh(_=None) -> None:
        plan = plan_from_choices(ticked())
        off = {t: r for t in tokens if t not in ticked() and (r := compatible_for(plan, t, where))}
        for t, b in boxes.items():
            b.disabled = t in off
        why.value = reasons_html(off)

    for b in boxes.values():
        b.observe(refresh, names="value")
    run_b.on_click(lambda _: _run_into(out, lambda: on_run(plan_from_choices(ticked()))))
    refresh()
    ui = W.VBox([W.HTML(f"<b>{title}</b> (greyed out: refused with your choice here)"),
                 W.GridBox(list(boxes.values()), layout=W.Layout(grid_template_columns="repeat(4, 200px)")),
                 why, run_b, out])
    display(ui)
    return ui


def fit_view(model: str, plan: str, batch: int, seq: int, gpu: str = "t4") -> dict[str, Any] | None:
    """Will ``model`` train with ``plan`` at ``batch`` x ``seq`` on ``gpu``? Prints the verdict and each
    category's predicted bytes (own peak, at the peak), draws the breakdown against that GPU's capacity,
    and returns the estimate; a refused plan prints the reason and returns None."""
    from .estimate import estimate
    from .memory import CATEGORIES, fmt_bytes
    from .plan import PlanError
    from .plots import plot_estimates, show

    try:
        r = estimate(model, plan, batch=batch, seq=seq, gpu=gpu)
    except (PlanError, ValueError) as e:
        print(f"{model}  plan {plan}: refused -- {e}")
        return None
    d = r["resources"]["device"]
    print(f"{model}  plan {plan}  batch {batch} x seq {seq} on {gpu.upper()}: {r['verdict']} "
          f"(needs {fmt_bytes(d['need'])} of {fmt_bytes(d['budget'])})")
    print(f"{'category':<12} {'own peak':>10} {'at peak':>10}")
    for c in CATEGORIES:
        print(f"{c:<12} {fmt_bytes(r['breakdown'][c]):>10} {fmt_bytes(r['at_peak'][c]):>10}")
    show(plot_estimates([r]))
    return r


def will_it_fit(models: Sequence[str], tokens: Sequence[str], batch: int, seq: int, chosen: Sequence[str] = (),
                gpu: str = "t4"):
    """Pick a model and plan tokens: the prediction (:func:`fit_view`) redraws below as choices change;
    a token a ``gpu`` run would refuse with the ticked ones is disabled, its reason listed. Returns
    ``(widget box, the estimate of the initial choice)``."""
    import ipywidgets as W
    from IPython.display import display

    model_w = W.Dropdown(options=list(dict.fromkeys(models)), description="model")
    boxes = {t: W.Checkbox(value=t in chosen, description=t, indent=False, layout=W.Layout(width="170px"))
             for t in tokens}
    why, out = W.HTML(), W.Output()
    last: dict[str, Any] = {}

    def refresh(_=None) -> None:
        ticked = [t for t, b in boxes.items() if b.value]
        plan = plan_from_choices(ticked)
        off = {t: r for t in tokens if t not in ticked and (r := compatible_for(plan, t, gpu))}
        for t, b in boxes.items():
            b.disabled = t in off
        why.value = reasons_html(off)
        last["estimate"] = _run_into(out, lambda: fit_view(model_w.value, plan, batch, seq, gpu))

    for w in (model_w, *boxes.values()):
        w.observe(refresh, names="value")
    ui = W.VBox([model_w, W.HBox(list(boxes.values())), why, out])
    display(ui)
    refresh()
    return ui, last["estimate"]
