"""Notes of declared verl 0.9 keys that rlsp accepts because they change nothing in what the run computes.

Merged into rlsp.config.verl_notes.VERL_NOTES (fnmatch patterns -> what rlsp does): `rlsp.check` and
`rlsp.main` print the note of every such key a command sets, and docs/config.md lists them. Each one names
what rlsp does instead and what it costs, and which values are still refused (a value that would change
the results).
"""

from __future__ import annotations

_TEACHER_POOL = ("rlsp has no teacher pool: it colocates the teachers on the policy workers (in the reference model's "
                 "layout), where they score the same tokens with the same weights, so the results are those of verl's "
                 "pool; the teachers' weights and activations use the policy workers' memory instead of GPUs of their "
                 "own. With a pool given (n_gpus_per_node x nnodes > 0) verl's arithmetic is checked: one teacher's "
                 "inference.tensor_model_parallel_size divides it, several teachers' num_replicas x "
                 "tensor_model_parallel_size add up to it")

NOTES_0_9 = {
    "actor_rollout_ref.actor.clip_ratio_c": "the dual-clip bound of the losses that read it (vanilla, dppo_tv, "
                                            "dppo_kl, bypass_mode), verl's meaning; verl's other policy losses "
                                            "(gspo, geo_mean, sapo, cispo, gpg, clip_cov, kl_cov) ignore it, and so "
                                            "does rlsp: accepted there with no effect (must be > 1 either way)",
    "actor_rollout_ref.rollout.max_model_len": "verl's cap on the engine's context: null or >= data.max_prompt_length "
                                               "+ data.max_response_length, where it never binds (rlsp sizes its "
                                               "engine to exactly that sum, so every prompt and response fits either "
                                               "way); a smaller value, which would cut sequences, is refused",
    "actor_rollout_ref.rollout.prompt_length": "verl's cap on the prompts its engine takes (its default: "
                                               "data.max_prompt_length): null or data.max_prompt_length, the bound "
                                               "rlsp's prompts already keep (data.filter_overlong_prompts, "
                                               "data.truncation); another value is refused (set "
                                               "data.max_prompt_length instead)",
    "actor_rollout_ref.rollout.response_length": "verl's generation limit (its default: data.max_response_length; "
                                                 "an agent loop's whole trajectory): null or data.max_response_length, "
                                                 "the limit rlsp's engine generates to; another value is refused (set "
                                                 "data.max_response_length instead)",
    "data.image_patch_size": "null or the model processor's patch_size (14 for Qwen2.5-VL, 16 for Qwen3-VL and "
                             "Qwen3.5): verl 0.9 resizes images with it (qwen_vl_utils.fetch_image, multiples of "
                             "patch x merge) only to count prompt lengths for data.filter_overlong_prompts, and rolls "
                             "out and trains with the processor's own patch size; rlsp counts and processes every "
                             "image with the processor's own, so these values give verl's result. Another value is "
                             "refused on data with images (rlsp.check names the processor's patch_size); on data "
                             "without images the key changes nothing",
    "distillation.n_gpus_per_node": f"verl's teacher pool, any value >= 0: {_TEACHER_POOL}",
    "distillation.nnodes": f"verl's teacher pool, any value >= 0: {_TEACHER_POOL}",
    "distillation.teacher_models.*.num_replicas": f"the teacher's replicas in verl's teacher pool, any value >= 0: "
                                                  f"{_TEACHER_POOL}",
    "distillation.teacher_models.*.inference.tensor_model_parallel_size": f"the tensor-parallel degree of the "
                                                                          f"teacher's engine in verl's teacher pool, "
                                                                          f"any value >= 1: {_TEACHER_POOL}",
}
