"""The course as a learner meets it: JupyterLab in a real (headless) Chromium, widgets clicked.

nbval re-runs the notebooks' code but never opens them the way a learner does. This module starts
JupyterLab on a free local port, drives Debian's Chromium with Playwright for Python, and checks:

* notebook 00's calculator: Run → Run All Cells, then the model dropdown, the batch slider (typed
  into its readout, as a learner does) and the tp dropdown are changed and the printed figures must
  follow, e.g. Llama-3.1-70B, batch 128, 4,096 tokens, bf16 -> 160 GiB; tp 8 -> 20 GiB per GPU;
  its "Next" link opens notebook 01 in a new tab;
* every notebook opens without turning "modified" (stored kernelspec = what JupyterLab writes), and
  shows no error output, no image that fails to load and no relative link that leads nowhere.

Screenshots (notebook 00's calculator, the first plot of every notebook) go to build/screenshots/
(ignored by git; KVLAB_SCREENSHOTS overrides); docs/img/calculator.png in the README is a copy of
the first. JupyterLab serves the repository itself with autosave off, and nothing is ever saved. It
is shut down through its REST API, then by its own process id if need be; the test checks that it
and its kernels are gone.

Needs: `playwright` (pip) and Chromium at /usr/lib/chromium/chromium (Debian's `chromium` package;
KVLAB_CHROMIUM overrides the path). Playwright's own browser download is not used. Without them the
module is skipped with the reason; `bash .ci/run` installs both.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CALCULATOR_NOTEBOOK = "00_the_oom_story.ipynb"
# Debian's /usr/bin/chromium is a wrapper script that fails to start headless here; the binary works.
CHROMIUM = Path(os.environ.get("KVLAB_CHROMIUM", "/usr/lib/chromium/chromium"))
SCREENSHOTS = Path(os.environ.get("KVLAB_SCREENSHOTS", ROOT / "build" / "screenshots"))
# --no-sandbox: CI runs as root, where Chromium refuses to start sandboxed. The rest keeps a headless
# run from reaching the network on its own (no updates, sync or QUIC probes).
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
TIMEOUT_MS = 60_000
# Notebook 00 runs whole in the browser: under 25 s on a quiet 2-core machine; the bound leaves
# room for a load average of 8, which made an earlier, longer version of it take 85 s.
RUN_ALL_TIMEOUT_MS = 240_000

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="Playwright for Python is not installed (python3 -m pip install playwright; "
           "bash .ci/run installs it)")
pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (pip install -e .)")
if not CHROMIUM.is_file():
    pytest.skip(f"no Chromium binary at {CHROMIUM} (apt-get install chromium, or set KVLAB_CHROMIUM)",
                allow_module_level=True)

# JupyterLab user settings for the test's own settings folder (JUPYTERLAB_SETTINGS_DIR).
LAB_SETTINGS = {
    # The "news" and update pop-ups can cover output in screenshots and would try the network.
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    # Running cells in the browser must never write to the repository's notebooks.
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    # Render every cell: windowed rendering leaves cells outside the viewport out of the page.
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Lab:
    """One JupyterLab server for this module: started on a free port, stopped by its own pid."""

    def __init__(self, workdir: Path):
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = workdir / "settings"
        for plugin, values in LAB_SETTINGS.items():
            file = settings / (plugin.replace(":", "/") + ".jupyterlab-settings")
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(values))
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
                   JUPYTER_CONFIG_DIR=str(workdir / "config"))
        # In a virtual environment made with --system-site-packages, Jupyter searches only the venv's
        # share/jupyter, so the ipywidgets front end installed beside the base Python is missing and
        # every widget fails with "Exception opening new comm". Add the base prefix's share/jupyter.
        if sys.prefix != sys.base_prefix:
            extra = str(Path(sys.base_prefix) / "share" / "jupyter")
            env["JUPYTER_PATH"] = os.pathsep.join(filter(None, [env.get("JUPYTER_PATH"), extra]))
        self.log = (workdir / "jupyterlab.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
        self.kernel_pids: set[int] = set()
        self._wait_until_up()

    def _wait_until_up(self, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.process.returncode}; see {self.log.name}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        raise RuntimeError(f"JupyterLab did not answer on {self.url} within {seconds} s")

    def api(self, method: str, path: str) -> bytes:
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()

    def page_url(self, workspace: str, notebook: str) -> str:
        """A fresh named workspace per page, so JupyterLab restores no tabs from an earlier page."""
        return f"{self.url}/lab/workspaces/{workspace}/tree/notebooks/{notebook}?token={self.token}"

    def stop(self) -> None:
        """Shut down kernels and server through the API, then by pid; nothing may be left running."""
        self.kernel_pids.update(child_pids(self.process.pid))
        try:
            for session in json.loads(self.api("GET", "/api/sessions")):
                self.api("DELETE", f"/api/sessions/{session['id']}")
            self.api("POST", "/api/shutdown")
            self.process.wait(timeout=15)
        except (OSError, urllib.error.URLError, subprocess.TimeoutExpired):
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        finally:
            self.log.close()
        for pid in self.kernel_pids:  # kernels the server failed to stop: ours, so ended by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    server.stop()
    left = [pid for pid in [server.process.pid, *server.kernel_pids] if alive(pid)]
    assert not left, f"processes still running after shutdown: {left}"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium with a fresh profile (Playwright's --user-data-dir)."""
    playwright = sync_api.sync_playwright().start()
    try:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            headless=True, args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000})
        context.set_default_timeout(TIMEOUT_MS)
        yield context
        context.close()
    finally:
        playwright.stop()


