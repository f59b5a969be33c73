"""The paged cache: field declarations, the arena laid out from them, capacity and offload."""

from qsa.arena.arena import (ALIGNMENT, Arena, ArenaError, PageLayout, Segment, align_up,
                             blocks_in)
from qsa.arena.capacity import capacity_frame, capacity_table, write_capacity_table
from qsa.arena.fields import (CacheFormats, FieldSpec, RowSpace, allocate_layer, declare_fields,
                              declare_row_spaces)
from qsa.arena.offload import (BindingMismatchError, DigestError, LayoutMismatchError,
                               ManifestError, OffloadError, PageOffload, StoredPages,
                               TruncatedPagesError, verify_layer_binding)
from qsa.arena.roundtrip import offload_roundtrip_check

__all__ = [
    "ALIGNMENT", "Arena", "ArenaError", "BindingMismatchError", "CacheFormats", "DigestError",
    "FieldSpec", "LayoutMismatchError", "ManifestError", "OffloadError", "PageLayout", "PageOffload", "RowSpace",
    "Segment", "StoredPages", "TruncatedPagesError", "align_up", "allocate_layer", "blocks_in",
    "capacity_frame", "capacity_table", "declare_fields", "declare_row_spaces",
    "offload_roundtrip_check", "verify_layer_binding", "write_capacity_table",
]
