// A job's name, tags and notes (edited on the job page with PATCH /v1/jobs/{id}) and its metrics
// export (CSV or JSON, fetched with the token and saved through a blob link).

import { ApiError, patch, token } from "./api.js";
import { $, showError } from "./ui.js";

const jobPath = (id, rest = "") => `/v1/jobs/${encodeURIComponent(id)}${rest}`;

export function showMeta(job) {
  const form = $("meta-form");
  if (form.contains(document.activeElement)) return; // never overwrite what is being typed
  form.elements.name.value = job.name || "";
  form.elements.tags.value = (job.tags || []).join(", ");
  form.elements.notes.value = job.notes || "";
}

export async function saveMeta(jobId) {
  const form = $("meta-form");
  const tags = form.elements.tags.value.split(",").map((t) => t.trim()).filter(Boolean);
  const name = form.elements.name.value.trim() || null;
  try {
    const job = await patch(jobPath(jobId), { name, tags, notes: form.elements.notes.value });
    Object.assign($("meta-result"), { textContent: "saved", className: "ok", hidden: false });
    return job;
  } catch (err) {
    Object.assign($("meta-result"), { textContent: err.message, className: "error", hidden: false });
    return null;
  }
}

export async function exportMetrics(jobId, format) {
  const response = await fetch(jobPath(jobId, `/metrics/export?format=${format}`), {
    headers: { Authorization: `Bearer ${token.get() || ""}` }, cache: "no-store",
  });
  if (!response.ok) {
    showError(new ApiError(response.status, `export failed: ${response.status}`));
    return;
  }
  const url = URL.createObjectURL(await response.blob());
  const link = Object.assign(document.createElement("a"), { href: url, download: `${jobId}-metrics.${format}` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
