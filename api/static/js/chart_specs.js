// The job page's default charts: which recorded metrics each one plots, with axis titles and units.
//
// A series names one metric key; `axis: "y1"` puts it on a right-hand axis with its own title.
// `kind: "area"` stacks the series as filled lines (the step time by phase). SFT jobs record under
// sft/ (loss, lr, grad_norm), RL jobs under actor/ and critic/: the charts list both.

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#64748b", "#ea580c"];

const PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync"];

export const CHARTS = [
  { name: "reward", title: "Reward", y: "score", series: [
    { key: "critic/score/mean", label: "train score" },
    { key: "critic/score/max", label: "train max" },
  ] },
  // Accuracy and mean score are often equal (a 0/1 reward): two axes, the score dashed, so both show.
  { name: "validation", title: "Validation", y: "accuracy", y1: "mean score", series: [
    { key: "val/accuracy", label: "val accuracy" },
    { key: "val/score/mean", label: "val score", axis: "y1", dashed: true },
  ] },
  { name: "loss", title: "Loss", y: "loss", series: [
    { key: "sft/loss", label: "SFT (cross-entropy)" },
    { key: "actor/pg_loss", label: "policy" },
    { key: "critic/vf_loss", label: "value" },
  ] },
  { name: "lr", title: "Learning rate", y: "lr", series: [
    { key: "sft/lr", label: "SFT lr" },
    { key: "actor/lr", label: "actor lr" },
    { key: "critic/lr", label: "critic lr" },
  ] },
  { name: "grad", title: "Gradient norm", y: "‖g‖₂ (before clipping)", series: [
    { key: "sft/grad_norm", label: "SFT" },
    { key: "actor/grad_norm", label: "actor" },
    { key: "critic/grad_norm", label: "critic" },
  ] },
  { name: "kl", title: "KL", y: "nats / token", series: [
    { key: "actor/ppo_kl", label: "ppo_kl" },
    { key: "actor/kl_loss", label: "kl_loss" },
  ] },
  { name: "entropy", title: "Entropy", y: "nats / token", series: [
    { key: "actor/entropy", label: "actor update" },
    { key: "actor/rollout_entropy", label: "rollout" },
  ] },
  { name: "clip", title: "Clip fraction", y: "share of tokens", series: [
    { key: "actor/pg_clipfrac", label: "upper" },
    { key: "actor/pg_clipfrac_lower", label: "lower" },
  ] },
  { name: "advantages", title: "Advantages", y: "advantage", series: [
    { key: "critic/advantages/mean", label: "mean" },
    { key: "critic/advantages/max", label: "max" },
    { key: "critic/advantages/min", label: "min" },
  ] },
  // The rollout engine is not the trainer: how far their log-probs are apart, and what the rollout
  // correction (algorithm.rollout_correction) did about it.
  { name: "mismatch", title: "Train/inference mismatch", y: "nats / share", series: [
    { key: "rollout/log_prob_diff_mean", label: "|Δ log p| mean" },
    { key: "rollout/log_prob_diff_max", label: "|Δ log p| max" },
    { key: "rollout/kl_rollout_trainer", label: "KL(rollout‖trainer)" },
    { key: "rollout_corr/token_clipped_frac", label: "tokens IS-capped" },
    { key: "rollout_corr/token_rejected_frac", label: "tokens rejected" },
    { key: "rollout_corr/seq_rejected_frac", label: "sequences rejected" },
  ] },
  { name: "sampling", title: "Dynamic sampling and over-long", y: "count", y1: "share", series: [
    { key: "dynamic_sampling/prompts_drawn", label: "prompts drawn" },
    { key: "dynamic_sampling/groups_dropped", label: "groups dropped" },
    { key: "overlong/truncated_frac", label: "truncated share", axis: "y1" },
    { key: "overlong/penalty_mean", label: "length penalty", axis: "y1" },
  ] },
  { name: "length", title: "Response length", y: "tokens", series: [
    { key: "response_length/mean", label: "mean" },
    { key: "response_length/max", label: "max" },
    { key: "response_length/min", label: "min" },
  ] },
  { name: "timing", title: "Step time by phase", y: "seconds", kind: "area",
    series: PHASES.map((phase) => ({ key: `timing_s/${phase}`, label: phase })) },
  { name: "sync", title: "Weight sync", y: "seconds", y1: "GB/s", series: [
    { key: "weight_sync/seconds", label: "seconds" },
    { key: "weight_sync/gbps", label: "GB/s", axis: "y1" },
  ] },
  { name: "throughput", title: "Throughput", y: "tokens / s", series: [
    { key: "perf/throughput", label: "step tokens/s" },
    { key: "perf/rollout_tokens_per_s", label: "rollout tokens/s (async)" },
    { key: "perf/trainer_tokens_per_s", label: "trainer tokens/s (async)" },
  ] },
  // trainer.mode async (controller/async_loop.py): how full the buffer is, what each role waits for,
  // and the age of the samples each step trained (a stacked histogram, versions behind the trainer).
  { name: "async", title: "Async: buffer and waits", y: "seconds", y1: "share", series: [
    { key: "async/trainer_wait_s", label: "trainer waits" },
    { key: "async/rollout_wait_s", label: "rollout waits" },
    { key: "async/buffer_fill", label: "buffer fill", axis: "y1", dashed: true },
  ] },
  { name: "staleness", title: "Async: staleness of trained samples", y: "samples", kind: "area",
    series: [0, 1, 2, 3, 4].map((age) => ({ key: `async/staleness_hist/${age}`, label: `${age} behind` })) },
];

// A chart for one metric picked by the user: the unit guessed from the name's prefix.
export function pickedChart(key) {
  const unit = key.startsWith("timing_s/") || key.endsWith("/seconds") ? "seconds"
    : key.includes("length") ? "tokens" : key.split("/").pop();
  return { name: `m-${key.replace(/[^A-Za-z0-9_-]/g, "_")}`, title: key, y: unit, picked: true,
    series: [{ key, label: key }] };
}
