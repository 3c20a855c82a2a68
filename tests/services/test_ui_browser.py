"""The training pipeline through the Airflow 3 UI in a real browser (headless Chromium driven by
Playwright) on real services (airflow_stack.py): sign in, fill in the trigger form, watch the grid
go green, clear a task from its page, and open the GPU costs page with its chart; then declare a
cluster down and up again from the Clusters & DR page (a run of cluster_fence each time).

Screenshots go to <tmp>/screenshots/NN-name.png (printed) and, if HYBRIDFLOW_SCREENSHOTS is set,
are copied there too. Chromium is Debian's /usr/bin/chromium: Playwright never downloads a browser.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote

import pytest
from tests.services.airflow_stack import AirflowStack, config_copy, services_available, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DAG = "hybrid_training"
NIGHTLY = "gpu_cost_nightly"
CLEARED = "evaluate"  # cleared from the UI; it and its downstream tasks run again
FENCE = "cluster_fence"
FENCED = "onprem-a"
REASON = "power loss in dc-1 (browser test)"
# A disaster-recovery pool, so primaries can be declared down; role dr takes no normal placements, and
# no peacetime priorities, so the training run above is placed exactly as without it.
DR_CLUSTER = {
    "location": "private", "role": "dr", "region": "dc-2", "jurisdiction": "eu", "backend": "local",
    "dr": {"min_gpus": 2},
    "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 2}],
    "prices": {"onprem": 0.80}, "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"},
}

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - requirements-dev.txt has it
    sync_playwright = None


def _why_skip() -> str | None:
    if sync_playwright is None:
        return "the playwright package is not installed (scripts/bootstrap.sh)"
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)"
    return services_available()


_MISSING = _why_skip()
pytestmark = [pytest.mark.services, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-services")
    config = config_copy(root)
    _add_dr_cluster(config)
    with AirflowStack(root, config_dir=config) as running:
        print(f"\nservice logs: {running.logs}")
        running.wait_for_dag(DAG)
        running.unpause(DAG)
        yield running


def _add_dr_cluster(config: Path) -> None:
    import yaml

    estate = yaml.safe_load((config / "clusters.yaml").read_text())
    estate["clusters"]["dr-west"] = DR_CLUSTER
    (config / "clusters.yaml").write_text(yaml.safe_dump(estate, sort_keys=False))


class Shots:
    """Numbered screenshots, copied at once to $HYBRIDFLOW_SCREENSHOTS so a failed run keeps them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        stable = os.environ.get("HYBRIDFLOW_SCREENSHOTS")
        self.stable = Path(stable) if stable else None
        if self.stable:
            self.stable.mkdir(parents=True, exist_ok=True)
        self.n = 0
        print(f"\nscreenshots: {self.folder}" + (f" (and {self.stable})" if self.stable else ""))

    def __call__(self, page, name: str, **kw) -> Path:
        self.n += 1
        path = self.folder / f"{self.n:02d}-{name}.png"
        page.screenshot(path=path, animations="disabled", **kw)  # dialogs fade in: no half-drawn frames
        if self.stable:
            shutil.copy2(path, self.stable / path.name)
        return path


