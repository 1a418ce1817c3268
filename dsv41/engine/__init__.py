"""Generation on top of the model: sampling, the batched engine, speculative decoding, scoring."""
