"""Activation memory per rank: given, or estimated for a transformer.

The estimate is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", no tensor or sequence parallelism): one layer stores
s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations (s sequence, b micro-batch, h hidden,
a heads). The 5*a*s/h term is the attention matrix: flash / scaled-dot-product attention
does not store it, so it is left out unless ``heads`` is given. With activation
checkpointing every layer keeps only its 16-bit input (2*s*b*h bytes) and one layer is
recomputed at a time. fp32 activations double every figure. Embeddings, logits and the
loss are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activations:
    """Activation bytes per rank, without and with activation checkpointing."""

    full: int
    checkpointed: int
    source: str

    def bytes(self, checkpointing: bool) -> int:
        return self.checkpointed if checkpointing else self.full


def given(nbytes: int) -> Activations:
    return Activations(nbytes, nbytes, "given (--activations)")


def transformer(seq_len: int, micro_batch: int, hidden: int, layers: int, heads: int | None = None,
                dtype_bytes: int = 2) -> Activations:
    sbh = seq_len * micro_batch * hidden
    per_layer = sbh * 34 + (5 * heads * seq_len * seq_len * micro_batch if heads else 0)
    scale = dtype_bytes / 2
    full = int(layers * per_layer * scale)
    checkpointed = int((layers * 2 * sbh + per_layer) * scale)
    attention = f"{heads} heads, attention matrix stored" if heads else "flash attention"
    return Activations(full, checkpointed, f"transformer estimate: seq {seq_len} x micro-batch {micro_batch} x "
                                           f"hidden {hidden} x {layers} layers, {attention}")
