"""The MLflow UI as a user sees it after two short runs: `make ui` on a free loopback port, driven by a
real headless Chromium (the distribution's package; Playwright drives it). A newcomer opens the link
`make ui` prints, sees the runs with their datasets, selects both runs, compares them and plots
`val/accuracy`; opens a run's samples table, its system metrics and its tags. Screenshots of each view
go to `reports/test-artifacts/mlflow-ui/` (CI keeps them as the test's artifacts)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlvr_lightning.rollout.loopback import free_port
from rlvr_lightning.rollout.server_process import stop_process_group
from tests.support.cli import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = REPO / "reports" / "test-artifacts" / "mlflow-ui"
# As the browser runs on a closed machine: no sandbox (root in CI), no GPU, no background connections.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: `make setup` installs Debian's chromium "
                       "when it can run apt-get as root; install it to run the MLflow UI test"),  # fmt: skip
]


@pytest.fixture(scope="module")
def ui(two_step_runs):
    """`make ui` on the two runs' store: (base URL, what it printed, the runs by engine)."""
    import mlflow

    for engine in ("vllm", "hf"):
        proc = two_step_runs.get(engine)
        assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(tracking_uri=two_step_runs.tracking_uri)
    experiment = client.get_experiment_by_name("rlvr_lightning")
    runs = {r.data.tags["engine"]: r for r in client.search_runs(experiment.experiment_id)}
    with make_ui(two_step_runs.root) as (base, printed):
        yield base, printed, runs, client


@contextmanager
def make_ui(root: Path):
    """`make ui` on the MLflow store in `root`, on a free loopback port: (base URL, what it printed so far)."""
    port, venv = free_port(), Path(sys.executable).parents[1]
    log = open(root / "make-ui.log", "w+")  # noqa: SIM115 - read back below
    # -o: the venv is set up already; `make ui` must not re-run the installer from inside a test.
    server = subprocess.Popen(
        ["make", "-s", "-C", str(REPO), "-o", f"{venv}/.installed", "ui", f"VENV={venv}", f"UI_PORT={port}",
         f"MLRUNS={root}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(0.5)
        yield base, Path(log.name).read_text()
    finally:
        stop_process_group(server, grace_s=20)  # make, mlflow's server and its workers: one process group
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})  # a fresh profile: a first visit
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


