"""The notebooks' widgets and live plot, driven as a person would: JupyterLab on a loopback port, Debian's
Chromium headless through Playwright (PyPI's ``playwright``, launched on ``/usr/bin/chromium``: no browser
download). nbval proves the cells run; these tests prove that what the cells display works in a browser:
the live plot redraws while training, the strategy picker runs the ticked plan and its row appears, the
checkpointing slider and the will-it-fit widget redraw their numbers.

Run them:  ``pytest -m browser tests`` (they also run in ``make test``). They need Chromium
(``apt-get install chromium``) and the dev extras (``pip install -e ".[dev]"``: jupyterlab, playwright).
Without them the tests skip with a loud warning; with ``CI`` set, a missing piece fails instead.
On failure a screenshot lands in ``tests/browser_artifacts/`` (or ``$COLABKIT_BROWSER_ARTIFACTS``).

All browser tests live in this one file: ``make test`` runs pytest-xdist with ``--dist loadfile``, so they
share one worker, one JupyterLab and one Chromium.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("COLABKIT_BROWSER_ARTIFACTS", REPO / "tests" / "browser_artifacts"))
HOW_TO = 'apt-get install chromium; pip install -e ".[dev]"'
S = 1000  # Playwright timeouts are in milliseconds
RUN_ALL_TIMEOUT_S = 150  # one notebook's "Run All" in smoke mode: ~10 s alone, slower beside a busy suite
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


class BrowserTestsNotRun(UserWarning):
    """Shown in pytest's warnings summary when the browser tests were skipped."""


# ---------------------------------------------------------------- prerequisites (skip loudly, fail in CI)
def chromium_path() -> str | None:
    """Debian's Chromium ($COLABKIT_CHROMIUM overrides)."""
    for p in (os.environ.get("COLABKIT_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"),
              "/usr/bin/chromium"):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def missing_prerequisites() -> list[str]:
    missing = [] if chromium_path() else ["Chromium (apt-get install chromium)"]
    missing += [f"{mod} (pip install -e \".[dev]\")" for mod in ("playwright", "jupyterlab")
                if importlib.util.find_spec(mod) is None]
    return missing


def require_browser() -> None:
    """Skip loudly when a piece is missing; in CI (``CI`` set) fail: CI must run these tests."""
    missing = missing_prerequisites()
    if not missing:
        return
    msg = (f"THE BROWSER TESTS DID NOT RUN: missing {', '.join(missing)}. "
           f"Get them with: {HOW_TO}  (then: pytest -m browser tests)")
    if os.environ.get("CI"):
        pytest.fail(f"CI is set, so the browser tests must run. {msg}", pytrace=False)
    warnings.warn(msg, BrowserTestsNotRun, stacklevel=2)
    pytest.skip(msg)


@pytest.mark.browser
def test_ci_does_not_skip_browser_tests():
    """Outside CI this says loudly when the browser tests cannot run; in CI a missing piece is a failure."""
    require_browser()
    assert chromium_path() and not missing_prerequisites()


