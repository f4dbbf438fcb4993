"""Models: HF model loading, value head, tiny-model factory, Ulysses attention, vocab-chunked logprobs."""
