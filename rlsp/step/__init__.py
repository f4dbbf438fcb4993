"""The driver's side of one training step, between generation and update: scoring (rewards), what the
configured estimator reads and the call that runs it on the workers (the step stage), dynamic sampling,
greedy baselines, distillation and off-policy settings. Helpers here receive what they use (a generate
function, a reward, a queue), never the trainer."""
