// The Samples panel of the Job page: one step's stored trajectories, turn by turn, as a chat.
//
// Data: GET /v1/jobs/{id}/samples?step=N (controller/trajectory_view.py). By default the panel
// follows the job's latest step; typing a step pins it. Each trajectory shows its reward, finish
// reason and how many response tokens were trained on (sampled) versus observation/template; a
// Tinker sampler's sample, which has no reward and trained nothing, its sampler and response tokens.

import { get, query } from "./api.js";
import { el, showError } from "./ui.js";

export class SamplesPanel {
  constructor(root) {
    this.root = root;
    this.jobId = null;
    this.shownStep = null;
    this.pinned = false;
    this.list = el("div", { class: "samples-list", id: "samples-list" });
    this.stepInput = el("input", { type: "number", min: "0", step: "1", id: "samples-step",
      placeholder: "latest", "aria-label": "step" });
    this.stepInput.addEventListener("change", () => {
      this.pinned = this.stepInput.value !== "";
      if (this.pinned) this.load(Number(this.stepInput.value));
    });
    root.replaceChildren(el("div", { class: "toolbar" }, el("label", { class: "inline" }, "Step ",
      this.stepInput)), this.list);
  }

  show(jobId) {
    this.jobId = jobId;
    this.shownStep = null;
    this.pinned = false;
    this.stepInput.value = "";
    this.list.replaceChildren(el("p", { class: "muted" }, "No samples yet."));
  }

  // Called with the job's latest completed step on every refresh of the job.
  follow(step) {
    if (!this.pinned && step > 0 && step !== this.shownStep) this.load(step);
  }

  async load(step) {
    const jobId = this.jobId;
    try {
      const page = await get(`/v1/jobs/${encodeURIComponent(jobId)}/samples${query({ step, limit: 16 })}`);
      if (jobId !== this.jobId) return;
      this.shownStep = step;
      this.list.replaceChildren(...(page.data.length
        ? page.data.map(renderSample)
        : [el("p", { class: "muted" }, `No samples of step ${step}.`)]));
    } catch (err) {
      if (err.status !== 401) showError(err);
    }
  }
}

function renderSample(sample) {
  const tokens = sample.tokens || {};
  const head = el("div", { class: "sample-head" },
    el("b", {}, `#${sample.index}`), ` step ${sample.step}`,
    // A Tinker sampler's rows have no reward and nothing trained: they say which sampler drew them.
    ...(Number.isFinite(sample.reward)
      ? [" · reward ", el("b", { class: "sample-reward" }, sample.reward.toFixed(3))] : []),
    ...(sample.sampler ? [" · sampler ", el("b", { class: "sample-sampler" }, sample.sampler)] : []),
    ...(sample.finish_reason ? [` · ${sample.finish_reason}`] : []),
    ` · ${(sample.turns || []).length} turn(s) · `,
    Number.isFinite(tokens.trained) ? `trained ${tokens.trained}/${tokens.response} tokens`
      : `${tokens.response ?? "?"} response tokens`,
    ...(sample.trajectory ? [` · agent trajectory `, el("b", { class: "sample-trajectory" }, sample.trajectory.id),
      ` (task ${sample.uid}; ${sample.trajectory.segment})`] : []));
  const turns = (sample.turns || []).map((turn) => el("div", { class: `turn turn-${turn.role}` },
    el("span", { class: "role" }, turn.role), el("pre", { class: "content" }, turn.content)));
  return el("article", { class: "sample" }, head,
    el("div", { class: "turn turn-prompt" }, el("span", { class: "role" }, "prompt"),
      el("pre", { class: "content" }, sample.prompt)),
    ...turns);
}
