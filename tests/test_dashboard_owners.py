"""The dashboard signed in as each of two owners, in real headless Chromium: each sees only their own
jobs (with the owner column) and their own usage, and another owner's job page is "no job"; the
admin sees both, and a link whose job id is broken shows the jobs. The service runs on the tests' Ray
without its scheduler (jobs stay queued)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api_util import start_service
from tests.owners_util import make_key, owned_job

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extras")
expect = sync_api.expect

from tests.test_dashboard import browser as chromium  # noqa: E402  (its module-scoped headless Chromium)

browser = chromium  # the fixture, under the name the tests ask for


@pytest.fixture(scope="module")
def two_owners(ray_cluster, tmp_path_factory) -> Iterator[tuple]:
    svc = start_service(tmp_path_factory.mktemp("dashboard-owners"), schedule=False)
    with svc.client() as admin:
        keys = {name: make_key(admin, name)["key"] for name in ("alice", "bob")}
    jobs = {name: owned_job(svc, name, checkpoint=False) for name in ("alice", "bob")}
    yield svc, keys, jobs
    svc.stop()


def signed_in(browser, url: str, key: str):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    tab.goto(url + "/")
    tab.fill("#token-input", key)
    tab.click("#signin-form button[type=submit]")
    expect(tab.locator("#signin-view")).to_be_hidden()
    return context, tab


@pytest.mark.parametrize("me,other", [("alice", "bob"), ("bob", "alice")])
def test_each_owner_sees_only_their_own_jobs_and_usage(browser, two_owners, me, other) -> None:
    svc, keys, jobs = two_owners
    context, tab = signed_in(browser, svc.url, keys[me])
    mine = tab.locator(f"#job-rows tr[data-job-id='{jobs[me]}']")
    expect(mine).to_be_visible()
    expect(mine.locator("td.owner")).to_have_text(me)
    expect(tab.locator(f"#job-rows tr[data-job-id='{jobs[other]}']")).to_have_count(0)
    expect(tab.locator("#job-rows td.owner")).to_have_text([me] * tab.locator("#job-rows tr").count())
    expect(tab.locator("#usage-rows tr")).to_have_count(1)
    expect(tab.locator(f"#usage-rows tr[data-owner='{me}']")).to_contain_text("1")  # one queued job
    tab.evaluate(f"location.hash = '#/jobs/{jobs[me]}'")
    expect(tab.locator("#job-owner")).to_have_text(f"owner {me}")
    tab.evaluate(f"location.hash = '#/jobs/{jobs[other]}'")
    expect(tab.locator("#banner-text")).to_have_text(f"no job '{jobs[other]}'")
    expect(tab.locator("#job-owner")).not_to_have_text(f"owner {other}")
    context.close()


def test_the_admin_sees_every_owners_jobs_and_usage(browser, two_owners) -> None:
    svc, _, jobs = two_owners
    context, tab = signed_in(browser, svc.url, svc.token)
    for owner, job_id in jobs.items():
        expect(tab.locator(f"#job-rows tr[data-job-id='{job_id}'] td.owner")).to_have_text(owner)
        expect(tab.locator(f"#usage-rows tr[data-owner='{owner}']")).to_be_visible()
    context.close()


def test_a_link_with_a_broken_job_id_shows_the_jobs_and_says_why(browser, two_owners) -> None:
    svc, _, _ = two_owners
    context, tab = signed_in(browser, svc.url, svc.token)
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.evaluate("location.hash = '#/jobs/%E0'")  # not UTF-8 once decoded: decodeURIComponent throws
    expect(tab.locator("#banner-text")).to_contain_text("not valid percent-encoding: %E0")
    expect(tab.locator("#jobs-view")).to_be_visible()
    assert not errors, errors
    context.close()
