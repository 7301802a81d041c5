"""The engine: scheduler, model runner, cache manager, sampler and requests (continuous batching over one model)."""
