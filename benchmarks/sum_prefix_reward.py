"""Reward of the step benchmarks: 1.0 when the completion starts with the sum, else 0.0."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0
