"""The plotting vocabulary: bars that sum to the measured peak, units that scale, phases and colours
named, the timeline drawn from the first phase with even slots and room for the host line, charts shown
once, whole-number ticks on counting axes, readable log ticks, the readability audit catching what a
learner could not read (negative controls); and the widgets' choices checked by colabkit's own plan check."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import colabkit  # noqa: E402
from colabkit.plots import (CATEGORY_COLORS, LivePlot, audit, byte_unit, draw_categories, draw_timeline,  # noqa: E402
                            plot_breakdown, plot_lines, plot_timings, results_table, show)
from colabkit.widgets import OptionPicker, disabled_tokens, plan_reason  # noqa: E402


@pytest.fixture(scope="module")
def run():
    lp = LivePlot(display=False, title="gpt-tiny baseline")
    out = colabkit.train("gpt-tiny", steps=2, batch=4, seq=32, progress=False, live_plot=lp)
    return lp, out


@pytest.fixture(scope="module")
def records():
    return colabkit.compare("gpt-tiny", ["baseline", "checkpoint"], batch=4, seq=32, steps=2, device="cpu")


def test_byte_units_scale():
    assert byte_unit(512) == ("B", 1)
    assert byte_unit(3 * 1024) == ("KiB", 1024)
    assert byte_unit(2.5 * 2**20) == ("MiB", 2**20)
    assert byte_unit(15 * 2**30) == ("GiB", 2**30)


def test_breakdown_bars_sum_to_the_measured_peak(records):
    fig = plot_breakdown(records)
    ax = fig.axes[0]
    unit, size = byte_unit(max(max(r["peak_bytes"], *r["breakdown"].values()) for r in records))
    assert f"({unit})" in ax.get_ylabel() and unit == "MiB"   # smoke runs are MiB, not 0.002 GiB
    for i, r in enumerate(records):
        bars = [p for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 1e-9]
        assert len(bars) == len(colabkit.CATEGORIES)
        assert sum(b.get_height() for b in bars) * size == pytest.approx(r["peak_bytes"], rel=1e-9)
        # the old chart stacked each category's own peak: taller than the peak whenever they fall apart
        assert sum(r["breakdown"].values()) >= r["peak_bytes"]
    assert audit(fig) == []
    plt.close(fig)


def test_category_timeline_tells_the_story_of_a_step(run):
    lp, out = run
    rows = [s for s in out["timeline"] if s["phase"] != "setup"]
    fwd, bwd, opt = rows[0], rows[1], rows[2]          # step 0: forward, backward, optimizer
    assert (fwd["phase"], bwd["phase"], opt["phase"]) == ("forward", "backward", "optimizer")
    assert fwd["categories"]["params"] == opt["categories"]["params"]            # parameters flat
    assert fwd["categories"]["activations"] > bwd["categories"]["activations"]   # freed by backward
    assert bwd["categories"]["grads"] > 0 and opt["categories"]["grads"] == 0    # set_to_none after the step
    assert fwd["categories"]["optimizer"] == 0 < opt["categories"]["optimizer"]  # state at the first step
    fig = lp.figure()
    assert len(fig.axes) >= 2 and audit(fig) == []
    legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert {"forward phase", "backward phase", "optimizer phase"} <= set(legend)
    assert set(colabkit.CATEGORIES) <= set(legend)
    plt.close(fig)


def test_audit_catches_unreadable_figures():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color="red", label="a")
    ax.plot([0, 1], [1, 0], color="blue")
    ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("memory")                       # no unit
    problems = audit(fig)
    assert any("no unit" in p for p in problems)
    assert any("no title" in p for p in problems)
    assert any("#0000ff" in p for p in problems)  # blue is drawn, no legend names it
    with pytest.raises(AssertionError, match="unreadable figure"):
        show(fig)
    ax.set_ylabel("memory (MiB)"); ax.set_title("t"); ax.lines[1].set_label("b"); ax.legend()
    assert audit(fig) == []
    plt.close(fig)


def test_show_returns_nothing_so_a_cell_ending_in_show_draws_once():
    # IPython displays a cell's last value: a returned figure was drawn a second time (03, 04, 13)
    fig = plot_lines({"a": [1, 2]}, "optimizer step", "loss (nats)", "t")
    assert show(fig) is None
    plt.close(fig)


def test_audit_reads_error_bars_by_their_line_colour():
    fig, ax = plt.subplots()
    ax.bar([0], [1.0], color="#4c72b0", label="median")
    ax.errorbar([0], [1.0], yerr=[[0.1], [0.2]], fmt="none", ecolor="red", capsize=3)
    ax.set_xlabel("plan"); ax.set_ylabel("time (ms)"); ax.set_title("t"); ax.legend()
    assert audit(fig) == ["axes 0: colours ['#ff0000'] are not in any legend"]   # the whiskers are unnamed
    plt.close(fig)


def test_budget_line_only_when_on_scale(records):
    fig = plot_breakdown(records, budget_bytes=colabkit.T4_USABLE_BYTES)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] < 100                  # MiB scale kept: the 14.5 GiB line is not drawn
    assert any("off scale" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close(fig)
    fig = plot_breakdown(records, budget_bytes=4 * 2**20)
    assert any("budget" in t.get_text() and "off scale" not in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    plt.close(fig)


def test_draw_categories_needs_category_samples():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="categories=True"):
        draw_categories(ax, [{"phase": "forward", "step": 0, "categories": None}])
    plt.close(fig)
    assert set(CATEGORY_COLORS) == set(colabkit.CATEGORIES)


def test_side_by_side_predicts_the_real_size(records):
    rows = colabkit.side_by_side(records, "gpt2-124m", batch=4, seq=256)
    for r, rec in zip(rows, records):
        assert r["measured_bytes"] == rec["peak_bytes"]
        est = colabkit.estimate("gpt2-124m", rec["plan"], batch=4, seq=256, gpu="t4")
        assert r["predicted_bytes"] == est["peak_bytes"] > 100 * r["measured_bytes"]
    assert rows[1]["predicted_bytes"] < rows[0]["predicted_bytes"]   # checkpoint saves at the real size too
    assert "predictions" in colabkit.side_by_side_table(rows)


# ----- the timeline renderer --------------------------------------------------------------------------
def _sample(step, phase, peak, rss=100 * 2**20):
    return {"step": step, "phase": phase, "phase_peak": peak, "allocated": peak, "reserved": None, "host_rss": rss}


def _drawn_value(line, x):
    """The value a step line shows at ``x`` (where="pre": a value holds from the previous point)."""
    path = line.get_path().vertices if hasattr(line, "get_path") else None
    xs, ys = path[:, 0], path[:, 1]
    inside = [y for x0, x1, y in zip(xs, xs[1:], ys[1:]) if x0 < x <= x1 and x1 > x0]
    return inside[0] if inside else None


def test_timeline_draws_the_first_forward_phase():
    # step 0's forward ends at 1/3: with where="pre" and no leading point nothing was drawn before it
    samples = [_sample(0, "forward", 4 * 2**20), _sample(0, "backward", 3 * 2**20), _sample(0, "optimizer", 2 * 2**20)]
    fig, ax = plt.subplots()
    draw_timeline(ax, samples, None)
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("allocated"))
    assert line.get_xdata()[0] == pytest.approx(0.0)
    assert _drawn_value(line, 1 / 6) == pytest.approx(4.0)      # the forward's peak, in MiB, over (0, 1/3]
    plt.close(fig)


def test_an_unfinished_last_step_keeps_the_slots_of_the_others():
    # a live plot mid-step: step 1 has only its forward; it sits at 1 + 1/3, not stretched to 2
    samples = [_sample(0, p, 2**20) for p in ("forward", "backward", "optimizer")] + [_sample(1, "forward", 2**20)]
    fig, ax = plt.subplots()
    draw_timeline(ax, samples, None)
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("allocated"))
    assert line.get_xdata()[-1] == pytest.approx(1 + 1 / 3)
    spans = sorted(round(p.get_x() + p.get_width(), 6) for p in ax.patches)
    assert spans == pytest.approx([1 / 3, 2 / 3, 1.0, 4 / 3], abs=1e-6)
    plt.close(fig)
    # the tracker's "end" sample (after the last step) takes no slot: three phases keep three slots
    fig, ax = plt.subplots()
    draw_timeline(ax, samples[:3] + [{**_sample(0, "end", 2**20)}], None)
    assert sorted(round(p.get_x() + p.get_width(), 6) for p in ax.patches) == pytest.approx([1 / 3, 2 / 3, 1.0])
    plt.close(fig)


def test_host_ram_line_has_headroom_and_says_what_host_ram_is():
    samples = [_sample(0, p, 2**20, rss=r * 2**20) for p, r in (("forward", 300), ("backward", 320), ("optimizer", 310))]
    fig, ax = plt.subplots()
    draw_timeline(ax, samples, None)
    ax2 = next(a for a in fig.axes if a is not ax)
    assert ax2.get_ylim()[1] >= 1.2 * 320                     # the line is not drawn on the frame
    assert "RSS" in ax2.get_ylabel()
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "resident memory of this whole process" in legend
    assert audit(fig) == []
    plt.close(fig)


def test_counting_axes_have_whole_number_ticks(run):
    lp, _ = run
    fig = lp.figure()
    fig.canvas.draw()
    for ax in fig.axes[:1] + fig.axes[-1:]:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks   # no 0.5 steps
    plt.close(fig)
    fig = plot_lines({"K=1": [3.0, 2.9, 2.8], "K=4": [3.0, 2.9, 2.8]}, "optimizer step", "loss (nats)", "t")
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())
    plt.close(fig)


def test_log_axes_are_ticked_at_the_measured_values_and_in_bytes():
    fig = plot_lines({"math": ([128, 256, 512], [2**20, 4 * 2**20, 16 * 2**20]), "efficient": ([128, 256, 512], [2**18, 2**19, 2**20])},
                     "sequence length (tokens)", "attention memory", "t", unit="bytes", log="xy")
    fig.canvas.draw()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256", "512"]   # not 10^2
    ylabels = [t.get_text() for t in ax.get_yticklabels()]
    assert ylabels and all(lab.endswith(("KiB", "MiB")) for lab in ylabels) and len(ylabels) <= 6
    assert max(ax.get_lines()[0].get_ydata()) == 16 * 2**20              # the data in bytes, like its ticks
    lo, hi = ax.get_ylim()
    assert lo <= 2**18 and hi >= 16 * 2**20 and all(lo <= t <= hi for t in ax.get_yticks())
    assert audit(fig) == []
    plt.close(fig)


def test_equal_curves_stay_distinguishable():
    fig = plot_lines({"adamw": [3.0, 2.0, 1.0], "adamw8bit": [3.0, 2.0, 1.0]}, "optimizer step", "loss (nats)", "t")
    a, b = fig.axes[0].get_lines()
    assert a.get_linestyle() != b.get_linestyle() and a.get_marker() != b.get_marker()
    assert a.get_linewidth() > b.get_linewidth() and a.get_zorder() < b.get_zorder()   # the thin one on top
    plt.close(fig)


def test_live_plot_redraws_only_what_is_new_and_throttles_to_its_cost(monkeypatch):
    import time as _time

    lp = LivePlot(display=False, every_s=0.0)
    lp._display = True
    draws = []

    def fake_redraw_figure():
        draws.append(len(lp.samples))
        _time.sleep(0.05)                                      # a slow draw on a busy machine
        return plt.figure()

    monkeypatch.setattr(lp, "figure", fake_redraw_figure)
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: type("H", (), {"update": lambda s, f: None})())
    lp.update(_sample(0, "forward", 1))                       # draws
    lp.update(_sample(0, "backward", 1))                      # within 4 x 0.05 s of the last draw: skipped
    lp.close()                                                # something new: drawn
    lp.close()                                                # nothing new: not drawn again
    assert draws == [1, 2]


# ----- the live plot shows what the tracker measured, legends outside, long runs readable (issue 37) -------
def _tracked_run(steps, mlp=False, momentum=0.9, seq=32):
    """A LivePlot fed by a MemoryTracker over ``steps`` SGD steps (forward, backward, optimizer phases) of
    gpt-tiny or a small MLP (``mlp``: cheap enough for many steps), and the tracker's report."""
    torch.manual_seed(0)
    if mlp:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        x = torch.randn(4, seq, 64)
    else:
        model = colabkit.build_model("gpt-tiny")
        x = torch.randint(0, 64, (4, seq))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=momentum)
    lp = LivePlot(display=False, title="t")
    with colabkit.MemoryTracker(model, opt, device="cpu", on_sample=lp.update, alert_at=None) as mt:
        for step in range(steps):
            with mt.phase("forward", step):
                out = model(x)
                loss = out.square().mean() if mlp else torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())
                del out
            with mt.phase("backward", step):
                loss.backward()
                del loss
            with mt.phase("optimizer", step):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return lp, mt.report()