def test_compare_view_plots_val_accuracy_of_both_runs(ui, page):
    base, printed, runs, client = ui
    links = re.findall(r"rlvr_lightning: (http://\S+)", printed)
    assert len(links) == 1 and links[0].startswith(base), printed  # `make ui` prints where to look
    page.goto(links[0])
    names = {engine: run.info.run_name for engine, run in runs.items()}
    rows = {}
    for engine, name in names.items():
        rows[engine] = page.locator(".ag-row", has=page.get_by_role("link", name=name, exact=True)).first
        rows[engine].wait_for()
        # The grid draws the pinned columns (checkbox, name) and the others as separate rows with one id.
        cells = page.locator(f'.ag-row[row-id="{rows[engine].get_attribute("row-id")}"]').all_inner_texts()
        assert "embedded-train" in " ".join(cells), cells  # the runs table's Dataset column
    page.screenshot(path=SCREENSHOTS / "1-runs.png")
    # The tags a user filters the table by: only the HF-engine run is left.
    search = page.get_by_placeholder(re.compile("metrics.rmse"))
    search.fill("tags.engine = 'hf'")
    search.press("Enter")
    page.get_by_text(re.compile(r"^1 matching runs?$")).wait_for()
    assert page.get_by_role("link", name=names["hf"], exact=True).count() == 1
    assert page.get_by_role("link", name=names["vllm"], exact=True).count() == 0
    search.fill("")
    search.press("Enter")
    page.get_by_text(re.compile(r"^2 matching runs$")).wait_for()
    for row in rows.values():
        row.locator("input[type=checkbox]").first.check()
    page.get_by_test_id("runs-compare-button").click()
    page.get_by_text("Comparing 2 Runs from 1 Experiment").wait_for()
    page.screenshot(path=SCREENSHOTS / "2-compare.png")
    # The compare view's metrics table lists every metric as a link to its plot. It renders only the rows
    # in view (a virtualised grid whose value column scrolls both), so scroll it until val/accuracy's exists.
    link = page.locator('a[title="Plot chart"][href*="metric=%22val%2Faccuracy%22"]')
    scroll_metrics = """e => {
        let n = e.closest('.ReactVirtualized__Grid').parentElement;
        while (n.querySelectorAll('.ReactVirtualized__Grid').length < 2) n = n.parentElement;
        const grid = [...n.querySelectorAll('.ReactVirtualized__Grid')].find(g => getComputedStyle(g).overflowY === 'auto');
        grid.scrollTop += 150;
    }"""
    for _ in range(60):
        if link.count():
            break
        page.get_by_title("Plot chart").first.evaluate(scroll_metrics)
        page.wait_for_timeout(100)
    assert link.count(), page.get_by_title("Plot chart").all_inner_texts()
    # A click event on the link itself: in the virtualised grid the next row's box can overlap its edge.
    link.first.dispatch_event("click")
    page.locator(".js-plotly-plot .scatterlayer .trace").first.wait_for(state="attached")
    for name in names.values():
        page.get_by_text(f"{name} (val/accuracy)", exact=True).wait_for()  # each run's curve in the legend
    assert page.locator(".js-plotly-plot .scatterlayer .trace path.js-line").count() >= 2  # and drawn
    # The table under the plot: each run's last val/accuracy as the store holds it.
    for engine, run in runs.items():
        last = max(client.get_metric_history(run.info.run_id, "val/accuracy"), key=lambda m: m.step)
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=names[engine], exact=True))
        js_number = repr(last.value).removesuffix(".0")  # how the page prints a float (shortest round trip)
        assert f"{js_number} (step={last.step})" in row.first.inner_text()
    page.screenshot(path=SCREENSHOTS / "3-val-accuracy.png")


