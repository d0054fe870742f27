"""The inference core: models, paged KV cache, radix prefix cache, continuous batching, sampling.

Import submodules directly; this package's own import pulls in nothing heavy, so light actors
(tokenizer, detokenizer) can import ``app.engine.<light module>`` without loading torch.
"""