def test_missing_browser_skips_loudly_or_fails_in_ci(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "chromium_path", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.warns(BrowserTestsNotRun, match=r"DID NOT RUN.*apt-get install chromium"), \
            pytest.raises(pytest.skip.Exception, match=re.escape(HOW_TO)):
        require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set, so the browser tests must run"):
        require_browser()


# ---------------------------------------------------------------- JupyterLab + Chromium (one per module)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_lab_settings(settings: Path) -> None:
    """User settings for this throw-away JupyterLab: never autosave into the repo's notebooks (they are
    stored without outputs), render every cell (no windowing: off-screen cells stay in the DOM), no news."""
    files = {
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                           "checkForUpdates": False},
    }
    for name, value in files.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class Lab:
    def __init__(self, url: str, token: str, log: Path):
        self.url, self.token, self.log = url, token, log

    def notebook_url(self, name: str) -> str:
        """The notebook alone in a fresh workspace (JupyterLab restores a workspace's open tabs)."""
        return f"{self.url}/lab/workspaces/{secrets.token_hex(4)}/tree/notebooks/{name}?reset&token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}?token={self.token}", method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def sessions(self, name: str) -> list[dict]:
        return [s for s in self.api("sessions") if s.get("path", "").endswith(f"notebooks/{name}")]

    def kernel(self, name: str) -> dict | None:
        """The server's model of the notebook's kernel (execution_state, connections), if started."""
        return next((s["kernel"] for s in self.sessions(name) if s.get("kernel")), None)

    def shut_down_kernels(self, name: str) -> None:
        """Shut down the notebook's session (the server keeps its kernel after the page closes)."""
        for s in self.sessions(name):
            with contextlib.suppress(OSError):
                self.api(f"sessions/{s['id']}", method="DELETE")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a free loopback port, root = the repository, the project's interpreter as kernel,
    smoke mode and the repository's colabkit in the kernel's environment."""
    require_browser()
    tmp = tmp_path_factory.mktemp("jupyterlab")
    _write_lab_settings(tmp / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "JUPYTER_PLATFORM_DIRS")}
    env.update(COLABKIT_SMOKE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               # the "python3" kernelspec runs `python`: make that this interpreter
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"))
    log = tmp / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO}",
           f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
           "--LabApp.extension_manager=readonly", "--LabApp.news_url=None"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited ({proc.returncode}):\n{log.read_text()[-3000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer in 90 s:\n{log.read_text()[-3000:]}", pytrace=False)
            time.sleep(0.5)
        yield Lab(url, token, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS, timeout=60 * S)
        yield b
        b.close()
    finally:
        pw.stop()


@pytest.fixture
def page(browser):
    """A fresh browser context and page per test."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(60 * S)
    yield context.new_page()
    context.close()


# ---------------------------------------------------------------- driving a notebook as a person would
# Records every image a notebook cell shows, as it is shown: which cell, which of the cell's outputs
# (a display handle updated in place keeps its slot), inside a widget's Output or not, whether the cell
# was still running ([*]), and a hash of the image data. A live plot is a slot whose image changes while
# its cell runs.
_RECORD_FRAMES = """(root) => {
  window.__frames = [];
  const hash = (s) => { let h = 2166136261; for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i);
                        h = Math.imul(h, 16777619); } return (h >>> 0).toString(16) + ':' + s.length; };
  const record = (img) => {
    const cell = img.closest('.jp-Cell');
    if (!cell || !img.src) return;
    const cells = [...root.querySelectorAll('.jp-Cell')];
    let slot = null;  // the outermost output of the cell holding the image
    for (let n = img; n && n !== cell; n = n.parentElement)
      if (n.classList.contains('jp-OutputArea-child')) slot = n;
    const wo = img.closest('.widget-output');  // the innermost widget Output holding the image
    if (wo && !wo.dataset.frameId) wo.dataset.frameId = String(window.__frames.length) + ':' + Math.random();
    let wchild = null;  // inside a widget's Output: the output of that area holding the image
    for (let n = img; wo && n && n !== wo; n = n.parentElement)
      if (n.classList.contains('jp-OutputArea-child')) wchild = n;
    const prompt = cell.querySelector('.jp-InputPrompt');
    window.__frames.push({cell: cells.indexOf(cell), slot: slot ? [...slot.parentElement.children].indexOf(slot) : -1,
                          widget: !!wo, src: hash(img.src),
                          wslot: wchild ? wo.dataset.frameId + '/' + [...wchild.parentElement.children].indexOf(wchild) : '',
                          running: !!prompt && prompt.textContent.trim() === '[*]:'});
  };
  new MutationObserver((muts) => { for (const m of muts) {
    if (m.type === 'attributes') { if (m.target.tagName === 'IMG') record(m.target); continue; }
    for (const n of m.addedNodes) { if (n.nodeType !== 1) continue;
      if (n.tagName === 'IMG') record(n); else n.querySelectorAll('img').forEach(record); } }
  }).observe(root, {childList: true, subtree: true, attributes: true, attributeFilter: ['src']});
}"""

_STATE = """(root) => {
  const prompts = [...root.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
  const errors = [...root.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).filter(t => /Traceback|^\\s*\\w*(Error|Exception)\\b/m.test(t));
  const ind = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
  return {prompts, errors, kernel: ind ? ind.getAttribute('data-status') : null};
}"""


_NUMBERED = re.compile(r"\[\d+\]:")  # the prompt of a cell that ran ("[*]:" running or queued, "[ ]:" not run)


def poll(predicate, timeout_s: float, what, every_s: float = 0.3):
    """Wait until predicate() is truthy and return it; after timeout_s fail with `what` (or what())."""
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what() if callable(what) else what} (waited {timeout_s:.0f} s)")
        time.sleep(every_s)
    return result


