"""verl keys rlsp accepts although it reaches verl's result its own way, with the note saying how.

`VERL_NOTES` maps fnmatch patterns of verl keys to the note: `rlsp.check` prints it for every such key a command
sets and docs/config.md lists them all (rlsp.config.verl_compat reads the table; verl 0.9's additions are in
rlsp.config.verl_notes_0_9).
"""

from __future__ import annotations

from rlsp.config.verl_notes_0_9 import NOTES_0_9

# Accepted keys whose verl result rlsp reaches its own way (fnmatch patterns -> what rlsp does).
VERL_NOTES = {
    "actor_rollout_ref.model.use_remove_padding": "true or false: rlsp always packs sequences without padding; verl's "
                                                  "false (a padded forward) computes the same logprobs and entropy, so "
                                                  "the flag has no effect on results (false with Ulysses sp > 1 is "
                                                  "refused, as in verl)",
    "critic.model.use_remove_padding": "true or false: as actor_rollout_ref.model.use_remove_padding, for the values",
    "*.model.use_remove_padding": "true only: rlsp always packs sequences without padding (its Ulysses and ring "
                                  "sharding work on the packed stream); false (padded batches) is refused",
    "actor_rollout_ref.model.use_fused_kernels": "true or false: rlsp always computes logprobs and entropy "
                                                 "vocab-chunked, never materialising the full logits (what verl's "
                                                 "fused kernels are for)",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": "torch or triton: both run rlsp's vocab-chunked "
                                                                 "torch head",
    "actor_rollout_ref.model.use_shm": "true copies the model into /dev/shm once and every worker loads it from "
                                       "there (one node; refused with trainer.nnodes > 1)",
    "*.strategy": "fsdp or fsdp2: both run rlsp's FSDP2 engine (megatron is refused)",
    "actor_rollout_ref.rollout.mode": "sync or async: rlsp's engine runs in-process in every worker and generates "
                                      "the same samples either way (agent loops too)",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "the reference's FSDP2 CPUOffloadPolicy (no effect on cpu); with "
                                                       "LoRA no effect at all: the reference is the actor's engine with "
                                                       "the adapters off, sharing the base weights that "
                                                       "actor_rollout_ref.actor.fsdp_config.* offloads (as in verl)",
    "actor_rollout_ref.ref.fsdp_config.offload_policy": "as actor_rollout_ref.ref.fsdp_config.param_offload",
    "*.fsdp_config.param_offload": "FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer state in host "
                                   "memory together (the state follows its parameters, whatever optimizer_offload "
                                   "says); no effect on cpu",
    "*.fsdp_config.optimizer_offload": "true needs param_offload=true (FSDP2 keeps the optimizer state next to its "
                                       "parameters); frozen roles: false",
    "*.fsdp_config.offload_policy": "FSDP2's CPUOffloadPolicy (verl's meaning), whatever param_offload and "
                                    "optimizer_offload say",
    "actor_rollout_ref.rollout.free_cache_engine": "true only: rlsp always frees the engine's KV cache and weights "
                                                   "while training (GPU)",
    "actor_rollout_ref.rollout.multi_turn.*": "verl's meaning: multi-turn rollouts through agent loops with tools "
                                              "(tool YAML, function tools, hermes calls, turn limits, tool response "
                                              "truncation); interaction_config_path and num_repeat_rollouts null "
                                              "only; use_inference_chat_template and tokenization_sanity_check_mode "
                                              "any legal value (rlsp never re-renders a trajectory: the generated "
                                              "ids train); docs/agents.md",
    "actor_rollout_ref.rollout.agent.*": "verl's meaning: default_agent_loop, agent_loop_config_path ({name, "
                                         "_target_} entries); num_workers any value >= 1 (every trajectory of a "
                                         "worker runs concurrently on one event loop); custom_async_server null only",
    "actor_rollout_ref.rollout.val_kwargs.*": "validation sampling, verl's meaning (n samples per prompt, greedy "
                                              "unless do_sample)",
    "*.optim.lr_warmup_steps*": "verl's rule: lr_warmup_steps training steps, else ratio x total_training_steps; "
                                "rlsp ramps the rate per optimizer step over that span",
    "*.optim.clip_grad": "verl's spelling of optim.grad_clip (mapped onto it)",
    "custom_reward_function.*": "verl's spelling of reward.custom_function_path / reward.custom_function_name "
                                "(mapped onto them)",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "verl's names; gspo, geo_mean and sapo: verl aggregates them with "
                                                    "seq-mean-token-mean whatever actor.loss_agg_mode says, rlsp "
                                                    "follows loss_agg_mode (set seq-mean-token-mean to match verl)",
    "data.truncation": "error, left, right or middle, verl's meaning, for prompts longer than data.max_prompt_length "
                       "that data.filter_overlong_prompts did not drop",
    "data.return_raw_chat": "true or false: rlsp keeps every prompt's chat messages with its rows either way (a reward "
                            "model re-renders them in its own template) and generates from the templated ids",
    "data.shuffle": "verl's meaning: a new order every epoch (seeded by data.seed), or file order",
    "trainer.logger": "a name or a list of names (verl's forms)",
    "trainer.total_epochs": "verl's rule: the run is total_epochs x batches per epoch unless "
                            "trainer.total_training_steps is set",
    "trainer.use_legacy_worker_impl": "auto, enable or disable: rlsp has one worker implementation",
    "reward_model.use_reward_loop": "true: verl's reward loop, the reward model served by vLLM pooling engines on "
                                    "the policy workers (in their processes, or in one process beside each worker "
                                    "when the rollout engine uses another tp degree; reward_model.rollout.*); false: "
                                    "verl's legacy FSDP reward-model worker",
    "reward_model.num_workers": "verl's meaning: reward-loop processes that score rule rewards concurrently (Ray actors "
                                "over chunks of the batch); the reward model's inputs are rendered on the workers "
                                "hosting its engine",
    "reward_model.rollout.*": "the reward loop's vLLM engine (verl's keys); engine features rlsp does not use are "
                              "refused by value",
    "actor_rollout_ref.rollout.calculate_log_probs": "true or false: rlsp's engine always returns the sampled tokens' "
                                                     "logprobs (rollout correction and the rollout-vs-trainer logprob "
                                                     "metrics read them)",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "vLLM's chunked prefill on GPU (verl's meaning); always off on "
                                                        "CPU, where vLLM's seeded sampling cannot rewind after a split "
                                                        "prefill",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM's token budget per scheduler step (verl's meaning); on "
                                                        "CPU (no chunked prefill) raised to a whole sequence",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.*": "passed to vllm.LLM as keyword arguments (verl's meaning); "
                                                      "arguments rlsp sets from its own keys are refused",
    "actor_rollout_ref.rollout.checkpoint_engine.*": "backend naive or nccl: rlsp moves weights to its colocated "
                                                     "engines in process, one tensor at a time (so no transfer bucket "
                                                     "exists and update_weights_bucket_megabytes bounds nothing), and "
                                                     "to a rollout pool through its weight board; engine_kwargs empty",
    "actor_rollout_ref.rollout.data_parallel_size": "1 only: every rlsp engine is one tensor-parallel group of workers",
    "actor_rollout_ref.rollout.expert_parallel_size": "1, or tensor_model_parallel_size (vllm on GPU, a MoE model): vLLM's "
                                                      "enable_expert_parallel, as verl (ep = tp x dp, dp 1 in rlsp)",
    "*.entropy_from_logits_with_chunking": "true or false: rlsp's logprob/entropy head always works in vocabulary "
                                           "chunks (never the full [tokens, vocab] logits), what verl's chunking is for",
    "*.entropy_checkpointing": "true or false: rlsp's head always recomputes each chunk's logits in backward instead "
                               "of keeping them, what verl's entropy checkpointing is for",
    "*.checkpoint.*": "save_contents / load_contents [model, optimizer, extra]: what a resume needs, always written; "
                      "hf_model in the actor's save_contents adds an HF-format copy of the actor to every checkpoint "
                      "(<global_step_N>/actor_hf; ['hf_model'] alone still writes the resumable parts); async_save "
                      "false only",
    "data.filter_overlong_prompts_workers": "any value >= 1: rlsp counts prompt lengths in the driver (the parallel "
                                            "filter processes of verl are not needed for that)",
    "trainer.log_val_generations": "verl's meaning: the first N validation samples (prompt, response, score) of every "
                                   "validation, in <trainer.default_local_dir>/val_generations.jsonl",
    "ray_kwargs.ray_init.runtime_env.env_vars.*": "set in every Ray process of the run (workers, scoring and reward "
                                                  "processes; a private Ray or a joined cluster's job); names rlsp "
                                                  "sets per worker (RANK, WORLD_SIZE, ...) are refused; the driver "
                                                  "keeps the environment it was started with",
    "ray_kwargs.ray_init.runtime_env.py_executable": "null (verl's default): the workers run this Python; a launcher "
                                                     "(e.g. `uv run --frozen`) starts every worker process through "
                                                     "it (Ray's runtime_env py_executable); refused when its program "
                                                     "is not on this machine's PATH for a private Ray",
    "ray_kwargs.ray_init.*": "num_cpus and object_store_memory of the private local Ray rlsp starts (no effect when "
                             "joining a cluster with trainer.ray_address); num_cpus >= the run's workers, GPU runs only",
    "actor_rollout_ref.nccl_timeout": "seconds (verl's meaning and default 600): the timeout of every process group "
                                      "of the run's training workers (the default group and every mesh group, gloo "
                                      "and nccl; the critic pool's too)",
    "actor_rollout_ref.rollout.multi_stage_wake_up": "vLLM on GPU: a weight sync wakes the engine's weights, loads "
                                                     "them, then wakes the KV cache (lower peak memory, verl's "
                                                     "meaning); no effect on CPU (vLLM has no sleep mode there) or "
                                                     "with the hf engine",
    "actor_rollout_ref.rollout.engine_kwargs.sglang.*": "engine not in use: ignored (rlsp's rollout engines are vllm "
                                                        "and hf; rollout.name=sglang is refused)",
    "actor_rollout_ref.rollout.engine_kwargs.trtllm.*": "engine not in use: ignored (rlsp's rollout engines are vllm "
                                                        "and hf; rollout.name=trtllm is refused)",
    "ray_kwargs.timeline_json_file": "null only",
    "actor_rollout_ref.*.use_torch_compile": "true, false or auto (rlsp's default: on cuda only, where verl's true "
                                             "pays off; inductor costs ~20 s at start-up on cpu): the actor's entropy "
                                             "head (the per-block logsumexp and sum p*logit, what verl compiles) runs "
                                             "through torch.compile, within fp32 rounding of eager; the logprobs, "
                                             "decoder and backward stay eager; the reference computes no entropy, so "
                                             "nothing is compiled there",
    "*.optim.optimizer": "a torch.optim class by verl's case-sensitive name (AdamW, Adam, SGD, Adamax, NAdam, RAdam, "
                         "RMSprop, Adagrad, Adadelta, Adafactor, ASGD) given lr, weight_decay, betas for the Adam "
                         "family, then override_optimizer_config (verl's rule); LBFGS, SparseAdam, Muon and Rprop are "
                         "refused with the reason; optimizer_impl torch.optim only",
    "*.optim.override_optimizer_config": "null or the optimizer's keyword arguments (verl's meaning); add them one by "
                                         "one (+<role>.optim.override_optimizer_config.eps=1e-6); an argument the "
                                         "class does not take is refused naming the ones it does",
    "reward.reward_manager.name": "naive, dapo or gdpo (verl's managers): the reward function once per row, every entry "
                                  "of a returned dict kept per row (what algorithm.gdpo_reward_keys reads, whatever "
                                  "the manager); dapo adds overlong shaping, gdpo the run's trainer.experiment_name "
                                  "under extra_info.experiment_name (as verl's gdpo manager)",
    "reward.reward_kwargs.max_resp_len": "null or data.max_response_length only (null means that value): the "
                                         "overlong penalty reaches -penalty_factor at the generation limit",
    "algorithm.filter_groups.*": "verl's dynamic sampling; the run still trains trainer.total_training_steps steps: "
                                 "the prompt stream continues into further epochs when filtered groups used it up "
                                 "(verl's recipe stops at the end of total_epochs instead)",
    **NOTES_0_9,  # verl 0.9 keys accepted because they change nothing computed (rlsp.config.verl_notes_0_9)
}
