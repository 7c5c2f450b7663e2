// The dashboard's entry point: sign-in, and a hash router between the Jobs page and a Job page.
//
// Routes: #/jobs (the list) and #/jobs/<id> (one job). The token never appears in a route.

import { request, token, whenUnauthorized } from "./api.js";
import { JobView } from "./job.js";
import { JobsView } from "./jobs.js";
import { $, hideError, showError } from "./ui.js";

const views = { signin: $("signin-view"), jobs: $("jobs-view"), job: $("job-view") };
const jobsView = new JobsView();
const jobView = new JobView();

function showOnly(name) {
  for (const [key, node] of Object.entries(views)) node.hidden = key !== name;
  $("nav").hidden = name === "signin";
}

function showSignIn(message = "") {
  jobsView.hide();
  jobView.hide();
  showOnly("signin");
  document.title = "Sign in · Tandem";
  $("signin-error").textContent = message;
  $("signin-error").hidden = !message;
  $("token-input").focus();
}

function route() {
  if (!token.get()) {
    showSignIn();
    return;
  }
  hideError();
  const match = location.hash.match(/^#\/jobs\/([^/]+)$/);
  let jobId = null;
  try {
    jobId = match && decodeURIComponent(match[1]);
  } catch {
    showError(`this link's job id is not valid percent-encoding: ${match[1]}`);
  }
  if (jobId) {
    jobsView.hide();
    showOnly("job");
    jobView.show(jobId);
  } else {
    jobView.hide();
    showOnly("jobs");
    document.title = "Jobs · Tandem";
    jobsView.show();
  }
}

// A token is accepted when the API lets it list jobs; the API's own message is shown otherwise.
async function signIn(event) {
  event.preventDefault();
  const candidate = $("token-input").value.trim();
  const button = event.submitter || $("signin-form").querySelector("button");
  button.disabled = true;
  try {
    await request("GET", "/v1/jobs?limit=1", undefined, candidate);
    token.set(candidate);
    $("token-input").value = "";
    route();
  } catch (err) {
    $("signin-error").textContent = err.message;
    $("signin-error").hidden = false;
  } finally {
    button.disabled = false;
  }
}

whenUnauthorized((err) => {
  token.clear();
  showSignIn(`Signed out: ${err.message}`);
});

$("signin-form").addEventListener("submit", signIn);
$("sign-out").addEventListener("click", () => {
  token.clear();
  showSignIn();
});
$("banner-close").addEventListener("click", hideError);
window.addEventListener("hashchange", route);
route();