# JavaScript run in the page (JupyterLab exposes its application as window.jupyterapp when started
# with --LabApp.expose_app_in_browser). `path` is relative to the server root: notebooks/NAME.
JS_PANEL = """path => [...window.jupyterapp.shell.widgets('main')]
    .find(w => w.context && w.context.path === path)"""

# A polling predicate (it must return a plain value, not a promise): the layout is restored, the
# notebook's tab is attached, its kernel is idle and has answered kernel_info (JupyterLab rewrites
# kernelspec and language_info from that answer, which is what would mark a notebook modified).
JS_READY = f"""path => {{
    const app = window.jupyterapp;
    if (!app) return false;
    if (app.__kvlabRestored === undefined) {{
        app.__kvlabRestored = false;
        app.restored.then(() => {{ app.__kvlabRestored = true; }});
    }}
    if (!app.__kvlabRestored) return false;
    const panel = ({JS_PANEL})(path);
    if (!panel || !panel.isAttached || !panel.context.isReady) return false;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    if (!kernel || kernel.status !== 'idle') return false;
    if (kernel.__kvlabInfo === undefined) {{
        kernel.__kvlabInfo = false;
        kernel.info.then(() => {{ kernel.__kvlabInfo = true; }});
    }}
    return kernel.__kvlabInfo;
}}"""

JS_DIRTY = f"path => ({JS_PANEL})(path).context.model.dirty"
JS_KERNEL_NAME = f"path => ({JS_PANEL})(path).sessionContext.kernelDisplayName"

JS_ALL_CELLS_RAN = f"""path => {{
    const cells = ({JS_PANEL})(path).content.model.cells;
    for (let i = 0; i < cells.length; i++) {{
        const cell = cells.get(i);
        if (cell.type === 'code' && cell.executionCount === null) return false;
    }}
    return ({JS_PANEL})(path).sessionContext.session.kernel.status === 'idle';
}}"""

# Errors in the notebook's outputs: error outputs, tracebacks on stderr, and failures JupyterLab
# draws in place of an output (a widget it cannot display, a renderer that failed).
JS_ERRORS = f"""path => {{
    const panel = ({JS_PANEL})(path);
    const found = [];
    const cells = panel.content.model.cells;
    for (let i = 0; i < cells.length; i++) {{
        const cell = cells.get(i);
        if (cell.type !== 'code') continue;
        for (const out of cell.outputs.toJSON()) {{
            if (out.output_type === 'error') found.push(`cell ${{i}}: ${{out.ename}}: ${{out.evalue}}`);
            const text = [].concat(out.text || []).join('');
            if (out.name === 'stderr' && /Traceback|Error/.test(text))
                found.push(`cell ${{i}} stderr: ${{text.slice(0, 300)}}`);
        }}
    }}
    for (const node of panel.node.querySelectorAll('.jp-OutputArea-output')) {{
        if (/Error displaying widget|Error rendering output|Javascript Error/.test(node.textContent))
            found.push(`drawn: ${{node.textContent.slice(0, 200)}}`);
    }}
    return found;
}}"""