class Notebook:
    """One notebook open in JupyterLab in a Chromium page."""

    def __init__(self, page, lab: Lab, name: str):
        self.page, self.lab, self.name = page, lab, name
        self.panel = page.locator(".jp-NotebookPanel")  # the only one: a fresh workspace per page
        self.root = self.panel.locator(".jp-Notebook")

    def open(self, timeout_s: float = 90) -> "Notebook":
        """Open the notebook and wait until every cell is rendered and its kernel is started, idle and
        connected to this page (a Run All sent earlier is lost)."""
        cells = json.loads((REPO / "notebooks" / self.name).read_text())["cells"]
        n_code = sum(c["cell_type"] == "code" for c in cells)
        self.page.goto(self.lab.notebook_url(self.name))
        seen = {}

        def ready() -> bool:
            seen.update(page=self.state(), server=self.lab.kernel(self.name))
            st, kernel = seen["page"], seen["server"]
            return (len(st["prompts"]) == n_code and st["kernel"] == "idle" and bool(kernel)
                    and kernel["execution_state"] == "idle" and kernel.get("connections", 1) >= 1)

        poll(ready, timeout_s, lambda: f"{self.name} not ready: {seen}", every_s=0.5)
        self.root.evaluate(_RECORD_FRAMES)
        return self

    def state(self) -> dict:
        return self.root.evaluate(_STATE)

    def run_all(self, timeout_s: float = RUN_ALL_TIMEOUT_S) -> dict:
        """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle.
        Fails with the errors shown when a cell raised (Run All stops there)."""
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        self.page.locator(".lm-Menu-item", has_text=re.compile(r"^Run All Cells")).first.click()
        self.page.wait_for_function("(root) => [...root.querySelectorAll('.jp-InputPrompt')].some("
                                    "p => /^\\[(\\*|\\d+)\\]:$/.test(p.textContent.trim()))",
                                    arg=self.root.element_handle(), timeout=60 * S)

        def finished() -> dict | None:
            st = self.state()
            idle = "[*]:" not in st["prompts"] and st["kernel"] == "idle"
            return st if idle and any(_NUMBERED.fullmatch(p) for p in st["prompts"]) else None

        st = poll(finished, timeout_s, lambda: f"{self.name}: Run All did not finish: {self.state()}", every_s=0.5)
        assert not st["errors"], f"{self.name}: a cell shows an error:\n" + "\n".join(st["errors"])[-3000:]
        assert all(_NUMBERED.fullmatch(p) for p in st["prompts"]), \
            f"{self.name}: Run All stopped before the end: prompts {st['prompts']}"
        return st

    def frames(self) -> list[dict]:
        return self.page.evaluate("() => window.__frames")

    def live_plots(self) -> dict[tuple[int, int], list[str]]:
        """(cell, output slot) -> the distinct images it showed while its cell was running, for the slots
        outside widgets that showed more than one: a plot redrawn in place during the run."""
        seen: dict[tuple[int, int], list[str]] = {}
        for f in self.frames():
            if f["running"] and not f["widget"] and f["slot"] >= 0:
                srcs = seen.setdefault((f["cell"], f["slot"]), [])
                if f["src"] not in srcs:
                    srcs.append(f["src"])
        return {k: v for k, v in seen.items() if len(v) > 1}

    def widget(self, has_text: str):
        """The widget box (an ipywidgets VBox) showing this text."""
        return self.root.locator(".widget-vbox").filter(has_text=has_text).last

    def wait_text(self, locator, pattern: str, timeout_s: float = 90) -> str:
        """Wait until the locator's text matches the regex (multiline); returns the text."""
        shown = [""]

        def matches() -> str | None:
            st = self.state()
            assert not st["errors"], f"{self.name}: an error is shown:\n" + "\n".join(st["errors"])[-3000:]
            shown[0] = locator.inner_text() if locator.count() else ""
            return shown[0] if re.search(pattern, shown[0], re.M) else None

        return poll(matches, timeout_s, lambda: f"{self.name}: no text matching {pattern!r}; shown:\n{shown[0]}")

    def add_cell_and_run(self, source: str) -> None:
        """Insert a code cell below the last one, type `source` into it and run it (Shift+Enter)."""
        self.root.locator(".jp-Cell").last.locator(".jp-InputPrompt").click()
        kb = self.page.keyboard
        kb.press("Escape")
        kb.press("b")
        kb.press("Enter")
        kb.type(source)
        kb.press("Shift+Enter")


