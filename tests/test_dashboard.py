"""The web dashboard in real headless Chromium against a live service (uvicorn, the tests' Ray, SQLite).

One long tiny-qwen2 job is shared by the module: it appears in the table, its reward chart grows
from the metrics stream, a hyper-parameter edit shows up as events, pause and resume change its
state, a fork from one of its checkpoints is cancelled. Every test brings the page and the job to
the state it needs itself (signed in, on the job's page, the job running), so each passes alone
and in any order; tests that cancel a job cancel one of their own. Screenshots go to
artifacts/dashboard/. Debian's chromium is driven through playwright's API;
playwright's own browser download is never used (`make install` installs chromium with apt-get).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api_util import LiveService, tiny_job, wait_for, wait_for_step

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extras")
expect = sync_api.expect

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard"
TERMINAL = ("succeeded", "failed", "cancelled")
# A chart can exist before its datasets do: every read below tolerates that.
REWARD_POINTS = "(Chart.getChart('chart-reward')?.data.datasets[0]?.data.length ?? 0)"
FILLED = "Chart.getChart('chart-{}').data.datasets.filter(d => d.data.length).length"


def chromium_path() -> str:
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing: `make install` installs Debian's chromium with apt-get")
    pytest.skip(f"{CHROMIUM} is missing: run `make install` (apt-get install chromium)")


@pytest.fixture(scope="module")
def job(api: httpx.Client) -> Iterator[dict]:
    """A job long enough to steer for the whole module; whatever is still active is cancelled at the end."""
    spec = tiny_job(
        trainer={"total_steps": 20_000, "val_every": 4},  # never reached: cancelled at the end
        checkpoint={"every": 2},
        metadata={"suite": "dashboard"},
    )
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    yield created.json()
    for listed in api.get("/v1/jobs", params={"metadata": "suite:dashboard", "limit": 100}).json()["data"]:
        if listed["status"] not in TERMINAL:
            api.post(f"/v1/jobs/{listed['id']}/cancel")
            wait_for(api, listed["id"], TERMINAL, timeout_s=120)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page(browser, live: LiveService) -> Iterator:
    """One signed-in tab for the module, checked at the end for script errors and token leaks."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    errors: list[str] = []
    urls: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.on("request", lambda request: urls.append(request.url))
    yield tab
    assert not errors, f"script errors on the page: {errors}"
    assert not [u for u in urls if live.token in u], "the token appeared in a URL"
    context.close()


def wait_until(page, expression: str, timeout_s: float) -> None:
    """Polls a page expression from outside: the page's CSP forbids the eval wait_for_function uses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout_s}s: {expression}")
        page.wait_for_timeout(250)


def job_action(page, action: str) -> None:
    page.locator(f"#job-actions button[data-action='{action}']").click()


def sign_in(page, live: LiveService) -> None:
    """The tab signed in with the admin token, whatever it showed before."""
    if not page.url.startswith(live.url):
        page.goto(live.url + "/")
    if page.evaluate("sessionStorage.getItem('tandem.token')") != live.token:
        page.fill("#token-input", live.token)
        page.click("#signin-form button[type=submit]")
    expect(page.locator("#signin-view")).to_be_hidden()


def open_job(page, live: LiveService, job_id: str) -> None:
    sign_in(page, live)
    page.evaluate(f"location.hash = '#/jobs/{job_id}'")
    expect(page.locator("#job-title")).to_have_text(job_id)


def running(api: httpx.Client, job: dict, past_step: int = 0) -> dict:
    """The shared job running (resumed if a test left it paused) and past `past_step`."""
    current = api.get(f"/v1/jobs/{job['id']}").json()
    if current["status"] in ("pausing", "paused"):
        wait_for(api, job["id"], ("paused",), timeout_s=90)
        api.post(f"/v1/jobs/{job['id']}/resume")
    assert wait_for(api, job["id"], ("running", *TERMINAL), timeout_s=120)["status"] == "running"
    return wait_for_step(api, job["id"], past_step, timeout_s=120)


def own_job(api: httpx.Client, suite: str) -> dict:
    """A job of the test's own that never trains (paused at once), for tests that cancel a job."""
    created = api.post("/v1/jobs", json=tiny_job(metadata={"suite": suite}))
    assert created.status_code == 201, created.text
    api.post(f"/v1/jobs/{created.json()['id']}/pause")
    return created.json()


