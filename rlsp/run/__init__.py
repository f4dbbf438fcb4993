"""A run's files: checkpoints and resume positions, resolved assets (built-in models, GGUF checkpoints, data
files), experiment trackers and the metric logs."""
