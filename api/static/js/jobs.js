// The Jobs page: the cluster panel and the jobs table, with a status filter, actions and auto-refresh.

import { get, query } from "./api.js";
import {
  $, allowed, el, formatBytes, formatDuration, formatNumber, formatTime, jobAction, jobDuration, progressBar,
  showError, statusBadge,
} from "./ui.js";

const ACTIVE = ["queued", "running", "pausing", "paused", "cancelling"];
const PAGE_SIZE = 50;
const REFRESH_MS = 3000;
const ROW_ACTIONS = ["pause", "resume", "cancel", "fork"];

function jobLink(id) {
  return el("a", { href: `#/jobs/${encodeURIComponent(id)}`, class: "mono" }, id);
}

function actionButtons(job, onDone) {
  return ROW_ACTIONS.map((action) => el("button", {
    type: "button",
    class: action === "cancel" ? "small danger" : "small",
    "data-action": action,
    disabled: !allowed(action, job.status),
    onclick: async () => {
      if (await jobAction(job.id, action)) onDone();
    },
  }, action));
}

function jobRow(job, onDone) {
  const reward = job.latest_metrics ? job.latest_metrics["critic/score/mean"] : undefined;
  const parent = job.parent_id ? el("div", { class: "sub" }, "fork of ", jobLink(job.parent_id)) : null;
  const name = job.name ? el("div", { class: "job-name" }, job.name) : null;
  const tags = (job.tags || []).length ? el("div", { class: "sub" }, job.tags.map((t) => `#${t}`).join(" ")) : null;
  return el("tr", { "data-job-id": job.id },
    el("td", { title: job.notes || undefined }, name, jobLink(job.id), tags, parent),
    el("td", {}, statusBadge(job.status, job.restart)),
    el("td", { class: "owner" }, job.owner),
    el("td", {}, job.method),
    el("td", { class: "model", title: job.model }, job.model),
    el("td", { class: "step" }, progressBar(job), el("span", { class: "num" }, `${job.step}/${job.total_steps}`)),
    el("td", { class: "num reward" }, formatNumber(reward)),
    el("td", { title: `created ${formatTime(job.created_at)}` }, formatTime(job.started_at)),
    el("td", { class: "num" }, formatDuration(jobDuration(job))),
    el("td", { class: "row-actions" }, actionButtons(job, onDone)),
  );
}

export class JobsView {
  constructor() {
    this.pages = 1;
    this.timer = null;
    this.loading = false;
    $("status-filter").addEventListener("change", () => {
      this.pages = 1;
      this.refresh();
    });
    $("auto-refresh").addEventListener("change", () => this.schedule());
    let typing = null;
    $("job-search").addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => {
        this.pages = 1;
        this.refresh();
      }, 250);
    });
    $("jobs-more").addEventListener("click", () => {
      this.pages += 1;
      this.refresh();
    });
  }

  show() {
    this.refresh();
    this.schedule();
  }

  hide() {
    clearInterval(this.timer);
    this.timer = null;
  }

  schedule() {
    clearInterval(this.timer);
    this.timer = $("auto-refresh").checked ? setInterval(() => this.refresh(), REFRESH_MS) : null;
  }

  async refresh() {
    if (this.loading) return;
    this.loading = true;
    try {
      const [jobs, cluster, usage] = await Promise.all([this.fetchJobs(), get("/v1/cluster"), get("/v1/usage")]);
      this.renderJobs(jobs);
      this.renderCluster(cluster);
      this.renderUsage(usage.data);
      $("jobs-updated").textContent = `updated ${formatTime(Date.now() / 1000)}`;
    } catch (err) {
      if (err.status !== 401) showError(err);
    } finally {
      this.loading = false;
    }
  }

  // The newest `pages` pages, walking the `after` cursor.
  async fetchJobs() {
    const filter = $("status-filter").value;
    const status = filter === "active" ? ACTIVE : filter || undefined;
    const data = [];
    let after;
    let more = false;
    for (let page = 0; page < this.pages; page += 1) {
      const q = $("job-search").value.trim() || undefined;
      const listing = await get(`/v1/jobs${query({ status, q, limit: PAGE_SIZE, after })}`);
      data.push(...listing.data);
      more = listing.has_more;
      if (!more || !listing.data.length) break;
      after = listing.data[listing.data.length - 1].id;
    }
    return { data, more };
  }

  renderJobs({ data, more }) {
    $("job-rows").replaceChildren(...data.map((job) => jobRow(job, () => this.refresh())));
    $("jobs-empty").hidden = data.length > 0;
    $("jobs-more").hidden = !more;
  }

  // Each owner's use against its quota (the caller's own; an admin's: every owner's).
  renderUsage(rows) {
    const of = (used, limit, format = formatNumber) => (limit == null ? format(used) : `${format(used)} / ${format(limit)}`);
    $("usage-rows").replaceChildren(...rows.map((u) => el("tr", { "data-owner": u.owner },
      el("td", {}, u.owner),
      el("td", { class: "num" }, of(u.running_jobs, u.quota.running_jobs)),
      el("td", { class: "num" }, of(u.queued_jobs, u.quota.queued_jobs)),
      el("td", { class: "num" }, of(u.cpus, u.quota.cpus)),
      el("td", { class: "num" }, of(u.gpus, u.quota.gpus)),
      el("td", { class: "num" }, of(u.stored_bytes.total, u.quota.stored_bytes, formatBytes)))));
  }

  renderCluster(cluster) {
    const alive = cluster.nodes.filter((n) => n.alive).length;
    $("cl-nodes").textContent = `${alive}${alive === cluster.nodes.length ? "" : ` / ${cluster.nodes.length}`}`;
    for (const kind of ["cpus", "gpus"]) {
      const { total, free } = cluster[kind];
      $(`cl-${kind}`).textContent = `${formatNumber(total - free)} / ${formatNumber(total)}`;
      $(`cl-${kind}-free`).textContent = `${formatNumber(free)} free`;
    }
    $("cl-running").textContent = cluster.jobs.running;
    $("cl-queued").textContent = cluster.jobs.queued;
    $("cl-node-rows").replaceChildren(...cluster.nodes.map((n) => el("tr", {},
      el("td", { class: "mono" }, n.node_id.slice(0, 12)), el("td", {}, n.address ?? "-"),  // an admin's view only
      el("td", { class: "num" }, formatNumber(n.cpus)), el("td", { class: "num" }, formatNumber(n.gpus)),
      el("td", {}, n.alive ? "yes" : "no"))));
  }
}