def test_the_page_and_its_assets_load_without_a_token_and_pin_their_sources(live: LiveService) -> None:
    index = httpx.get(live.url + "/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in index.headers["content-security-policy"]
    chart = httpx.get(live.url + "/static/vendor/chart.umd.min.js")
    assert chart.status_code == 200 and "Chart.js v4" in chart.text[:200]
    config = httpx.get(live.url + "/dashboard/config").json()
    assert config["hyperparameters"]["lr"] == "optim.lr"
    assert httpx.get(live.url + "/v1/jobs").status_code == 401  # the data still needs the token


@pytest.mark.parametrize(
    "path", ["/", "/static/index.html", "/docs", "/static/js/main.js", "/static/dashboard.css"]
)
def test_every_page_and_asset_forbids_framing_inline_script_sniffing_and_referrers(
    live: LiveService, path: str
) -> None:
    # /static/index.html is the dashboard too: served bare, another site could frame it.
    answer = httpx.get(live.url + path)
    assert answer.status_code == 200
    policy = answer.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy, (path, policy)
    assert answer.headers.get("x-content-type-options") == "nosniff", path
    assert answer.headers.get("referrer-policy") == "no-referrer", path


def test_another_site_cannot_frame_the_page_or_the_docs_and_the_docs_still_work(
    browser, live: LiveService
) -> None:
    context = browser.new_context()
    tab = context.new_page()
    tab.goto(live.url + "/docs")  # Swagger UI runs under its CSP: its one inline script is allowed by hash
    expect(tab.locator(".info .title")).to_contain_text("Tandem")
    expect(tab.locator(".opblock").first).to_be_visible()
    tab.set_content(
        f'<iframe src="{live.url}/static/index.html"></iframe><iframe src="{live.url}/docs"></iframe>'
    )
    framed = [frame.url for frame in tab.frames[1:] if frame.url.startswith(live.url)]
    assert not framed, f"another site framed {framed}"
    context.close()


def test_a_wrong_token_shows_the_apis_error_on_the_sign_in_form(browser, live: LiveService) -> None:
    context = browser.new_context()
    tab = context.new_page()
    tab.goto(live.url + "/")
    tab.fill("#token-input", "tdm_not-a-real-token")
    tab.click("#signin-form button[type=submit]")
    expect(tab.locator("#signin-error")).to_have_text("invalid bearer token")  # the API's error.message
    expect(tab.locator("#signin-view")).to_be_visible()
    assert tab.evaluate("sessionStorage.length") == 0
    context.close()


def test_signing_in_lists_the_running_job(browser, live: LiveService, api: httpx.Client, job: dict) -> None:
    running(api, job)
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    tab = context.new_page()
    tab.goto(live.url + "/")
    tab.fill("#token-input", live.token)
    tab.click("#signin-form button[type=submit]")
    row = tab.locator(f"#job-rows tr[data-job-id='{job['id']}']")
    expect(row).to_be_visible()
    expect(row.locator(".badge")).to_have_text("running", timeout=90_000)
    expect(row).to_contain_text("tiny-qwen2")
    expect(tab.locator("#cl-running")).not_to_have_text("0")
    assert live.token not in tab.url
    assert tab.evaluate("sessionStorage.getItem('tandem.token')") == live.token
    context.close()


def test_the_reward_chart_grows_from_the_metrics_stream(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    running(api, job)
    sign_in(page, live)
    page.evaluate("location.hash = '#/jobs'")
    page.locator(f"#job-rows tr[data-job-id='{job['id']}'] a").first.click()
    expect(page.locator("#job-title")).to_have_text(job["id"])
    wait_until(page, f"window.Chart && Chart.getChart('chart-reward') && {REWARD_POINTS} >= 1", 90)
    seen = page.evaluate(REWARD_POINTS)
    wait_until(page, f"{REWARD_POINTS} >= {seen + 2}", 60)  # no reload: the stream feeds it
    expect(page.locator("#metrics-live")).to_have_text("live")
    timing = page.evaluate("Chart.getChart('chart-timing').data.datasets.filter(d => d.data.length).length")
    assert timing >= 3  # gen, reward, update_actor, ... stacked
    mismatch = page.evaluate(
        "Chart.getChart('chart-mismatch').data.datasets.filter(d => d.data.length).length"
    )
    assert mismatch >= 3  # every step reports |log-prob difference| mean and max and KL(rollout || trainer)


def test_a_hyperparameter_edit_from_the_form_shows_up_as_events(
    page, live, api: httpx.Client, job: dict
) -> None:
    running(api, job)
    open_job(page, live, job["id"])
    page.fill("#hp-form input[name='top_k']", "many")
    page.click("#hp-form button[type=submit]")
    expect(page.locator("#hp-result")).to_have_text("top_k: 'many' is not a number")
    page.fill("#hp-form input[name='top_k']", "")
    page.fill("#hp-form input[name='lr']", "0.0005")
    page.click("#hp-form button[type=submit]")
    expect(page.locator("#hp-result")).to_have_text("Requested for the next step: lr = 0.0005")
    expect(page.locator("#events li[data-kind='hyperparameters_requested']").last).to_be_visible()
    expect(page.locator("#events li[data-kind='hyperparameters']").last).to_contain_text("0.0005")  # applied
    assert api.get(f"/v1/jobs/{job['id']}").json()["spec"]["optim"]["lr"] == 5e-4


def test_the_job_page_screenshot(page, live, api: httpx.Client, job: dict) -> None:
    running(api, job, past_step=8)
    open_job(page, live, job["id"])
    wait_until(page, f"window.Chart && Chart.getChart('chart-reward') && {REWARD_POINTS} >= 8", 90)
    page.wait_for_timeout(300)  # the charts redraw 100 ms after their last point
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "job.png"), full_page=True)
    assert (ARTIFACTS / "job.png").stat().st_size > 50_000