def _bars(ax) -> dict[str, list[float]]:
    """Bar heights per category label, left to right."""
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_category_panel_draws_each_categorys_peak_in_each_phase_as_the_tracker_measured():
    lp, report = _tracked_run(1)
    assert report["peak_phase"] == "backward"                  # the run the issue describes: peak in backward
    fig = lp.figure()
    ax = fig.axes[1]
    assert "peak within the phase" in ax.get_ylabel() and audit(fig) == []
    top = max(v for p in report["phase_peaks"].values() for v in p["own"].values())
    unit, size = byte_unit(top)
    bars = _bars(ax)
    assert set(bars) == set(colabkit.CATEGORIES)               # other included
    for i, phase in enumerate(("forward", "backward", "optimizer")):
        own = report["phase_peaks"][phase]["own"]              # the tracker's per-phase replay of its ledger
        assert {c: bars[c][i] * size for c in colabkit.CATEGORIES} == pytest.approx(own, rel=1e-9), phase
    assert report["phase_peaks"]["backward"]["own"]["other"] > 0   # temporaries of backward, drawn
    # negative control: what the old panel drew (categories live as the phase ended) is not the peak
    bwd = next(s for s in lp.samples if s["phase"] == "backward")
    assert bwd["categories"]["activations"] < bars["activations"][1] * size
    assert bwd["categories"]["other"] < bars["other"][1] * size
    plt.close(fig)