@contextlib.contextmanager
def notebook(page, lab: Lab, name: str, test: str):
    """Open a notebook; on any failure save a full-page screenshot to ARTIFACTS/<test>.png."""
    try:
        yield Notebook(page, lab, name).open()
    except BaseException:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{test}.png"
        with contextlib.suppress(Exception):
            page.screenshot(path=str(path), full_page=True)
            print(f"browser screenshot of the failure: {path}")
        print(f"JupyterLab's log: {lab.log}")
        raise
    finally:
        lab.shut_down_kernels(name)


_SIZE = re.compile(r"([\d.]+) (B|KiB|MiB|GiB)")


def nbytes(text: str) -> float:
    """'5.3 MiB' -> bytes (colabkit.fmt_bytes's units), read from what the page shows."""
    value, unit = _SIZE.fullmatch(text.strip()).groups()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def row_sizes(text: str, first: str) -> list[float]:
    """The byte sizes on the line starting with `first` (the last such line)."""
    lines = [ln for ln in text.splitlines() if re.split(r"\s", ln, maxsplit=1)[0] == first]  # "optimizer", not "optimizer_step"; a table row's cells are tab-separated
    assert lines, f"no line starting with {first!r} in:\n{text}"
    return [nbytes(m.group(0)) for m in _SIZE.finditer(lines[-1])]


# ---------------------------------------------------------------- the tests
@pytest.mark.browser
def test_quickstart_live_plot_and_strategy_picker(page, lab, request):
    """00: Run All without an error; the live plot redraws while it trains; ticking fp16 greys out bf16;
    ticking accum:2 and pressing Run adds the plan's row (with less activation memory) and its bars."""
    with notebook(page, lab, "00_quickstart.ipynb", request.node.name) as nb:
        nb.run_all()
        live = nb.live_plots()
        assert live, f"no plot changed in place while its cell ran; images seen: {nb.frames()}"

        picker = nb.widget("Pick techniques")
        box = lambda tok: picker.get_by_role("checkbox", name=tok, exact=True)  # noqa: E731
        assert box("offload:optimizer").is_disabled(), "a CPU run has nothing to offload to: greyed out"
        # the reasons are written out (JupyterLab 4 shows no tooltip on a described Checkbox)
        picker.get_by_text(re.compile(r"^Why \d+ are greyed out")).click()
        assert "nothing to offload to" in picker.inner_text()
        assert box("bf16").is_enabled()
        box("fp16").check()
        page.wait_for_function("(el) => el.disabled", arg=box("bf16").element_handle(), timeout=30 * S)
        box("accum:2").check()
        out = picker.locator(".widget-output").first   # the picker's own (live plots nest theirs inside)
        assert "fp16+accum:2" not in out.inner_text()
        n_before = len(nb.frames())
        picker.get_by_role("button", name=re.compile(r"^Run\b")).click()
        text = nb.wait_text(out, r"^fp16\+accum:2\s+\d")
        base, plan = row_sizes(text, "baseline"), row_sizes(text, "fp16+accum:2")
        # columns: peak, params, grads, optimizer, activations, other. fp32 master weights, their
        # gradients and AdamW state are untouched by autocast and accumulation; activations shrink.
        assert plan[1:4] == base[1:4], text
        assert plan[4] < base[4] and plan[0] < base[0], text
        # the table is printed before the chart is drawn: wait for the chart
        poll(lambda: any(f["widget"] for f in nb.frames()[n_before:]), 60, "the picker drew no chart after Run")
        # and while it ran, its live plot was redrawn in place inside the picker's output
        in_slot: dict[str, set] = {}   # (which Output widget, which of its outputs) -> images it showed
        for f in nb.frames()[n_before:]:
            if f["widget"] and f["wslot"]:
                in_slot.setdefault(f["wslot"], set()).add(f["src"])
        assert any(len(v) > 1 for v in in_slot.values()), f"the picker's live plot was not redrawn in place: {in_slot}"
        assert not nb.state()["errors"]

        # negative control: the error check above does see an error shown by a cell
        nb.add_cell_and_run("raise RuntimeError('negative control: the browser test must see this')")
        poll(lambda: any("negative control" in e for e in nb.state()["errors"]), 60,
             "the error check missed a cell's traceback")