def test_pause_and_resume_from_the_page(page, live, api: httpx.Client, job: dict) -> None:
    running(api, job)
    open_job(page, live, job["id"])
    expect(page.locator("#job-status")).to_have_text("running")
    job_action(page, "pause")
    expect(page.locator("#job-status")).to_have_text(re.compile("^paus(ing|ed)$"))  # the API answered
    assert api.get(f"/v1/jobs/{job['id']}").json()["status"] in ("pausing", "paused")
    assert wait_for(api, job["id"], ("paused",), timeout_s=60)["status"] == "paused"
    expect(page.locator("#job-status")).to_have_text("paused")
    expect(page.locator("#events li[data-kind='paused']").last).to_be_visible()
    job_action(page, "resume")
    expect(page.locator("#job-status")).to_have_text(re.compile("^(queued|running)$"))
    assert api.get(f"/v1/jobs/{job['id']}").json()["status"] in ("queued", "running")
    expect(page.locator("#job-status")).to_have_text("running", timeout=60_000)


def test_fork_from_a_checkpoint_then_cancel_it_from_the_page(
    page, live, api: httpx.Client, job: dict
) -> None:
    running(api, job)
    deadline = time.monotonic() + 120
    while not api.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]:
        assert time.monotonic() < deadline, "the job saved no checkpoint"
        time.sleep(0.5)
    open_job(page, live, job["id"])
    fork = page.locator("#checkpoint-rows button[data-fork-step]").first
    expect(fork).to_be_visible()
    step = int(fork.get_attribute("data-fork-step"))
    fork.click()
    page.fill("#fork-step", "9999")  # refused by the API: its message shows in the dialog
    page.click("#fork-submit")
    expect(page.locator("#fork-error")).to_contain_text("has no checkpoint at step 9999")
    page.fill("#fork-step", str(step))
    page.fill("#fork-overrides", '{"trainer": {"total_steps": 3000}}')
    page.click("#fork-submit")
    expect(page.locator("#job-facts")).to_contain_text(
        f"fork of {job['id']}", timeout=60_000
    )  # a loaded machine
    child_id = page.locator("#job-title").inner_text()
    child = api.get(f"/v1/jobs/{child_id}").json()
    assert child["parent_id"] == job["id"] and child["total_steps"] == 3000
    expect(page.locator("#events li[data-kind='forked']")).to_contain_text(f"step {step}")
    job_action(page, "cancel")
    page.click("#confirm-yes")
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=90_000)
    assert api.get(f"/v1/jobs/{job['id']}").json()["status"] not in TERMINAL  # the parent runs on


def test_cancel_from_the_jobs_table(page, live, api: httpx.Client) -> None:
    mine = own_job(api, "dashboard-cancel")
    sign_in(page, live)
    page.evaluate("location.hash = '#/jobs'")
    row = page.locator(f"#job-rows tr[data-job-id='{mine['id']}']")
    row.locator("button[data-action='cancel']").click()
    page.click("#confirm-yes")
    expect(row.locator(".badge")).to_have_text("cancelled", timeout=90_000)
    assert api.get(f"/v1/jobs/{mine['id']}").json()["status"] == "cancelled"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "jobs.png"), full_page=True)


def test_a_diverged_metric_leaves_a_gap_not_a_stalled_chart(
    page, live: LiveService, api: httpx.Client
) -> None:
    mine = own_job(api, "dashboard-nan")
    api.post(f"/v1/jobs/{mine['id']}/cancel")
    wait_for(api, mine["id"], TERMINAL, timeout_s=120)
    store = live.service.store  # the job ended: these rows are the last its stream replays
    store.add_metrics(mine["id"], 9001, {"critic/score/mean": float("nan")})  # sent as a bare NaN
    store.add_metrics(mine["id"], 9002, {"critic/score/mean": 0.5})
    open_job(page, live, mine["id"])
    wait_until(page, "Chart.getChart('chart-reward')?.data.datasets[0]?.data.at(-1)?.x === 9002", 30)
    expect(page.locator("#metrics-live")).to_have_text("ended")


