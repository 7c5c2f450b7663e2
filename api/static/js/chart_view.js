// How every chart on the job page is viewed: EMA smoothing, log or linear y, step or wall-clock x,
// and the zoomed x range. The raw points stay as recorded; `project` derives what is drawn.

export const view = {
  smoothing: 0, // EMA weight of the past, 0 (raw) to 0.99
  log: false,
  x: "step", // or "time": seconds since the job's first recorded step
  range: null, // [min, max] in the current x units, or null for everything
};

// points: [{step, time, value}] sorted by step; t0: the time of the job's first step.
export function project(points, t0) {
  const out = [];
  let ema = null;
  for (const p of points) {
    // Started at the first value, so the first points are not pulled toward zero.
    ema = ema === null ? p.value : view.smoothing * ema + (1 - view.smoothing) * p.value;
    const y = view.smoothing ? ema : p.value;
    if (view.log && !(y > 0)) continue; // a log axis cannot draw zero or less
    out.push({ x: view.x === "time" ? p.time - t0 : p.step, y });
  }
  return out;
}

export function xTitle() {
  return view.x === "time" ? "wall-clock (s since first step)" : "step";
}
