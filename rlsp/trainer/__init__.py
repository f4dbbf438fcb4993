"""The RL loop: `RayTrainer.fit` / `train_on` and the asynchronous variant, their validation and progress.

What a step asks of the rewards and the workers between generation and update lives in rlsp.step; a run's
files (checkpoints, assets, trackers, metric logs) in rlsp.run; the Ray session and pools in rlsp.controller.
"""
