#!/usr/bin/env bash
# The REST API with nothing but curl: submit a job, watch it, pause, resume, fork it from a
# checkpoint, change a hyper-parameter while it runs, cancel it.
#
#   source .venv/bin/activate && tandem serve &   # in another terminal (or `make run`)
#   bash examples/walkthrough.sh
#
# TANDEM_URL (default: the URL the running service recorded in $TANDEM_HOME/service.json, else
# http://127.0.0.1:8000) and TANDEM_TOKEN (default: the admin token the service wrote to
# $TANDEM_HOME/admin_token), TANDEM_HOME defaulting to ~/.tandem. JSON fields are picked
# with python3 so jq is not needed. Every wait is bounded (WAIT_S, default 180 s) and the jobs are
# tiny, so the script finishes on its own in a minute or two on a laptop.
set -euo pipefail

HOME_DIR="${TANDEM_HOME:-$HOME/.tandem}"
# The running service recorded its URL (port included) in the home.
RECORDED="$(sed -n 's/.*"url": "\([^"]*\)".*/\1/p' "$HOME_DIR/service.json" 2>/dev/null || true)"
URL="${TANDEM_URL:-${RECORDED:-http://127.0.0.1:8000}}"
TOKEN="${TANDEM_TOKEN:-$(cat "$HOME_DIR/admin_token" 2>/dev/null || true)}"
WAIT_S="${WAIT_S:-180}"
if [ -z "$TOKEN" ]; then
  echo "no token: set TANDEM_TOKEN (the service's admin token is in \$TANDEM_HOME/admin_token)" >&2
  exit 1
fi

# api METHOD PATH [JSON-BODY]: one call; prints the body; fails on an HTTP error, showing it.
api() {
  local out status
  out=$(curl -sS --max-time 30 -X "$1" "$URL$2" -H "Authorization: Bearer $TOKEN" \
    -H "Content-Type: application/json" ${3:+--data "$3"} -w '\n%{http_code}')
  status="${out##*$'\n'}"
  out="${out%$'\n'*}"
  if [ "$status" -ge 400 ]; then
    echo "HTTP $status from $1 $2: $out" >&2
    return 1
  fi
  printf '%s\n' "$out"
}

# pick FIELD: a top-level field of the JSON on stdin (a dotted path reaches nested ones).
pick() {
  python3 -c 'import json, sys
value = json.load(sys.stdin)
for part in sys.argv[1].split("."):
    value = value[int(part)] if isinstance(value, list) else value[part]
print(value)' "$1"
}

# wait_until JOB_ID PYTHON-CONDITION-ON-job: poll the job until the condition holds (bounded).
wait_until() {
  local deadline=$((SECONDS + WAIT_S)) job
  while true; do
    job=$(api GET "/v1/jobs/$1")
    if printf '%s' "$job" | python3 -c "import json, sys; job = json.load(sys.stdin); sys.exit(0 if ($2) else 1)"; then
      printf '%s\n' "$job"
      return 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "gave up after ${WAIT_S}s waiting for $1 to satisfy: $2" >&2
      return 1
    fi
    sleep 1
  done
}

# status_line: "ID: STATUS, step N/TOTAL" of the job on stdin.
status_line() {
  python3 -c 'import json, sys
j = json.load(sys.stdin)
print("%s: %s, step %s/%s" % (j["id"], j["status"], j["step"], j["total_steps"]))'
}

echo "==> health: $URL"
curl -sS --max-time 10 "$URL/healthz"
echo

echo "==> submit a GRPO job (tiny-qwen2 on the built-in arithmetic task)"
SPEC='{
  "method": "grpo",
  "model": {"builtin": "tiny-qwen2"},
  "data": {"builtin_task": "arithmetic"},
  "reward": {"function": "builtin:arithmetic"},
  "rollout": {"n": 4, "max_new_tokens": 4},
  "optim": {"lr": 1e-3},
  "trainer": {"total_steps": 40, "prompts_per_step": 4, "val_every": 0},
  "checkpoint": {"every": 1, "keep_last": 50, "export_hf": false},
  "metadata": {"example": "walkthrough"}
}'
JOB=$(api POST /v1/jobs "$SPEC" | pick id)
echo "submitted $JOB"

echo "==> watch its status until it has taken 2 steps"
wait_until "$JOB" 'job["step"] >= 2 or job["status"] in ("succeeded", "failed", "cancelled")' | status_line
api GET "/v1/jobs/$JOB/metrics?keys=critic/score/mean,actor/pg_loss" \
  | python3 -c 'import json, sys
for row in json.load(sys.stdin)["data"]:
    print("  step", row["step"], row["values"])'

echo "==> pause: the job checkpoints after its current step"
api POST "/v1/jobs/$JOB/pause" | status_line
wait_until "$JOB" 'job["status"] == "paused"' | status_line

echo "==> resume: it is queued again and continues from its last checkpoint"
api POST "/v1/jobs/$JOB/resume" | status_line

echo "==> fork from a checkpoint: a new job with 1 more step"
CKPT=$(api GET "/v1/jobs/$JOB/checkpoints" | pick data.-1.step)
echo "checkpoints of $JOB end at step $CKPT"
CHILD=$(api POST "/v1/jobs/$JOB/fork" \
  "{\"checkpoint_step\": $CKPT, \"overrides\": {\"trainer\": {\"total_steps\": $((CKPT + 1))}}}" | pick id)
echo "forked $CHILD from $JOB at step $CKPT"

echo "==> change a hyper-parameter while it runs: lr from the next step"
api PATCH "/v1/jobs/$JOB/hyperparameters" '{"lr": 5e-4}' | pick spec.optim.lr
api GET "/v1/jobs/$JOB/events?limit=1000" \
  | python3 -c 'import json, sys
print(*[e["message"] for e in json.load(sys.stdin)["data"] if e["kind"] == "hyperparameters_requested"], sep="\n")'

echo "==> cancel: the job stops after its current step and keeps its record"
api POST "/v1/jobs/$JOB/cancel" | status_line
wait_until "$JOB" 'job["status"] == "cancelled"' | status_line

echo "==> the fork runs its one step and succeeds"
wait_until "$CHILD" 'job["status"] in ("succeeded", "failed", "cancelled")' | status_line

echo "==> events of $JOB"
api GET "/v1/jobs/$JOB/events?limit=1000" \
  | python3 -c 'import json, sys
for e in json.load(sys.stdin)["data"]:
    print("  %-26s %s" % (e["kind"], e["message"]))'
echo "==> done"