@pytest.fixture
def page(tmp_path):
    expect.set_options(timeout=30_000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(30_000)
            pg.shots = Shots(tmp_path / "screenshots")
            yield pg
        finally:
            browser.close()


def test_training_pipeline_through_the_ui(stack, page) -> None:
    shot = page.shots
    try:
        _sign_in(stack, page, shot)
        run_id = _trigger_from_the_form(stack, page, shot)
        _watch_the_grid(stack, page, shot, run_id)
        _clear_a_task(stack, page, shot, run_id)
        _cost_page(stack, page, shot)
    except Exception:
        shot(page, "failure", full_page=True)
        raise


def _sign_in(stack, page, shot) -> None:
    page.goto(stack.url + "/")
    # Signed out, the SPA sends the browser to the simple auth manager's own login page.
    page.wait_for_url(re.compile(r"/auth/login"))
    expect(page.get_by_role("heading", name="Sign into Airflow")).to_be_visible()
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password").fill(stack.password)
    shot(page, "login")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/auth/login" not in url)
    expect(page.get_by_role("button", name="Browse")).to_be_visible()


def _field(dialog, name: str):
    # Locate by the input's name (element_<param>): string inputs get id element_<param> while their
    # <label for> points elsewhere, so get_by_label finds only the number fields.
    # The JSON editor of an object Param has the id but no name.
    return dialog.locator('[data-scope="field"][data-part="root"]').filter(
        has=dialog.page.locator(f'[name="element_{name}"], [id="element_{name}"]'))


def _trigger_from_the_form(stack, page, shot) -> str:
    from hybridflow.params import TRAINING_PARAMS

    params = stack.api("GET", f"/dags/{DAG}/details")["params"]
    assert set(params) == set(TRAINING_PARAMS)
    page.goto(f"{stack.url}/dags/{DAG}")
    page.get_by_role("button", name="Trigger Dag").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Trigger Dag - {DAG}")
    trigger = dialog.get_by_role("button", name="Trigger", exact=True)
    # With the defaults the form is valid (a non-nullable Param whose value is "" would disable it).
    expect(trigger).to_be_enabled()
    for name, param in params.items():
        title, description = param["schema"]["title"], param["description"]
        assert (title, description) == (TRAINING_PARAMS[name]["title"], TRAINING_PARAMS[name]["description"])
        field = _field(dialog, name)
        expect(field).to_have_count(1)
        expect(field.locator("label").first).to_contain_text(title)
        expect(field.locator('[data-part="helper-text"]')).to_have_text(description)
    shot(page, "trigger-form")

    # Out of range: the number field does not keep it; on leaving the field it is clamped to the
    # Param's maximum, without an error message, so 1000 can never be submitted.
    workers = dialog.locator('[name="element_workers"]')
    maximum = params["workers"]["schema"]["maximum"]
    workers.fill("1000")
    workers.press("Tab")
    expect(workers).to_have_value(str(maximum))
    # Empty: a required field; the form says so and refuses to trigger.
    workers.fill("")
    expect(_field(dialog, "workers")).to_contain_text("This field is required")
    expect(trigger).to_be_disabled()
    shot(page, "trigger-form-refused")
    workers.fill("2")
    expect(trigger).to_be_enabled()
    expect(_field(dialog, "workers")).not_to_contain_text("This field is required")

    dialog.locator('[name="element_checkpoint_every_steps"]').fill("40")
    deploy = dialog.get_by_role("checkbox", name="Deploy")
    expect(deploy).to_be_checked()
    # The checkbox itself is visually hidden under the accordion; the switch's control takes the click.
    dialog.locator('[id="switch:element_deploy:control"]').click()
    expect(deploy).not_to_be_checked()
    shot(page, "trigger-form-filled")
    trigger.click()
    expect(dialog).to_be_hidden()
    # The UI opens the new run's page.
    page.wait_for_url(re.compile(rf"/dags/{DAG}/runs/[^/]+$"))
    run_id = unquote(page.url.rsplit("/runs/", 1)[1])
    conf = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}")["conf"]
    assert (conf["workers"], conf["checkpoint_every_steps"], conf["deploy"]) == (2, 40, False)
    assert not conf.get("model") and not conf.get("hyperparameters")  # left empty: the registry's defaults
    assert not conf["budget_override"]
    return run_id


def _expect_all_green(page, run_id: str, tasks: list[str]) -> None:
    expect(page.get_by_test_id("state-badge").first).to_have_text("Success")
    expect(page.get_by_test_id("table-cell-state")).to_have_text(["Success"] * len(tasks))
    badges = [page.locator(f'a[id="grid-{run_id}-{t}"] [data-testid="task-state-badge"]') for t in tasks]
    for badge in badges:
        expect(badge).to_be_visible()
    # Every grid square has the colour of the table's "Success" badges. The grid refreshes on its own
    # timer, after the table: a square may still show its last state for a moment.
    success = page.get_by_test_id("table-cell-state").first.get_by_test_id("state-badge")
    colour = success.evaluate("e => getComputedStyle(e).backgroundColor")
    deadline = time.monotonic() + 30
    while (seen := {b.evaluate("e => getComputedStyle(e).backgroundColor") for b in badges}) != {colour}:
        assert time.monotonic() < deadline, f"grid squares {seen} never all took the Success colour {colour}"
        page.wait_for_timeout(250)


