// The job page's live charts: which metrics each one plots, and feeding them rows from the metrics stream.
//
// Each chart is a Chart.js instance (window.Chart, vendored) on a canvas with id `chart-<name>`, so
// `Chart.getChart("chart-reward")` finds it. Points are {x: step, y: value}, one per step: a step
// seen again (a job resumed from an older checkpoint) replaces its point.

import { el, formatNumber } from "./ui.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#64748b", "#ea580c"];

const PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync"];

export const CHARTS = [
  { name: "reward", title: "Reward", series: [
    { key: "critic/score/mean", label: "train score" },
    { key: "val/accuracy", label: "val accuracy" },
    { key: "val/score/mean", label: "val score" },
  ] },
  { name: "kl", title: "KL", series: [
    { key: "actor/ppo_kl", label: "ppo_kl" },
    { key: "actor/kl_loss", label: "kl_loss" },
  ] },
  { name: "entropy", title: "Entropy", series: [
    { key: "actor/rollout_entropy", label: "rollout" },
    { key: "actor/entropy", label: "actor update" },
  ] },
  // The rollout engine is not the trainer: how far their log-probs are apart, and what the rollout
  // correction (algorithm.rollout_correction) did about it.
  { name: "mismatch", title: "Train/inference mismatch", series: [
    { key: "rollout/log_prob_diff_mean", label: "|Δ log p| mean" },
    { key: "rollout/log_prob_diff_max", label: "|Δ log p| max" },
    { key: "rollout/kl_rollout_trainer", label: "KL(rollout‖trainer)" },
    { key: "rollout_corr/token_clipped_frac", label: "tokens IS-capped" },
    { key: "rollout_corr/token_rejected_frac", label: "tokens rejected" },
    { key: "rollout_corr/seq_rejected_frac", label: "sequences rejected" },
  ] },
  { name: "sampling", title: "Dynamic sampling and over-long", series: [
    { key: "dynamic_sampling/prompts_drawn", label: "prompts drawn", axis: "y" },
    { key: "dynamic_sampling/groups_dropped", label: "groups dropped", axis: "y" },
    { key: "overlong/truncated_frac", label: "truncated share", axis: "y1" },
    { key: "overlong/penalty_mean", label: "length penalty", axis: "y1" },
  ] },
  { name: "length", title: "Response length (tokens)", series: [
    { key: "response_length/mean", label: "mean" },
    { key: "response_length/max", label: "max" },
    { key: "response_length/min", label: "min" },
  ] },
  { name: "timing", title: "Step time by phase (s)", kind: "bar",
    series: PHASES.map((phase) => ({ key: `timing_s/${phase}`, label: phase })) },
  { name: "sync", title: "Weight sync", series: [
    { key: "weight_sync/seconds", label: "seconds", axis: "y" },
    { key: "weight_sync/gbps", label: "GB/s", axis: "y1" },
  ] },
  { name: "lr", title: "Learning rate", series: [
    { key: "actor/lr", label: "actor lr" },
    { key: "critic/lr", label: "critic lr" },
  ] },
  { name: "loss", title: "Loss", series: [
    { key: "actor/pg_loss", label: "policy" },
    { key: "critic/vf_loss", label: "value" },
  ] },
  { name: "throughput", title: "Throughput (tokens/s)", series: [{ key: "perf/throughput", label: "tokens/s" }] },
];

function dataset(series, index, kind) {
  const color = PALETTE[index % PALETTE.length];
  const common = { label: series.label, data: [], backgroundColor: color, borderColor: color, yAxisID: series.axis || "y" };
  if (kind === "bar") return { ...common, stack: "phases", borderWidth: 0 };
  // Dots help while a job is young; past a few dozen steps they only clutter the line.
  const pointRadius = (ctx) => (ctx.dataset.data.length > 60 ? 0 : 2);
  return { ...common, borderWidth: 1.5, pointRadius, pointHoverRadius: 4, spanGaps: true, tension: 0 };
}

function options(spec) {
  const bar = spec.kind === "bar";
  const scales = {
    x: { type: "linear", offset: bar, stacked: bar, title: { display: true, text: "step" },
      ticks: { precision: 0 } },
    y: { stacked: bar, beginAtZero: bar, ticks: { callback: formatNumber } },
  };
  if (spec.series.some((s) => s.axis === "y1")) {
    scales.y.title = { display: true, text: spec.series[0].label };
    scales.y1 = { position: "right", grid: { drawOnChartArea: false }, ticks: { callback: formatNumber },
      title: { display: true, text: spec.series.find((s) => s.axis === "y1").label } };
  }
  return {
    animation: false,
    responsive: true,
    maintainAspectRatio: false,
    interaction: { mode: "nearest", axis: "x", intersect: false },
    scales,
    plugins: {
      legend: { position: "bottom", labels: { boxWidth: 10, boxHeight: 10, font: { size: 11 },
        filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } },
      tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${formatNumber(ctx.parsed.y)}` } },
    },
  };
}

// Inserts or replaces the point at `step`, keeping the data sorted by step.
function upsert(points, step, value) {
  const last = points[points.length - 1];
  if (!last || last.x < step) {
    points.push({ x: step, y: value });
    return;
  }
  const at = points.findIndex((p) => p.x >= step);
  if (points[at].x === step) points[at].y = value;
  else points.splice(at, 0, { x: step, y: value });
}

export class MetricCharts {
  constructor(container) {
    this.container = container;
    this.cards = new Map();
    this.pending = null;
    this.steps = 0;
    container.replaceChildren();
    for (const spec of CHARTS) this.build(spec);
  }

  build(spec) {
    const canvas = el("canvas", { id: `chart-${spec.name}`, "aria-label": spec.title, role: "img" });
    const latest = el("span", { class: "latest" });
    const empty = el("p", { class: "chart-empty" }, "waiting for the first step…");
    const card = el("section", { class: "chart-card", "data-chart": spec.name },
      el("h3", {}, spec.title, latest), el("div", { class: "chart-box" }, canvas, empty));
    this.container.append(card);
    const datasets = spec.series.map((s, i) => dataset(s, i, spec.kind));
    const chart = new window.Chart(canvas, { type: spec.kind || "line", data: { datasets }, options: options(spec) });
    this.cards.set(spec.name, { spec, chart, latest, empty });
  }

  // A row from /metrics or /metrics/stream: {id, step, time, values}.
  add(row) {
    this.steps += 1;
    for (const { spec, chart } of this.cards.values()) {
      spec.series.forEach((series, i) => {
        const value = row.values[series.key];
        if (typeof value === "number" && Number.isFinite(value)) upsert(chart.data.datasets[i].data, row.step, value);
      });
    }
    // Replays arrive hundreds at a time: redraw once for the lot.
    if (!this.pending) this.pending = setTimeout(() => this.redraw(), 100);
  }

  redraw() {
    this.pending = null;
    for (const { spec, chart, latest, empty } of this.cards.values()) {
      const filled = chart.data.datasets.filter((d) => d.data.length);
      empty.hidden = filled.length > 0;
      empty.textContent = this.steps ? "not reported by this job" : "waiting for the first step…";
      const first = chart.data.datasets.find((d) => d.data.length);
      latest.textContent = first && spec.kind !== "bar"
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