def _overlaps_data(fig) -> list[str]:
    """Legends whose box overlaps the data area of any axes of ``fig`` (drawn first)."""
    fig.canvas.draw()
    boxes = [ax.get_window_extent() for ax in fig.axes]
    return [f"legend of axes {i}" for i, ax in enumerate(fig.axes)
            if ax.get_legend() and any(ax.get_legend().get_window_extent().overlaps(b) for b in boxes)]


def test_live_plot_legends_sit_outside_the_data(run):
    lp, _ = run
    fig = lp.figure()
    assert sum(ax.get_legend() is not None for ax in fig.axes) == 2 and _overlaps_data(fig) == []
    plt.close(fig)
    fig, ax = plt.subplots()                                   # negative control: a legend inside the axes
    ax.plot([0, 1], [0, 1], label="a")
    ax.legend(loc="upper left")
    assert _overlaps_data(fig) == ["legend of axes 0"]
    plt.close(fig)


def test_a_30_step_run_stays_readable():
    from colabkit.liveplot import MAX_SLOTS

    lp, _ = _tracked_run(30, mlp=True)
    fig = lp.figure()
    left, right = fig.axes[0], fig.axes[1]
    assert len(left.patches) <= MAX_SLOTS                      # phase bands: none or one per slot, not 90 stripes
    assert len(right.patches) <= MAX_SLOTS * len(colabkit.CATEGORIES)
    labels = [t for t in right.get_xticklabels() if t.get_text()]
    assert 1 < len(labels) <= MAX_SLOTS
    fig.canvas.draw()
    extents = [t.get_window_extent() for t in labels]
    assert not any(a.overlaps(b) for a, b in zip(extents, extents[1:]))   # tick labels side by side, not on top
    assert audit(fig) == [] and _overlaps_data(fig) == []
    # each slot's bar is the largest of its steps' per-phase peaks (3 steps per slot at 30 steps)
    rows = [s for s in lp.samples if s["phase"] not in ("setup", "end")]
    first = max(s["category_peaks"]["activations"] for s in rows if s["step"] < 3)
    unit, size = byte_unit(max(v for s in rows for v in s["category_peaks"].values()))
    assert _bars(right)["activations"][0] * size == pytest.approx(first, rel=1e-9)
    plt.close(fig)
    # negative control: a 3-step run keeps a slot (and a band) per phase
    lp3, _ = _tracked_run(3, mlp=True)
    fig = lp3.figure()
    assert len(fig.axes[0].patches) == 9 and len(fig.axes[1].patches) == 9 * len(colabkit.CATEGORIES)
    plt.close(fig)


