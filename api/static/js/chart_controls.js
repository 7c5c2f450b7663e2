// The toolbar above the job page's charts: the metric picker (every recorded key, grouped by
// prefix), EMA smoothing, log scale, step or wall-clock x, and resetting the zoom.

import { view } from "./chart_view.js";
import { $, el } from "./ui.js";

// <optgroup>s of the keys not charted yet, one per prefix (actor/, critic/, timing_s/, val/, ...).
function pickerOptions(keys) {
  const groups = new Map();
  for (const key of keys) {
    const prefix = key.includes("/") ? key.slice(0, key.indexOf("/") + 1) : "(other)";
    if (!groups.has(prefix)) groups.set(prefix, []);
    groups.get(prefix).push(key);
  }
  const placeholder = el("option", { value: "" }, keys.length ? `add a chart (${keys.length} metrics)…` : "no metrics yet");
  return [placeholder, ...[...groups].map(([prefix, members]) => el("optgroup", { label: prefix },
    members.map((key) => el("option", { value: key }, key))))];
}

export class ChartControls {
  // charts: () => the page's MetricCharts (it is rebuilt for each job).
  constructor(charts) {
    this.charts = charts;
    this.known = "";
    $("metric-picker").addEventListener("focus", () => this.refreshPicker());
    $("metric-picker").addEventListener("change", (event) => {
      const key = event.target.value;
      if (!key) return;
      const name = this.charts().addMetric(key);
      this.charts().redraw();
      event.target.value = "";
      document.querySelector(`[data-chart='${CSS.escape(name)}']`)?.scrollIntoView({ block: "nearest" });
    });
    $("smoothing").addEventListener("input", (event) => {
      view.smoothing = Number(event.target.value);
      $("smoothing-value").textContent = view.smoothing.toFixed(2);
      this.charts().redraw();
    });
    $("log-scale").addEventListener("change", (event) => this.set({ log: event.target.checked }));
    $("x-axis").addEventListener("change", (event) => this.set({ x: event.target.value, range: null }));
    $("zoom-reset").addEventListener("click", () => this.set({ range: null }));
  }

  set(changes) {
    Object.assign(view, changes);
    $("zoom-reset").hidden = !view.range;
    this.charts().redraw();
  }

  zoom(range) {
    this.set({ range });
  }

  refreshPicker() {
    const keys = this.charts().keys();
    if (keys.join(",") === this.known) return;
    this.known = keys.join(",");
    $("metric-picker").replaceChildren(...pickerOptions(keys));
  }
}