def _watch_the_grid(stack, page, shot, run_id: str) -> None:
    assert stack.wait_for_run(DAG, run_id, timeout=600) == "success", stack.task_states(DAG, run_id)
    tasks = list(stack.task_states(DAG, run_id))
    assert set(stack.task_states(DAG, run_id).values()) == {"success"}
    _expect_all_green(page, run_id, tasks)  # the open run page refreshes itself while the run is active
    shot(page, "grid-success")


def _clear_a_task(stack, page, shot, run_id: str) -> None:
    def ti(task_id: str) -> dict:
        return stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}")

    tries_before = {t: ti(t)["try_number"] for t in ("train", CLEARED)}
    page.locator(f'a[id="grid-{run_id}-{CLEARED}"]').click()
    page.wait_for_url(re.compile(rf"/tasks/{CLEARED}$"))
    # The run's page has a clear button with the same label: wait until the task's page (its log) is up.
    expect(page.get_by_role("button", name="Log Settings")).to_be_visible()
    page.get_by_role("button", name="Press shift+c to clear").click()  # its accessible name: the shortcut
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Clear Task Instance: {CLEARED}")
    # Downstream is selected by default: evaluate, compress, deploy, record.
    expect(dialog).to_contain_text("Affected Tasks: 4")
    confirm = dialog.get_by_role("button", name="Confirm")
    expect(confirm).to_be_enabled()
    shot(page, "clear-dialog")
    confirm.click()
    expect(dialog).to_be_hidden()

    wait_for(f"{CLEARED} to run again", lambda: ti(CLEARED)["try_number"] > tries_before[CLEARED], 60)
    assert stack.wait_for_run(DAG, run_id, timeout=300) == "success", stack.task_states(DAG, run_id)
    assert ti(CLEARED)["try_number"] == tries_before[CLEARED] + 1
    assert ti("train")["try_number"] == tries_before["train"]  # upstream of the cleared task: not run again
    assert set(stack.task_states(DAG, run_id).values()) == {"success"}
    page.goto(f"{stack.url}/dags/{DAG}/runs/{run_id}")
    _expect_all_green(page, run_id, list(stack.task_states(DAG, run_id)))
    shot(page, "grid-success-after-clear")


def _cost_page(stack, page, shot) -> None:
    day = datetime.now(UTC).date().isoformat()  # the day the run above trained
    stack.wait_for_dag(NIGHTLY)
    stack.unpause(NIGHTLY)
    nightly = stack.trigger(NIGHTLY, {"day": day})
    assert stack.wait_for_run(NIGHTLY, nightly, timeout=300) == "success", stack.task_states(NIGHTLY, nightly)

    page.goto(stack.url + "/")
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="GPU costs & budgets").click()
    # A plugin page: the UI frames /hybridflow/costs, which frames the day's report.
    page.wait_for_url(re.compile(r"/plugin/hybridflow-costs"))
    costs = page.locator('iframe[src$="/hybridflow/costs"]').content_frame
    expect(costs.get_by_role("heading", name="GPU costs & budgets")).to_be_visible()
    expect(costs.get_by_text(f"Day {day}")).to_be_visible()
    report = costs.locator(f'iframe[title="allocation report {day}"]').content_frame
    expect(report.get_by_role("heading", name=f"GPU cost allocation, {day}")).to_be_visible()
    chart = report.locator("svg").first
    expect(chart).to_be_visible()
    box = chart.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 50, box
    shot(page, "costs-page")