def default_view(page) -> None:
    """The chart toolbar back to raw, linear, step x, not zoomed (the view is shared by the page)."""
    page.evaluate("document.querySelectorAll('dialog[open]').forEach(d => d.close())")  # left by another test
    page.locator("#smoothing").fill("0")
    page.locator("#log-scale").set_checked(False)
    page.select_option("#x-axis", "step")
    if page.locator("#zoom-reset").is_visible():
        page.click("#zoom-reset")


def charted_job(page, live: LiveService, api: httpx.Client, job: dict, points: int = 2) -> None:
    running(api, job, past_step=points)
    open_job(page, live, job["id"])
    default_view(page)
    wait_until(page, f"window.Chart && Chart.getChart('chart-reward') && {REWARD_POINTS} >= {points}", 90)


def test_every_default_chart_has_an_axis_title_and_entropy_is_recorded(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    charted_job(page, live, api, job)
    titles = page.evaluate(
        "[...document.querySelectorAll('#charts canvas')].map(c => Chart.getChart(c).options.scales.y.title.text)"
    )
    assert len(titles) >= 12 and all(titles), titles
    wait_until(page, f"{FILLED.format('entropy')} >= 1", 30)  # actor/entropy with entropy_coeff 0
    assert page.evaluate(f"{FILLED.format('grad')}") >= 1
    validation = page.evaluate("Chart.getChart('chart-validation').data.datasets.map(d => d.yAxisID)")
    assert validation == ["y", "y1"]  # val accuracy and val score on their own axes


def test_picking_a_metric_adds_a_chart_with_points(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    charted_job(page, live, api, job)
    page.focus("#metric-picker")  # the picker lists the keys recorded so far
    groups = page.eval_on_selector_all("#metric-picker optgroup", "gs => gs.map(g => g.label)")
    assert {"actor/", "critic/", "timing_s/"} <= set(groups)
    page.select_option("#metric-picker", "critic/advantages/max")
    card = page.locator("[data-chart='m-critic_advantages_max']")
    expect(card).to_be_visible()
    wait_until(page, f"{FILLED.format('m-critic_advantages_max')} === 1", 30)
    card.locator("button.remove").click()
    expect(card).to_have_count(0)


def test_smoothing_log_scale_wall_clock_and_zoom_change_the_charts(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    charted_job(page, live, api, job, points=6)
    data = "Chart.getChart('chart-length').data.datasets[0].data"
    raw = page.evaluate(f"{data}.map(p => p.y)")
    page.locator("#smoothing").fill("0.9")
    page.wait_for_timeout(200)
    smoothed = page.evaluate(f"{data}.map(p => p.y)")
    assert smoothed[0] == raw[0] and len(smoothed) >= len(raw)
    page.locator("#log-scale").set_checked(True)
    assert page.evaluate("Chart.getChart('chart-reward').options.scales.y.type") == "logarithmic"
    page.locator("#log-scale").set_checked(False)
    page.select_option("#x-axis", "time")
    x_title = page.evaluate("Chart.getChart('chart-length').options.scales.x.title.text")
    assert x_title.startswith("wall-clock")
    seconds = page.evaluate(f"{data}.map(p => p.x)")  # seconds since the job's first recorded row
    assert 0 <= seconds[0] < seconds[-1] and seconds == sorted(seconds)
    page.select_option("#x-axis", "step")
    page.locator("#chart-length").scroll_into_view_if_needed()  # the mouse only reaches the viewport
    box = page.locator("#chart-length").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=4)
    page.mouse.up()
    expect(page.locator("#zoom-reset")).to_be_visible()
    low, high = page.evaluate(
        "[Chart.getChart('chart-reward').options.scales.x.min, Chart.getChart('chart-reward').options.scales.x.max]"
    )
    assert low < high
    page.click("#zoom-reset")
    assert page.evaluate("Chart.getChart('chart-reward').options.scales.x.max") is None
    default_view(page)


def test_another_job_overlaid_on_the_charts(page, live: LiveService, api: httpx.Client, job: dict) -> None:
    other = own_job(api, "dashboard-overlay")
    api.post(f"/v1/jobs/{other['id']}/cancel")
    wait_for(api, other["id"], TERMINAL, timeout_s=120)
    for step in (1, 2, 3):
        live.service.store.add_metrics(other["id"], step, {"critic/score/mean": 0.1 * step})
    charted_job(page, live, api, job)
    page.fill("#compare-input", other["id"])
    page.click("#compare-form button[type=submit]")
    expect(page.locator(f"#compare-list [data-compare='{other['id']}']")).to_be_visible()
    overlay = f"Chart.getChart('chart-reward').data.datasets.find(d => d.other === '{other['id']}' && d.key === 'critic/score/mean')"
    wait_until(page, f"{overlay}?.data.length === 3", 30)
    assert page.evaluate(REWARD_POINTS) >= 2  # the job's own line is still there
    page.locator(f"#compare-list [data-compare='{other['id']}'] button").click()
    wait_until(page, f"!{overlay}", 10)


def test_a_hyperparameter_change_marks_the_charts(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    charted_job(page, live, api, job)
    changed = api.patch(f"/v1/jobs/{job['id']}/hyperparameters", json={"lr": 0.0004})
    assert changed.status_code == 200, changed.text
    marked = "Chart.getChart('chart-reward').options.plugins.markers.items.filter(m => m.label === 'hyperparameters').length"
    wait_until(page, f"{marked} >= 1", 90)
    page.select_option("#event-filter", "")
    expect(page.locator("#events li[data-kind='checkpoint']").first).to_be_visible(timeout=60_000)
    page.select_option("#event-filter", "main")  # checkpoints and validations no longer flood the feed
    expect(page.locator("#events li[data-kind='checkpoint']").first).to_be_hidden()
    expect(page.locator("#events li[data-kind='hyperparameters']").last).to_be_visible()


def test_a_killed_worker_shows_restarting_then_marks_the_charts(
    page, live: LiveService, api: httpx.Client, job: dict
) -> None:
    """SIGKILL to the job's worker: the badge reads 'restarting (1/3): ...' during the restart's 5 s
    backoff (not a failed job), a red 'restart' marker goes on the charts, and the job runs on."""
    import os
    import signal

    import ray

    charted_job(page, live, api, job)
    controller, deadline = live.service.scheduler.controller(job["id"]), time.monotonic() + 60
    while not (pids := ray.get(controller.worker_pids.remote(), timeout=60)).get("actor"):
        assert time.monotonic() < deadline, "the job's workers were not up within 60 s"
        time.sleep(0.2)  # between two attempts of the job (a restart) its groups are not there
    os.kill(pids["actor"][0], signal.SIGKILL)
    expect(page.locator("#job-status")).to_contain_text(
        "restarting (1/3): worker rank 0 died", timeout=60_000
    )
    marked = "Chart.getChart('chart-reward').options.plugins.markers.items.filter(m => m.label === 'restart').length"
    wait_until(page, f"{marked} >= 1", 90)
    expect(page.locator("#job-status")).to_have_text("running", timeout=120_000)


def test_events_filter_name_tags_notes_search_and_export(
    page, live: LiveService, api: httpx.Client, job: dict, tmp_path: Path
) -> None:
    mine = own_job(api, "dashboard-meta")
    api.post(f"/v1/jobs/{mine['id']}/cancel")
    wait_for(api, mine["id"], TERMINAL, timeout_s=120)
    live.service.store.add_metrics(mine["id"], 1, {"critic/score/mean": 0.25})
    open_job(page, live, mine["id"])
    page.fill("#meta-form input[name='name']", "blue-heron")
    page.fill("#meta-form input[name='tags']", "sweep, lr-test")
    page.fill("#meta-form textarea[name='notes']", "try a smaller lr")
    page.click("#meta-form button[type=submit]")
    expect(page.locator("#meta-result")).to_have_text("saved")
    saved = api.get(f"/v1/jobs/{mine['id']}").json()
    assert (saved["name"], saved["tags"], saved["notes"]) == (
        "blue-heron",
        ["sweep", "lr-test"],
        "try a smaller lr",
    )
    expect(page.locator("#job-facts")).to_contain_text("blue-heron")
    with page.expect_download() as download:
        page.click("#export-csv")
    csv_path = tmp_path / "metrics.csv"
    download.value.save_as(csv_path)
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "step,time,critic/score/mean" and lines[1].startswith("1,")
    page.select_option("#event-filter", "main")
    page.evaluate("location.hash = '#/jobs'")
    page.fill("#job-search", "blue-her")
    expect(page.locator(f"#job-rows tr[data-job-id='{mine['id']}']")).to_contain_text("#lr-test")
    expect(page.locator("#job-rows tr")).to_have_count(1)
    page.fill("#job-search", "")
