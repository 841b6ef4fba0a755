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


def plan_picker(on_run: Callable[[str], Any], ctx: Context | None = None, exclude: Sequence[str] = ("adamw",)):
    """A checkbox per registered token (conflicting ones disabled, each reason listed below them) and a
    Run button that calls ``on_run(plan_string)`` and shows what it returns/prints below."""
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
        off = disabled_tokens(chosen(), ctx)
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
