"""Data: the Batch container, prompt datasets, packing into token streams, synthetic tasks."""
