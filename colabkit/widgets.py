"""Notebook widgets: thin layers over plain functions. Each widget's callback is a function that a
notebook also calls once with the default choice, so CI runs the same code path.

>>> plan_from_choices(["checkpoint", "accum:4"]), plan_from_choices([])
('checkpoint+accum:4', 'baseline')
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .plan import Context, available_tokens, compatible


def plan_from_choices(tokens: Sequence[str]) -> str:
    """Join chosen tokens into a plan string ('baseline' when none)."""
    return "+".join(tokens) or "baseline"


def disabled_tokens(chosen: Sequence[str], ctx: Context | None = None) -> dict[str, str]:
    """Tokens that cannot be added to the current choice, with the reason (shown as a tooltip)."""
    plan = plan_from_choices(chosen)
    out = {}
    for tok, _ in available_tokens():
        if tok in chosen:
            continue
        reason = compatible(plan, tok, ctx)
        if reason:
            out[tok] = reason
    return out


def plan_picker(on_run: Callable[[str], Any], ctx: Context | None = None, exclude: Sequence[str] = ("adamw",)):
    """A checkbox per registered token (conflicting ones disabled, the reason in the tooltip) and a
    Run button that calls ``on_run(plan_string)`` and shows what it returns/prints below."""
    import ipywidgets as W
    from IPython.display import display

    boxes = {tok: W.Checkbox(value=False, description=tok, tooltip=help_, indent=False,
                             layout=W.Layout(width="190px"))
             for tok, help_ in available_tokens() if tok not in exclude}
    out = W.Output()
    button = W.Button(description="Run against baseline", button_style="primary")

    def chosen() -> list[str]:
        return [t for t, b in boxes.items() if b.value]

    def refresh(_=None) -> None:
        off = disabled_tokens(chosen(), ctx)
        for tok, box in boxes.items():
            box.disabled = tok in off
            box.tooltip = off.get(tok, box.tooltip)

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
                 button, out])
    display(ui)
    return ui
