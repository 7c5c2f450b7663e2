// Small DOM helpers shared by the views: element building, formatting, the banner and the dialogs.

import { post } from "./api.js";

export const $ = (id) => document.getElementById(id);

// el("td", {class: "num"}, "3", child) — text is always set as text, never parsed as HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function formatTime(seconds) {
  if (!seconds) return "–";
  const date = new Date(seconds * 1000);
  const today = new Date().toDateString() === date.toDateString();
  const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
  return today ? time : `${date.toLocaleDateString([], { month: "short", day: "numeric" })} ${time}`;
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "–";
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

export function jobDuration(job) {
  if (!job.started_at) return null;
  return (job.finished_at || Date.now() / 1000) - job.started_at;
}

export function formatNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-4 || abs >= 1e5)) return value.toExponential(2);
  return String(Number(value.toPrecision(4)));
}

export function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

// While a lost worker is replaced (job.restart), a running job reads "restarting (1/3): worker rank 0
// died (waiting for resources)" rather than looking stuck.
export function statusBadge(status, restart = null) {
  if (restart && ["queued", "running", "pausing", "cancelling"].includes(status)) {
    const text = `${restart.message} (${restart.phase})`;
    return el("span", { class: "badge status-restarting", title: text }, text);
  }
  return el("span", { class: `badge status-${status}` }, status);
}

export function progressBar(job) {
  const bar = el("div", { class: "bar" });
  bar.style.width = `${Math.round(100 * (job.progress || 0))}%`;
  return el("div", { class: "progress", title: `${Math.round(100 * (job.progress || 0))}%` }, bar);
}

// What a job in each state can be asked to do (the API has the last word; its refusals are shown).
export const ALLOWED = {
  pause: ["queued", "running"],
  resume: ["paused"],
  cancel: ["queued", "running", "pausing", "paused"],
  checkpoint: ["running"],
  fork: null, // any job with a checkpoint
};

export const allowed = (action, status) => ALLOWED[action] === null || ALLOWED[action].includes(status);

let bannerTimer = null;
export function showError(err) {
  const message = err instanceof Error ? err.message : String(err);
  $("banner-text").textContent = message;
  $("banner").hidden = false;
  clearTimeout(bannerTimer);
  bannerTimer = setTimeout(() => ($("banner").hidden = true), 12000);
}

export function hideError() {
  $("banner").hidden = true;
}

export function confirmDialog(text) {
  const dialog = $("confirm-dialog");
  $("confirm-text").textContent = text;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "yes"), { once: true });
  });
}

// Runs a job action (pause, resume, cancel, checkpoint, fork); resolves to the API's answer or null.
export async function jobAction(jobId, action) {
  if (action === "fork") return forkDialog(jobId);
  if (action === "cancel" && !(await confirmDialog(`Cancel ${jobId}? It stops after its current step.`))) {
    return null;
  }
  const path = action === "checkpoint" ? "checkpoints" : action;
  try {
    return await post(`/v1/jobs/${encodeURIComponent(jobId)}/${path}`);
  } catch (err) {
    showError(err);
    return null;
  }
}

// The fork dialog: a checkpoint step (empty = latest) and JSON overrides; resolves to the new job.
export function forkDialog(jobId, step = null) {
  const dialog = $("fork-dialog");
  $("fork-job").textContent = jobId;
  $("fork-step").value = step === null ? "" : String(step);
  $("fork-error").hidden = true;
  dialog.showModal();
  return new Promise((resolve) => {
    const form = $("fork-form");
    let created = null;
    const cancel = () => dialog.close();
    const submit = async (event) => {
      event.preventDefault();
      const body = {};
      const stepText = $("fork-step").value.trim();
      if (stepText) body.checkpoint_step = Number(stepText);
      try {
        body.overrides = JSON.parse($("fork-overrides").value.trim() || "{}");
      } catch (err) {
        $("fork-error").textContent = `overrides are not valid JSON: ${err.message}`;
        $("fork-error").hidden = false;
        return;
      }
      try {
        created = await post(`/v1/jobs/${encodeURIComponent(jobId)}/fork`, body);
        dialog.close();
      } catch (err) {
        $("fork-error").textContent = err.message;
        $("fork-error").hidden = false;
      }
    };
    // Escape closes a dialog too, so the close event (not the buttons) settles the promise.
    dialog.addEventListener("close", () => {
      form.removeEventListener("submit", submit);
      $("fork-cancel").removeEventListener("click", cancel);
      resolve(created);
    }, { once: true });
    form.addEventListener("submit", submit);
    $("fork-cancel").addEventListener("click", cancel);
  });
}
