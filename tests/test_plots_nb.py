"""The charts, widgets and helpers notebooks 07-13 call (issue 23): each test states what a learner must be
able to read or do, checks it against an independent reference (the tracker's samples, the plan's own
check, the estimator's numbers, matplotlib's rendered text), and has a negative control."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import colabkit  # noqa: E402
from colabkit import (CATEGORIES, Context, PlanError, charts, compatible, compatible_for, line_chart,  # noqa: E402
                      phase_slots, plot_estimates, plot_per_rank, plot_timelines, series_style)
from colabkit.plots import CATEGORY_COLORS, PHASE_COLORS, audit, byte_unit  # noqa: E402


@pytest.fixture(scope="module")
def samples():
    """Two tracked runs of two steps: AdamW and adamw8bit (same forward and backward, less state)."""
    out = {}
    for plan in ("baseline", "adamw8bit"):
        out[plan] = []
        colabkit.measure("gpt-tiny", plan, batch=2, seq=16, steps=2, device="cpu", on_sample=out[plan].append)
    return out


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---------------------------------------------------------------- styles and axes
def test_series_styles_differ_in_colour_line_and_marker():
    styles = [tuple(series_style(i).values()) for i in range(40)]
    assert len(set(styles)) == 40                                   # no two series look alike
    assert series_style(0)["linestyle"] != series_style(1)["linestyle"]
    assert series_style(0)["marker"] != series_style(1)["marker"]


def _overlapping_tick_labels(ax) -> list[tuple[str, str]]:
    """Pairs of visible x tick labels whose rendered boxes overlap (what a reader cannot read)."""
    ax.figure.canvas.draw()
    r = ax.figure.canvas.get_renderer()
    labels = [t for t in ax.get_xticklabels(which="both") if t.get_visible() and t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in labels]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if ba.overlaps(bb)]


def test_log_axis_is_ticked_at_the_data_and_readable():
    ns = [256, 512, 1024, 2048, 4096]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    line_chart(ax, {"dense": (ns, [n * n for n in ns])}, "N (rows)", "bytes (B)", "t", log="xy")
    assert list(ax.get_xticks()) == ns
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(n) for n in ns]
    assert _overlapping_tick_labels(ax) == []
    # negative control: matplotlib's default log axis over the same data labels minor ticks into each other
    fig2, ax2 = plt.subplots(figsize=(5.5, 3.6))
    ax2.loglog(ns, [n * n for n in ns])
    assert _overlapping_tick_labels(ax2)


def test_integer_axis_has_only_whole_ticks():
    fig, ax = plt.subplots()
    line_chart(ax, {"loss": [3.0, 2.5, 2.2]}, "optimizer step", "loss (nats)", "t", integer_x=True)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    fig2, ax2 = plt.subplots()
    ax2.plot([1, 2, 3], [3.0, 2.5, 2.2])                      # negative control: default ticks at halves
    assert not all(float(t).is_integer() for t in ax2.get_xticks())


def test_a_label_keeps_its_style_across_panels():
    fig = charts(dict(series={"adamw": [3, 2], "adamw8bit": [3, 2.1]}, xlabel="step (n)", ylabel="loss (nats)", title="a"),
                 dict(series={"adamw8bit": [0, 0.1]}, xlabel="step (n)", ylabel="difference (nats)", title="b"))
    left = {ln.get_label(): (ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in fig.axes[0].lines}
    right = {ln.get_label(): (ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in fig.axes[1].lines}
    assert right["adamw8bit"] == left["adamw8bit"] != left["adamw"]
    assert audit(fig) == []


def test_marks_draw_a_named_vertical_line():
    fig = charts(dict(series={"loss": [3, 2, 1]}, marks={"killed here": 2}, xlabel="step (n)", ylabel="loss (nats)",
                      title="t"))
    assert [ln.get_xdata()[0] for ln in fig.axes[0].lines if ln.get_label() == "killed here"] == [2]
    assert audit(fig) == []


# ---------------------------------------------------------------- the overlaid timeline
def test_phase_slots_are_the_tracked_phases_evenly_spaced(samples):
    s = samples["baseline"]
    edges, peaks, phases = phase_slots(s)
    ran = [x for x in s if x["phase"] in PHASE_COLORS]          # the tracker's setup and end are no phases
    assert phases == [x["phase"] for x in ran] == ["forward", "backward", "optimizer"] * 2
    assert peaks == [x["phase_peak"] for x in ran]
    assert edges[0] == 0 and edges[-1] == 2 and len(edges) == len(peaks) + 1
    widths = [b - a for a, b in zip(edges, edges[1:])]
    assert max(widths) - min(widths) < 1e-12                    # every phase the same width
    report_peak = max(x["phase_peak"] for x in s)
    assert max(peaks) == report_peak                            # the tallest slot is the run's peak


def test_timeline_overlays_runs_distinguishably_from_the_first_phase(samples):
    fig = plot_timelines(samples, title="t")
    ax = fig.axes[0]
    stairs = [c for c in ax.patches if type(c).__name__ == "StepPatch"]
    assert len(stairs) == 2
    unit, size = byte_unit(max(max(x["phase_peak"] for x in s) for s in samples.values()))
    for patch, (name, s) in zip(stairs, samples.items()):
        values, edges, _ = patch.get_data()
        _, peaks, _ = phase_slots(s)
        assert list(values) == pytest.approx([p / size for p in peaks])
        assert edges[0] == 0                                    # the first forward phase is drawn
    assert stairs[0].get_linestyle() != stairs[1].get_linestyle()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"baseline", "adamw8bit", "forward phase", "backward phase", "optimizer phase"} <= set(labels)
    assert f"({unit})" in ax.get_ylabel() and audit(fig) == []
    # the runs differ only in the optimizer state: adamw8bit's optimizer phases sit lower
    _, base, phases = phase_slots(samples["baseline"])
    _, q8, _ = phase_slots(samples["adamw8bit"])
    opt = [i for i, p in enumerate(phases) if p == "optimizer"]
    assert all(q8[i] < base[i] for i in opt)


# ---------------------------------------------------------------- will it fit
@pytest.fixture(scope="module")
def estimates():
    return [colabkit.estimate("gpt2-124m", p, batch=1, seq=128, gpu="t4") for p in ("baseline", "checkpoint")]


def test_estimate_chart_bars_are_the_device_need_against_the_estimates_own_budget(estimates):
    fig = plot_estimates(estimates)
    ax = fig.axes[0]
    unit, size = byte_unit(max(r["budget_bytes"] for r in estimates))
    for i, r in enumerate(estimates):
        bars = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - i) < 1e-9]
        assert sum(b.get_width() for b in bars) * size == pytest.approx(r["resources"]["device"]["need"], rel=1e-9)
    budget = [ln.get_xdata()[0] for ln in ax.lines]
    assert budget == [pytest.approx(estimates[0]["budget_bytes"] / size)]
    # one source: the line is the estimate's capacity, not the flat budget the live plot used to draw
    assert estimates[0]["budget_bytes"] != colabkit.T4_USABLE_BYTES
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(labels) & set(CATEGORIES) == {c for c in CATEGORIES if any(r["at_peak"][c] for r in estimates)}
    assert audit(fig) == []
    no_grads = [{**r, "at_peak": {**r["at_peak"], "grads": 0}} for r in estimates]   # a peak with no gradients
    labels = [t.get_text() for t in plot_estimates(no_grads).axes[0].get_legend().get_texts()]
    assert "grads" not in labels and "params" in labels         # no legend entry without a bar


def test_per_rank_bars_stack_to_each_peak():
    measured = {"zero:1": {"params": 4, "grads": 3, "optimizer": 2, "activations": 1, "other": 0}}
    predicted = {"zero:1": {"params": 4, "grads": 3, "optimizer": 2, "activations": 0, "other": 0}}
    fig = plot_per_rank(measured, predicted, title="t")
    ax = fig.axes[0]
    for dx, src in ((-0.2, measured), (0.2, predicted)):
        bars = [p for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - dx) < 1e-9]
        assert sum(b.get_height() for b in bars) == pytest.approx(sum(src["zero:1"].values()))
    assert "other" not in [t.get_text() for t in ax.get_legend().get_texts()]
    assert audit(fig) == []


def test_pareto_legend_names_only_what_is_drawn():
    rows = [{"plan": "baseline", "peak_bytes": 2 * 2**30, "overhead": 0.0, "fits": True},
            {"plan": "checkpoint", "peak_bytes": 2**30, "overhead": 0.33, "fits": True}]
    labels = [t.get_text() for t in colabkit.pareto(rows).get_legend().get_texts()]
    assert "fits" in labels and "does not fit" not in labels
    rows.append({"plan": "huge", "peak_bytes": 40 * 2**30, "overhead": 0.0, "fits": False})
    assert "does not fit" in [t.get_text() for t in colabkit.pareto(rows).get_legend().get_texts()]


# ---------------------------------------------------------------- plan checks in the run's context
def test_compatible_for_a_t4_refuses_what_a_t4_run_refuses():
    why = compatible_for("fused-step", "fp16", "t4")
    with pytest.raises(PlanError) as err:                       # the plan's own check in a CUDA context
        colabkit.Plan.parse("fused-step+fp16").check(Context(device=torch.device("cuda")))
    assert why == str(err.value)
    assert compatible("fused-step", "fp16") is None             # negative control: no context, nothing checked
    assert compatible_for("baseline", "bf16", "t4") is not None  # a T4 has no bf16 ...
    assert compatible("baseline", "bf16", Context(device=torch.device("cpu"))) is None  # ... this CPU run may
    assert compatible_for("checkpoint", "adamw8bit", "t4") is None
    with pytest.raises(ValueError, match="unknown GPU profile"):
        compatible_for("baseline", "fp16", "t5")


def test_will_it_fit_widget_disables_what_a_t4_refuses_and_predicts_like_estimate():
    ui, r = colabkit.will_it_fit(["gpt2-124m"], ["fp16", "checkpoint", "fused-step"], batch=1, seq=128, chosen=["checkpoint"])
    ref = colabkit.estimate("gpt2-124m", "checkpoint", batch=1, seq=128, gpu="t4")
    assert r["peak_bytes"] == ref["peak_bytes"] and r["budget_bytes"] == ref["budget_bytes"]
    boxes = {b.description: b for b in ui.children[1].children}
    assert not boxes["fp16"].disabled
    boxes["fused-step"].value = True                            # a T4 run refuses fp16 next to fused-step
    assert boxes["fp16"].disabled and "GradScaler" in ui.children[2].value
    boxes["fused-step"].value = False
    assert not boxes["fp16"].disabled


def test_token_picker_checks_in_the_given_context_and_runs_the_ticked_plan():
    ran = []
    ctx = Context(device=torch.device("cpu"), offload_sim=True)
    ui = colabkit.token_picker(["offload:params", "checkpoint", "offload:optimizer"], ran.append, where=ctx)
    grid, button = ui.children[1], ui.children[3]
    boxes = {b.description: b for b in grid.children}
    boxes["checkpoint"].value = True
    assert boxes["offload:params"].disabled and not boxes["offload:optimizer"].disabled
    assert "already recomputes" in ui.children[2].value
    boxes["offload:optimizer"].value = True
    button.click()
    assert ran == ["checkpoint+offload:optimizer"]
    plain = colabkit.token_picker(["offload:optimizer"], ran.append, where=Context(device=torch.device("cpu")))
    assert plain.children[1].children[0].disabled               # a plain CPU run refuses offload


def test_choices_widget_runs_on_change_or_only_on_the_button():
    calls = []
    ui = colabkit.choices_widget(lambda stage: calls.append(stage), {"stage": ["zero:1", "zero:3"]})
    ui.children[0].children[0].value = "zero:3"
    assert calls == ["zero:3"]
    ui = colabkit.choices_widget(lambda stage: calls.append(stage), {"stage": ["zero:1", "zero:3"]}, button="Run")
    drop, button = ui.children[0].children
    drop.value = "zero:3"
    assert calls == ["zero:3"]                                  # a slow run waits for the button
    button.click()
    assert calls == ["zero:3", "zero:3"]


# ---------------------------------------------------------------- helpers
def test_tracker_vs_allocator_prints_nothing_into_the_cell(capfd):
    tracked, alloc = colabkit.tracker_vs_allocator(lambda: colabkit.build_model("gpt:1x32"), batch=2, seq=16, steps=1)
    assert abs(tracked - alloc) <= 0.02 * alloc
    out, err = capfd.readouterr()
    assert "profiler_start" not in out + err                     # torch's C++ profiler lines, written to fd 2
    from torch.profiler import ProfilerActivity, profile        # negative control: the bare profiler prints them
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(4)
    out, err = capfd.readouterr()
    assert "profiler_start" in out + err


def test_side_by_side_predicts_sharded_plans_per_gpu():
    rec = {"plan": "zero:3", "ok": True, "peak_bytes": 1, "model": "m", "batch": 2, "seq": 8, "device": "cpu"}
    row = colabkit.side_by_side([rec], "gpt2-124m", batch=2, seq=64, world_size=2)[0]
    ref = colabkit.estimate("gpt2-124m", "zero:3", batch=2, seq=64, gpu="t4", world_size=2)
    assert row["predicted_bytes"] == ref["peak_bytes"] and row["error"] is None
    old = colabkit.side_by_side([rec], "gpt2-124m", batch=2, seq=64)[0]    # without world_size: refused
    assert old["predicted_bytes"] is None and "world_size" in old["error"]


def test_kill_and_resume_refuses_a_kill_after_the_last_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="kill after 1 to 3"):
        colabkit.kill_and_resume("gpt-tiny", "baseline", 20, 2, 16, 0, "cpu", 5, str(tmp_path / "d"), kill_after=4)


def test_kill_and_resume_passes_deterministic_to_both_processes(tmp_path, monkeypatch):
    """Notebook 13 asserts bit-identical weights after a resume; on a GPU that holds only with deterministic
    algorithms in the killed and the resumed process alike (the H100 run had no --deterministic to give them)."""
    from colabkit import resilience

    seen = []

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen.append(cmd)
        raise Stop

    monkeypatch.setattr(resilience.subprocess, "Popen", popen)
    for det in (True, False):
        with pytest.raises(Stop):
            colabkit.kill_and_resume("gpt-tiny", "baseline", 20, 2, 16, 0, "cpu", 5, str(tmp_path / "d"), deterministic=det)
    assert ["--deterministic" in cmd for cmd in seen] == [True, False]   # control: not asked, not given


def test_disk_bandwidth_is_measured_in_the_given_folder(tmp_path):
    write, read = colabkit.disk_bandwidth(str(tmp_path), nbytes=1 << 20)
    assert write > 0 and read > 0 and list(tmp_path.iterdir()) == []   # the probe file is removed


def test_every_category_has_a_colour():
    assert set(CATEGORY_COLORS) == set(CATEGORIES)