def test_step_time_chart_and_results_table(records):
    from colabkit.timing import Timing

    timings = {"baseline": Timing(0.010, 0.009, 0.012, [0.01, 0.009, 0.012]),
               "checkpoint": Timing(0.013, 0.012, 0.015, [0.013, 0.012, 0.015])}
    fig = plot_timings(timings, "step time")
    ax = fig.axes[0]
    assert "(ms)" in ax.get_ylabel() and "untracked" in ax.get_title() and "cpu" in ax.get_title()
    assert [round(p.get_height(), 6) for p in ax.patches] == [10.0, 13.0]
    assert audit(fig) == []
    plt.close(fig)
    table = results_table(records, timings).splitlines()
    base, ckpt = records
    ratio = f"{ckpt['peak_bytes'] / base['peak_bytes']:.2f}"
    assert table[3].split(" | ")[2] == ratio                  # the peak relative to the first record
    assert "untracked" in table[0] and "13.0 ms" in table[3]
    assert "step s" not in results_table(records)              # no tracked step time


# ----- the widgets: choices checked by colabkit's own plan check --------------------------------------
def test_plan_reason_checks_as_a_t4_from_a_cpu():
    # the estimator's T4 check (no bf16, no flash attention) answered on a machine without a GPU
    assert "fp16" in plan_reason("baseline", "bf16", gpu="t4")
    assert "attention:efficient" in plan_reason("baseline", "attention:flash", gpu="t4")
    assert plan_reason("baseline", "attention:efficient", gpu="t4") is None
    assert "fp16" in plan_reason("fused-step", "fp16", gpu="t4")      # 09: ticking fused-step must grey out fp16
    cpu = colabkit.Context(device=torch.device("cpu"))
    assert plan_reason("baseline", "attention:efficient", cpu) is not None   # this device: only math forced
    assert "fused-step" in disabled_tokens(["fp16"], gpu="t4")
    with pytest.raises(ValueError, match="unknown GPU profile"):
        plan_reason("baseline", "fp16", gpu="t5")


