// The job page's live charts: feeding them rows from the metrics stream, and drawing them as the
// view (chart_view.js) says, with overlays of other jobs and event markers.
//
// Each chart is a Chart.js instance (window.Chart, vendored) on a canvas with id `chart-<name>`, so
// `Chart.getChart("chart-reward")` finds it. Raw points are {step, time, value}, one per step: a
// step seen again (a job resumed from an older checkpoint) replaces its point.

import { CHARTS, PALETTE, pickedChart } from "./chart_specs.js";
import { markers, rangeSelect } from "./chart_plugins.js";
import { project, view, xTitle } from "./chart_view.js";
import { el, formatNumber } from "./ui.js";

// Inserts or replaces the point at `step`, keeping the points sorted by step.
function upsert(points, step, time, value) {
  const last = points[points.length - 1];
  if (!last || last.step < step) {
    points.push({ step, time, value });
    return;
  }
  const at = points.findIndex((p) => p.step >= step);
  if (points[at].step === step) Object.assign(points[at], { time, value });
  else points.splice(at, 0, { step, time, value });
}

// A job's metric rows kept as one sorted point list per key.
export class Series {
  constructor() {
    this.byKey = new Map();
    this.t0 = null;
  }

  add(row) {
    if (this.t0 === null || row.time < this.t0) this.t0 = row.time;
    for (const [key, value] of Object.entries(row.values)) {
      if (typeof value !== "number" || !Number.isFinite(value)) continue;
      if (!this.byKey.has(key)) this.byKey.set(key, []);
      upsert(this.byKey.get(key), row.step, row.time, value);
    }
  }

  points(key) {
    return this.byKey.get(key) || [];
  }
}

function dataset(series, index, spec, other = null) {
  const color = PALETTE[index % PALETTE.length];
  const area = spec.kind === "area";
  // Dots help while a job is young; past a few dozen steps they only clutter the line.
  const pointRadius = (ctx) => (area || ctx.dataset.data.length > 60 ? 0 : 2);
  return {
    label: other ? `${series.label} · ${other}` : series.label, data: [], borderColor: color,
    backgroundColor: area ? `${color}99` : color, fill: area ? (index ? "-1" : "origin") : false,
    yAxisID: series.axis || "y", borderWidth: 1.5, borderDash: other || series.dashed ? [5, 3] : [],
    pointRadius, pointHoverRadius: 4, spanGaps: true, tension: 0, key: series.key, other,
  };
}

function axis(title, position = "left") {
  return { type: view.log ? "logarithmic" : "linear", position, stacked: false,
    title: { display: true, text: title }, ticks: { callback: formatNumber } };
}

