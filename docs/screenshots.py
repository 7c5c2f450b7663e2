"""`make screenshots`: today's pictures of the dashboard for the README and the docs (docs/img/*.png).

Starts a real `tandem serve` on a fresh home (a temporary folder), trains a short GRPO job from
examples/grpo_tiny.yaml through the REST API, changes a hyper-parameter half way (so the charts show
its marker), and photographs the jobs page and the job's page in headless Chromium (Debian's
chromium driven through playwright, as tests/test_dashboard.py does). The service is stopped at the
end, whatever happened.

    .venv/bin/python docs/screenshots.py [--out docs/img] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.client import TandemClient  # noqa: E402
from examples.demo import start_service, wait_ready  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
VIEWPORT = {"width": 1280, "height": 860}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_job(client: TandemClient, steps: int, timeout_s: float = 600) -> str:
    """A short GRPO job that ends succeeded, with an lr change at half way; returns its id."""
    spec = yaml.safe_load((ROOT / "examples" / "grpo_tiny.yaml").read_text())
    spec["trainer"].update(total_steps=steps, val_every=5)
    spec["name"], spec["tags"] = "grpo-tiny", ["example", "screenshot"]
    job = client.create_job(spec)
    deadline, changed = time.time() + timeout_s, False
    while time.time() < deadline:
        current = client.get_job(job["id"])
        if not changed and current.get("step", 0) >= steps // 2 and current["status"] == "running":
            client.set_hyperparameters(job["id"], {"lr": 1.5e-3})
            changed = True
        if current["status"] in ("succeeded", "failed", "cancelled"):
            if current["status"] != "succeeded":
                raise SystemExit(f"the screenshot job ended {current['status']}: {current.get('error')}")
            return job["id"]
        time.sleep(1)
    raise SystemExit(f"the screenshot job did not finish within {timeout_s:.0f} s")


def photograph(url: str, token: str, job_id: str, out: Path) -> list[Path]:
    from playwright.sync_api import expect, sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.set_default_timeout(60_000)
        page.goto(url + "/")
        page.fill("#token-input", token)
        page.click("#signin-form button[type=submit]")
        expect(page.locator("#job-rows tr")).to_have_count(1)
        page.wait_for_timeout(1500)  # the cluster panel's first poll
        shots.append(out / "jobs.png")
        page.screenshot(path=str(shots[-1]))
        page.evaluate(f"location.hash = '#/jobs/{job_id}'")
        expect(page.locator("#job-title")).to_have_text(job_id)
        expect(page.locator("#events li").first).to_be_visible()
        page.wait_for_timeout(3000)  # charts draw from the metrics stream
        shots.append(out / "job.png")
        page.screenshot(path=str(shots[-1]))
        page.locator("#samples").evaluate("el => el.closest('section').scrollIntoView()")
        page.wait_for_timeout(1000)
        shots.append(out / "samples.png")
        page.screenshot(path=str(shots[-1]))
        browser.close()
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--steps", type=int, default=40, help="the job's total_steps")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tandem-shots-") as tmp:
        home = Path(tmp) / "home"
        os.environ["TANDEM_HOME"] = str(home)
        os.environ["TANDEM_PORT"] = str(free_port())  # never the user's own service's port
        server = start_service(home)
        try:
            url = wait_ready(home, server)
            client = TandemClient(url=url)
            job_id = train_job(client, args.steps)
            token = (home / "admin_token").read_text().strip()
            for path in photograph(url, token, job_id, args.out):
                print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
                      f"{path.stat().st_size // 1024} KiB")  # fmt: skip
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
