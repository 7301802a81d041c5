"""Per-step batch description (ForwardBatch) and the engine-owned memory pools it points into."""
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool

__all__ = ["ForwardBatch", "SeqChunk", "KVPool", "StatePool"]
