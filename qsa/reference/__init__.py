"""Float32 reference of one QSA layer: the oracle every kernel is checked against.

Readable over fast. The modules mirror the kernel modules in `qsa.kernels`:
compress <-> kernels.compress, score <-> kernels.score_*, topk <-> kernels.topk,
kv <-> kernels.kv_quant, attention <-> kernels.sparse_gqa.
"""

from qsa.reference.attention import dense_causal_reference, sparse_gqa_reference
from qsa.reference.compress import (apply_rope, compress_reference, rms_norm, rope_inv_freq,
                                    write_raw_keys_reference)
from qsa.reference.kv import store_kv_reference
from qsa.reference.pipeline import LayerPassOutput, qsa_layer_reference
from qsa.reference.score import score_reference, visible_groups
from qsa.reference.topk import expand_reference, select_reference, topk_expand_reference

__all__ = [
    "LayerPassOutput", "apply_rope", "compress_reference", "dense_causal_reference",
    "expand_reference", "qsa_layer_reference", "rms_norm", "rope_inv_freq", "score_reference",
    "select_reference", "sparse_gqa_reference", "store_kv_reference", "topk_expand_reference",
    "visible_groups", "write_raw_keys_reference",
]
