"""Models: loading HF causal LMs, Ulysses attention, vocab-chunked token logprobs, the logprob module."""