JS_BROKEN_IMAGES = f"""async path => {{
    const images = [...({JS_PANEL})(path).node.querySelectorAll('img')];
    await Promise.all(images.map(img => img.complete ? null :
        new Promise(done => {{ img.onload = done; img.onerror = done; }})));
    return images.filter(img => img.naturalWidth === 0).map(img => img.getAttribute('src').slice(0, 120));
}}"""

# Every link in rendered markdown: same-notebook anchors must name a heading on the page; links to
# this server (JupyterLab turns a relative `../README.md` into /files/README.md) must answer 200.
JS_BROKEN_LINKS = f"""async path => {{
    const panel = ({JS_PANEL})(path);
    const broken = [];
    let checked = 0;
    for (const link of panel.node.querySelectorAll('.jp-RenderedMarkdown a[href]')) {{
        const href = link.getAttribute('href');
        if (link.classList.contains('jp-InternalAnchorLink')) continue;  // a heading's own ¶ link
        if (href.startsWith('#')) {{
            checked++;
            const id = decodeURIComponent(href.slice(1));
            if (!panel.node.querySelector(`[id="${{CSS.escape(id)}}"], [data-jupyter-id="${{CSS.escape(id)}}"]`)) broken.push(`${{href}} (no such heading)`);
            continue;
        }}
        const url = new URL(link.href, location.href);
        if (url.origin !== location.origin) continue;  // the web: not reachable from the test
        checked++;
        const response = await fetch(url.href);
        if (response.status !== 200) broken.push(`${{href}} -> HTTP ${{response.status}}`);
    }}
    return {{checked, broken}};
}}"""


def open_notebook(browser, lab: Lab, name: str):
    """A new page with JupyterLab showing notebooks/<name>, its kernel started and idle."""
    page = browser.new_page()
    page.goto(lab.page_url(f"test-{Path(name).stem}", name))
    page.wait_for_function(JS_READY, arg=f"notebooks/{name}", timeout=TIMEOUT_MS, polling=250)
    return page


def click_menu(page, menu: str, item: str) -> None:
    """Open a menu of JupyterLab's menu bar and click one of its items."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def widget(page, kind: str, label: str):
    """The ipywidgets control of class widget-<kind> whose description is `label`."""
    return page.locator(f".widget-interact .widget-{kind}").filter(
        has=page.locator("label.widget-label", has_text=re.compile(f"^{re.escape(label)}$")))


def set_slider(page, label: str, value: int) -> None:
    """Type a value into a slider's readout and press Enter, as a learner does."""
    readout = widget(page, "hslider", label).locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(str(value))
    page.keyboard.press("Enter")


def expect_printed(output, *lines: str) -> None:
    for line in lines:
        sync_api.expect(output).to_contain_text(line, timeout=TIMEOUT_MS)


