// The Job page: header with actions, live charts, hyper-parameter form, checkpoints, events, log, spec.
//
// Metrics, events and the log arrive over SSE (see api.js); the header polls the job every two
// seconds until it is terminal. Leaving the page aborts every stream and timer.

import { get, patch, query, stream } from "./api.js";
import { ChartControls } from "./chart_controls.js";
import { MetricCharts } from "./charts.js";
import { SamplesPanel } from "./samples.js";
import { Compare } from "./compare.js";
import { exportMetrics, saveMeta, showMeta } from "./job_meta.js";
import {
  $, allowed, el, forkDialog, formatDuration, formatTime, jobAction, jobDuration, showError, statusBadge,
} from "./ui.js";

const POLL_MS = 2000;
const TERMINAL = ["succeeded", "failed", "cancelled"];
const MAX_EVENTS = 500;
const MAX_LOG_LINES = 1000;
// Kinds the default event filter hides (they arrive every few steps), and kinds marked on charts.
const FREQUENT = ["checkpoint", "validation"];
const MARKED = { hyperparameters: "#7c3aed", paused: "#d97706", resumed: "#16a34a", forked: "#db2777",
  started: "#64748b", restart: "#dc2626" };

const jobPath = (id, rest = "") => `/v1/jobs/${encodeURIComponent(id)}${rest}`;

function lookup(spec, dotted) {
  return dotted.split(".").reduce((node, key) => (node == null ? undefined : node[key]), spec);
}

// Keeps a scrolled-to-bottom feed pinned to the bottom as it grows; leaves it alone otherwise.
function appendPinned(feed, nodes, max) {
  const pinned = feed.scrollHeight - feed.scrollTop - feed.clientHeight < 40;
  feed.append(...nodes);
  while (feed.childNodes.length > max) feed.firstChild.remove();
  if (pinned) feed.scrollTop = feed.scrollHeight;
}

