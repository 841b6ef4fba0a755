"""The plotting vocabulary: bars that sum to the measured peak, units that scale, phases and colours
named, and the readability audit catching what a learner could not read (negative controls)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import colabkit  # noqa: E402
from colabkit.plots import CATEGORY_COLORS, LivePlot, audit, byte_unit, draw_categories, plot_breakdown, show  # noqa: E402


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
    assert audit(fig) == [] and show(fig) is fig
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