def test_a_run_shows_its_tags_samples_table_and_system_metrics(ui, page, tmp_path):
    base, _, runs, client = ui
    run = runs["vllm"]
    page.goto(f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning")
    page.get_by_text(run.info.run_name, exact=True).first.wait_for()
    page.get_by_text("model_family", exact=True).wait_for()
    text = page.locator("main").first.inner_text()
    for tag, value in (("model_family", "qwen2"), ("engine", "vllm"), ("algorithm", "GRPO")):
        assert re.search(rf"\b{tag}\s*:\s*{value}\b", text), tag  # the Overview's Tags
    assert re.search(r"embedded-train \(\w+\)\s*Training", text)  # its Datasets: name (digest), context
    page.screenshot(path=SCREENSHOTS / "4-run-overview.png", full_page=True)

    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("samples", exact=True).first.click()
    page.get_by_text("val_step_000000.json", exact=True).first.click()
    page.get_by_text("View as table").wait_for()
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/val_step_000000.json", str(tmp_path))).read_text())
    prompt = table["data"][0][table["columns"].index("prompt")]
    page.get_by_text(prompt, exact=True).first.wait_for()  # the first sample's prompt, as a cell
    assert "\n".join(table["columns"]) in page.locator("main").first.inner_text()  # the header row, in order
    page.screenshot(path=SCREENSHOTS / "5-samples-table.png")

    page.get_by_role("tab", name="System metrics").click()
    page.get_by_text("cpu_utilization_percentage", exact=True).first.wait_for()
    page.locator(".js-plotly-plot").first.wait_for()
    page.screenshot(path=SCREENSHOTS / "6-system-metrics.png")


RUN_NAME = "grpo+correctness=parity+reward=brevity+shaper=thr+tool=python"


@pytest.fixture(scope="module")
def shaped_run_ui(tmp_path_factory, quick_warm_start):
    """`make ui` on a store with one rollout batch of GRPO with THR (every token of a mixed group weighted), a
    reward function and the Python tool (each answer's first result is a call), named by the CLI: (base URL, the
    run, the client)."""
    import mlflow

    from tests.support.cli import run_cli, small_run_args
    from tests.support.rewards import PARITY
    from tests.support.tool_args import FIRST_RESULT_AS_CALL

    root = tmp_path_factory.mktemp("shaped_run")
    flags = ["--rollout_batches", "1", "--rollout.engine", "hf", "--data.val_data", "null",
             "--model.init_args.shapers.thr.p", "0.2", "--model.init_args.shapers.thr.threshold", "all",
             "--model.init_args.rewards.correctness", PARITY,  # about half right: mixed groups for THR
             "--model.init_args.rewards.functions=[{function: tests.support.rewards.brevity, weight: 0.1}]",
             *FIRST_RESULT_AS_CALL]  # fmt: skip
    proc = run_cli([*small_run_args(root, quick_warm_start[1]), *flags], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    with make_ui(root) as (base, _):
        yield base, run, client


def test_a_run_shows_its_completions_with_each_reward_term_and_its_thr_token_view(shaped_run_ui, page):
    """The run's name says what it adds; its training completions table has a column per reward term; its token
    view, opened from the artifact view, gives each token its THR weight (read from the page, not pixels)."""
    base, run, _ = shaped_run_ui
    assert run.info.run_name == RUN_NAME
    page.goto(f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning")
    page.get_by_text(run.info.run_name, exact=True).first.wait_for()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("samples", exact=True).first.click()
    page.get_by_text("train_step_000000.json", exact=True).first.click()
    page.get_by_text("View as table").wait_for()
    page.get_by_text("reward/brevity", exact=True).first.wait_for()  # a column per reward term
    header = page.locator("main").first.inner_text()
    assert all(column in header for column in ("completion", "correct", "reward", "advantage", "turns"))
    page.screenshot(path=SCREENSHOTS / "7-completions-table.png")

    page.get_by_text("tokens_step_000000.html", exact=True).first.click()
    view = page.frame_locator("iframe").first
    view.locator("span.t").first.wait_for()
    titles = view.locator("span.t").evaluate_all("spans => spans.map(s => s.title)")
    weights = [float(m) for t in titles for m in re.findall(r"shaper weight w \(THR, OAR\) = ([-\d.e]+)", t)]
    assert len(weights) == len(titles) and {1.2, 0.8} & set(weights), sorted(set(weights))  # THR's 1 ± p
    page.screenshot(path=SCREENSHOTS / "8-token-view.png")


def test_a_two_turn_tool_answer_is_a_trace_with_its_tool_calls_code_and_output(shaped_run_ui, page):
    """The run's Traces tab lists its traced answers; a two-turn answer that called the tool opens on its spans in
    order, and its tool span shows the code the model wrote and what it printed (read from the page)."""
    base, run, client = shaped_run_ui
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id)
    assert len(traces) == 4  # one group (G = 4) of the one rollout batch
    spans = {t.info.trace_id: sorted(t.data.spans, key=lambda s: s.start_time_ns) for t in traces}
    called = [i for i, s in spans.items() if "python" in [x.name for x in s] and "turn 2" in [x.name for x in s]]
    assert called, {i: [x.name for x in s] for i, s in spans.items()}
    trace = called[0]
    tool = next(s for s in spans[trace] if s.name == "python")
    page.goto(f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning")
    page.get_by_role("tab", name="Traces").click()
    for trace_id in spans:
        page.get_by_text(trace_id, exact=True).wait_for()  # each one listed
    page.get_by_text(trace, exact=True).click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("turn 2", exact=True).wait_for()
    tree = dialog.inner_text()
    assert tree.index("turn 1") < tree.index("python") < tree.index("turn 2") < tree.index("score")
    dialog.get_by_text("python", exact=True).first.click()
    dialog.get_by_text("observation", exact=True).wait_for()
    shown = dialog.inner_text()
    code, printed = tool.inputs["code"], tool.outputs["stdout"].strip()
    assert re.search(rf"code\s+{re.escape(code)}\s", shown) and re.search(rf"stdout\s+{re.escape(printed)}\s", shown), shown
    page.screenshot(path=SCREENSHOTS / "9-tool-trace.png")