export class JobView {
  constructor() {
    this.jobId = null;
    this.job = null;
    this.charts = null;
    this.controller = null;
    this.timer = null;
    this.hyperparameters = {};
    this.samples = new SamplesPanel($("samples"));
    this.configLoaded = fetch("/dashboard/config").then((r) => r.json())
      .then((config) => { this.hyperparameters = config.hyperparameters; })
      .catch(() => {});
    for (const button of $("job-actions").querySelectorAll("button")) {
      button.addEventListener("click", () => this.act(button.dataset.action));
    }
    this.controls = new ChartControls(() => this.charts);
    this.compare = new Compare(() => this.charts);
    this.markers = [];
    $("event-filter").addEventListener("change", () => this.filterEvents());
    $("meta-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const job = await saveMeta(this.jobId);
      if (job) this.render(job);
    });
    $("export-csv").addEventListener("click", () => exportMetrics(this.jobId, "csv"));
    $("export-json").addEventListener("click", () => exportMetrics(this.jobId, "json"));
    $("hp-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.applyHyperparameters();
    });
  }

  async show(jobId) {
    this.hide();
    this.jobId = jobId;
    this.controller = new AbortController();
    const { signal } = this.controller;
    document.title = `${jobId} · Tandem`;
    $("job-title").textContent = jobId;
    $("meta-form").reset();
    $("events").replaceChildren();
    $("logs").replaceChildren();
    $("job-spec").textContent = "";
    $("hp-result").hidden = true;
    for (const pill of ["metrics-live", "events-live", "logs-live"]) Object.assign($(pill), { textContent: "connecting", className: "live" });
    this.charts = new MetricCharts($("charts"), (range) => this.controls.zoom(range));
    this.samples.show(jobId);
    this.markers = [];
    $("meta-result").hidden = true;
    await this.configLoaded;
    if (!(await this.refresh())) return;
    showMeta(this.job);
    this.compare.reset(this.job);
    this.buildHyperparameterForm();
    this.refreshCheckpoints();
    this.follow("metrics", "metrics-live", (frame) => this.charts.add(frame.data), signal);
    this.follow("events", "events-live", (frame) => this.addEvent(frame.data), signal);
    this.followLog(signal);
    this.timer = setInterval(() => this.refresh(), POLL_MS);
  }

  hide() {
    if (this.controller) this.controller.abort();
    clearInterval(this.timer);
    this.timer = null;
    if (this.charts) this.charts.destroy();
    this.charts = null;
    this.jobId = null;
  }

  // Re-reads the job for the header; false when it cannot be read (the error is shown).
  async refresh() {
    const jobId = this.jobId;
    try {
      const job = await get(jobPath(jobId));
      if (jobId !== this.jobId) return false;
      this.render(job);
      this.samples.follow(job.step);
      if (TERMINAL.includes(job.status)) {
        clearInterval(this.timer);
        this.timer = null;
      }
      return true;
    } catch (err) {
      if (err.status !== 401) showError(err);
      return false;
    }
  }

  render(job) {
    this.job = job;
    showMeta(job);
    $("job-status").replaceWith(Object.assign(statusBadge(job.status, job.restart), { id: "job-status" }));
    const facts = [
      job.name ? el("span", { class: "job-name" }, job.name) : null,
      ...(job.tags || []).map((tag) => el("span", { class: "tag" }, `#${tag}`)),
      el("span", {}, el("b", {}, job.method), " · ", job.model),
      el("span", { id: "job-owner" }, "owner ", el("b", {}, job.owner)),
      el("span", {}, "created ", formatTime(job.created_at)),
      el("span", {}, "started ", formatTime(job.started_at)),
      el("span", {}, "duration ", formatDuration(jobDuration(job))),
    ];
    if (job.parent_id) {
      facts.push(el("span", {}, "fork of ", el("a", { href: `#/jobs/${encodeURIComponent(job.parent_id)}` }, job.parent_id)));
    }
    for (const [key, value] of Object.entries(job.metadata || {})) facts.push(el("span", { class: "tag" }, `${key}: ${value}`));
    $("job-facts").replaceChildren(...facts.filter(Boolean));
    $("job-progress").style.width = `${Math.round(100 * job.progress)}%`;
    $("job-step").textContent = `step ${job.step} / ${job.total_steps}`;
    for (const button of $("job-actions").querySelectorAll("button")) {
      button.disabled = !allowed(button.dataset.action, job.status);
    }
    $("job-error").textContent = job.error || "";
    $("job-error").hidden = !job.error;
    const spec = JSON.stringify(job.spec, null, 2);
    if ($("job-spec").textContent !== spec) $("job-spec").textContent = spec;
    for (const input of $("hp-form").querySelectorAll("input")) {
      const current = lookup(job.spec, this.hyperparameters[input.name] || "");
      input.placeholder = current === undefined || current === null ? "" : String(current);
    }
    const editable = !TERMINAL.includes(job.status);
    for (const control of $("hp-form").elements) control.disabled = !editable;
  }

  async act(action) {
    const jobId = this.jobId;
    const result = await jobAction(jobId, action);
    if (!result) return;
    if (action === "fork") location.hash = `#/jobs/${encodeURIComponent(result.id)}`;
    else if (result.object === "job" && jobId === this.jobId) this.render(result);
    if (!this.timer && jobId === this.jobId) this.timer = setInterval(() => this.refresh(), POLL_MS);
  }

  follow(kind, pill, onEvent, signal, after = 0) {
    const onStatus = (state) => {
      $(pill).textContent = state;
      $(pill).className = `live is-${state}`;
    };
    const onError = (err) => { if (err.status !== 401) showError(err); };
    stream(jobPath(this.jobId, `/${kind}/stream${query({ after })}`), { onEvent, onStatus, onError, signal });
  }

  addEvent(event) {
    const item = el("li", { "data-kind": event.kind },
      el("time", {}, formatTime(event.time)), el("span", { class: `kind kind-${event.kind}` }, event.kind),
      el("span", { class: "message" }, event.message));
    item.hidden = this.hiddenKind(event.kind);
    appendPinned($("events"), [item], MAX_EVENTS);
    if (MARKED[event.kind] && this.charts) {
      this.markers.push({ time: event.time, step: event.data?.step, label: event.kind, color: MARKED[event.kind] });
      this.charts.setMarkers(this.markers);
    }
    if (event.kind === "checkpoint") this.refreshCheckpoints();
  }

  hiddenKind(kind) {
    return $("event-filter").value === "main" && FREQUENT.includes(kind);
  }

  filterEvents() {
    for (const item of $("events").children) item.hidden = this.hiddenKind(item.dataset.kind);
  }

  // The log's last lines first, then the stream from just after them.
  async followLog(signal) {
    const jobId = this.jobId;
    let last = 0;
    try {
      const tail = await get(jobPath(jobId, `/logs${query({ tail: 200 })}`));
      if (signal.aborted) return;
      this.addLogLines(tail.data);
      if (tail.data.length) last = tail.data[tail.data.length - 1].id;
    } catch (err) {
      if (err.status !== 401) showError(err);
    }
    if (!signal.aborted) this.follow("logs", "logs-live", (frame) => this.addLogLines([frame.data]), signal, last);
  }

  addLogLines(rows) {
    // A log line carries its own timestamp; the record's time is kept for hovering.
    const lines = rows.map((row) => el("span", { class: `line level-${(row.level || "info").toLowerCase()}`,
      title: formatTime(row.time) }, row.line, "\n"));
    appendPinned($("logs"), lines, MAX_LOG_LINES);
  }

  async refreshCheckpoints() {
    const jobId = this.jobId;
    try {
      const listing = await get(jobPath(jobId, "/checkpoints"));
      if (jobId !== this.jobId) return;
      $("checkpoint-rows").replaceChildren(...listing.data.slice().reverse().map((c) => el("tr", {},
        el("td", { class: "num" }, c.step), el("td", {}, formatTime(c.time)),
        el("td", { class: "mono path", title: c.path }, c.path),
        el("td", {}, el("button", { type: "button", class: "small", "data-fork-step": c.step,
          onclick: () => this.forkFrom(c.step) }, "Fork")))));
      $("checkpoints-empty").hidden = listing.data.length > 0;
    } catch (err) {
      if (err.status !== 401) showError(err);
    }
  }

  async forkFrom(step) {
    const child = await forkDialog(this.jobId, step);
    if (child) location.hash = `#/jobs/${encodeURIComponent(child.id)}`;
  }

  buildHyperparameterForm() {
    const fields = Object.keys(this.hyperparameters).map((name) => el("label", {},
      el("span", {}, name), el("input", { name, type: "text", inputmode: "decimal", autocomplete: "off" })));
    const submit = el("button", { type: "submit", class: "primary" }, "Apply at next step");
    $("hp-form").replaceChildren(el("div", { class: "hp-grid" }, fields), submit);
    if (this.job) this.render(this.job);
  }

  async applyHyperparameters() {
    const result = $("hp-result");
    const changes = {};
    for (const input of $("hp-form").querySelectorAll("input")) {
      const text = input.value.trim();
      if (!text) continue;
      const value = Number(text);
      if (!Number.isFinite(value)) {
        result.textContent = `${input.name}: '${text}' is not a number`;
        result.className = "error";
        result.hidden = false;
        return;
      }
      changes[input.name] = value;
    }
    if (!Object.keys(changes).length) {
      Object.assign(result, { textContent: "Fill in at least one field.", className: "error", hidden: false });
      return;
    }
    try {
      const job = await patch(jobPath(this.jobId, "/hyperparameters"), changes);
      for (const input of $("hp-form").querySelectorAll("input")) input.value = "";
      const summary = Object.entries(changes).map(([k, v]) => `${k} = ${v}`).join(", ");
      Object.assign(result, { textContent: `Requested for the next step: ${summary}`, className: "ok", hidden: false });
      this.render(job);
    } catch (err) {
      Object.assign(result, { textContent: err.message, className: "error", hidden: false });
    }
  }
}
