"""verl 0.9's keys that rlsp does not declare: the values it accepts because they are what rlsp does anyway
(`ACCEPTED_VALUES`), and those it refuses by name with the reason (`UNSUPPORTED_0_9`). Read by
rlsp.config.verl_keys (one answer per key of verl's surface) and rlsp.config.verl_compat.
"""

from __future__ import annotations

from typing import Any

_FSDP1 = "verl's FSDP1 setting: rlsp's engine is FSDP2 (fully_shard per decoder layer"
_MODEL = "rlsp builds the model its config.json names with transformers' own classes"
_MOE = ("MoE expert load balancing metrics of the rollout engine are not implemented in rlsp (the actor logs actor/moe/* "
        "from its own forwards); routing replay is actor_rollout_ref.actor.router_replay.mode")
_ROUTE_FILES = ("rlsp keeps the routes recorded for R2 in memory, as a column of the step's rows that the update reads; "
                "no route file is written or read")
_MTP = "multi-token prediction (MTP) heads are not trained or used for speculative decoding in rlsp"
_QAT = "quantization-aware training (QAT) is not implemented in rlsp; train in model.dtype (bf16) instead"
_MEGATRON_LORA = ("verl's Megatron LoRA block (model.lora.*) is not implemented; rlsp's LoRA keys are model.lora_rank, "
                  "lora_alpha, target_modules, exclude_modules and lora_adapter_path")
_TQ = "verl's TransferQueue data plane is not implemented: rlsp moves batches through Ray's object store"
_V1 = ("verl's v1 trainer modes are not implemented: rlsp's trainer is synchronous (colocated) or runs asynchronously "
       "with async_training.* and rollout.nnodes/n_gpus_per_node")
_SKIP = "verl's rollout dumps and replay (skip.*) are not implemented in rlsp"
_PROMETHEUS = "exporting vLLM's Prometheus metrics is not implemented; rlsp logs rollout timings and lengths per step"
_TRACE = "rollout tracing back-ends (weave, mlflow) are not implemented; trainer.log_val_generations logs samples"
_PD = "prefill/decode disaggregation is not implemented: every rlsp engine is one tensor-parallel group"
_VISION = ("this vision-language option is not implemented: rlsp reads images from verl's `images` column with the "
           "model's own processor (docs/models.md)")
_SANDBOX = ("rewards from a remote code sandbox (Sandbox Fusion) are not implemented in rlsp; score code locally with "
            "reward.custom_function_path")
_TOKENIZER = "rlsp reads the tokenizer from the model directory (actor_rollout_ref.model.path)"
_DATASET = "rlsp reads parquet/jsonl rows with its own dataset (data.prompt_key); custom dataset classes are not loaded"
_REMOTE = ("remote code is not run: rlsp loads model types transformers ships (trust_remote_code is always false)")
_LIGER = "Liger kernels are not used: rlsp's vocab-chunked head and packed sequences cover the logits memory"
_TEACHER = ("a teacher's inference engine takes rlsp's own settings (distillation.teacher_models.<name>.inference keys "
            "that rlsp declares)")
_PREFIX_GROUPER = ("verl's prefix grouper computes a group's shared prompt once in the actor's forward (one prompt "
                   "and rollout.n responses per sequence): an optimization with the same logprobs, entropy and "
                   "gradients as each sample's own forward, which rlsp runs (true or false: the same results). verl "
                   "v0.9.0's FSDP engine never calls it (its actor forwards each sample whole too); there the flag only "
                   "makes trainer.balance_batch keep a group's samples on one rank, which rlsp's whole-mini-batch loss "
                   "does not need. Cost against the grouper: rlsp's forward and backward repeat the prompt's tokens "
                   "once per sample, (n - 1) x prompt tokens more per group, in compute and in packed tokens per "
                   "micro-batch")

