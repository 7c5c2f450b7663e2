// Run comparison: other jobs' metrics overlaid (dashed) on the job page's charts. A fork shows its
// parent by default; more jobs are added by id (or a unique prefix of one) and removed with ×.

import { get, query } from "./api.js";
import { Series } from "./charts.js";
import { $, el, showError } from "./ui.js";

const MAX_POINTS = 2000;

async function metricsOf(jobId) {
  const series = new Series();
  const page = await get(`/v1/jobs/${encodeURIComponent(jobId)}/metrics${query({ max_points: MAX_POINTS })}`);
  for (const row of page.data) series.add(row);
  return series;
}

async function resolve(text) {
  const listing = await get(`/v1/jobs${query({ q: text, limit: 5 })}`);
  const exact = listing.data.find((job) => job.id === text || job.name === text);
  if (exact) return exact.id;
  const prefixed = listing.data.filter((job) => job.id.startsWith(text));
  if (prefixed.length === 1) return prefixed[0].id;
  throw new Error(`no single job matches '${text}'`);
}

export class Compare {
  constructor(charts) {
    this.charts = charts;
    this.jobs = [];
    $("compare-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const text = $("compare-input").value.trim();
      if (!text) return;
      try {
        await this.add(await resolve(text));
        $("compare-input").value = "";
      } catch (err) {
        showError(err);
      }
    });
  }

  reset(job) {
    this.jobs = [];
    this.render();
    if (job.parent_id) this.add(job.parent_id).catch(() => {});
  }

  async add(jobId) {
    if (this.jobs.includes(jobId)) return;
    const charts = this.charts();
    const series = await metricsOf(jobId);
    if (charts !== this.charts()) return; // the page moved on
    this.jobs.push(jobId);
    charts.overlay(jobId, series);
    this.render();
  }

  removeJob(jobId) {
    this.jobs = this.jobs.filter((id) => id !== jobId);
    this.charts().overlay(jobId, null);
    this.render();
  }

  render() {
    $("compare-list").replaceChildren(...this.jobs.map((id) => el("span", { class: "tag", "data-compare": id }, id,
      el("button", { type: "button", class: "link", title: "remove", onclick: () => this.removeJob(id) }, "×"))));
  }
}
