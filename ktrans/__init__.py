"""ktrans: heterogeneous CPU/GPU serving of Mixture-of-Experts LLMs."""
__version__ = "0.1.0"