def test_declaring_a_cluster_down_and_up_from_the_clusters_page(stack, page) -> None:
    shot = page.shots
    stack.wait_for_dag(FENCE)
    stack.unpause(FENCE)
    try:
        _sign_in(stack, page, shot)
        _blank_reason_refused(stack, page, shot)
        down = _declare(stack, page, shot, "down", REASON)
        assert down["conf"] == {"action": "down", "cluster": FENCED, "reason": REASON}
        row = _cluster_row(_clusters_page(stack, page))
        expect(row).to_contain_text("down since")
        expect(row).to_contain_text("by admin")
        expect(row).to_contain_text(f"why: {REASON}")
        expect(row.get_by_role("button", name="Declare up")).to_be_visible()
        shot(page, "cluster-down")
        up = _declare(stack, page, shot, "up", None)
        assert up["conf"] == {"action": "up", "cluster": FENCED, "reason": None}
        row = _cluster_row(_clusters_page(stack, page))
        expect(row.locator("td").nth(4)).to_have_text("up")
        expect(row.get_by_role("button", name="Declare down")).to_be_visible()
        shot(page, "cluster-up")
    except Exception:
        shot(page, "failure", full_page=True)
        raise
    finally:
        _lift_fence(stack)


def _clusters_page(stack, page):
    page.goto(stack.url + "/")
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="Clusters & DR").click()
    page.wait_for_url(re.compile(r"/plugin/hybridflow-clusters"))
    frame = page.locator('iframe[src$="/hybridflow/clusters"]').content_frame
    expect(frame.get_by_role("heading", name="Clusters & DR")).to_be_visible()
    return frame


def _cluster_row(frame):
    return frame.locator(f'tr:has(form.declare[data-cluster="{FENCED}"])')


def _fence_runs(stack) -> int:
    return stack.api("GET", f"/dags/{FENCE}/dagRuns")["total_entries"]


def _blank_reason_refused(stack, page, shot) -> None:
    row = _cluster_row(_clusters_page(stack, page))
    reason, declare = row.get_by_role("textbox", name="reason"), row.get_by_role("button", name="Declare down")
    before = _fence_runs(stack)
    # Empty: the browser keeps the form from submitting and points at the reason field.
    declare.click()
    assert reason.evaluate("e => e.validity.valueMissing && document.activeElement === e")
    # Only blanks: the page's script refuses, naming the field.
    reason.fill("   ")
    declare.click()
    expect(row.get_by_role("status")).to_contain_text("reason: say why the cluster is declared down")
    shot(page, "declare-down-refused")
    page.wait_for_timeout(500)  # a request sent despite the refusal would have created its run by now
    assert _fence_runs(stack) == before


def _declare(stack, page, shot, action: str, reason: str | None) -> dict:
    """Declare FENCED ``action`` from its row, follow the created run's link into the UI's run page,
    and return the run once it has succeeded."""
    row = _cluster_row(_clusters_page(stack, page))
    if reason is not None:
        row.get_by_role("textbox", name="reason").fill(reason)
    row.get_by_role("button", name=f"Declare {action}").click()
    outcome = row.get_by_role("status")
    expect(outcome).to_contain_text("triggered run ")
    shot(page, f"declared-{action}")
    link = outcome.get_by_role("link")
    linked = link.inner_text()
    link.click()
    page.wait_for_url(re.compile(rf"/dags/{FENCE}/runs/[^/]+$"))
    run_id = unquote(page.url.rsplit("/runs/", 1)[1])
    assert run_id == linked
    expect(outcome).to_be_hidden()  # the UI left the plugin page for the run's
    assert stack.wait_for_run(FENCE, run_id, timeout=120) == "success", stack.task_log(FENCE, run_id, "fence")
    expect(page.get_by_test_id("state-badge").first).to_have_text("Success")
    expect(page.get_by_test_id("table-cell-state")).to_have_text(["Success"])  # the task table refreshes later
    shot(page, f"fence-run-{action}")
    run = stack.api("GET", f"/dags/{FENCE}/dagRuns/{run_id}")
    assert run["triggering_user_name"] == "admin"
    return run


def _lift_fence(stack) -> None:
    """Leave FENCED up for whatever uses the stack next, whatever the test got to."""
    from hybridflow.fencing import down_clusters, state_path
    from hybridflow.settings import Settings

    if FENCED in down_clusters(state_path(Settings(home=stack.home, config_dir=stack.config_dir).state_dir)):
        run_id = stack.trigger(FENCE, {"action": "up", "cluster": FENCED, "reason": None})
        assert stack.wait_for_run(FENCE, run_id, timeout=120) == "success"
