"""One rank of rlsp's vLLM reward engine (run by tests/e2e/test_reward_engine.py as a script).

`python _reward_engine_worker.py RANK WORLD TP PORT RM_MODEL POLICY_MODEL ROLLOUT_TP OUT` joins a gloo
world of WORLD processes; when POLICY_MODEL is not "-" it first builds a rollout engine from it with
tensor_parallel_size=ROLLOUT_TP (as a policy worker hosts both), then builds VLLMRewardEngine from RM_MODEL with tensor_parallel_size=TP
(external_launcher), scores SEQUENCES, checks the global RNG was left as it was and that the rollout
engine still generates, and writes the scores to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys

SEQUENCES = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(3, 40)), [2, 37, 35, 21, 34, 5, 10, 43, 11, 46, 3]]


def main(argv: list[str]) -> None:
    rank, world, tp, port = (int(x) for x in argv[:4])
    rm_model, policy_model, rollout_tp, out = argv[4], argv[5], int(argv[6]), argv[7]
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_CPU_OMP_THREADS_BIND=str(rank % max(1, os.cpu_count() or 1)))
    import torch
    import torch.distributed as dist

    from rlsp.rollout.base import SamplingConfig
    from rlsp.rollout.vllm_engine import VLLMEngine
    from rlsp.rollout.vllm_reward import VLLMRewardEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    rollout = None
    if policy_model != "-":
        rollout = VLLMEngine(policy_model, dtype="float32", max_model_len=128, seed=0,
                             tensor_parallel_size=rollout_tp, distributed_executor_backend="external_launcher")
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    engine = VLLMRewardEngine(rm_model, dtype="float32", max_model_len=128, tensor_parallel_size=tp)
    rng_kept = bool(torch.equal(torch.rand(3), expected))
    scores = engine.score(SEQUENCES)
    try:
        engine.score([list(range(3, 3 + 129))])
        too_long = ""
    except ValueError as exc:
        too_long = str(exc)
    generated = []
    if rollout is not None:
        sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=4)
        generated = rollout.generate([SEQUENCES[0]], sampling).response_ids
    with open(out, "w") as f:
        json.dump({"scores": scores, "rng_kept": rng_kept, "too_long": too_long, "generated": generated}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
