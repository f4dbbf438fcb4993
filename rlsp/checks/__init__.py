"""The checks that run before any worker has the run's config, beside `rlsp.check`'s pipeline: start-up
(`preflight`: files, model, reward, agent loops, what the engines can run) and resume (`resume_check`). Both are
stages of the check registry (rlsp.config.checks); `rlsp.main` and `rlsp.check` run them, the trainer never does."""