def test_option_picker_disables_what_the_check_refuses_and_runs_the_choice():
    runs = []
    p = OptionPicker({"backend": ["attention:math", "attention:efficient", "attention:flash"], "seq": [128, 256]},
                     lambda backend, seq: runs.append((backend, seq)), gpu="t4", default={"backend": "attention:flash"})
    assert p.choice == {"backend": "attention:math", "seq": 128}   # flash refused on a T4: first allowed instead
    assert set(p.reasons) == {"attention:flash"}
    p.display()
    buttons = {b.description: b for row in p.ui.children[1:3] for b in row.children[1:]}
    assert buttons["attention:flash"].disabled and not buttons["attention:efficient"].disabled
    assert "attention:flash" in p.ui.children[3].value                 # the reason is written out
    buttons["attention:efficient"].value = True
    buttons["256"].value = True
    assert p.choice == {"backend": "attention:efficient", "seq": 256} and not buttons["attention:math"].value
    p.ui.children[4].click()
    assert runs == [("attention:efficient", 256)]


def test_side_by_side_says_a_t4_refusal_in_plain_words(monkeypatch):
    """A bf16 run measured on a GPU with native bf16, predicted for a T4: the row's refusal says "compute capability
    7.5", not colabkit's internal "T4 emulation is on ... sm75" (what the notebooks' output check flags). Control:
    the raw plan check's reason does carry those words."""
    import importlib

    compare = importlib.import_module("colabkit.compare")  # the module (the package exports a function named compare)
    record = {"plan": "bf16", "ok": True, "peak_bytes": 1, "model": "gpt:2x64", "batch": 2, "seq": 16, "device": "cuda"}
    raw = "bf16: T4 emulation is on and a T4 (sm75) has no native bf16; use fp16"

    def refuse(*a, **k):
        raise colabkit.PlanError(raw)

    monkeypatch.setattr(compare, "estimate", refuse)
    row = colabkit.side_by_side([record], "gpt2-124m", batch=4, seq=256)[0]
    assert row["error"] == "bf16: a T4 (compute capability 7.5) has no native bf16; use fp16"
    assert "sm75" not in colabkit.side_by_side_table([row]) and "emulation" not in colabkit.side_by_side_table([row])
    with pytest.raises(colabkit.PlanError, match="T4 emulation is on"):
        colabkit.estimate("gpt:2x64", "bf16", batch=2, seq=16, gpu="t4")


def test_side_by_side_says_a_measured_refusal_in_plain_words():
    """A record whose own run was refused (measured under T4 rules) carries the check's raw words; its row says them
    plainly, without the exception's class name. Control: the raw record does carry 'sm75' and 'PlanError: '."""
    raw = "PlanError: bf16: T4 emulation is on and a T4 (sm75) has no native bf16; use fp16"
    record = {"plan": "baseline", "ok": False, "error": raw, "model": "gpt:2x64", "batch": 2, "seq": 16, "device": "cpu"}
    row = colabkit.side_by_side([record], "gpt:2x64", batch=2, seq=16)[0]
    assert row["error"] == "bf16: a T4 (compute capability 7.5) has no native bf16; use fp16"
    assert "sm75" in raw and raw.startswith("PlanError: ")
