"""One rank of a tensor-parallel vLLM rollout engine (run by tests/e2e/test_rollout_tp.py as a script).

`python _rollout_tp_worker.py RANK WORLD TP PORT MODEL SYNC_FROM OUT` joins a gloo world of WORLD
processes, builds rlsp's VLLMEngine from MODEL with tensor_parallel_size=TP the way the rollout role
does (external_launcher), hands it the full weights of SYNC_FROM as a weight sync does, generates
greedily from the prompts of its engine (engine = RANK // TP) and writes the tokens, their logprobs
and the engine's local parameter shapes to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys

# "<|im_start|>user\nA+B=<|im_end|>\n<|im_start|>assistant\n" as char-token ids, for several A, B.
PROMPTS = [[2, 37, 35, 21, 34, 5, a, 43, b, 46, 3, 5, 2, 17, 35, 35, 25, 35, 36, 17, 30, 36, 5]
           for a, b in ((10, 11), (8, 12), (9, 9), (7, 13))]


def main(argv: list[str]) -> None:
    rank, world, tp, port = (int(x) for x in argv[:4])
    model, sync_from, out = argv[4:7]
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_CPU_OMP_THREADS_BIND=str(rank % max(1, os.cpu_count() or 1)))
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlsp.rollout.base import SamplingConfig
    from rlsp.rollout.vllm_engine import VLLMEngine

    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine = VLLMEngine(model, dtype="float32", max_model_len=128, seed=0, tensor_parallel_size=tp,
                        distributed_executor_backend="external_launcher")
    weights = AutoModelForCausalLM.from_pretrained(sync_from, dtype=torch.float32).named_parameters()
    engine.update_weights((name, p.detach()) for name, p in weights)
    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    shapes = {name: list(p.shape) for name, p in runner.model.named_parameters()}
    engines = world // tp
    result = engine.generate(PROMPTS[rank // tp::engines], SamplingConfig(n=1, temperature=0.0, max_tokens=10))
    with open(out, "w") as f:
        json.dump({"ids": result.response_ids, "logprobs": result.response_logprobs, "shapes": shapes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