# Undeclared verl keys whose listed values are what rlsp does anyway: (values, what rlsp does). Other values are
# refused with the same text.
ACCEPTED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "*.fsdp_config.reshard_after_forward": ((True,), "rlsp's FSDP2 reshards parameters after every forward "
                                                     "(verl's default)"),
    "*.fsdp_config.use_orig_params": ((True, False), "an FSDP1 flag: rlsp's FSDP2 shards the original parameters "
                                                     "(no flat parameters) whatever it says"),
    "*.fsdp_config.forward_prefetch": ((True, False), "FSDP2 overlaps the next layer's all-gather with compute by "
                                                      "itself; no effect on results"),
    "actor_rollout_ref.rollout.enable_prefix_caching": ((True, False), "vLLM's prefix cache: rlsp's engine keeps it "
                                                        "on (verl's default); a cache never changes the samples"),
    "actor_rollout_ref.hybrid_engine": ((True,), "rlsp's colocated actor and rollout are one hybrid engine (verl "
                                                 "supports only that too)"),
    "*.fsdp_config.seed": ((42,), "rlsp seeds every worker from trainer.seed"),
    "actor_rollout_ref.rollout.seed": ((42,), "rlsp seeds sampling from trainer.seed"),
    "data.image_key": (("images",), "verl's default column name: images are read with the model's processor "
                       "(rlsp.data.multimodal); other column names are not supported"),
    "data.video_key": (("videos",), "verl's default column name: rows with videos are refused (video processors need "
                       "torchvision)"),
    "data.audio_key": (("audios",), "verl's default column name; no audio is read (text prompts only)"),
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing": ((True, False), "rlsp computes sum pi^2 inside its "
                                                                            "vocab-chunked logprob head, a chunk at a "
                                                                            "time without gradient: no full-vocabulary "
                                                                            "activation to checkpoint"),
    "critic.model.fsdp_config.use_torch_compile": ((True, False), "the value head computes no entropy, the one part "
                                                                  "verl compiles: nothing to compile for the critic"),
    "actor_rollout_ref.actor.use_prefix_grouper": ((True, False), _PREFIX_GROUPER),
}