@pytest.mark.browser
def test_checkpointing_slider(page, lab, request):
    """03: Run All without an error; moving the checkpoint:N slider to N=1 (every block) and to N=L (one
    block) redraws the measured activations next to theory, and checkpointing every block keeps far less."""
    with notebook(page, lab, "03_gradient_checkpointing.ipynb", request.node.name) as nb:
        nb.run_all()
        box = nb.root.locator(".widget-hslider").filter(has_text="every N-th").last
        out = nb.root.locator(".widget-output").last
        handle = box.locator(".noUi-handle")
        line = r"^checkpoint:{n} \((\d+)/(\d+) blocks\): activations ([\d.]+ \w+) \(theory ([\d.]+ \w+); none checkpointed ([\d.]+ \w+)\)"
        shown = {}
        for key in ("Home", "End"):
            handle.focus()
            page.keyboard.press(key)
            n = int(box.locator(".widget-readout").inner_text())
            text = nb.wait_text(out, line.format(n=n))
            m = re.search(line.format(n=n), text, re.M)
            assert m, text
            shown[key] = (n, int(m.group(1)), int(m.group(2)), *(nbytes(m.group(i)) for i in (3, 4, 5)))
        (n1, m_all, L, act_all, th_all, act0), (n_last, m_one, L_, act_one, th_one, act0_) = shown["Home"], shown["End"]
        assert n1 == 1 and m_all == L == L_ == n_last > 1 and m_one == 1 and act0 == act0_, shown
        assert act_all < 0.5 * act_one < act0, shown
        for act, theory in ((act_all, th_all), (act_one, th_one)):
            assert abs(act - theory) < 0.10 * act0, shown   # the notebook's own tolerance, as displayed


@pytest.mark.browser
def test_will_it_fit_widget(page, lab, request):
    """09: Run All without an error; picking a model and plan tokens redraws the verdict and breakdown:
    AdamW keeps 8 B/param next to the 4 B/param weights, adamw8bit about 2; gpt2-1.5b does not fit a T4."""
    with notebook(page, lab, "09_will_it_fit.ipynb", request.node.name) as nb:
        nb.run_all()
        ui = nb.root.locator(".widget-vbox").filter(has=page.locator("select")).last
        out = ui.locator(".widget-output")
        box = lambda tok: ui.get_by_role("checkbox", name=tok, exact=True)  # noqa: E731

        ui.locator("select").select_option("gpt2-124m")
        text = nb.wait_text(out, r"^gpt2-124m\s+plan checkpoint\s")
        assert re.search(r"\bfits\b", text, re.I) and not re.search(r"does not fit", text, re.I), text
        p, opt = row_sizes(text, "params")[0], row_sizes(text, "optimizer")[0]
        assert 110e6 < p / 4 < 140e6, text  # GPT-2 small: 124M parameters in fp32
        assert abs(opt / p - 2) < 0.05, text  # two fp32 moments per fp32 weight

        assert box("adamw4bit").is_enabled()
        box("adamw8bit").check()
        text = nb.wait_text(out, r"^gpt2-124m\s+plan checkpoint\+adamw8bit\s")
        assert row_sizes(text, "params")[0] == p, text
        assert 0.4 < row_sizes(text, "optimizer")[0] / p < 0.6, text  # 2 x 8 bit + block scales per 4 B
        page.wait_for_function("(el) => el.disabled", arg=box("adamw4bit").element_handle(), timeout=30 * S)

        ui.locator("select").select_option("gpt2-1.5b")
        text = nb.wait_text(out, r"^gpt2-1\.5b\s+plan checkpoint\+adamw8bit\s")
        assert re.search(r"does not fit", text, re.I), text
        assert row_sizes(text, "params")[0] > 10 * p, text


@pytest.mark.browser
@pytest.mark.skipif(not (REPO / "notebooks" / "13_resilient_training.ipynb").exists(),
                    reason="notebooks/13_resilient_training.ipynb does not exist yet")
def test_resilient_training_kill_and_resume(page, lab, request):
    """13: Run All without an error, and the kill-and-resume demo says it resumed."""
    with notebook(page, lab, "13_resilient_training.ipynb", request.node.name) as nb:
        nb.run_all()
        shown = "\n".join(nb.root.locator(".jp-OutputArea").all_inner_texts())
        assert re.search(r"resum", shown, re.I), shown[-3000:]