function options(spec, onSelect) {
  const area = spec.kind === "area";
  const scales = {
    x: { type: "linear", title: { display: true, text: xTitle() }, ticks: { precision: 0 },
      min: view.range ? view.range[0] : undefined, max: view.range ? view.range[1] : undefined },
    y: { ...axis(spec.y), stacked: area && !view.log, beginAtZero: area },
  };
  if (spec.y1) scales.y1 = { ...axis(spec.y1, "right"), grid: { drawOnChartArea: false } };
  return {
    animation: false,
    responsive: true,
    maintainAspectRatio: false,
    events: ["mousemove", "mouseout", "mousedown", "mouseup", "click"],
    interaction: { mode: "nearest", axis: "x", intersect: false },
    scales,
    plugins: {
      legend: { position: "bottom", labels: { boxWidth: 10, boxHeight: 10, font: { size: 11 },
        filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } },
      tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${formatNumber(ctx.parsed.y)}` } },
      markers: { items: [] },
      rangeSelect: { onSelect },
    },
  };
}

export class MetricCharts {
  constructor(container, onZoom = () => {}) {
    this.container = container;
    this.cards = new Map();
    this.pending = null;
    this.series = new Series();
    this.others = new Map(); // job id -> Series, overlaid dashed
    this.markers = []; // [{time, step, label, color}]
    this.onZoom = onZoom;
    container.replaceChildren();
    for (const spec of CHARTS) this.build(spec);
  }

  build(spec) {
    const canvas = el("canvas", { id: `chart-${spec.name}`, "aria-label": spec.title, role: "img" });
    const latest = el("span", { class: "latest" });
    const empty = el("p", { class: "chart-empty" }, "waiting for the first step…");
    const remove = spec.picked ? el("button", { type: "button", class: "link remove", title: "remove chart",
      onclick: () => this.remove(spec.name) }, "×") : null;
    const card = el("section", { class: "chart-card", "data-chart": spec.name },
      el("h3", {}, spec.title, el("span", {}, latest, remove)), el("div", { class: "chart-box" }, canvas, empty));
    this.container.append(card);
    const onSelect = (min, max) => this.onZoom([min, max]);
    const chart = new window.Chart(canvas, { type: "line", data: { datasets: [] }, options: options(spec, onSelect),
      plugins: [markers, rangeSelect] });
    this.cards.set(spec.name, { spec, chart, latest, empty, card, shape: "" });
    this.schedule();
  }

  // A chart of one recorded metric (from the picker); returns its name.
  addMetric(key) {
    const spec = pickedChart(key);
    if (!this.cards.has(spec.name)) this.build(spec);
    return spec.name;
  }

  remove(name) {
    const card = this.cards.get(name);
    if (!card) return;
    card.chart.destroy();
    card.card.remove();
    this.cards.delete(name);
  }

  keys() {
    return [...this.series.byKey.keys()].sort();
  }

  // A row from /metrics or /metrics/stream: {id, step, time, values}.
  add(row) {
    this.series.add(row);
    this.schedule();
  }

  overlay(jobId, series) {
    if (series) this.others.set(jobId, series);
    else this.others.delete(jobId);
    this.redraw();
  }

  setMarkers(items) {
    this.markers = items;
    this.schedule();
  }

  // Replays arrive hundreds at a time: redraw once for the lot.
  schedule() {
    if (!this.pending) this.pending = setTimeout(() => this.redraw(), 100);
  }

  // The datasets a card needs: its series for this job, then for each overlaid job.
  shape(spec) {
    const sets = spec.series.map((s, i) => dataset(s, i, spec));
    for (const other of this.others.keys()) sets.push(...spec.series.map((s, i) => dataset(s, i, spec, other)));
    return sets;
  }

  redraw() {
    clearTimeout(this.pending);
    this.pending = null;
    const stepOf = (time) => (this.series.points("training/step").find((p) => p.time >= time) || {}).step;
    for (const card of this.cards.values()) {
      const { spec, chart, latest, empty } = card;
      const shape = [...this.others.keys()].join(",");
      if (card.shape !== shape || !chart.data.datasets.length) {
        chart.data.datasets = this.shape(spec);
        card.shape = shape;
      }
      for (const set of chart.data.datasets) {
        const source = set.other ? this.others.get(set.other) : this.series;
        set.data = project(source.points(set.key), source.t0);
      }
      // Complete before it is assigned: until update(), chart.options still reads the old options.
      const opts = options(spec, (min, max) => this.onZoom([min, max]));
      opts.plugins.markers.items = this.markers
        .map((m) => ({ ...m, x: view.x === "time" ? m.time - this.series.t0 : m.step ?? stepOf(m.time) }))
        .filter((m) => m.x !== undefined && Number.isFinite(m.x));
      chart.options = opts;
      const filled = chart.data.datasets.filter((d) => d.data.length);
      empty.hidden = filled.length > 0;
      empty.textContent = this.series.byKey.size ? "not reported by this job" : "waiting for the first step…";
      const first = chart.data.datasets.find((d) => !d.other && d.data.length);
      latest.textContent = first && spec.kind !== "area"
        ? `${first.label} ${formatNumber(first.data[first.data.length - 1].y)}` : "";
      chart.update("none");
    }
  }

  destroy() {
    clearTimeout(this.pending);
    for (const { chart } of this.cards.values()) chart.destroy();
    this.cards.clear();
  }
}