def test_calculator_widgets_print_the_right_figures(lab, browser):
    started = time.monotonic()
    path = f"notebooks/{CALCULATOR_NOTEBOOK}"
    page = open_notebook(browser, lab, CALCULATOR_NOTEBOOK)
    # As a learner does: Edit -> Clear Outputs of All Cells, then Run -> Run All Cells.
    click_menu(page, "Edit", "Clear Outputs of All Cells")
    click_menu(page, "Run", "Run All Cells")
    page.wait_for_function(JS_ALL_CELLS_RAN, arg=path, timeout=RUN_ALL_TIMEOUT_MS, polling=250)
    assert page.evaluate(JS_ERRORS, path) == []

    calculator = page.locator(".widget-interact")
    output = calculator.locator(".widget-output")
    # The widgets' start values: Llama-3.1-70B, batch 128, 4,096 tokens, bf16, H100-80GB, tp 8.
    # Per GPU: 2 x 80 layers x (8 / 8) KV heads x 128 x 2 B = 40 KiB per token;
    # 128 x 4,096 x 40 KiB = 20 GiB beside 16.43 GiB of weights.
    expect_printed(output, "on each of 8 GPU(s): weights 16.43 GiB + cache (128 x 4,096 tokens x "
                   "40 KiB = 20 GiB) = 36.43 GiB, fits in 0.9 x H100-80GB",
                   "requests of 4,096 tokens that fit beside the weights: 355")

    widget(page, "dropdown", "tp").locator("select").select_option(label="1")
    # One GPU holds all 8 KV heads: 320 KiB per token; 128 x 4,096 x 320 KiB = 160 GiB, which
    # beside 131.42 GiB of weights does not fit in 90 % of 80 GiB.
    expect_printed(output, "weights 131.42 GiB + cache (128 x 4,096 tokens x 320 KiB = 160 GiB) = "
                   "291.42 GiB, does NOT fit in 0.9 x H100-80GB")

    widget(page, "dropdown", "model").locator("select").select_option(label="llama-3.1-8b")
    # 2 x 32 x 8 x 128 x 2 = 128 KiB per token; (72 GiB - 14.96 GiB) / 512 MiB -> 114 requests.
    expect_printed(output, "llama-3.1-8b, bf16, on each of 1 GPU(s): weights 14.96 GiB + cache "
                   "(128 x 4,096 tokens x 128 KiB = 64 GiB)",
                   "requests of 4,096 tokens that fit beside the weights: 114")

    set_slider(page, "batch", 1)
    expect_printed(output, "cache (1 x 4,096 tokens x 128 KiB = 512 MiB)")

    # Back to the story's deployment, the state the README's screenshot shows.
    widget(page, "dropdown", "model").locator("select").select_option(label="llama-3.1-70b")
    set_slider(page, "batch", 128)
    expect_printed(output, "cache (128 x 4,096 tokens x 320 KiB = 160 GiB)")
    widget(page, "dropdown", "tp").locator("select").select_option(label="8")
    expect_printed(output, "cache (128 x 4,096 tokens x 40 KiB = 20 GiB)",
                   "requests of 4,096 tokens that fit beside the weights: 355")
    assert page.evaluate(JS_ERRORS, path) == []

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    calculator.scroll_into_view_if_needed()
    calculator.screenshot(path=str(SCREENSHOTS / "00_calculator.png"))

    # The "Next" link opens notebook 01 inside JupyterLab.
    page.get_by_role("link", name="01_a_tiny_llama.ipynb").click()
    page.wait_for_function(f"() => !!({JS_PANEL})('notebooks/01_a_tiny_llama.ipynb')",
                           timeout=TIMEOUT_MS)
    page.close()
    print(f"calculator test: {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="module")
def lab_page(lab, browser):
    """One JupyterLab page for the per-notebook checks (loading JupyterLab once saves seconds)."""
    page = browser.new_page()
    page.goto(lab.page_url("test-each", NOTEBOOKS[0].name))
    page.wait_for_function(JS_READY, arg=f"notebooks/{NOTEBOOKS[0].name}", timeout=TIMEOUT_MS,
                           polling=250)
    yield page
    page.close()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_opens_clean(lab_page, notebook):
    page, path = lab_page, f"notebooks/{notebook.name}"
    # File -> Open, in effect: JupyterLab's own command, in the page already loaded. One notebook
    # at a time: every tab left open slows the rendering of the next.
    page.evaluate("path => window.jupyterapp.commands.execute('docmanager:open', {path})"
                  ".then(() => true)", path)
    page.wait_for_function(JS_READY, arg=path, timeout=TIMEOUT_MS, polling=250)

    assert page.evaluate(JS_KERNEL_NAME, path) == "Python 3 (ipykernel)"
    assert page.evaluate(JS_DIRTY, path) is False, (
        f"{notebook.name} turns modified when opened: its stored metadata differs from what "
        "JupyterLab writes (run scripts/tidy_notebooks.py)")
    assert page.evaluate(JS_ERRORS, path) == []
    assert page.evaluate(JS_BROKEN_IMAGES, path) == []
    links = page.evaluate(JS_BROKEN_LINKS, path)
    assert links["broken"] == [], f"{notebook.name}: broken links {links['broken']}"

    # The first plot, as the learner sees it (a notebook without plots has no screenshot).
    plots = page.locator(f"#{page.evaluate(f'path => ({JS_PANEL})(path).id', path)} "
                         ".jp-RenderedImage img")
    if plots.count():
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        plots.first.scroll_into_view_if_needed()
        plots.first.screenshot(path=str(SCREENSHOTS / f"{notebook.stem}_plot.png"))
    # Close the tab and end its kernel (the notebook is unchanged, so no "save?" dialog).
    page.evaluate(f"""async path => {{
        const panel = ({JS_PANEL})(path);
        await panel.sessionContext.shutdown();
        panel.close();
    }}""", path)