# Keys of verl 0.9 that rlsp refuses by name (fnmatch patterns over rlsp's spelling of the key -> why, and what to
# use instead); merged into rlsp.config.verl_compat.UNSUPPORTED_KEYS after its own entries.
UNSUPPORTED_0_9: dict[str, str] = {
    **{p: f"{note}; legal values: {', '.join(map(str, values))}" for p, (values, note) in ACCEPTED_VALUES.items()},
    "*.fsdp_config.wrap_policy.*": f"{_FSDP1}); the size-based wrap policy does not apply",
    "*.fsdp_config.model_dtype": "rlsp keeps trainable weights in fp32 and computes in actor_rollout_ref.model.dtype; "
                                 "set that",
    "*.fsdp_config.dtype": "rlsp computes in actor_rollout_ref.model.dtype (FSDP2's mixed precision); set that",
    "*.fsdp_config.mixed_precision.*": "rlsp's FSDP2 mixed precision computes in model.dtype and reduces gradients in "
                                       "fp32; per-dtype overrides are not supported",
    "*.fsdp_config.full_determinism": "bitwise-deterministic kernels are not switched on by rlsp; runs are seeded "
                                      "(trainer.seed)",
    "*.fsdp_config.entropy_from_logits_chunk_size": "rlsp's head chunks the vocabulary by actor.logprob_chunk_size; set "
                                                    "that",
    "*.entropy_from_logits_chunk_size": "rlsp's head chunks the vocabulary by actor.logprob_chunk_size; set that",
    "*.fsdp_config.pad_to_length*": "padding packed batches to fixed lengths is not implemented (rlsp packs without "
                                    "padding)",
    "*.pad_to_length": "padding packed batches to fixed lengths is not implemented (rlsp packs without padding)",
    "*.fsdp_config.forward_only": "set by verl for frozen roles; rlsp knows which roles train",
    "*.fsdp_config.qat.*": _QAT,
    "actor_rollout_ref.actor.qat.*": _QAT,
    "actor_rollout_ref.rollout.qat": _QAT,
    "*.rollout_n": "verl's copy of actor_rollout_ref.rollout.n; set rollout.n",
    "*.ppo_micro_batch_size": "verl's deprecated global micro-batch size is not supported; set ppo_micro_batch_size_per_gpu",
    "*.log_prob_micro_batch_size": "verl's deprecated global micro-batch size is not supported; set "
                                   "log_prob_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "verl's deprecated global micro-batch size is not supported; set "
                                       "critic.forward_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.policy_loss.dro_beta": "the DRO policy loss is not implemented; rlsp's loss modes are "
                                                    "listed under actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.calculate_entropy": "rlsp computes the entropy when actor.entropy_coeff != 0 and logs it "
                                                 "every step; the switch is not needed",
    "*.data_loader_seed": "rlsp orders batches from trainer.seed / data.seed",
    "*.checkpoint.strict": "rlsp resumes only from a checkpoint of the same model and layout (always strict)",
    "actor_rollout_ref.actor.use_fused_kernels": "verl's copy of actor_rollout_ref.model.use_fused_kernels; set that",
    "actor_rollout_ref.actor.use_remove_padding": "verl's copy of actor_rollout_ref.model.use_remove_padding; set that",
    "actor_rollout_ref.actor.router_replay.record_file": _ROUTE_FILES,
    "actor_rollout_ref.actor.router_replay.replay_file": _ROUTE_FILES,
    "actor_rollout_ref.ref.router_replay.*": "the reference model is frozen: its routing never moves between passes, "
                                             "so there is nothing to replay",
    "*.router_replay.*": _MOE,
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval": _MOE,
    "actor_rollout_ref.rollout.nnodes": "a rollout pool of its own is rollout.nnodes / rollout.n_gpus_per_node (rlsp's "
                                        "async_training keys); the colocated engine runs on the training workers",
    "actor_rollout_ref.rollout.n_gpus_per_node": "a rollout pool of its own is rollout.nnodes / rollout.n_gpus_per_node "
                                                 "(rlsp's async_training keys)",
    "actor_rollout_ref.rollout.full_determinism": "bitwise-deterministic vLLM sampling is not switched on by rlsp; "
                                                  "sampling is seeded (trainer.seed)",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": "rlsp's vLLM engine uses vLLM's CUDA-graph sizes; "
                                                         "rollout.enforce_eager=true turns graphs off",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": "pipeline parallel rollouts are not implemented: rlsp's "
                                                              "engines use tensor parallelism "
                                                              "(rollout.tensor_model_parallel_size)",
    "actor_rollout_ref.rollout.logprobs_mode": "rlsp's engine returns the logprobs of the sampling distribution "
                                               "(temperature, top_p/top_k applied: verl's processed_logprobs)",
    "actor_rollout_ref.rollout.scheduling_policy": "vLLM's scheduling policy is fcfs in rlsp",
    "actor_rollout_ref.rollout.disable_log_stats": "set vLLM's own argument through "
                                                   "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_log_stats",
    "actor_rollout_ref.rollout.do_sample": "rlsp's training rollouts always sample (temperature, top_p, top_k); greedy "
                                           "is for validation (val_kwargs.do_sample=false)",
    "actor_rollout_ref.rollout.over_sample_rate": "over-sampling prompts and dropping the slowest is not implemented",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": "checkpoint-engine back-ends of one's own are "
                                                                         "not loaded (backend naive or nccl)",
    "actor_rollout_ref.rollout.trace.*": _TRACE,
    "actor_rollout_ref.rollout.skip_tokenizer_init": "rlsp's engine generates from token ids and returns token ids "
                                                     "(its tokenizer is never used for that)",
    "actor_rollout_ref.rollout.prometheus.*": _PROMETHEUS,
    "actor_rollout_ref.rollout.quantization*": "quantized rollouts (fp8, ...) are not implemented: the engine runs in "
                                               "rollout.dtype",
    "actor_rollout_ref.rollout.mtp": _MTP,
    "*.model.mtp.*": _MTP,
    "actor_rollout_ref.rollout.disaggregation.*": _PD,
    "*.model.hf_config_path": "rlsp reads config.json from the model directory (model.path)",
    "*.model.tokenizer_path": _TOKENIZER,
    "data.tokenizer": _TOKENIZER,
    "*.model.trust_remote_code": _REMOTE,
    "data.trust_remote_code": _REMOTE,
    "*.model.custom_chat_template": "rlsp renders prompts with the model directory's chat template (edit a copy of "
                                    "its tokenizer_config.json)",
    "*.model.external_lib": f"no extra module is imported: {_MODEL}",
    "*.model.use_liger": _LIGER,
    "*.model.lora.*": _MEGATRON_LORA,
    "critic.model.lora_rank": "LoRA on the critic is not implemented (the actor's LoRA: actor_rollout_ref.model.*)",
    "critic.model.lora_alpha": "LoRA on the critic is not implemented (the actor's LoRA: actor_rollout_ref.model.*)",
    "critic.model.target_modules": "LoRA on the critic is not implemented (the actor's LoRA: actor_rollout_ref.model.*)",
    "critic.model.exclude_modules": "LoRA on the critic is not implemented (the actor's LoRA: actor_rollout_ref.model.*)",
    "critic.model.lora_adapter_path": "LoRA on the critic is not implemented (the actor's LoRA: actor_rollout_ref.model.*)",
    "critic.model.use_shm": "the critic loads from its path (actor_rollout_ref.model.use_shm is the actor's)",
    "critic.model.use_fused_kernels": "the critic's value head has no vocabulary logits: nothing to fuse",
    "critic.model.fused_kernel_options.*": "the critic's value head has no vocabulary logits: nothing to fuse",
    "data.use_shm": "rlsp reads the data files in the driver (actor_rollout_ref.model.use_shm copies the model)",
    "data.train_max_samples": "not implemented: truncate the data file itself",
    "data.val_max_samples": "not implemented: truncate the data file itself",
    "data.reward_fn_key": "rlsp picks the reward function by each row's data_source column (verl's default)",
    "data.val_batch_size": "rlsp validates the whole validation set in one batch (verl's default, null)",
    "data.tool_config_path": "verl's copy of actor_rollout_ref.rollout.multi_turn.tool_config_path; set that",
    "data.function_tool_path": "verl's copy of actor_rollout_ref.rollout.multi_turn.function_tool_path; set that",
    "data.return_raw_input_ids": "rlsp keeps the prompt ids and chat messages with each row itself",
    "data.return_full_prompt": "rlsp keeps the prompt ids and chat messages with each row itself",
    "data.dataloader_num_workers": "rlsp reads and tokenizes prompts in the driver",
    "data.validation_shuffle": "rlsp validates in file order",
    "data.return_multi_modal_inputs": _VISION,
    "data.mm_processor_kwargs": _VISION,
    "data.continuous_token.*": _VISION,
    "data.custom_cls.*": _DATASET,
    "critic.enable": "the critic is on when algorithm.adv_estimator=gae (verl's rule), off otherwise",
    "critic.loss_scale_factor": "verl's copy of actor_rollout_ref.actor.loss_scale_factor; set that",
    "reward_model.reward_loop_*": "reward loops of one's own are not loaded: rlsp's reward loop serves "
                                  "reward_model.model.path (reward.custom_function_path for rule rewards)",
    "reward_model.model.external_lib": f"no extra module is imported: {_MODEL}",
    "sandbox_fusion.*": _SANDBOX,
    "reward.sandbox_fusion.*": _SANDBOX,
    "reward.reward_manager.source": "rlsp's reward managers are its own (naive, dapo, gdpo); custom managers are not "
                                    "loaded: use reward.custom_function_path",
    "reward.reward_manager.module.*": "rlsp's reward managers are its own (naive, dapo, gdpo); custom managers are not "
                                      "loaded: use reward.custom_function_path",
    "algorithm.filter_groups.max_inflight_gen_batches": "rlsp's dynamic sampling generates one batch at a time "
                                                        "(algorithm.filter_groups.max_num_gen_batches bounds them)",
    "transfer_queue.*": _TQ,
    "trainer.rollout_data_dir": "dumping every rollout is not implemented; trainer.log_val_generations logs "
                                "validation samples",
    "trainer.validation_data_dir": "trainer.log_val_generations writes validation samples to "
                                   "<trainer.default_local_dir>/val_generations.jsonl",
    "trainer.esi_redundant_time": "elastic-server-instance (ESI) expiry saves are not implemented; "
                                  "trainer.save_on_preempt saves on SIGTERM",
    "trainer.val_only": "not implemented: validation runs with training (trainer.val_before_train, test_freq)",
    "trainer.default_hdfs_dir": "copying checkpoints to HDFS is not implemented (trainer.default_local_dir)",
    "trainer.del_local_ckpt_after_load": "rlsp keeps the checkpoint it resumed from (max_actor_ckpt_to_keep prunes "
                                         "old ones)",
    "trainer.ray_wait_register_center_timeout": "rlsp's workers register through Ray's own actor start-up",
    "trainer.use_v1": _V1,
    "trainer.v1.*": _V1,
    "skip.*": _SKIP,
    **{f"reward_model.rollout.{k}": "the reward model's vLLM engine scores sequences (pooling): sampling settings, "
                                    "pipeline parallelism, quantization, MTP, disaggregation and determinism "
                                    "switches do not apply (its keys: reward_model.rollout.* in docs/config.md)"
       for k in ("pipeline_model_parallel_size", "layered_summon", "scheduling_policy", "full_determinism", "seed",
                 "multi_stage_wake_up", "ignore_eos", "temperature", "top_k", "top_p", "do_sample", "n",
                 "quantization", "quantization_config_file", "mtp", "disaggregation.*")},
    "critic.model.fsdp_config.entropy_*": "the critic computes values, not an entropy: nothing to chunk or checkpoint",
    "distillation.teacher_models.*.inference.cudagraph_capture_sizes": _TEACHER,
    "distillation.teacher_models.*.inference.expert_parallel_size": _TEACHER,
    "distillation.teacher_models.*.inference.load_format": _TEACHER,
    "distillation.teacher_models.*.inference.engine_kwargs": _TEACHER,
    "distillation.teacher_models.*.inference.limit_images": _TEACHER,
    "distillation.teacher_models.*.inference.enable_chunked_prefill": _TEACHER,
    "distillation.teacher_models.*.inference.enable_prefix_caching": _TEACHER,
    "distillation.teacher_models.*.inference.disable_log_stats": _TEACHER,
    "distillation.teacher_models.*.inference.skip_tokenizer_init": _TEACHER,
    "distillation.teacher_models.*.inference.prompt_length": _TEACHER,
    "distillation.teacher_models.*.inference.response_length": _TEACHER,
    "distillation.teacher_models.*.inference.temperature": _TEACHER,
}
