"""The RL loop: rollouts, rewards, advantages, actor updates, weight sync, validation and metrics."""
