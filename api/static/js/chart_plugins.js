// Two Chart.js plugins for the job page's charts: event markers (dashed vertical lines with a
// label) and drag-to-zoom on the x axis. Both read their state from the chart's options:
// options.plugins.markers.items = [{x, label, color}], options.plugins.rangeSelect.onSelect(min, max).

export const markers = {
  id: "markers",
  afterDatasetsDraw(chart, _args, opts) {
    const { ctx, chartArea, scales } = chart;
    for (const item of opts.items || []) {
      const x = scales.x.getPixelForValue(item.x);
      if (!(x >= chartArea.left && x <= chartArea.right)) continue;
      ctx.save();
      ctx.strokeStyle = item.color;
      ctx.setLineDash([3, 3]);
      ctx.beginPath();
      ctx.moveTo(x, chartArea.top);
      ctx.lineTo(x, chartArea.bottom);
      ctx.stroke();
      ctx.fillStyle = item.color;
      ctx.font = "10px sans-serif";
      ctx.fillText(item.label, x + 2, chartArea.top + 9);
      ctx.restore();
    }
  },
};

// Press, drag and release over a chart: onSelect(min, max) in x units; a plain click does nothing.
export const rangeSelect = {
  id: "rangeSelect",
  afterEvent(chart, args, opts) {
    const { event } = args;
    const state = chart.$range || (chart.$range = {});
    if (event.type === "mousedown") {
      state.start = event.x;
      state.now = event.x;
    } else if (event.type === "mousemove" && state.start !== undefined) {
      state.now = event.x;
      args.changed = true;
    } else if (event.type === "mouseup" && state.start !== undefined) {
      const [a, b] = [state.start, event.x].sort((p, q) => p - q);
      delete state.start;
      args.changed = true;
      if (b - a > 5 && opts.onSelect) opts.onSelect(chart.scales.x.getValueForPixel(a), chart.scales.x.getValueForPixel(b));
    }
  },
  afterDraw(chart) {
    const state = chart.$range;
    if (!state || state.start === undefined) return;
    const { ctx, chartArea } = chart;
    ctx.save();
    ctx.fillStyle = "rgba(37, 99, 235, 0.12)";
    ctx.fillRect(Math.min(state.start, state.now), chartArea.top, Math.abs(state.now - state.start), chartArea.bottom - chartArea.top);
    ctx.restore();
  },
};
